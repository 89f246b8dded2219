"""A prompt's first chunk attends through the causal kernel: the same function, the same greedy output."""

from __future__ import annotations

import pytest
import torch
from scripted import ScriptedDrafter, branching, oracle
from tiny import hf_greedy, tiny_target

from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits, run_batch
from toolspec_core.engine.sequence import Sequence
from toolspec_core.model import batch_forward
from toolspec_core.model.batch_forward import (
    blocked_attention,
    blocked_masks,
    causal_attention,
    causal_mask,
    grouped_mask,
    rope,
    segment_attention,
)


@pytest.mark.parametrize("heads", [(4, 2), (14, 2), (4, 4)])
def test_causal_attention_equals_the_masked_call(heads):
    """``is_causal`` without a mask tensor computes what the grouped rows with a causal mask do."""
    h, hkv = heads
    torch.manual_seed(0)
    for n in (2, 7, 65, 300):
        q, k, v = torch.randn(1, h, n, 16), torch.randn(1, hkv, n, 16), torch.randn(1, hkv, n, 16)
        mask = grouped_mask(causal_mask(0, n, torch.float32, "cpu"), h // hkv)
        got = causal_attention(q, k, v, 0.25)
        assert got.shape == (1, n, h * 16)
        torch.testing.assert_close(got, segment_attention(q, k, v, mask, 0.25), rtol=1e-6, atol=1e-6)


def test_causal_attention_equals_the_masked_call_at_served_shapes():
    """The embedded model's attention shape (14 query heads, 2 KV heads, 64 dims) at the first
    chunks that take the causal kernel: from ``CAUSAL_MIN_ROWS`` rows, across the CPU kernel's
    query-block sizes."""
    h, hkv, d = 14, 2, 64
    torch.manual_seed(1)
    for n in sorted({batch_forward.CAUSAL_MIN_ROWS, 800, 1024}):
        q, k, v = torch.randn(1, h, n, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
        mask = grouped_mask(causal_mask(0, n, torch.float32, "cpu"), h // hkv)
        got = causal_attention(q, k, v, d**-0.5)
        torch.testing.assert_close(got, segment_attention(q, k, v, mask, d**-0.5), rtol=1e-5, atol=1e-6)


def test_only_first_chunks_take_the_causal_kernel(monkeypatch):
    """A prompt's first chunk (no cached prefix, ``CAUSAL_MIN_ROWS`` rows or more) goes through
    ``causal_attention``, once a layer; shorter first chunks, later chunks and single rows keep
    their masks; with the kernel off none does; the hidden states agree either way."""
    tg = tiny_target()
    calls = []
    real = batch_forward.causal_attention
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    monkeypatch.setattr(batch_forward, "causal_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    prefill(tg, prompt, chunk=16)  # first chunk below CAUSAL_MIN_ROWS: the mask
    assert calls == []
    monkeypatch.setattr(batch_forward, "CAUSAL_MIN_ROWS", 2)
    on = prefill(tg, prompt, chunk=16, states=True)
    assert calls == [16] * tg.model.config.num_hidden_layers  # chunk 1 only, every layer
    monkeypatch.setattr(batch_forward, "CAUSAL_KERNEL", False)
    calls.clear()
    off = prefill(tg, prompt, chunk=16, states=True)
    assert calls == []
    torch.testing.assert_close(on.states, off.states, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(batch_forward, "CAUSAL_KERNEL", True)
    prefill(tg, prompt[:1], chunk=16)  # a one-token prompt: a single row, no kernel
    assert calls == []


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_output_is_plain_greedy_with_and_without_the_kernel(kernel, monkeypatch):
    """A batch through the scheduler -- prompts prefilled in 16-row chunks beside decoding rows,
    each drafted by an oracle and a branching drafter -- writes HF's plain greedy output."""
    monkeypatch.setattr(batch_forward, "CAUSAL_KERNEL", kernel)
    monkeypatch.setattr(batch_forward, "CAUSAL_MIN_ROWS", 8)  # the tiny prompts' first chunks take it
    tg = tiny_target()
    prompts = [[5, 9, 17, 33, 2, 8, 60, 41, 12, 7, 7, 19, 88, 3], [(5 * i) % 90 + 2 for i in range(45)], [4]]
    refs = [hf_greedy(tg, p, 12) for p in prompts]
    for make in (oracle, branching):
        seqs = [
            Sequence(tg, p, ScriptedDrafter(make(r)), DecodeConfig(max_new_tokens=12)) for p, r in zip(prompts, refs)
        ]
        out = run_batch(tg, seqs, CostModel.flat(), BatchLimits(max_running=3, prefill_chunk=16))
        assert [r.tokens for r in out] == refs


@pytest.mark.parametrize(
    ("prefix", "n", "block"), [(0, 512, 256), (512, 388, 256), (300, 700, 256), (5, 9, 4), (0, 3, 8)]
)
def test_row_blocks_equal_the_masked_call(prefix, n, block):
    """A causal chunk attended in row blocks (each over only the keys it may see) gives the one
    masked call's output, at the embedded model's attention shape and the served chunk shapes."""
    h, hkv, d = 14, 2, 64
    torch.manual_seed(2)
    q = torch.randn(1, h, n, d)
    k, v = torch.randn(1, hkv, prefix + n, d), torch.randn(1, hkv, prefix + n, d)
    blocks = blocked_masks(prefix, n, h // hkv, torch.float32, "cpu", block)
    assert [(a, b) for a, b, _ in blocks] == [(a, min(n, a + block)) for a in range(0, n, block)]
    got = blocked_attention(q, k, v, blocks, prefix, d**-0.5)
    want = segment_attention(q, k, v, grouped_mask(causal_mask(prefix, n, torch.float32, "cpu"), h // hkv), d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_prefill_chunks_in_row_blocks_give_the_same_states_and_greedy_output(monkeypatch):
    """Prompt chunks above ``ROW_BLOCK`` rows attend in row blocks: the prompt's hidden states
    agree with one masked call's, and a batch through the scheduler writes HF's plain greedy."""
    tg = tiny_target()
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    monkeypatch.setattr(batch_forward, "ROW_BLOCK", 0)
    off = prefill(tg, prompt, chunk=16, states=True)
    monkeypatch.setattr(batch_forward, "ROW_BLOCK", 5)
    calls = []
    real = batch_forward.blocked_attention
    monkeypatch.setattr(batch_forward, "blocked_attention", lambda *a: calls.append(len(a[3])) or real(*a))
    on = prefill(tg, prompt, chunk=16, states=True)
    layers = tg.model.config.num_hidden_layers
    assert calls == [4] * layers + [4] * layers + [2] * layers  # chunks of 16, 16, 8 rows in blocks of 5
    torch.testing.assert_close(on.states, off.states, rtol=1e-5, atol=1e-5)
    prompts = [[5, 9, 17, 33, 2, 8, 60, 41, 12, 7, 7, 19, 88, 3], [(5 * i) % 90 + 2 for i in range(45)], [4]]
    refs = [hf_greedy(tg, p, 12) for p in prompts]
    seqs = [
        Sequence(tg, p, ScriptedDrafter(branching(r)), DecodeConfig(max_new_tokens=12)) for p, r in zip(prompts, refs)
    ]
    out = run_batch(tg, seqs, CostModel.flat(), BatchLimits(max_running=3, prefill_chunk=16))
    assert [r.tokens for r in out] == refs


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bitwise_hf_rotary_embedding(family, dtype):
    """``rope`` is each supported family's ``apply_rotary_pos_emb``, bit for bit, on the strided
    q / k the decoder makes (heads transposed out of the projection's rows)."""
    import importlib

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    torch.manual_seed(0)
    for n in (1, 5, 300):
        q = torch.randn(1, n, 6, 32, dtype=dtype).transpose(1, 2)  # [1, H, n, D], strided
        k = torch.randn(1, n, 2, 32, dtype=dtype).transpose(1, 2)
        cos, sin = torch.randn(1, n, 32, dtype=dtype), torch.randn(1, n, 32, dtype=dtype)
        want_q, want_k = hf(q, k, cos, sin)
        assert torch.equal(rope(q, cos[:, None], sin[:, None]), want_q)
        assert torch.equal(rope(k, cos[:, None], sin[:, None]), want_k)
