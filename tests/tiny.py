"""Tiny random Qwen2 targets for tests that do not need real weights."""

from __future__ import annotations

import torch

from toolspec_core.model.target import from_model


class CharTokenizer:
    """Token i <-> chr(ord('a') + i); enough for stop strings and text in tests."""

    eos_token_id = None
    unk_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + (int(i) % 26)) if i < 26 else f"<{int(i)}>" for i in ids)

    def convert_tokens_to_ids(self, tok):
        return None


def tiny_model(
    vocab: int = 96,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    attn: str = "sdpa",
    init: float = 0.3,
    eos: int | None = None,
    **config,
):
    """A random Qwen2 model; ``config``: other or more Qwen2Config keys (a sliding window, a width
    of the MLP or a head count other than these, say)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    keys = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        attn_implementation=attn,
        eos_token_id=eos,
    )
    cfg = Qwen2Config(**keys | config)
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def tiny_target(vocab: int = 96, eos: int | None = None, **kw):
    model = tiny_model(vocab=vocab, eos=eos, **kw)
    return from_model(model, CharTokenizer(vocab), name="tiny")


def hf_greedy(target, prompt, n):
    """Plain greedy with HF generate (the reference everything must equal)."""
    out = target.model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def reference_mask(parents: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive mask [1, 1, n, n] of rows with these parent rows, built the slow obvious way
    (each row copies its parent's row and sees itself): what the forwards' masks are checked against."""
    n = len(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i] = visible[p]
        visible[i, i] = True
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
