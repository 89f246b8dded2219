"""CPU linears for verify steps: per weight, the fastest exact kernel for few rows, measured at load."""

from __future__ import annotations

import time

import torch

SMALL_ROWS = 3  # up to this many rows the BLAS's own matrix-vector kernel may be fastest: measured at load
ONEDNN_WINS = 0.9  # at 1-3 rows oneDNN replaces F.linear only when at least this much faster (timing noise)
ONEDNN_ROWS = 16  # row-count hint for oneDNN's weight layout
PACKED_ROWS = 16  # opt-in: 4..16 rows through MKL's packed GEMM, inputs padded to 16 rows (measured)
ONEDNN_EXACT_ROWS = 16  # up to this many rows oneDNN gets the row count as is; above, a row bucket
ONEDNN_BUCKETS_PER_OCTAVE = 8  # row buckets per doubling of the row count (padding < 1/8 of the rows)


def mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``weight`` [out, in] reordered by MKL for ``rows``-row inputs, or None without MKL."""
    try:
        with torch.inference_mode():
            return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> torch.Tensor:
    """``F.linear`` through a weight packed for ``rows`` rows; fewer rows are zero-padded, because
    the packed kernel is only fast at the row count it was packed for."""
    flat = x.reshape(-1, x.shape[-1])  # [n, in]
    n = flat.shape[0]
    if n < rows:
        flat = torch.cat([flat, flat.new_zeros(rows - n, flat.shape[1])])
    y = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)[:n]  # [n, out]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def onednn_pack(weight: torch.Tensor, rows: int = ONEDNN_ROWS) -> torch.Tensor | None:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout (a hint of ``rows`` input
    rows), or None where this torch has no oneDNN."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def onednn_rows(n: int) -> int:
    """The row count oneDNN is called with for ``n`` rows: ``n`` up to ``ONEDNN_EXACT_ROWS``, else
    ``n`` rounded up to one of ``ONEDNN_BUCKETS_PER_OCTAVE`` steps per doubling (65..128 rows in
    steps of 8, 513..1024 in steps of 64, ...).

    Why: oneDNN builds (JIT) and caches a primitive per input shape, ~0.4-0.6 MB each, in an LRU
    of 1024 (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A serving replica's verify steps have every row
    count from 65 to over 1,000 (prefill chunks + draft trees of any size), times each weight
    shape, so the cache filled, then churned: each step created and evicted primitives, and the
    freed memory came back fragmented -- the replica's RSS grew ~40 MB a minute without end in
    the 20-minute soak (benchmarks/results/loadtest/soak-c8-20min-cpu-epyc-2d7866b). Bucketed,
    a replica sees at most ~70 row counts a weight shape (up to 2,048 rows): the cache stops
    growing and never evicts, and a step pays no JIT for a new shape. Rows are independent in the
    product, so padding changes no real row's result (tested bitwise)."""
    if n <= ONEDNN_EXACT_ROWS:
        return n
    step = max(1, (1 << (n.bit_length() - 1)) // ONEDNN_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """``F.linear`` through a weight from :func:`onednn_pack`; any number of rows (above
    ``ONEDNN_EXACT_ROWS`` zero-padded to :func:`onednn_rows`, the padding's outputs dropped)."""
    flat = x.reshape(-1, x.shape[-1])  # [n, in]
    n = flat.shape[0]
    m = onednn_rows(n)
    if m > n:
        flat = torch.cat([flat, flat.new_zeros(m - n, flat.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")  # [m, out]
    if m > n:
        y = y[:n]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def call_seconds(fn, repeats: int, warm: bool = True) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn()``, after one untimed call (a first call pays set-up;
    ``warm=False``: none, the caller warmed it)."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one untimed call."""
    times = call_seconds(fn, repeats)
    return sorted(times)[len(times) // 2]


def small_row_kernels(
    weight: torch.Tensor, dnn: torch.Tensor | None, small_rows: int = SMALL_ROWS, repeats: int = 5
) -> tuple[bool, ...]:
    """For 1..``small_rows`` rows: whether oneDNN (``dnn``) beats ``F.linear`` on this weight here.

    Why measured: which kernel is fastest at a few rows depends on the CPU, not the model. On
    the Intel Xeon dev box ``F.linear``'s matrix-vector kernel wins at 1-3 rows (lm_head 19 ms vs
    oneDNN 20 ms); on an AMD EPYC it is 1.9-5x slower than oneDNN there (lm_head 34 / 75 / 107 ms
    at 1 / 2 / 3 rows vs 18 / 20 / 21 ms: ``results/measurements/linear-rows-cpu-epyc-6e488eb.json``).
    Plain decoding (1 row) gets the faster one too, so speedups are never measured against a
    needlessly slow baseline. Entry ``r - 1`` is the choice for ``r`` rows.
    """
    import torch.nn.functional as F

    if dnn is None:
        return (False,) * small_rows
    out = []
    with torch.inference_mode():
        for rows in range(1, small_rows + 1):
            x = torch.randn(rows, weight.shape[1])
            t_lin = median_seconds(lambda: F.linear(x, weight), repeats)
            t_dnn = median_seconds(lambda: onednn_linear(x, dnn, None), repeats)
            out.append(t_dnn < ONEDNN_WINS * t_lin)
    return tuple(out)


def tune_cpu_linears(
    model: torch.nn.Module,
    small_rows: int = SMALL_ROWS,
    packed_rows: int = 0,
    small_kernels: dict | None = None,
    rows_kernel: bool = True,
    kernel_module=None,
) -> int:
    """Make every ``nn.Linear`` of a CPU model fast for a few rows at a time (tree verification).

    Why: on x86 CPUs ``F.linear`` switches from a matrix-vector kernel to a GEMM path at 4 rows
    that is 2-2.5x slower than 1-3 rows (Xeon dev box). Where it builds (:mod:`.rows_kernel`:
    AVX2, a C++ compiler), up to ``rows_kernel.MAX_ROWS`` rows -- plain decoding and every
    verify step the budget picks -- go through ToolSpec's own few-rows kernel on the weight as it
    is. Above that, and everywhere without it, the weight goes through oneDNN on a copy
    reordered once at load into its blocked layout (per layer 4-8 rows cost 1.2-1.5x one row,
    against 1.4-1.9x for ``x @ W.T`` on a transposed copy, the fallback where torch has no oneDNN).
    With ``packed_rows=16`` and no rows kernel, 4..16 rows go through MKL's packed GEMM instead of
    oneDNN (inputs padded; opt-in, one more weight copy). Measured in
    ``results/measurements/linear-rows-cpu-xeon-bc0b02f.json`` (with its command) and by the end-to-end A/B
    ``benchmarks/studies/kernel_ab.py`` (no result file; its code is in git at ``5afc378``).
    Without the rows kernel, at 1-3 rows (plain decoding included) the faster of ``F.linear`` and
    oneDNN is measured once per weight shape (:func:`small_row_kernels`; ``small_kernels``: shape ->
    choices, given or filled here). ``kernel_module``: a built rows kernel to use instead of
    :func:`.rows_kernel.load`'s (a benchmark comparing two kernels). Returns how many layers were tuned.
    """
    import torch.nn.functional as F

    from toolspec_core.model import rows_kernel as rk

    kernel = (kernel_module or rk.load()) if rows_kernel else None
    n = 0
    chosen = {} if small_kernels is None else small_kernels
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or mod.weight.device.type != "cpu" or mod.weight.dtype != torch.float32:
            continue
        weight, bias = mod.weight, mod.bias
        dnn = onednn_pack(weight)
        weight_t = None if dnn is not None else weight.detach().t().contiguous()  # [in, out]
        packed = mkl_pack(weight, packed_rows) if packed_rows > small_rows else None
        shape = tuple(weight.shape)
        if kernel is None and shape not in chosen:
            chosen[shape] = small_row_kernels(weight.detach(), dnn, small_rows)
        small = chosen.get(shape, (False,) * small_rows)
        plain = weight.detach() if weight.is_contiguous() else weight.detach().contiguous()  # [out, in]

        def forward(x, weight=weight, bias=bias, weight_t=weight_t, dnn=dnn, packed=packed, small=small, plain=plain):
            rows = x.numel() // x.shape[-1]
            if kernel is not None and rows <= rk.MAX_ROWS:
                return kernel.rows_linear(x, plain, bias)
            if rows <= small_rows:
                return onednn_linear(x, dnn, bias) if small[rows - 1] else F.linear(x, weight, bias)
            if packed is not None and rows <= packed_rows:
                return packed_linear(x, packed, weight, bias, packed_rows)
            if dnn is not None:
                return onednn_linear(x, dnn, bias)
            y = x @ weight_t
            return y + bias if bias is not None else y

        mod.forward = forward
        n += 1
    return n


def tune_reduced_linears(model: torch.nn.Module) -> int:
    """Run every one-row ``nn.Linear`` call of a bfloat16 / float16 CPU model as a two-row call
    (the row doubled, the copy's output dropped).

    Why: ``F.linear`` in bfloat16 computes one row on a matrix-vector path whose sums run in
    another order than its GEMM's for two rows or more (Qwen2.5-0.5B's down_proj, 4,864 inputs:
    one bfloat16 ulp apart), so plain decoding's one-row steps differed from a verify step's rows
    and greedy ToolSpec from plain greedy. Its GEMM gives a row the same bits whatever the rows
    beside it (2-600 rows, every weight shape of the model, tested). oneDNN on a weight packed
    once (:func:`onednn_pack`) was faster at one row (~2.5x, not quiet) but not exact: past ~15
    rows its 4,864-input product rounds some rows differently from one row. The rows kernel of
    :func:`tune_cpu_linears` is float32 only. Returns how many layers were wrapped."""
    import torch.nn.functional as F

    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or mod.weight.device.type != "cpu":
            continue
        if mod.weight.dtype not in (torch.bfloat16, torch.float16):
            continue

        def forward(x, weight=mod.weight, bias=mod.bias):
            if x.numel() != x.shape[-1]:
                return F.linear(x, weight, bias)
            flat = x.reshape(1, -1)  # [1, in]
            return F.linear(flat.expand(2, -1), weight, bias)[:1].reshape(*x.shape[:-1], -1)  # [..., out]

        mod.forward = forward
        n += 1
    return n
