"""Study: batched verify attention, per-sequence SDPA vs one padded call vs flex_attention. Result: benchmarks/results/measurements/batch-attention-cpu-epyc-0f934ae.json.

Batched verify attention: one SDPA call per sequence against one padded call and flex_attention.

The batched forward (``toolspec_core/model/batch_forward.py``) attends each sequence over its own
KV cache with its own tree mask. The alternatives run the whole batch in one call: SDPA over the
caches padded to the longest one (their K / V gathered into one tensor each layer), or
``torch.nn.attention.flex_attention`` over the concatenated caches with a block mask that keeps
each row to its own sequence's keys. Timed per layer call, Qwen2.5-0.5B head shapes (14 query
heads, 2 KV heads, head dim 64), every variant checked against the per-sequence loop.

    python -m benchmarks.studies.batch_attention_ab --out benchmarks/runs/batch-attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from toolspec_core.model.batch_forward import causal_mask, grouped_mask, segment_attention

H, HKV, D = 14, 2, 64


def _case(b: int, s: int, n: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = [max(8, int(s * f)) for f in torch.linspace(0.5, 1.0, b).tolist()]  # ragged caches
    qs = [torch.randn(1, H, n, D, generator=g).to(device) for _ in lens]
    ks = [torch.randn(1, HKV, L + n, D, generator=g).to(device) for L in lens]
    vs = [torch.randn(1, HKV, L + n, D, generator=g).to(device) for L in lens]
    masks = [causal_mask(L, n, torch.float32, device) if n > 1 else None for L in lens]
    return lens, qs, ks, vs, masks


def loop(qs, ks, vs, masks):
    g = H // HKV
    return [
        segment_attention(q, k, v, None if m is None else grouped_mask(m, g), D**-0.5)
        for q, k, v, m in zip(qs, ks, vs, masks)
    ]


def padded(qs, ks, vs, masks):
    """One SDPA call over the batch padded to the longest cache (K / V gathered each call)."""
    b, n, smax = len(qs), qs[0].shape[2], max(k.shape[2] for k in ks)
    g = H // HKV
    k = qs[0].new_zeros(b, HKV, smax, D)
    v = qs[0].new_zeros(b, HKV, smax, D)
    mask = qs[0].new_full((b, 1, g * n, smax), torch.finfo(torch.float32).min)
    for i, (ki, vi, m) in enumerate(zip(ks, vs, masks)):
        s = ki.shape[2]
        k[i, :, :s], v[i, :, :s] = ki[0], vi[0]
        mask[i, 0, :, :s] = 0.0 if m is None else grouped_mask(m, g)[0, 0]
    q = torch.cat([qi.reshape(1, HKV, g * n, D) for qi in qs])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)  # [B, Hkv, g*n, D]
    return [out[i : i + 1].reshape(1, H, n, D).transpose(1, 2).reshape(1, n, H * D) for i in range(b)]


def flex(qs, ks, vs, masks, compiled):
    """flex_attention over the concatenated caches: each query row sees its own sequence's keys
    (causal within its new rows)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = qs[0].shape[2]
    lens = [k.shape[2] for k in ks]
    dev = qs[0].device
    kv_seq = torch.cat([torch.full((L,), i, device=dev) for i, L in enumerate(lens)])
    kv_pos = torch.cat([torch.arange(L, device=dev) for L in lens])
    q_seq = torch.arange(len(qs), device=dev).repeat_interleave(n)
    q_pos = torch.cat([torch.arange(L - n, L, device=dev) for L in lens])

    def mask_mod(b, h, qi, ki):
        return (q_seq[qi] == kv_seq[ki]) & (kv_pos[ki] <= q_pos[qi])

    bm = create_block_mask(mask_mod, 1, None, len(qs) * n, sum(lens), device=dev)
    q = torch.cat(qs, 2)  # [1, H, B*n, D]
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    out = compiled(q, k, v, block_mask=bm, enable_gqa=True, scale=D**-0.5)  # [1, H, B*n, D]
    return [out[:, :, i * n : (i + 1) * n].transpose(1, 2).reshape(1, n, H * D) for i in range(len(qs))]


def _time(fn, reps: int, device: str) -> float:
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--contexts", default="500,1500")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default="benchmarks/runs/batch-attention.json")
    args = ap.parse_args(argv)
    compiled, flex_error = None, None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # not in this build
            flex_error = f"{type(exc).__name__}: {exc}"
    rows = []
    with torch.inference_mode():
        for b in [int(x) for x in args.batches.split(",")]:
            for s in [int(x) for x in args.contexts.split(",")]:
                for n in [int(x) for x in args.rows.split(",")]:
                    lens, qs, ks, vs, masks = _case(b, s, n, args.device)
                    ref = loop(qs, ks, vs, masks)
                    row = {
                        "batch": b,
                        "context": s,
                        "rows_per_seq": n,
                        "loop_us": _time(lambda: loop(qs, ks, vs, masks), args.reps, args.device),
                    }
                    got = padded(qs, ks, vs, masks)
                    row["padded_max_err"] = max(float((a - r).abs().max()) for a, r in zip(got, ref))
                    row["padded_us"] = _time(lambda: padded(qs, ks, vs, masks), args.reps, args.device)
                    if compiled is not None and flex_error is None:
                        try:
                            got = flex(qs, ks, vs, masks, compiled)
                            row["flex_max_err"] = max(float((a - r).abs().max()) for a, r in zip(got, ref))
                            row["flex_us"] = _time(lambda: flex(qs, ks, vs, masks, compiled), args.reps, args.device)
                        except Exception as exc:  # compile or kernel unavailable on this device
                            flex_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    dev = torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu"
    out = {
        "tool": "benchmarks.studies.batch_attention_ab",
        "device": dev,
        "torch": torch.__version__,
        "flex_error": flex_error,
        "cases": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}" + (f" (flex_attention: {flex_error})" if flex_error else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
