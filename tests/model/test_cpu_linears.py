"""CPU linears: every kernel computes the linear, and the tuned model keeps greedy output."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from scripted import PROMPT, N, ScriptedDrafter, branching, oracle
from scripted import reference as reference
from scripted import tiny as tiny
from tiny import tiny_target

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate


def test_packed_linear_matches_linear():
    """MKL's packed GEMM (inputs zero-padded to the packed row count) is the same function."""
    from toolspec_core.model.cpu_linears import mkl_pack, packed_linear

    w, b = torch.randn(40, 24), torch.randn(40)
    packed = mkl_pack(w, 16)
    assert packed is not None  # the CPU wheel ships MKL: the tuned path is really exercised
    for shape in ((4, 24), (1, 7, 24), (16, 24)):
        x = torch.randn(*shape)
        torch.testing.assert_close(
            packed_linear(x, packed, w, b, 16), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5
        )


def test_onednn_linear_matches_linear():
    """oneDNN on a weight reordered once (the default path for 4+ rows) is the same function."""
    from toolspec_core.model.cpu_linears import onednn_linear, onednn_pack

    w, b = torch.randn(40, 24), torch.randn(40)
    packed = onednn_pack(w)
    assert packed is not None  # the CPU wheel ships oneDNN: the tuned path is really exercised
    for shape in ((4, 24), (1, 7, 24), (16, 24), (1, 64, 24)):
        x = torch.randn(*shape)
        torch.testing.assert_close(
            onednn_linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            onednn_linear(x, packed, None), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5
        )


def test_onednn_row_buckets_are_few_and_tight():
    """oneDNN caches a primitive per input shape: a replica's row counts (any of 65..1,000+ in a
    step) reach it as ~70 buckets up to 2,048 rows, each at most 1/8 above the real count (the
    soak's memory growth was that cache churning; see ``onednn_rows``)."""
    from toolspec_core.model.cpu_linears import ONEDNN_EXACT_ROWS, onednn_rows

    for n in range(1, 5000):
        m = onednn_rows(n)
        assert m == n if n <= ONEDNN_EXACT_ROWS else n <= m < n * 1.125
        assert onednn_rows(m) == m  # a bucket is its own bucket
    assert len({onednn_rows(n) for n in range(1, 2049)}) <= 80
    assert len({onednn_rows(n) for n in range(65, 1101)}) <= 40


def test_onednn_padding_changes_no_row():
    """The padded rows are dropped and the real rows are bitwise what the unpadded call gives
    (rows are independent in the product), for row counts in every bucket range."""
    from toolspec_core.model.cpu_linears import onednn_linear, onednn_pack, onednn_rows

    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    packed = onednn_pack(w)
    assert packed is not None
    for n in (17, 33, 65, 100, 130, 300, 517, 1030):
        assert onednn_rows(n) > n
        x = torch.randn(n, 64)
        for bias in (b, None):
            got = onednn_linear(x, packed, bias)
            assert got.shape == (n, 96) and got.is_contiguous()
            assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 50, 64)  # leading dimensions kept
    torch.testing.assert_close(onednn_linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("packed_rows", [16, 0])
def test_tuned_cpu_linears_keep_greedy_output(reference, packed_rows):
    """The row-count dispatch of ``tune_cpu_linears`` (with and without MKL's packed GEMM)
    computes the same function: same logits (to float tolerance) for 1..64 rows, and drafting
    on the tuned model still gives exactly the plain greedy output of the untouched model."""
    import copy

    from toolspec_core.model.cpu_linears import tune_cpu_linears

    plain = tiny_target()
    tuned = copy.deepcopy(plain)
    n = tune_cpu_linears(tuned.model, packed_rows=packed_rows)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in tuned.model.modules()) > 0
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 64):
        h = torch.randn(rows, plain.model.config.hidden_size)
        torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
    for make in (oracle, branching):
        res = generate(
            tuned,
            PROMPT,
            ScriptedDrafter(make(reference)),
            DecodeConfig(max_new_tokens=N),
            CostModel.flat(),
        )
        assert res.tokens == reference


def test_small_row_kernel_choice_is_measured_and_dispatched():
    """Without the rows kernel, at 1-3 rows the kernel is whichever was measured faster on this
    CPU; either way the tuned layer computes the same function, and a given choice is what the
    layer uses."""
    import copy

    from toolspec_core.model.cpu_linears import onednn_pack, small_row_kernels, tune_cpu_linears

    w = torch.randn(40, 24)
    choice = small_row_kernels(w, onednn_pack(w), repeats=2)
    assert len(choice) == 3 and all(isinstance(c, bool) for c in choice)
    assert small_row_kernels(w, None) == (False, False, False)  # no oneDNN: F.linear
    plain = tiny_target()
    for forced in ((True, True, True), (False, False, False)):
        tuned = copy.deepcopy(plain)
        kernels = {tuple(m.weight.shape): forced for m in tuned.model.modules() if isinstance(m, torch.nn.Linear)}
        tune_cpu_linears(tuned.model, small_kernels=kernels, rows_kernel=False)
        calls = []
        import toolspec_core.model.cpu_linears as linears_mod

        orig = linears_mod.onednn_linear
        with patch.object(linears_mod, "onednn_linear", lambda *a: calls.append(1) or orig(*a)):
            for rows in (1, 2, 3):
                h = torch.randn(rows, plain.model.config.hidden_size)
                torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
        assert bool(calls) == forced[0]


def test_reduced_precision_linears_give_a_row_the_same_bits_beside_any_rows():
    """bfloat16 CPU linears (``tune_reduced_linears``): a row's output is bitwise the same alone
    and in any larger call -- what lets a verify step's rows equal plain decoding's single rows.
    The down_proj shape of the embedded model (4,864 inputs) is where ``F.linear`` differs."""
    from toolspec_core.model.cpu_linears import tune_reduced_linears

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4864, 96), torch.nn.Linear(96, 4864, bias=False)).bfloat16()
    assert tune_reduced_linears(layers) == 2
    assert tune_reduced_linears(torch.nn.Linear(8, 8)) == 0  # float32 keeps tune_cpu_linears
    x = torch.randn(40, 4864).bfloat16()
    with torch.inference_mode():
        for mod, inp in ((layers[0], x), (layers[1], torch.randn(40, 96).bfloat16())):
            alone = torch.cat([mod(inp[r : r + 1]) for r in range(inp.shape[0])])  # [40, out]
            for m in (2, 3, 17, 40):
                assert torch.equal(mod(inp[:m]), alone[:m]), m
            assert torch.equal(mod(inp[None, :1])[0], alone[:1])  # any leading dims


def test_a_bfloat16_step_gives_a_row_the_same_state_as_one_row_at_a_time():
    """A bfloat16 CPU target (linears tuned, attention in float32): eight tokens fed as one causal
    chunk over a cached prefix give bitwise the last-layer states they give one token a step."""
    from toolspec_core.model.cpu_linears import tune_reduced_linears

    tg = tiny_target(hidden=128, layers=2, seed=3)
    tg.model.to(torch.bfloat16)
    tune_reduced_linears(tg.model)
    prompt = torch.tensor([list(range(5, 45))])
    new = torch.tensor([[7, 9, 11, 13, 15, 17, 19, 21]])

    def states(chunks):
        cache, pos, outs = tg.new_cache(), 0, []
        for ids in chunks:
            outs.append(tg.hidden(ids, torch.arange(pos, pos + ids.shape[1])[None], None, cache))
            pos += ids.shape[1]
        return torch.cat(outs[1:])  # [8, H]

    one_by_one = states([prompt] + [new[:, k : k + 1] for k in range(8)])
    together = states([prompt, new])
    assert one_by_one.dtype == torch.bfloat16 and torch.equal(one_by_one, together)
