"""Study: prefill ms per token of real dev prompts. Result: benchmarks/results/measurements/prefill-cpu-epyc-20a884d.json.

Prefill time of real dev prompts on this machine: one prompt of about 550-750 tokens from each
dev set, no cached prefix, median of three. The serving cost breakdown (README, docs/results.md)
multiplies the load test's uncached prompt tokens by this rate.

    python -m benchmarks.studies.prefill_rate --out benchmarks/results/measurements/prefill-cpu-epyc-SHA.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SETS = ("api_bank", "bfcl_v3", "toolalpaca")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-tokens", type=int, default=550)
    ap.add_argument("--max-tokens", type=int, default=750)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.cost import hardware_string
    from benchmarks.data import load_items, prompt_ids
    from benchmarks.datasets import dev_set
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.target import load_target

    target = load_target()
    out = {
        "what": "prefill seconds of real dev prompts (no cached prefix), median of 3, the embedded target",
        "hardware": hardware_string("cpu"),
        "torch": torch.__version__,
        "prompts": [],
    }
    for name in SETS:
        for item in load_items(dev_set(name)):
            ids = prompt_ids(target.tokenizer, item)
            if args.min_tokens <= len(ids) <= args.max_tokens:
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    prefill(target, ids)
                    times.append(time.perf_counter() - t)
                out["prompts"].append({"item": item["id"], "tokens": len(ids), "seconds": sorted(times)[1]})
                break
    tokens = sum(p["tokens"] for p in out["prompts"])
    out["ms_per_token"] = 1000 * sum(p["seconds"] for p in out["prompts"]) / tokens if tokens else None
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
