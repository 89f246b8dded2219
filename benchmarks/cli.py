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


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="toolspec bench",
        description=__doc__.split("\n\n")[0],
        epilog="Rebuild report and plots from a run without decoding: toolspec bench report --out DIR [--name NAME]",
    )
    ap.add_argument(
        "--data",
        action="append",
        default=[],
        help="JSONL (or .jsonl.gz) file in the common format (repeatable); default: the API-Bank, BFCL v3 and "
        "ToolAlpaca dev sets in benchmarks/datasets",
    )
    ap.add_argument("--out", default="benchmarks/runs/bench", help="run directory (items.jsonl; a rerun resumes)")
    ap.add_argument("--name", default=None, help="report name: benchmarks/results/<name>.json (default: out dir name)")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--methods", type=_csv, default=list(ALL_METHODS), help=f"comma list of {','.join(ALL_METHODS)}")
    ap.add_argument(
        "--library", type=_csv, default=["online"], help=f"comma list of {','.join(LIBRARIES)} (history methods)"
    )
    ap.add_argument(
        "--retrieval-key",
        choices=RETRIEVAL_KEYS,
        default=None,
        help="how library methods key past calls: the request text as the Retrieval deployment keys it "
        "(qwen: its Qwen encoder, the default; hybrid: Qwen + lexical; lexical: hashed n-grams) in a "
        "retrieval_service memory store, or the target's last prompt state (hidden; --batch keys by it)",
    )
    ap.add_argument("--warm-file", action="append", default=[], help="JSONL whose gold calls fill the warm library")
    ap.add_argument("--warm-layout", choices=LAYOUTS, default="fence")
    ap.add_argument("--warm-limit", type=int, default=None, help="warm items per benchmark (each costs one prefill)")
    ap.add_argument("--no-warm-embed", action="store_true", help="do not prefill warm items for retrieval keys")
    ap.add_argument("--limit", type=int, default=None, help="items per data file")
    ap.add_argument(
        "--max-items",
        type=int,
        default=None,
        help="stop after this many items of the interleaved stream (the first of a --limit sample; resumable)",
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed for --limit; -1 = the first N items")
    ap.add_argument(
        "--structured",
        action="store_true",
        help="structured outputs: each item's task becomes its gold call's arguments as a response_format "
        "json_schema answer (benchmark structured_<set>)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cost", default="measured", help="measured | reference | flat | path to a cost JSON")
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where the target runs")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="target dtype; float32 keeps greedy output bit-identical (bf16: up to near-ties, see README)",
    )
    ap.add_argument(
        "--packed-rows",
        type=int,
        default=None,
        help="CPU fp32, opt-in: MKL packed GEMM for 4..N-row verify forwards (16; default 0: off)",
    )
    ap.add_argument(
        "--attention",
        choices=["auto", "per_sequence", "ragged"],
        default=None,
        help="the target's attention over a step's rows: one call per sequence, or one ragged call over the "
        "block pool (default: the target's own choice)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="replay the decode step from CUDA graphs captured at bucketed shapes (default: the target's own choice)",
    )
    ap.add_argument(
        "--calibrate", action="store_true", help="refit the shared cost curve from the verify steps really paid"
    )
    ap.add_argument(
        "--no-retime",
        action="store_true",
        help="on resume, compare new methods with the stored plain-greedy time instead of timing it again",
    )
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument(
        "--batch",
        type=lambda s: [int(x) for x in _csv(s)],
        default=None,
        help="batch sizes, e.g. 1,2,4,8,16: decode B items together per method (benchmarks/batch.py)",
    )
    ap.add_argument("--hardware", default=None, help="what the run ran on, for the --batch report")
    ap.add_argument("--report-only", action="store_true", help="--batch: rebuild the report from --out, no decoding")
    ap.add_argument(
        "--same-batch-reference",
        action="store_true",
        help="--batch: exact match against plain greedy at the same B, so B = 1 runs only when listed "
        "(default: against single-stream plain greedy, B = 1 always runs)",
    )
    return ap


def _check(args, ap) -> None:
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad:
        ap.error(f"unknown method(s) {', '.join(bad)}; known: {', '.join(ALL_METHODS)}")
    bad = [lib for lib in args.library if lib not in LIBRARIES]
    if bad:
        ap.error(f"unknown library {', '.join(bad)}; known: {', '.join(LIBRARIES)}")
    if "warm" in args.library and not args.warm_file:
        ap.error("--library warm needs --warm-file")
    args.data = args.data or [str(dev_set(name)) for name in SINGLE_TURN]
    for p in args.data + args.warm_file:
        if not Path(p).is_file():
            ap.error(f"no such file: {p}")


def report_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="toolspec bench report", description="rebuild report + plots from <out>/items.jsonl"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--data", action="append", default=None, help="the run's JSONL files on this machine (a run made elsewhere)"
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


def bench_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    ap = _parser()
    args = ap.parse_args(argv)
    _check(args, ap)
    if args.batch and args.structured:
        ap.error("--structured runs single-stream (no --batch)")
    if args.batch and args.retrieval_key not in (None, "hidden"):
        ap.error("--batch keys the library by the target's hidden state (--retrieval-key hidden)")
    if args.batch:
        if any(b <= 0 for b in args.batch):
            ap.error("--batch sizes must be positive")
        if args.methods and args.methods[0] != "ar":
            args.methods = ["ar"] + [m for m in args.methods if m != "ar"]  # the reference runs first
        from .batch import batch_main

        # B = 1 plain greedy is the exact-match reference, unless each B is compared with its own
        args.batch = sorted(set(args.batch) | (set() if args.same_batch_reference else {1}))
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
        print(
            "skipped methods: " + "; ".join(f"{k} ({v})" for k, v in runner.pool.unavailable.items()), file=sys.stderr
        )
    if not args.no_report:
        from .report import build_report

        rep = build_report(Path(args.out), args.name, Path(args.results_dir))
        _print_summary(rep, Path(args.results_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
