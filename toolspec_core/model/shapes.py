"""Named Qwen2.5 architecture shapes, from the public Instruct models' config.json files.

One home for them because two kinds of tool need a model's shape without its weights: the
benchmarks build random-weight models of a shape to time them (``benchmarks/cost.py``), and the
capacity plan (``deployments/plan.py``) does the memory arithmetic of a model no one has downloaded.
The keys are HF config keys, so a shape passes straight to ``Qwen2Config(**shape)``.
"""

from __future__ import annotations

# the HF config keys of a shape's row, in order
_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def shape(*row: int | bool, context: int = 32768) -> dict:
    """The HF config keys of one row: hidden size, intermediate size, layers, attention heads, KV
    heads, vocabulary, tied embeddings; ``context`` is ``max_position_embeddings``."""
    return dict(zip(_KEYS, row, strict=True), max_position_embeddings=context)


SHAPES = {
    # also Qwen2.5-Coder-0.5B-Instruct (the embedded target's converted checkpoint has an untied lm_head)
    "qwen2.5-0.5b": shape(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": shape(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": shape(5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": shape(5120, 27648, 64, 40, 8, 152064, False),
    # the production target (k8s/overlays/gpu-prod)
    "qwen2.5-72b": shape(8192, 29568, 80, 64, 8, 152064, False),
}
