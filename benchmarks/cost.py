"""``toolspec bench-cost``: measure the verify-cost curve c(k) of a model shape, and project
speedups onto other hardware's curves.

Decode speedup ≈ MAT / c(tree size): the same drafts pay off very differently on a CPU (steep
curve) and a GPU (nearly flat). Timing does not depend on weight values, so named shapes are
built from a config with random weights (no download): bf16 on a GPU, fp32 on a CPU. Usage:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

from toolspec_core.engine.budget import CPU_REFERENCE_CURVE, interpolate
from toolspec_core.engine.cost_probe import DEFAULT_KS
from toolspec_core.model.attention import use_grouped_sdpa
from toolspec_core.model.shapes import SHAPES
from toolspec_core.model.target import load_hf_model, resolve_dtype

RESULTS = Path(__file__).resolve().parent / "results"
CURVES = RESULTS / "curves"  # measured cost curves (not method runs): projections read them from here


# --------------------------------------------------------------------------- projection


def steps_cost(drafted_per_step: list[int], curve: list[float]) -> float:
    """Σ cost of one decode's steps: a step verifying a tree of k nodes runs k + 1 tokens."""
    last = len(curve) - 1
    return sum(curve[min(k + 1, last)] for k in drafted_per_step)


def host_seconds(record: dict) -> float:
    """Time a decode spent outside the target's forwards (drafting, commit, drafter set-up)."""
    return record.get("draft_s", 0.0) + record.get("commit_s", 0.0) + record.get("setup_s", 0.0)


def projected_speedup(
    ar_records: list[dict], records: list[dict], curve: list[float], step_s: float | None = None
) -> float:
    """Σ cost of plain greedy's steps / Σ cost of the method's actual steps under ``curve``.

    It uses the trees the method really verified (cut by the run's own budget): a lower bound on
    hardware whose flatter curve would let the budget keep more. With ``step_s`` (c(1) in seconds
    there) steps count in seconds plus each record's measured host time (drafting, commit: not
    overlapped with the forward), which is no longer small where a step takes milliseconds.
    """

    def cost(r: dict) -> float:
        c = steps_cost(r["drafted_per_step"], curve)
        return c if step_s is None else c * step_s + host_seconds(r)

    ar, me = sum(map(cost, ar_records)), sum(map(cost, records))
    return ar / me if me else float("nan")


def curve_from_points(points: dict, max_k: int = 64) -> list[float]:
    return interpolate({int(k): float(v) for k, v in points.items()}, max_k)


def load_curves(curves_dir: Path = CURVES, max_k: int = 64) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(curves, step seconds): the built-in curves plus every ``cost-*.json`` in ``curves_dir``, and
    c(1) in seconds of the accelerator ones (for projections that add host time)."""
    curves = {
        "cpu_reference": curve_from_points(CPU_REFERENCE_CURVE, max_k),
        "flat": curve_from_points({1: 1.0, max_k: 1.0}, max_k),
    }
    step_seconds: dict[str, float] = {}
    for path in sorted(Path(curves_dir).glob("cost-*.json")):
        try:
            d = json.loads(path.read_text())
            name = path.stem[len("cost-") :]
            curves[name] = curve_from_points(d["points"], max_k)
            if d.get("device", "cpu") != "cpu":
                step_seconds[name] = float(d["seconds"]["1"])
        except (KeyError, ValueError, TypeError, AttributeError, json.JSONDecodeError):
            continue
    return curves, step_seconds


# --------------------------------------------------------------------------- measurement


def build_shape(name: str, device: str, dtype: torch.dtype, overrides: dict | None = None):
    """A Qwen2 model of a named shape with random weights, created directly on ``device``;
    ``overrides``: config keys changed (fewer layers, a smaller width: a quick CPU probe)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = Qwen2Config(**{**SHAPES[name], **(overrides or {})}, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    use_grouped_sdpa(model)  # the attention decoding runs (toolspec_core.model.target.from_model)
    return model.eval()


def load_model(spec: str, device: str, dtype: torch.dtype):
    """(model, label): ``spec`` is "embedded", a local HF directory, or a name in SHAPES."""
    if spec in SHAPES:
        return build_shape(spec, device, dtype), spec
    if spec in ("", "embedded"):
        from toolspec_core.model.embedded import EMBEDDED_MODEL_NAME, embedded_model_dir

        path, label = embedded_model_dir(), EMBEDDED_MODEL_NAME
    else:
        path, label = Path(spec), Path(spec).name
    return load_hf_model(path, dtype).to(device), label


def serving_kernels(model, device: str, dtype: torch.dtype, packed_rows: int | None):
    """The CPU linear-layer dispatch the engine's ``load_target`` applies, so the curve is the
    one decoding will see (``packed_rows``: see ``tune_cpu_linears``; None/0: the default
    oneDNN-reordered copy only; a bfloat16 / float16 model: ``tune_reduced_linears``)."""
    if device == "cpu" and dtype == torch.float32:
        from toolspec_core.model.cpu_linears import tune_cpu_linears

        tune_cpu_linears(model, packed_rows=packed_rows or 0)
    elif device == "cpu":
        from toolspec_core.model.cpu_linears import tune_reduced_linears

        tune_reduced_linears(model)
    return model


def measure_curve(model, prefix_len: int = 500, ks=DEFAULT_KS, repeats: int = 5) -> tuple[dict, dict]:
    """(median seconds, cost relative to k=1) per k, through the engine's own start-up probe
    (``cost_probe.measure_cost_points``: ``Target.step`` on a decoding cache), i.e. what decoding pays:
    host-built inputs moved to the model's device, tree mask, argmax, KV commit."""
    from toolspec_core.engine.cost_probe import measure_cost_points
    from toolspec_core.model.target import Target

    return measure_cost_points(Target(model=model, tokenizer=None, name="probe"), prefix_len, tuple(ks), repeats)


def device_tag(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
        return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "cuda"
    return "cpu"


def hardware_string(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="toolspec bench-cost", description=__doc__.split("\n\n")[0])
    for flag, kw in (
        ("--model", dict(default="embedded", help=f"embedded | HF dir | shape: {', '.join(SHAPES)}")),
        ("--device", dict(default="cuda" if torch.cuda.is_available() else "cpu")),
        (
            "--dtype",
            dict(
                choices=["auto", "float32", "bfloat16", "float16"],
                default="auto",
                help="auto: bf16 where the device has it natively",
            ),
        ),
        ("--prefix-len", dict(type=int, default=500)),
        ("--ks", dict(default=",".join(map(str, DEFAULT_KS)))),
        ("--repeats", dict(type=int, default=5)),
        ("--threads", dict(type=int)),
        ("--packed-rows", dict(type=int, help="CPU fp32: MKL packed GEMM for 4..N rows, as toolspec bench")),
        ("--out", dict(help="output JSON (default benchmarks/results/curves/cost-<device>-<shape>.json)")),
    ):
        ap.add_argument(flag, **kw)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.device)
    ks = sorted({int(k) for k in args.ks.split(",")} | {1})
    t0 = time.perf_counter()
    model, label = load_model(args.model, args.device, dtype)
    serving_kernels(model, args.device, dtype, args.packed_rows)
    print(f"built {label} on {args.device} ({dtype}) in {time.perf_counter() - t0:.1f}s", flush=True)
    seconds, points = measure_curve(model, args.prefix_len, ks, args.repeats)
    shape = re.sub(r"[^a-z0-9.]+", "-", label.lower())
    report = {
        "device": args.device,
        "hardware": hardware_string(args.device),
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "prefix_len": args.prefix_len,
        "repeats": args.repeats,
        "via": "engine",
        "random_weights": args.model in SHAPES,
        "seconds": {str(k): s for k, s in seconds.items()},
        "points": {str(k): p for k, p in points.items()},
    }
    out = Path(args.out) if args.out else CURVES / f"cost-{device_tag(args.device)}-{shape}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("k:     " + " ".join(f"{k:>6d}" for k in ks))
    print("c(k):  " + " ".join(f"{points[k]:6.2f}" for k in ks))
    print(f"c(1) = {seconds[1] * 1000:.1f} ms; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
