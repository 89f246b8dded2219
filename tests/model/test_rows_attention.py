"""The fixed-order attention of decode, tree and prompt rows: SDPA's result to float tolerance, and a row's
output bit for bit the same alone (plain decoding) as in any tree (a verify step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

H, HKV, D = 14, 2, 64  # Qwen2.5-0.5B's heads
SCALE = D**-0.5


def _kernel():
    from toolspec_core.model import rows_attention

    kernel = rows_attention.load()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel is not None  # it builds wherever the rows kernel does (this project's machines)
    if kernel is None:
        pytest.skip("no AVX2 on this CPU: the kernel is not used here")
    return kernel


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _inputs(prefix: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(HKV, prefix + n, D, generator=g), torch.randn(HKV, prefix + n, D, generator=g)
    return q, k, v


TREE = [-1, 0, 1, 1, 3, 0, 5, 6, 2, 8, 4]  # a root chain, branches, a deep path


@pytest.mark.parametrize("prefix", [0, 5, 15, 16, 17, 300, 1027])
def test_rows_attention_is_attention(prefix):
    """Each row attends over the prefix and its ancestors (itself included), as SDPA with the tree's
    mask does, to float tolerance; a prefix that ends anywhere in a 16-key block."""
    kernel = _kernel()
    q, k, v = _inputs(prefix, len(TREE))
    out = kernel.rows_attention(q, k, v, torch.tensor(TREE), prefix, SCALE)  # [n, H, D]
    seen = torch.zeros(len(TREE), prefix + len(TREE), dtype=torch.bool)
    seen[:, :prefix] = True
    for i in range(len(TREE)):
        seen[i, [prefix + r for r in _path(TREE, i)]] = True
    mask = torch.where(seen, 0.0, float("-inf"))[None, None]  # [1, 1, n, S]
    g = H // HKV
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(g, 0)[None],
        v.repeat_interleave(g, 0)[None],
        attn_mask=mask,
        scale=SCALE,
    )[0].transpose(0, 1)  # [n, H, D]
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("prefix", [0, 9, 16, 777])
def test_a_row_alone_equals_the_row_in_a_tree(prefix):
    """What plain decoding computes for a token -- its row alone over the keys before it, laid out
    contiguously -- equals bit for bit what a verify step computes for it among the tree's rows
    (other branches beside it, other rows in the call), in any thread count: the kernel's order
    depends on logical positions only."""
    kernel = _kernel()
    q, k, v = _inputs(prefix, len(TREE), seed=1)
    together = kernel.rows_attention(q, k, v, torch.tensor(TREE), prefix, SCALE)
    threads = torch.get_num_threads()
    try:
        for i in range(len(TREE)):
            keys = list(range(prefix)) + [prefix + r for r in _path(TREE, i)]
            alone_at = len(keys) - 1  # the row's own key is the last, after everything it sees
            torch.set_num_threads(1 + i % 2)
            alone = kernel.rows_attention(q[i : i + 1], k[:, keys], v[:, keys], torch.tensor([-1]), alone_at, SCALE)
            assert torch.equal(alone[0], together[i]), i
    finally:
        torch.set_num_threads(threads)
    # causal rows (no parents) are the chain: each row the child of the one before
    from toolspec_core.model.rows_attention import rows_attention, rows_parents

    causal = rows_parents(None, len(TREE))
    chain = rows_attention(kernel, q.transpose(0, 1)[None], k[None], v[None], causal, prefix, SCALE)  # [1, n, H * D]
    linked = kernel.rows_attention(q, k, v, torch.tensor(range(-1, len(TREE) - 1)), prefix, SCALE)
    assert torch.equal(chain[0], linked.reshape(len(TREE), H * D))


@pytest.mark.parametrize("prefix", [0, 16, 333])
def test_a_chain_read_directly_equals_its_rows_walked_as_a_tree(prefix):
    """A chain (a prompt chunk, a decode row) reads its keys where they are stored, without
    per-row paths; its rows equal bit for bit the same rows in a call whose extra branch makes the
    kernel walk paths."""
    kernel = _kernel()
    n = 9
    q, k, v = _inputs(prefix, n + 1, seed=2)
    chain = kernel.rows_attention(
        q[:n], k[:, : prefix + n], v[:, : prefix + n], torch.tensor(range(-1, n - 1)), prefix, SCALE
    )
    branched = kernel.rows_attention(q, k, v, torch.tensor([*range(-1, n - 1), 3]), prefix, SCALE)
    assert torch.equal(chain, branched[:n])


@pytest.mark.parametrize("parents", [TREE, list(range(-1, len(TREE) - 1))])
def test_a_bfloat16_cache_is_read_in_place_as_its_float32_copy(parents):
    """A bf16 model's cache goes in as it is (no float32 copy of the whole cache every layer):
    widening bf16 is exact, so the result is the float32 copy's bit for bit; a float16 cache is
    widened by the wrapper."""
    from toolspec_core.model.rows_attention import rows_attention

    kernel = _kernel()
    q, k, v = _inputs(40, len(TREE), seed=3)
    kb, vb = k.bfloat16(), v.bfloat16()
    par = torch.tensor(parents)
    assert torch.equal(
        kernel.rows_attention(q, kb, vb, par, 40, SCALE),
        kernel.rows_attention(q, kb.float(), vb.float(), par, 40, SCALE),
    )
    qh = q.transpose(0, 1)[None].half()  # [1, H, n, D]
    half = rows_attention(kernel, qh, k.half()[None], v.half()[None], par, 40, SCALE)
    ref = rows_attention(kernel, qh, k.half().float()[None], v.half().float()[None], par, 40, SCALE)
    assert half.dtype == torch.float16 and torch.equal(half, ref)


def test_rows_attention_refuses_bad_input():
    kernel = _kernel()
    q, k, v = _inputs(4, 3)
    with pytest.raises(RuntimeError, match="parent must come before"):
        kernel.rows_attention(q, k, v, torch.tensor([-1, 2, 0]), 4, SCALE)
    with pytest.raises(RuntimeError, match="exceed"):
        kernel.rows_attention(q, k, v, torch.tensor([-1, 0, 1]), 5, SCALE)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rows_attention(q.double(), k, v, torch.tensor([-1, 0, 1]), 4, SCALE)
    with pytest.raises(RuntimeError, match="the same"):
        kernel.rows_attention(q, k.bfloat16(), v, torch.tensor([-1, 0, 1]), 4, SCALE)
