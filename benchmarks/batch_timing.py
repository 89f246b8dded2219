"""Step time of the batched forward by batch size and draft rows, for a model shape (random weights).

For each batch size B and draft length t: B sequences, each with its own ``--context``-token KV
cache, run steps of ``1 + t`` rows each (the root plus a chain of t drafts: what a sequence
verifies), through the engine's own path (``Target.forward`` over ``SeqKV`` caches, lm_head on
every row, one argmax sync, a KV commit of one row per sequence). Reported: milliseconds per step,
plain batched decoding tokens/s (t = 0), and per t the MAT a drafter must reach for the step to
pay (``step_ms(t) / step_ms(0)``). Timing does not depend on weight values, so a named shape
(``toolspec_core/model/shapes.py``) needs no download: bf16 on a GPU, fp32 on the CPU.

    python -m benchmarks.batch_timing --model qwen2.5-7b --device cuda --batches 1,2,4,8,16,32,64
    python -m benchmarks.batch_timing --model embedded --batches 1,4,16     # this CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from toolspec_core.engine.commit import commit_kv
from toolspec_core.engine.tree import DraftTree
from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.batch_forward import Segment

from .cost import hardware_string, load_model, serving_kernels


def step_ms(target, caches, context: int, t: int, repeats: int) -> float:
    """Median ms of one batched step of 1 + t rows per sequence (caches cropped back after each)."""
    vocab = target.model.config.vocab_size
    g = torch.Generator().manual_seed(t)
    tree = DraftTree()
    if t:
        tree.add_path(torch.randint(0, vocab, (t,), generator=g).tolist(), 0.5, "probe")
    ids, pos, mask = tree_inputs(1, tree, context, target.dtype)
    segs = [Segment(c, ids[0], pos[0], mask if t else None) for c in caches]
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        hidden = target.forward(segs)
        torch.argmax(target.logits(hidden), -1).tolist()  # the one sync a step makes
        for c in caches:
            commit_kv(c, context, [0])
        times.append(time.perf_counter() - t0)
        for c in caches:
            c.crop(context)
    return 1000 * sorted(times[1:])[repeats // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="embedded, an HF directory, or a shape name (random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--drafts", default="0,1,3,7,15")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/runs/batch-timing.json")
    args = ap.parse_args(argv)
    from toolspec_core.model.target import from_model

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    model, label = load_model(args.model, args.device, dtype)
    target = from_model(serving_kernels(model, args.device, dtype, None), None, name=label)
    if not target.batched:
        raise SystemExit(f"{label}: its family has no batched forward (toolspec_core.model.batch_forward)")
    vocab = model.config.vocab_size
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        caches = [target.new_cache() for _ in range(b)]
        g = torch.Generator().manual_seed(b)
        for c in caches:
            target.forward(
                [Segment(c, torch.randint(0, vocab, (args.context,), generator=g), torch.arange(args.context))]
            )
        base = None
        for t in [int(x) for x in args.drafts.split(",")]:
            ms = step_ms(target, caches, args.context, t, args.repeats)
            base = ms if t == 0 else base
            row = {"batch": b, "drafts": t, "rows": b * (1 + t), "step_ms": ms}
            if t == 0:
                row["plain_tokens_per_s"] = 1000 * b / ms
            elif base:
                row["break_even_mat"] = ms / base
            rows.append(row)
            print(json.dumps(row), flush=True)
        del caches
        if args.device != "cpu":
            torch.cuda.empty_cache()
    out = {
        "tool": "benchmarks.batch_timing",
        "model": label,
        "dtype": str(dtype).replace("torch.", ""),
        "hardware": hardware_string(args.device),
        "context": args.context,
        "cases": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
