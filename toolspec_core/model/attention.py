"""Tree-verify attention without repeating the KV heads.

HF's SDPA path runs grouped-query attention natively only without a mask (or for one query
token); a verify step has a tree mask, so every layer copied its K and V once per query head
(Qwen2.5-0.5B: 2 -> 14 heads, ~4 MB a layer over a 600-token cache). Here the ``g`` query heads
that share a KV head are stacked as ``g * T`` query rows of that head and the mask is repeated
``g`` times instead (``g * T * S`` values, tiny at verify sizes). Same function; a 2-32-token verify
step measured 2-6% faster over a 500-token prefix and 6-20% over a 1,500-token one on the dev CPU
(``benchmarks/results/measurements/attention-grouped-cpu-epyc-*.json``, each with its command; the
study's code is in git at ``5afc378``); one-token steps never had the copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "toolspec_grouped_sdpa"


def grouped_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """An HF attention function: query [B, H, T, D], key/value [B, Hkv, S, D] -> ([B, T, H, D], None).

    Falls back to HF's own SDPA function whenever its fast paths apply (no mask, one query
    token, no grouping) or an extra feature is asked for (position bias, dropout).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, t, d = query.shape
    hkv = key.shape[1]
    if (
        attention_mask is None
        or t == 1
        or hkv == h
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    g = h // hkv
    q = query.reshape(b, hkv, g * t, d)  # head hkv*g+i, row j -> row i*t+j of KV head hkv
    mask = attention_mask[:, :, :, : key.shape[-2]]  # [B|1, 1|H, T, S]
    if mask.shape[1] != 1:  # a per-head mask: stack its heads the same way
        mask = mask.reshape(mask.shape[0], hkv, g * t, mask.shape[-1])
    else:
        mask = mask.repeat(1, 1, g, 1)  # [B|1, 1, g*T, S]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [B, Hkv, g*T, D]
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch an HF model that runs SDPA attention to :func:`grouped_sdpa` (masks built as for SDPA).

    Models on another attention implementation are left alone. Returns whether it switched.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
