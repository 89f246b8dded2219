"""Study: one verify step's time under HF SDPA vs the grouped tree attention. Result: benchmarks/results/measurements/attention-grouped-cpu-epyc-prefix{500-472ad2c,1500-c7889c0}.json.

A/B of one verify step under HF's SDPA attention and the grouped one (``toolspec_core.model.attention``).

The start-up cost probe's steps (``toolspec_core.engine.cost_probe.probe_steps``: a chain of k-1 drafts over
a cached random prefix, 500 tokens unless told) on the embedded model as decoding loads it; each repetition runs every k once
under each attention, alternating, so a noisy host moves both alike. Median seconds per k.

    python -m benchmarks.studies.attention_ab [--ks 1,2,3,4,8,16,32] [--prefix 500] [--repeats 25] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.cost import hardware_string
from toolspec_core.model.attention import NAME as GROUPED

ATTENTIONS = ("sdpa", GROUPED)  # HF's, then ours (the one decoding runs, restored after)


def ab(target, ks: list[int], repeats: int, prefix: int = 500) -> dict:
    from toolspec_core.engine.cost_probe import probe_steps

    steps = probe_steps(target, prefix, ks)
    times = {a: {k: [] for k in ks} for a in ATTENTIONS}
    for rep in range(repeats + 1):  # the first round warms up
        for k in ks:
            for attn in ATTENTIONS:
                target.model.set_attn_implementation(attn)
                dt = steps[k]()
                if rep:
                    times[attn][k].append(dt)
    target.model.set_attn_implementation(ATTENTIONS[-1])
    out = {}
    for k in ks:
        hf, grouped = (statistics.median(times[a][k]) for a in ATTENTIONS)
        out[str(k)] = {
            "sdpa_ms": round(hf * 1e3, 2),
            "grouped_ms": round(grouped * 1e3, 2),
            "grouped_over_sdpa": round(grouped / hf, 3),
        }
    return out


def main(argv=None) -> None:
    from toolspec_core.model.target import load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=500, help="cached prefix length")
    ap.add_argument("--out", default="benchmarks/runs/attention-grouped.json")
    args = ap.parse_args(argv)
    target = load_target(threads=args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    result = {
        "what": f"median seconds of one verify step (probe_steps, {args.prefix}-token prefix), HF SDPA vs grouped attention",
        "model": target.name,
        "hardware": hardware_string("cpu"),
        "threads": args.threads,
        "repeats": args.repeats,
        "steps": ab(target, ks, args.repeats, args.prefix),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["steps"], indent=1))


if __name__ == "__main__":
    main()
