"""The target wrapper: the KV-cache argument follows the model's forward signature."""

from __future__ import annotations

import torch
from scripted import tiny as tiny


def test_cache_kwarg_follows_the_forward_signature(tiny):
    """transformers >= 5.20 names the KV cache ``cache``; older images (a GPU machine's 5.17) only
    know ``past_key_values``: a wrong name would silently decode without a cache."""
    from toolspec_core.model.target import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return None

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    assert cache_kwarg(tiny.model.model) in ("cache", "past_key_values")
    cache = tiny.new_cache()
    tiny.hidden(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], None, cache)
    assert cache.get_seq_length() == 3  # the cache really was used
