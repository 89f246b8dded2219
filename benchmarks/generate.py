"""``toolspec generate``: decode one request with a method and plain greedy, side by side.

For looking at a single item: prints the output, whether it equals plain greedy, MAT and the
accepted length per step with the FSM state of each step.

    toolspec generate --data benchmarks/datasets/bfcl_v3.dev.jsonl.gz --index 3 --method toolspec
    toolspec generate --prompt "What's the weather in Paris?" --tools tools.json
"""

from __future__ import annotations

import argparse
import json

from .datasets import read_jsonl


def _request(ns) -> tuple[list[dict], list[dict]]:
    if ns.data:
        item = read_jsonl(ns.data, ns.index + 1)[ns.index]
        return item["messages"], item["tools"]
    tools = json.load(open(ns.tools)) if ns.tools else []
    return [{"role": "user", "content": ns.prompt}], tools


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="toolspec generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", help="JSONL (or .jsonl.gz) in the common format")
    p.add_argument("--index", type=int, default=0, help="item of --data (0: the first)")
    p.add_argument("--prompt", default="What's the weather in Paris, in celsius?")
    p.add_argument("--tools", help="JSON file with OpenAI-style tools")
    p.add_argument("--method", default="toolspec")
    p.add_argument("--model", default=None, help="HF model directory (default: embedded)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--cost", choices=["measure", "reference", "flat"], default="reference")
    ns = p.parse_args(argv)

    from toolspec_core.drafters.methods import RequestInfo, make_method
    from toolspec_core.engine.cost_probe import cost_model_for
    from toolspec_core.engine.loop import DecodeConfig, generate, prefill
    from toolspec_core.engine.scheduler import BatchLimits
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.model.target import load_target

    target = load_target(ns.model)
    messages, tools = _request(ns)
    prompt = render_prompt(target.tokenizer, messages, tools)
    cost = cost_model_for(ns.cost, target)
    cfg = DecodeConfig(max_new_tokens=ns.max_new_tokens)
    # the prompt in one pool, prefilled once: both decodes start from its cached blocks
    pool = target.block_pool(len(prompt) + 2 * BatchLimits().rows_for(0, ns.max_new_tokens))
    pre = prefill(target, prompt, pool)
    plain = generate(target, prompt, None, cfg, pool=pool)
    method = make_method(ns.method, target.tokenizer)
    res = generate(
        target, prompt, method.drafter(RequestInfo(prompt, tools, embedding=pre.hidden)), cfg, cost, pool=pool
    )
    print(res.text)
    print(f"\nidentical to plain greedy: {res.tokens == plain.tokens}")
    print(
        f"tokens {res.stats.generated_tokens}, forwards {res.stats.forwards} (plain {plain.stats.forwards}), MAT {res.stats.mat:.2f}"
    )
    print(
        f"decode {res.stats.decode_s:.2f} s vs plain {plain.stats.decode_s:.2f} s ({plain.stats.decode_s / max(res.stats.decode_s, 1e-9):.2f}x)"
    )
    print(
        "steps (accepted/drafted state):",
        " ".join(f"{a}/{d}:{lab}" for a, d, lab in zip(res.stats.accepted, res.stats.drafted, res.stats.step_labels)),
    )
    return 0 if res.tokens == plain.tokens else 1
