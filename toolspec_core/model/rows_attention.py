"""Decode and tree-verify attention with one fixed order of arithmetic per row
(``kernels/rows_attention.cpp``), built once per machine like the rows kernel.

Why: lossless greedy decoding needs a token's row computed alike in a verify step (among the
tree's rows, in one call) and in plain decoding (alone). The CPU linears give a row the same bits
whatever rows share its call (:mod:`.rows_kernel`, :func:`.cpu_linears.tune_reduced_linears`);
torch's attention does not -- SDPA, and even a float32 matmul, put a row ~1e-7 apart depending on
the rows beside it (``python -m benchmarks.studies.attention_rows``). A float32 model absorbs
that; a bfloat16 model rounds the attention output into whole ulps, and on long tool prompts its
greedy ToolSpec output left plain greedy's on 7-8 of 48 requests. This kernel computes each row
from its query and the keys it sees, in logical order (the cached prefix, then its ancestors in
the call), in blocks of fixed logical positions, so a row's output is the same bits alone or in
any tree. :func:`toolspec_core.model.batch_forward.batched_forward` sends every row of a
reduced-precision CPU model through it, prompt rows too: a loaded server shares a step's prompt
rows among waiting sequences, so it cuts a prompt into other chunks than an idle one does (or
finds part of it in the prefix cache), and a prompt row computed by SDPA depends on its chunk --
in bfloat16 enough to part a greedy answer from plain greedy's (8 of 48 long tool prompts at
concurrency 8). Through the kernel a prompt row has the same bits in any chunk. It costs prefill
time: per layer 1.8-2.7x SDPA's attention on 512-row chunks (``prefill_chunk_timing`` in
``benchmarks/results/measurements/attention-rows-cpu-epyc-9620a45.json``).

Built where :func:`.rows_kernel.load` builds (a C++ compiler, AVX2 + FMA); elsewhere, or with
``TOOLSPEC_ROWS_ATTENTION=0``, :func:`load` returns None and rows keep SDPA in float32
(greedy output then equal to plain greedy's up to near-ties, as the README's limitations say).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "rows_attention.cpp"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (``rows_attention(q, k, v, parents, prefix, scale)``), or None."""
    from toolspec_core.model import rows_kernel as rk

    return rk.load_kernel(
        SOURCE, "toolspec_rows_attention", "TOOLSPEC_ROWS_ATTENTION", "rows attention", "rows keep SDPA"
    )


def rows_parents(parents: list[int] | None, n: int) -> torch.Tensor:
    """The kernel's parents [n] (int64) of a segment's rows; None: causal rows, each the child of
    the one before. Built once a forward (every layer reads it)."""
    return torch.tensor(parents if parents is not None else range(-1, n - 1), dtype=torch.long)


# Up to this many rows a bfloat16 cache is read in place: a decode row reads each key once, so
# widening the whole cache first costs more than the row; a chunk's rows each re-read every key, so
# one widening pays (a scratch timing put the crossover between 4 and 64 rows; not a committed run)
IN_PLACE_ROWS = 8


def rows_attention(kernel, q, k, v, parents: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """One sequence's rows (decode, tree or a prompt chunk) through the kernel: q [1, H, n, D], k / v [1, H_kv, S, D]
    (the cache with these rows written, any dtype), ``parents`` [n] (:func:`rows_parents`) ->
    [1, n, H * D] in q's dtype. Computed in float32 either way: a bfloat16 cache is read in place
    for a few rows (decode: widening the whole cache first would cost more than the row) and
    widened once for more (every row re-reads every key); a float16 one is always widened."""
    _, h, n, d = q.shape
    qf = q[0].transpose(0, 1).float().contiguous()  # [n, H, D]
    if k.dtype != torch.float32 and (k.dtype != torch.bfloat16 or n > IN_PLACE_ROWS):
        k, v = k.float(), v.float()
    out = kernel.rows_attention(qf, k[0], v[0], parents, prefix, scale)  # [n, H, D]
    return out.reshape(1, n, h * d).to(q.dtype)
