"""The few-rows CPU kernel: a linear, batch-invariant per row, the same bits in every build."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target


def test_rows_kernel_is_linear_and_batch_invariant():
    """ToolSpec's few-rows CPU kernel: ``F.linear`` to float tolerance (odd shapes: k tails, weight
    rows that do not fill a block, bias or not, 3D inputs), and a row's output bit for bit the same
    whatever the number of rows sharing the call -- so a verified row's logits are exactly a
    one-row forward's. It builds wherever the CPU has AVX2 (this project's dev and CI machines)."""
    from toolspec_core.model import rows_kernel

    kernel = rows_kernel.load()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel is not None
    if kernel is None:
        pytest.skip("no AVX2 on this CPU: the kernel is not used here")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((37, 900), (40, 24), (3, 7), (128, 896)):
        w = torch.randn(out_f, in_f, generator=g)
        b = torch.randn(out_f, generator=g)
        x = torch.randn(40, in_f, generator=g)
        for bias in (b, None):
            full = kernel.rows_linear(x, w, bias)
            torch.testing.assert_close(full, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 19, 24, 33, 40):
                assert torch.equal(kernel.rows_linear(x[:rows], w, bias), full[:rows]), (out_f, in_f, rows)
        x3 = x[:6].reshape(2, 3, in_f)
        assert torch.equal(kernel.rows_linear(x3, w, b), kernel.rows_linear(x[:6], w, b).reshape(2, 3, out_f))
    with pytest.raises(RuntimeError, match="features"):
        kernel.rows_linear(torch.randn(2, 5), torch.randn(3, 4), None)
    assert kernel.rows_linear(torch.randn(0, 4), torch.randn(3, 4), None).shape == (0, 3)  # no rows: no pass


def test_rows_kernel_builds_agree_bit_for_bit():
    """The AVX-512VL build (bigger tiles in 32 registers) and the AVX2-only build (16 registers) run
    the same per-output arithmetic: same bits for every row count, so a run's outputs do not depend
    on which build a machine got. Needs an AVX-512 CPU to build both (the dev box has one)."""
    from toolspec_core.model import rows_kernel

    if not rows_kernel.wide_registers() or rows_kernel.load() is None:
        pytest.skip("needs an AVX-512 CPU to compare both builds")
    # the AVX2 build an AVX2-only machine gets, cached beside this machine's (rebuilt when the source changes)
    avx2 = rows_kernel.build(
        rows_kernel.SOURCE, "toolspec_rows_linear_avx2", rows_kernel.build_dir("avx2-check"), rows_kernel.AVX2_FLAGS
    )
    wide = rows_kernel.load()
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in ((37, 900), (130, 896), (9, 4864)):
        w = torch.randn(out_f, in_f, generator=g)
        x = torch.randn(40, in_f, generator=g)
        for rows in (1, 2, 3, 4, 6, 7, 9, 16, 20, 33, 40):
            assert torch.equal(avx2.rows_linear(x[:rows], w, None), wide.rows_linear(x[:rows], w, None)), (
                out_f,
                in_f,
                rows,
            )


def test_rows_kernel_off_or_unbuildable_keeps_the_other_dispatch(monkeypatch):
    """``TOOLSPEC_ROWS_KERNEL=0`` (or a machine where it cannot build) loads no kernel, and the
    tuned linears still compute the same function through oneDNN / ``F.linear``."""
    import copy

    from toolspec_core.model import rows_kernel
    from toolspec_core.model.cpu_linears import tune_cpu_linears

    rows_kernel.load.cache_clear()
    monkeypatch.setenv("TOOLSPEC_ROWS_KERNEL", "0")
    try:
        assert rows_kernel.load() is None
        plain = tiny_target()
        tuned = copy.deepcopy(plain)
        assert tune_cpu_linears(tuned.model) > 0
        for rows in (1, 3, 8):
            h = torch.randn(rows, plain.model.config.hidden_size)
            torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
    finally:
        rows_kernel.load.cache_clear()


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path):
    """A build killed mid-way leaves torch's lock file, on which every later load would wait
    forever; one older than any build is removed, a fresh one (a build under way) is not."""
    import time

    from toolspec_core.model import rows_kernel

    lock = tmp_path / "lock"
    lock.write_text("")
    now = time.time()
    assert not rows_kernel.clear_stale_lock(tmp_path, now=now + 5) and lock.exists()
    assert rows_kernel.clear_stale_lock(tmp_path, now=now + rows_kernel.STALE_LOCK_S + 1) and not lock.exists()
    assert not rows_kernel.clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_each_source_file_builds_in_a_directory_of_its_own(tmp_path):
    """Two checkouts (two source paths) never share a build directory: ninja would rebuild each
    time the other one loads."""
    from toolspec_core.model import rows_kernel

    other = tmp_path / "rows_linear.cpp"
    other.write_bytes(rows_kernel.SOURCE.read_bytes())
    a, b = rows_kernel.build_dir("avx2"), rows_kernel.build_dir("avx2", other)
    assert a != b and a.parent == b.parent and a == rows_kernel.build_dir("avx2")
