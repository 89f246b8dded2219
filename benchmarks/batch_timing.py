"""Step time of the batched engine by batch size and draft rows, for a model shape (random weights).

Per attention mode, batch size B and draft length t: B sequences with random ``--context``-token
prompts run on the engine's scheduler over a KV block pool; every decode step verifies each root
plus a chain of t random drafts (what a drafter's tree costs; rejected, so the context stays near
``--context``). Reported per case, medians over ``--repeats`` steps: the step's wall time, its
forward (until its outputs are on the host) and host part; plain tokens/s (t = 0) and the MAT a
drafter must reach for the step to pay (``step_ms(t) / step_ms(0)``). Modes (``--modes``):
``default`` or ``ATTENTION[+graphs]``; a mode the build cannot run is recorded with its error. The
JSON is rewritten after every case, so a run stopped by a time limit keeps what it measured.

    python -m benchmarks.batch_timing --model qwen2.5-7b --device cuda --batches 1,4,16,64 \\
        --modes per_sequence,ragged,ragged+graphs --out step-curve-7b.json
    python -m benchmarks.batch_timing --model tiny --batches 1,4 --repeats 2     # a CPU smoke run
    python -m benchmarks.batch_timing --model qwen2.5-7b --device cuda --batches 1,4,16,64 \
        --modes ragged+graphs,tp1:ragged+graphs --out step-curve-7b-tp1.json     # the TP rank's step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from toolspec_core.engine.scheduler import BatchLimits, Scheduler
from toolspec_core.engine.sequence import DecodeConfig, Sequence
from toolspec_core.model.shapes import SHAPES
from toolspec_core.spec.labels import PROBE
from toolspec_core.spec.proposer import DraftContext, DrafterBase
from toolspec_core.spec.tree import DraftTree

from .cost import build_shape, hardware_string, load_model, serving_kernels

# a shape small enough for a CPU test: the 0.5B's layout, shrunk
TINY = (
    "qwen2.5-0.5b",
    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
)
TINY_VOCAB = 512
WARM_STEPS = 2  # untimed steps after each change of draft length
PREFILL_CHUNK = 2048


class ChainDrafter(DrafterBase):
    """A chain of ``t`` random tokens at every step: the rows a drafter's tree costs."""

    def __init__(self, t: int, vocab: int, seed: int):
        self.t, self.vocab = t, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = DraftTree()
        if self.t:
            tree.add_path(torch.randint(0, self.vocab, (self.t,), generator=self.gen).tolist(), 0.5, PROBE)
        return tree

    def feedback(self, tree, result) -> None:
        return None


class _NoText:
    """The tokenizer of a random-weight model: its tokens have no text (stop strings never match)."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


def with_mode(target, mode: str):
    """``target`` set to run ``mode`` (``default``, or ``[tp1:]ATTENTION[+graphs]``): a copy whose
    ``attention`` / ``cuda_graphs`` fields say so; ``tp1:`` runs it through the tensor-parallel
    rank's path at TP = 1 in this process (``deployments.tp.target.in_process_tp``). Raises where
    this build's Target has no such field."""
    if mode.startswith("tp1:"):
        from deployments.tp.target import in_process_tp

        inner = with_mode(target, mode[4:])
        return in_process_tp(inner, inner.attention, inner.cuda_graphs)
    if mode == "default":
        return target
    attention, _, extra = mode.partition("+")
    if extra not in ("", "graphs"):
        raise ValueError(f"mode {mode!r}: expected ATTENTION or ATTENTION+graphs")
    want = {"attention": attention, "cuda_graphs": extra == "graphs"}
    have = {f.name for f in dataclasses.fields(target)}
    missing = sorted(set(want) - have)
    if missing:
        raise RuntimeError(f"this build's Target has no {', '.join(missing)} field (mode {mode!r} cannot run)")
    return dataclasses.replace(target, **want)


def curve(target, batch: int, drafts: list[int], context: int, repeats: int, vocab: int, mode: str, emit) -> None:
    """Time one B for every draft length in ``drafts``; ``emit(row)`` each case as it is measured."""
    steps = len(drafts) * (WARM_STEPS + repeats) + 2
    limits = BatchLimits(max_running=batch, prefill_chunk=PREFILL_CHUNK, tree_rows=max(16, max(drafts) + 1))
    cfg = DecodeConfig(max_new_tokens=steps + 8)
    block = 16
    per_seq = -(-(context + cfg.max_new_tokens + limits.tree_rows) // block) * block  # a table's rows
    pool = target.block_pool(batch * per_seq, block, prefix_caching=False)
    sched = Scheduler(target, None, limits, pool)
    g = torch.Generator().manual_seed(batch)
    seqs = [
        sched.add(Sequence(target, torch.randint(0, vocab, (context,), generator=g).tolist(), None, cfg))
        for _ in range(batch)
    ]
    for _ in range(batch * context // PREFILL_CHUNK + batch + 2):  # prefill (untimed)
        if all(s.decoding for s in seqs):
            break
        sched.step()
    else:
        raise RuntimeError(f"{sum(not s.decoding for s in seqs)} of {batch} sequences never started decoding")
    base = None
    for t in drafts:
        for i, s in enumerate(seqs):
            s.drafter = ChainDrafter(t, vocab, 1000 * batch + i)
        wall, fwd, host = [], [], []
        for k in range(WARM_STEPS + repeats):
            t0 = time.perf_counter()
            sched.step()
            dt = time.perf_counter() - t0
            rec = sched.steps[-1]
            if rec.sequences != batch or rec.prefill_rows:
                raise RuntimeError(f"a timed step ran {rec.sequences} of {batch} sequences (a sequence ended early)")
            if k >= WARM_STEPS:
                wall.append(dt)
                fwd.append(rec.forward_s)
                host.append(rec.host_s)
        ms = 1000 * statistics.median(wall)
        base = ms if t == 0 else base
        row = {
            "mode": mode,
            "batch": batch,
            "drafts": t,
            "rows": batch * (1 + t),
            "step_ms": ms,
            "forward_ms": 1000 * statistics.median(fwd),
            "host_ms": 1000 * statistics.median(host),
        }
        if t == 0:
            row["plain_tokens_per_s"] = 1000 * batch / ms
        elif base:
            row["break_even_mat"] = ms / base
        emit(row)
    for s in seqs:
        sched.cancel(s)
    sched.run()


def best_mode(report: dict) -> str | None:
    """The mode of a curve ``report`` that ran without errors and whose steps sum least over the
    cases every such mode measured (None: no mode ran cleanly)."""
    clean = [m["mode"] for m in report["modes"] if not m["errors"]]
    cases: dict[str, dict] = {}
    for c in report["cases"]:
        if c["mode"] in clean:
            cases.setdefault(c["mode"], {})[(c["batch"], c["drafts"])] = c["step_ms"]
    if not cases:
        return None
    common = set.intersection(*(set(v) for v in cases.values()))
    return min(cases, key=lambda m: sum(cases[m][k] for k in common)) if common else None


def build(args, dtype):
    """(model, label) of ``--model`` (``tiny``, a shape name, ``embedded`` or an HF directory)."""
    if args.model == "tiny" or (args.model in SHAPES and args.layers):
        name, over = TINY if args.model == "tiny" else (args.model, {})
        over = {**over, **({"vocab_size": TINY_VOCAB} if args.model == "tiny" else {})}
        if args.layers:
            over["num_hidden_layers"] = args.layers
        return build_shape(name, args.device, dtype, over), args.model + (f"-{args.layers}l" if args.layers else "")
    return load_model(args.model, args.device, dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="tiny, embedded, an HF directory, or a shape name (random)")
    ap.add_argument("--layers", type=int, default=None, help="a shape's layers cut to this many (a quicker probe)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--drafts", default="0,3,15")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="default", help="comma list of default | [tp1:]ATTENTION[+graphs]")
    ap.add_argument("--out", default="benchmarks/runs/batch-timing.json")
    ap.add_argument(
        "--best", metavar="JSON", help="print the best clean mode of a written curve (nothing: none) and exit"
    )
    args = ap.parse_args(argv)
    if args.best:
        try:
            best = best_mode(json.loads(Path(args.best).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"no curve to choose from in {args.best}: {exc}")
        print(best or "")
        return 0
    from toolspec_core.model.target import from_model

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    t0 = time.perf_counter()
    model, label = build(args, dtype)
    base = from_model(serving_kernels(model, args.device, dtype, None), _NoText(), name=label)
    base.eos_ids = ()  # random weights choose any token, an end-of-turn id too: no timed sequence may end early
    if not base.batched:
        raise SystemExit(f"{label}: its family has no batched forward (toolspec_core.model.batch_forward)")
    print(f"built {label} on {args.device} ({dtype}) in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = model.config.vocab_size
    drafts = [int(x) for x in args.drafts.split(",")]
    out = {
        "tool": "benchmarks.batch_timing",
        "model": label,
        "dtype": str(dtype).replace("torch.", ""),
        "hardware": hardware_string(args.device),
        "context": args.context,
        "repeats": args.repeats,
        "modes": [],
        "cases": [],
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(row: dict | None = None) -> None:
        if row is not None:  # a case as it is measured
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
        path.write_text(json.dumps(out, indent=1) + "\n")

    for mode in args.modes.split(","):
        entry = {"mode": mode, "errors": []}
        out["modes"].append(entry)
        try:
            target = with_mode(base, mode)
        except Exception as exc:  # a mode this build has not: recorded, the others go on
            entry["errors"].append({"batch": None, "error": f"{type(exc).__name__}: {exc}"})
            print(f"mode {mode}: {exc}", flush=True)
            save()
            continue
        for b in [int(x) for x in args.batches.split(",")]:
            try:
                curve(target, b, drafts, args.context, args.repeats, vocab, mode, save)
            except Exception as exc:  # e.g. out of memory at one B: recorded, the next B goes on
                entry["errors"].append({"batch": b, "error": f"{type(exc).__name__}: {exc}"})
                print(f"mode {mode}, B={b}: {type(exc).__name__}: {exc}", flush=True)
            if args.device != "cpu":
                torch.cuda.empty_cache()
        save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
