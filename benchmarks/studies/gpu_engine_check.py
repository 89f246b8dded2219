"""Study: greedy equality of every tree drafter on an accelerator, fp32 and bf16. Result: benchmarks/results/measurements/engine-check-h200-68ef764.json.

Lossless decoding on an accelerator: does speculative decoding reproduce plain greedy there?

The test suite proves token-for-token equality on the CPU. On a GPU the target runs other kernels
for a 1-token forward than for a k-token tree forward, so logits can differ in the last bits and
an argmax near-tie can flip. This check decodes random-weight Qwen2 models (no download) on the
given device and dtype with plain greedy and with tree drafters (prompt lookup, an oracle chain,
a branching tree with the truth as its third branch, token recycling, suffix), and reports per
method how many decodes equal plain greedy, and for each divergence the position and the plain
step's top-1 / top-2 logit margin (a numerics near-tie has a margin near bf16/fp32 resolution).
HF ``generate`` greedy is decoded too, as the outside reference.

    python -m benchmarks.studies.gpu_engine_check --device cuda --dtypes float32,bfloat16 --out check.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from tests.tiny import tiny_model
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.model.target import DTYPES, from_model
from toolspec_core.spec.proposer import DraftContext, NoDrafter
from toolspec_core.spec.tree import DraftTree


class ByteTokenizer:
    """Token i <-> a printable character; enough for the engine's stop checks and text."""

    eos_token_id = None
    unk_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(33 + int(i) % 90) for i in ids)

    def convert_tokens_to_ids(self, tok):
        return None


class _Scripted:
    def __init__(self, fn):
        self.fn = fn

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.fn(len(ctx.generated))

    def feedback(self, tree, result) -> None:
        pass


def oracle(ref: list[int], n: int = 12):
    def fn(done: int) -> DraftTree:
        tree = DraftTree()
        tree.add_path(ref[done : done + n], 0.9, "oracle")
        return tree

    return _Scripted(fn)


def branching(ref: list[int], vocab: int):
    """Two wrong branches, then the truth (with a wrong sub-branch): exercises the KV gather."""

    def fn(done: int) -> DraftTree:
        true = ref[done : done + 8]
        tree = DraftTree()
        if len(true) < 3:
            return tree
        tree.add_path([(true[0] + 1) % vocab, 3, 4], 0.5, "b0")
        tree.add_path([(true[0] + 2) % vocab, 9], 0.5, "b1")
        node = tree.add_path(true[:2], 0.5, "b2")
        tree.add_path([(true[2] + 7) % vocab], 0.5, "b3", parent=node)
        tree.add_path(true[2:], 0.5, "b2", parent=node)
        return tree

    return _Scripted(fn)


def build_model(vocab: int, hidden: int, layers: int, seed: int, device: str, dtype: torch.dtype):
    """The suite's random Qwen2 (``tests/tiny.py``), wider: an MLP of 3 x ``hidden``, a head per 64
    of ``hidden``, a 4096-token window."""
    model = tiny_model(
        vocab,
        hidden,
        layers,
        seed,
        intermediate_size=hidden * 3,
        num_attention_heads=max(hidden // 64, 2),
        max_position_embeddings=4096,
    )
    return model.to(device, dtype)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts with repeated spans, so n-gram / suffix drafters find matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(vocab) for _ in range(rng.randint(8, 24))]
        p = [rng.randrange(vocab) for _ in range(rng.randint(20, 200))]
        for _ in range(rng.randint(1, 3)):
            cut = rng.randrange(len(p) + 1)
            p[cut:cut] = span
        out.append(p)
    return out


def margin_at(target, prompt: list[int], ref: list[int], i: int) -> float:
    """top-1 minus top-2 logit of a plain full forward of prompt + ref[:i] (the step that diverged)."""
    ids = torch.tensor([prompt + ref[:i]], device=target.device)
    with torch.inference_mode():
        logits = target.model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check(
    device: str,
    dtype: torch.dtype,
    n_prompts: int,
    new_tokens: int,
    seed: int,
    vocab: int = 512,
    hidden: int = 256,
    layers: int = 4,
) -> dict:
    target = from_model(build_model(vocab, hidden, layers, seed, device, dtype), ByteTokenizer(), name="random-qwen2")
    cfg = DecodeConfig(max_new_tokens=new_tokens)
    learned = {
        "pld": make_method("pld"),
        "suffix": make_method("suffix"),
        "token_recycling": make_method("token_recycling", vocab_size=vocab),
    }
    methods = {
        **{name: (lambda ref, req, m=m: m.drafter(req)) for name, m in learned.items()},
        "oracle": lambda ref, req: oracle(ref),
        "branching": lambda ref, req: branching(ref, vocab),
    }
    res = {m: {"decodes": 0, "equal": 0, "accepted_per_step": [], "divergences": []} for m in ["hf_generate", *methods]}
    t0 = time.perf_counter()
    for k, prompt in enumerate(prompts(n_prompts, vocab, seed)):
        ref = generate(target, prompt, NoDrafter(), cfg).tokens
        with torch.inference_mode():
            hf = target.model.generate(
                torch.tensor([prompt], device=target.device),
                max_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=target.device),
            )[0, len(prompt) :].tolist()
        outs = {"hf_generate": (hf, None)}
        req = RequestInfo(prompt)
        for name, make in methods.items():
            r = generate(target, prompt, make(ref, req), cfg)
            outs[name] = (r.tokens, r.stats)
        for m in learned.values():
            m.observe(req, ref, "")
        for name, (toks, stats) in outs.items():
            row = res[name]
            row["decodes"] += 1
            if stats is not None:
                row["accepted_per_step"].append(round(sum(stats.accepted) / max(len(stats.accepted), 1), 3))
            if toks == ref:
                row["equal"] += 1
                continue
            i = next((j for j, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
            row["divergences"].append({"prompt": k, "position": i, "plain_margin": margin_at(target, prompt, ref, i)})
    for row in res.values():
        apc = row.pop("accepted_per_step")
        row["mean_accepted_per_step"] = round(sum(apc) / len(apc), 3) if apc else None
    return {
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "prompts": n_prompts,
        "new_tokens": new_tokens,
        "vocab": vocab,
        "hidden": hidden,
        "layers": layers,
        "seconds": round(time.perf_counter() - t0, 1),
        "methods": res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    for flag, default in (("--prompts", 16), ("--new-tokens", 64), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    report = {
        "hardware": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "runs": [],
    }
    for name in a.dtypes.split(","):
        run = check(a.device, DTYPES[name], a.prompts, a.new_tokens, a.seed)
        report["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "methods"}), flush=True)
        for m, row in run["methods"].items():
            print(
                f"  {m:16s} equal {row['equal']}/{row['decodes']}  accepted/step {row['mean_accepted_per_step']}  "
                f"divergences {[(d['prompt'], d['position'], round(d['plain_margin'], 4)) for d in row['divergences']]}",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
