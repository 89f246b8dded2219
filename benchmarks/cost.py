"""``toolspec bench-cost``: measure the verify-cost curve c(k) of a model shape, and project
speedups onto other hardware's curves.

Decode speedup ≈ MAT / c(tree size): the same drafts pay off very differently on a CPU (steep
curve) and a GPU (nearly flat). Timing does not depend on weight values, so named shapes are
built from a config with random weights (no download): bf16 on a GPU, fp32 on a CPU.

    toolspec bench-cost --model embedded                        # this CPU, embedded 0.5B
    toolspec bench-cost --model qwen2.5-7b --device cuda        # 7B shape, random bf16
    toolspec bench-cost --model /path/to/hf_dir --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

from toolspec_core.budget import CPU_REFERENCE_CURVE, DEFAULT_KS, interpolate, paired_cost
from toolspec_core.target import cache_kwarg
from toolspec_core.tree import DraftTree
from toolspec_core.verify import tree_inputs

RESULTS = Path(__file__).resolve().parent / "results"

# Qwen2.5 architecture shapes (from the public config.json files).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}

# --------------------------------------------------------------------------- projection


def steps_cost(drafted_per_step: list[int], curve: list[float]) -> float:
    """Σ cost of one decode's steps: a step verifying a tree of k nodes runs k + 1 tokens."""
    last = len(curve) - 1
    return sum(curve[min(k + 1, last)] for k in drafted_per_step)


def projected_speedup(ar_records: list[dict], records: list[dict], curve: list[float]) -> float:
    """Σ cost of plain greedy's steps / Σ cost of the method's actual steps under ``curve``.

    For plain greedy every step costs c(1) = 1, so this is tokens / Σ c(k). It uses the trees
    the method really verified (cut by the run's own budget): a lower bound on hardware whose
    flatter curve would let the budget keep more. Drafting CPU time is not included.
    """
    ar = sum(steps_cost(r["drafted_per_step"], curve) for r in ar_records)
    me = sum(steps_cost(r["drafted_per_step"], curve) for r in records)
    return ar / me if me else float("nan")


def host_seconds(record: dict) -> float:
    """Time a decode spent outside the target's forwards (drafting, commit, drafter set-up)."""
    return record.get("draft_s", 0.0) + record.get("commit_s", 0.0) + record.get("setup_s", 0.0)


def projected_speedup_with_host(ar_records: list[dict], records: list[dict], curve: list[float], step_s: float) -> float:
    """As ``projected_speedup`` with steps in seconds (``step_s`` = c(1) measured on that hardware)
    plus each record's measured host-side time: where a step costs milliseconds, drafting time is
    no longer small. The host time is this run's (its CPU, drafting not overlapped with the forward)."""
    ar = sum(steps_cost(r["drafted_per_step"], curve) * step_s + host_seconds(r) for r in ar_records)
    me = sum(steps_cost(r["drafted_per_step"], curve) * step_s + host_seconds(r) for r in records)
    return ar / me if me else float("nan")


def curve_from_points(points: dict, max_k: int = 64) -> list[float]:
    return interpolate({int(k): float(v) for k, v in points.items()}, max_k)


def load_step_seconds(results_dir: Path = RESULTS) -> dict[str, float]:
    """c(1) in seconds of every measured accelerator curve (``cost-*.json`` with device != cpu)."""
    out = {}
    for path in sorted(Path(results_dir).glob("cost-*.json")):
        try:
            d = json.loads(path.read_text())
            if d.get("device", "cpu") != "cpu":
                out[path.stem[len("cost-") :]] = float(d["seconds"]["1"])
        except (KeyError, ValueError, TypeError, json.JSONDecodeError):
            continue
    return out


def load_curves(results_dir: Path = RESULTS, max_k: int = 64) -> dict[str, list[float]]:
    """Built-in curves plus every ``cost-*.json`` measured into ``results_dir``."""
    curves = {
        "cpu_reference": curve_from_points(CPU_REFERENCE_CURVE, max_k),
        "flat": curve_from_points({1: 1.0, max_k: 1.0}, max_k),
    }
    for path in sorted(Path(results_dir).glob("cost-*.json")):
        try:
            curves[path.stem[len("cost-") :]] = curve_from_points(json.loads(path.read_text())["points"], max_k)
        except (KeyError, ValueError, json.JSONDecodeError):
            continue
    return curves


# --------------------------------------------------------------------------- measurement


def build_shape(name: str, device: str, dtype: torch.dtype):
    """A Qwen2 model of a named shape with random weights, created directly on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=32768, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def load_model(spec: str, device: str, dtype: torch.dtype):
    """(model, label): ``spec`` is "embedded", a local HF directory, or a name in SHAPES."""
    from transformers import AutoModelForCausalLM

    if spec in SHAPES:
        return build_shape(spec, device, dtype), spec
    if spec in ("", "embedded"):
        from toolspec_core.embedded import EMBEDDED_MODEL_NAME, embedded_model_dir

        path, label = embedded_model_dir(), EMBEDDED_MODEL_NAME
    else:
        path, label = Path(spec), Path(spec).name
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), label


def serving_kernels(model, device: str, dtype: torch.dtype, packed_rows: int | None):
    """The CPU fp32 linear-layer dispatch the engine's ``load_target`` applies, so the curve is the
    one decoding will see (``packed_rows``: see ``tune_cpu_linears``; None/0: transposed copy only)."""
    if device == "cpu" and dtype == torch.float32:
        from toolspec_core.target import tune_cpu_linears

        tune_cpu_linears(model, packed_rows=packed_rows or 0)
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _verify_forward(model, k: int, prefix_len: int, cache, device: str, vocab: int, gen) -> None:
    """One decode-style forward: k tokens (root + chain of k-1) with the float tree mask,
    logits on every row, like ``engine.verify_step``."""
    tree = DraftTree()
    tree.add_path(torch.randint(0, vocab, (k - 1,), generator=gen).tolist(), 0.5, "probe")
    ids, pos, mask = tree_inputs(0, tree, prefix_len, model.dtype)  # [1,k], [1,k], [1,1,k,P+k]
    with torch.inference_mode():
        h = model.model(
            input_ids=ids.to(device), position_ids=pos.to(device),
            attention_mask=mask.to(device) if k > 1 else None, use_cache=True, **{cache_kwarg(model.model): cache},
        ).last_hidden_state[0]
        model.lm_head(h).float().argmax(-1).tolist()  # [k] -- the host sync a real step has
    _sync(device)


def measure_curve(model, device: str = "cpu", prefix_len: int = 500, ks=DEFAULT_KS, repeats: int = 5) -> tuple[dict, dict]:
    """(median seconds, cost relative to k=1) of one k-token verify forward, per k.

    Paired as in the engine's start-up probe (``budget.paired_cost``): on a shared machine the
    speed drifts, and a 1-token forward timed at another moment would skew every ratio.
    """
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(device)
    with torch.inference_mode():
        model.model(input_ids=ids, position_ids=torch.arange(prefix_len, device=device)[None], use_cache=True,
                    **{cache_kwarg(model.model): cache})
    _sync(device)
    if cache.get_seq_length() != prefix_len:  # a forward that ignored the cache would time k tokens alone
        raise RuntimeError(f"prefill left {cache.get_seq_length()} cached positions, expected {prefix_len}")

    def once(k: int) -> float:
        t0 = time.perf_counter()
        _verify_forward(model, k, prefix_len, cache, device, vocab, gen)
        dt = time.perf_counter() - t0
        assert cache.get_seq_length() == prefix_len + k, "the verify forward did not extend the cache"
        cache.crop(-(cache.get_seq_length() - prefix_len))
        return dt

    return paired_cost(once, ks, repeats)


def measure_engine_curve(model, prefix_len: int = 500, ks=DEFAULT_KS, repeats: int = 5) -> tuple[dict, dict]:
    """As ``measure_curve``, through the engine's own start-up probe (``budget.measure_cost_points``:
    ``engine.verify_step`` on a ``Target``), to see what decoding pays on top of the bare forward."""
    from toolspec_core.budget import measure_cost_points
    from toolspec_core.target import from_model

    class _NoTokens:  # the probe decodes nothing; from_model only asks for end-of-turn ids
        eos_token_id = unk_token_id = None

        def convert_tokens_to_ids(self, tok):
            return None

    target = from_model(model, _NoTokens(), name="probe")
    seconds: dict = {}
    points = measure_cost_points(target, prefix_len, tuple(ks), repeats, seconds=seconds)
    return seconds, points


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
    ap.add_argument("--model", default="embedded", help=f"embedded | HF dir | shape: {', '.join(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--prefix-len", type=int, default=500)
    ap.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--packed-rows", type=int, default=None, help="CPU fp32: MKL packed GEMM for 4..N rows, as toolspec bench (default 0: off)")
    ap.add_argument("--out", default=None, help="output JSON (default benchmarks/results/cost-<device>-<shape>.json)")
    ap.add_argument("--via", choices=["forward", "engine"], default="forward",
                    help="forward: the model's forward + lm_head; engine: toolspec_core's own verify step "
                         "(inputs built on the host and moved, tree mask, argmax, KV commit)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ks = sorted({int(k) for k in args.ks.split(",")} | {1})
    t0 = time.perf_counter()
    model, label = load_model(args.model, args.device, dtype)
    serving_kernels(model, args.device, dtype, args.packed_rows)
    print(f"built {label} on {args.device} ({dtype}) in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.via == "engine":
        seconds, points = measure_engine_curve(model, args.prefix_len, ks, args.repeats)
    else:
        seconds, points = measure_curve(model, args.device, args.prefix_len, ks, args.repeats)
    shape = re.sub(r"[^a-z0-9.]+", "-", label.lower())
    report = {
        "device": args.device, "hardware": hardware_string(args.device), "shape": shape, "dtype": str(dtype).replace("torch.", ""),
        "prefix_len": args.prefix_len, "repeats": args.repeats, "via": args.via, "random_weights": args.model in SHAPES,
        "seconds": {str(k): s for k, s in seconds.items()}, "points": {str(k): p for k, p in points.items()},
    }
    out = Path(args.out) if args.out else RESULTS / f"cost-{device_tag(args.device)}-{shape}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("k:     " + " ".join(f"{k:>6d}" for k in ks))
    print("c(k):  " + " ".join(f"{points[k]:6.2f}" for k in ks))
    print(f"c(1) = {seconds[1] * 1000:.1f} ms; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
