"""Grouped tree-verify attention: the same function as HF's SDPA, without repeating KV heads."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_mask, tiny_model, tiny_target

from toolspec_core.engine.verify import tree_inputs
from toolspec_core.model.attention import NAME, grouped_sdpa
from toolspec_core.model.batch_forward import widen
from toolspec_core.spec.tree import DraftTree


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _reference(module, q, k, v, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("kind", ["float", "bool", "per_head", "batched"])
@pytest.mark.parametrize("t", [2, 5, 16])
def test_grouped_sdpa_equals_hf_sdpa(kind, t):
    g = torch.Generator().manual_seed(t)
    b, h, hkv, s, d = (2 if kind == "batched" else 1), 6, 2, 40, 8
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    visible = torch.rand(b if kind == "batched" else 1, h if kind == "per_head" else 1, t, s + 3, generator=g) > 0.4
    visible[..., 0] = True  # every row sees something
    mask = visible if kind == "bool" else torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    module = _Module(h // hkv)
    got, weights = grouped_sdpa(module, q, k, v, mask, scaling=d**-0.5)
    assert weights is None and got.shape == (b, t, h, d)
    # a mask may be wider than the keys (HF slices it): the reference gets the slice
    torch.testing.assert_close(got, _reference(module, q, k, v, mask[..., :s]), rtol=1e-5, atol=1e-5)


def test_models_are_switched_and_tree_verify_never_repeats_kv_heads(monkeypatch):
    import transformers.integrations.sdpa_attention as hf_sdpa

    target = tiny_target()
    assert target.model.config._attn_implementation == NAME
    plain = tiny_model()  # same seed: same weights, HF's own SDPA
    assert plain.config._attn_implementation == "sdpa"
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    tree = DraftTree(tokens=[7, 9, 11, 4, 6], parents=[-1, 0, 0, 2, -1], conf=[0.5] * 5)
    outs = []
    for model in (target.model, plain):
        cache = target.hf_cache()  # HF's own forward: the grouped attention is what it runs
        with torch.inference_mode():
            model.model(input_ids=prompt, use_cache=True, past_key_values=cache)
        ids, pos, parents = tree_inputs(2, tree, prompt.shape[1])
        mask = reference_mask(parents)
        if model is target.model:

            def no_repeat(*a, **kw):
                raise AssertionError("KV heads repeated under a tree mask")

            monkeypatch.setattr(hf_sdpa, "repeat_kv", no_repeat)
        with torch.inference_mode():
            outs.append(
                model(
                    input_ids=ids, position_ids=pos, attention_mask=widen(mask, prompt.shape[1]), past_key_values=cache
                ).logits
            )
        monkeypatch.undo()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_eager_models_are_left_alone():
    target = tiny_target(attn="eager")
    assert target.model.config._attn_implementation == "eager"
