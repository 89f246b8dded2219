"""``toolspec bench``: run the side-by-side benchmark, or rebuild its report.

    toolspec bench --data benchmarks/datasets/api_bank.dev.jsonl.gz --data benchmarks/datasets/bfcl_v3.dev.jsonl.gz \\
        --limit 60 --methods ar,pld,suffix,token_recycling,toolspec --library online --out benchmarks/runs/cpu
    toolspec bench report --out benchmarks/runs/cpu --name cpu-embedded      # no decoding
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cost import RESULTS
from .data import LAYOUTS
from .datasets import SINGLE_TURN, dev_set
from .runner import ALL_METHODS, LIBRARIES, RETRIEVAL_KEYS, RunConfig

SAME_NAMED = (  # RunConfig fields that take the flag's value as it is
    *("data", "out", "methods", "limit", "warm_layout", "warm_limit", "max_new_tokens", "cost", "model", "threads"),
    *("packed_rows", "calibrate", "device", "dtype", "structured", "attention", "cuda_graphs"),
)
FLAG = {"action": "store_true"}


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _sizes(s: str) -> list[int]:
    return [int(x) for x in _csv(s)]


OPTIONS = (  # (flag, add_argument keywords), in --help order
    (
        "--data",
        dict(action="append", default=[], help="JSONL (.gz) file, repeatable (default: the dev sets)"),
    ),
    ("--out", dict(default="benchmarks/runs/bench", help="run directory (items.jsonl; a rerun resumes)")),
    ("--name", dict(help="report name: benchmarks/results/<name>.json (default: out dir name)")),
    ("--results-dir", dict(default=str(RESULTS))),
    ("--methods", dict(type=_csv, default=list(ALL_METHODS), help=f"comma list of {','.join(ALL_METHODS)}")),
    ("--library", dict(type=_csv, default=["online"], help=f"comma list of {','.join(LIBRARIES)} (history methods)")),
    (
        "--retrieval-key",
        dict(choices=RETRIEVAL_KEYS, help="qwen (default), hybrid, lexical: text; hidden: prompt state"),
    ),
    ("--warm-file", dict(action="append", default=[], help="JSONL whose gold calls fill the warm library")),
    ("--warm-layout", dict(choices=LAYOUTS, default="fence")),
    ("--warm-limit", dict(type=int, help="warm items per benchmark (each costs one prefill)")),
    ("--no-warm-embed", dict(FLAG, help="do not prefill warm items for retrieval keys")),
    ("--limit", dict(type=int, help="items per data file")),
    ("--max-items", dict(type=int, help="stop after this many items of the interleaved stream (resumable)")),
    ("--seed", dict(type=int, default=0, help="sampling seed for --limit; -1 = the first N items")),
    ("--structured", dict(FLAG, help="structured outputs: gold call arguments as a json_schema answer")),
    ("--max-new-tokens", dict(type=int, default=256)),
    ("--cost", dict(default="measured", help="measured | reference | flat | path to a cost JSON")),
    ("--model", dict(help="HF model directory (default: the embedded model)")),
    ("--threads", dict(type=int)),
    ("--device", dict(default="cpu", help="cpu | cuda | cuda:N: where the target runs")),
    (
        "--dtype",
        dict(
            choices=["float32", "bfloat16", "float16", "auto"],
            default="float32",
            help="auto: bfloat16 where the device computes it natively (a CPU with AVX512_BF16 or AMX), else float32",
        ),
    ),
    ("--packed-rows", dict(type=int, help="CPU fp32, opt-in: MKL packed GEMM for 4..N-row forwards (default 0: off)")),
    ("--attention", dict(choices=["auto", "per_sequence", "ragged"], help="default: the target's own choice")),
    ("--cuda-graphs", dict(FLAG, default=None, help="replay the decode step from CUDA graphs")),
    ("--calibrate", dict(FLAG, help="refit the shared cost curve from the verify steps really paid")),
    ("--no-retime", dict(FLAG, help="on resume, compare with the stored plain-greedy time, not a new one")),
    ("--no-report", FLAG),
    ("--batch", dict(type=_sizes, help="batch sizes, e.g. 1,2,4,8,16: decode B items together per method")),
    ("--hardware", dict(help="what the run ran on, for the --batch report")),
    ("--report-only", dict(FLAG, help="--batch: rebuild the report from --out, no decoding")),
    ("--same-batch-reference", dict(FLAG, help="--batch: exact match against ar at the same B, not at B = 1")),
    (
        "--target",
        dict(
            choices=["model", "replay"],
            default="model",
            help="--batch: model (default) or replay: the recorded plain-greedy outputs, no forward (benchmarks/replay.py)",
        ),
    ),
    ("--replay-file", dict(help="--target replay: the recording (default: benchmarks/datasets/greedy-*.jsonl.gz)")),
    ("--cycle", dict(FLAG, help="--target replay: fill a B larger than a set's recorded items by repeating them")),
    (
        "--step-model",
        dict(
            help="--target replay: each step lasts this GPU step curve's forward (benchmarks/step_model.py): a projection"
        ),
    ),
    (
        "--overlap",
        dict(
            choices=["auto", "on", "off"],
            help="--batch: host work beside the forward (Scheduler.overlap; auto: where the forward runs elsewhere)",
        ),
    ),
)
REPORT_OPTIONS = (
    ("--out", {"required": True}),
    ("--name", {}),
    ("--results-dir", {"default": str(RESULTS)}),
    ("--no-plots", FLAG),
    ("--data", dict(action="append", help="the run's JSONL files on this machine (a run made elsewhere)")),
)


def _parser(options=OPTIONS, **kw) -> argparse.ArgumentParser:
    kw = kw or dict(
        prog="toolspec bench",
        description=__doc__.split("\n\n")[0],
        epilog="Rebuild report and plots from a run without decoding: toolspec bench report --out DIR [--name NAME]",
    )
    ap = argparse.ArgumentParser(**kw)
    for flag, keywords in options:
        ap.add_argument(flag, **keywords)
    return ap


def _check(args, ap) -> None:
    for kind, given, known in (("method(s)", args.methods, ALL_METHODS), ("library", args.library, LIBRARIES)):
        if bad := [x for x in given if x not in known]:
            ap.error(f"unknown {kind} {', '.join(bad)}; known: {', '.join(known)}")
    if "warm" in args.library and not args.warm_file:
        ap.error("--library warm needs --warm-file")
    args.data = args.data or [str(dev_set(name)) for name in SINGLE_TURN]
    for p in args.data + args.warm_file:
        if not Path(p).is_file():
            ap.error(f"no such file: {p}")
    if args.batch and args.structured:
        ap.error("--structured runs single-stream (no --batch)")
    if args.batch and args.retrieval_key not in (None, "hidden"):
        ap.error("--batch keys the library by the target's hidden state (--retrieval-key hidden)")
    if args.batch and any(b <= 0 for b in args.batch):
        ap.error("--batch sizes must be positive")
    if args.target == "replay" and not args.batch:
        ap.error("--target replay runs with --batch")
    if args.target == "replay" and args.cost in ("measure", "measured"):
        ap.error("--target replay costs no forward: give the real model's curve (--cost PATH, or reference)")
    if args.cycle and args.target != "replay":
        ap.error("--cycle repeats recorded items: it needs --target replay")
    if args.step_model is not None:
        if args.target != "replay":
            ap.error("--step-model models the forward of the replay target: it needs --target replay")
        try:
            from .step_model import StepModel

            StepModel.load(args.step_model)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--step-model {args.step_model}: {exc}")
    if args.overlap is not None and not args.batch:
        ap.error("--overlap is a --batch option")


def report_main(argv: list[str]) -> int:
    ap = _parser(
        REPORT_OPTIONS, prog="toolspec bench report", description="rebuild report + plots from <out>/items.jsonl"
    )
    args = ap.parse_args(argv)
    if not (Path(args.out) / "items.jsonl").exists():
        ap.error(f"{args.out}/items.jsonl does not exist")
    from .report import build_report

    rep = build_report(Path(args.out), args.name, Path(args.results_dir), plots=not args.no_plots, data=args.data)
    _print_summary(rep, Path(args.results_dir))
    return 0


def _print_summary(rep: dict, results_dir: Path) -> None:
    print((results_dir / f"{rep['name']}.md").read_text())
    print(f"wrote {results_dir / rep['name']}.json / .md / _plots/")
    if rep["mismatches"]:
        print(f"!!! {len(rep['mismatches'])} EXACT-MATCH FAILURES (see the report)", file=sys.stderr)


def parse(argv: list[str]) -> argparse.Namespace:
    """``toolspec bench``'s arguments, checked; with ``--batch``, plain greedy first (the
    reference) and B = 1 added unless each B is compared with its own (``--same-batch-reference``).
    What ``BatchRun`` takes, for studies and tests too."""
    ap = _parser()
    args = ap.parse_args(argv)
    _check(args, ap)
    if args.batch:
        if args.methods and args.methods[0] != "ar":
            args.methods = ["ar"] + [m for m in args.methods if m != "ar"]  # the reference runs first
        args.batch = sorted(set(args.batch) | (set() if args.same_batch_reference else {1}))
    return args


def bench_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    args = parse(argv)
    if args.batch:
        from .batch import batch_main

        return batch_main(args)
    from .runner import run

    cfg = RunConfig(
        **{k: getattr(args, k) for k in SAME_NAMED},
        libraries=args.library,
        seed=None if args.seed < 0 else args.seed,
        warm_files=args.warm_file,
        warm_embed=not args.no_warm_embed,
        retime_reference=not args.no_retime,
        retrieval_key=args.retrieval_key or "qwen",
    )
    runner = run(cfg, max_items=args.max_items)
    if runner.pool.unavailable:
        skipped = "; ".join(f"{k} ({v})" for k, v in runner.pool.unavailable.items())
        print(f"skipped methods: {skipped}", file=sys.stderr)
    if not args.no_report:
        from .report import build_report

        _print_summary(build_report(Path(args.out), args.name, Path(args.results_dir)), Path(args.results_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
