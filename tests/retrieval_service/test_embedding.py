"""Request embedders. Model-backed ones run on a tiny random Qwen2 built here (no weights)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from retrieval_service.embedding import (
    Embedder,
    HFEmbedder,
    LexicalEmbedder,
    concat_keys,
    from_hidden,
    last_user_message,
    request_text,
)

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {"type": "function", "function": {"name": "GetWeather", "parameters": {}}},
    {"type": "function", "function": {"name": "BookHotel"}},
]
MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "What is the weather in Paris tomorrow?"},
    {"role": "assistant", "content": "Which unit?"},
]


def test_request_text_uses_last_user_message_and_tools():
    assert last_user_message(MSGS) == "What is the weather in Paris tomorrow?"
    assert request_text(MSGS, TOOLS) == "What is the weather in Paris tomorrow?\nTools: GetWeather, BookHotel"
    assert request_text([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == "hi"


def test_lexical_is_unit_deterministic_and_similarity_ordered():
    lex = LexicalEmbedder(256)
    assert isinstance(lex, Embedder)
    a = lex.embed_request(MSGS, TOOLS)
    assert a.shape == (256,) and a.dtype == np.float32 and np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    near = lex.embed_request([{"role": "user", "content": "weather in Paris on Friday?"}], TOOLS)
    far = lex.embed_request(
        [{"role": "user", "content": "open a bank account for user1"}], [{"name": "OpenBankAccount"}]
    )
    assert float(a @ near) > float(a @ far)
    assert np.array_equal(lex.embed({"messages": MSGS, "tools": TOOLS}), a)
    with pytest.raises(TypeError):
        lex.embed([1, 2, 3])
    # crc32 hashing: the same vector in another process (Python's str hash is salted per process)
    code = (
        "import sys; sys.path.insert(0, %r); from retrieval_service.embedding import LexicalEmbedder;"
        "print(LexicalEmbedder(256).embed('weather in Paris').tolist())" % str(ROOT)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert np.allclose(eval(out.stdout), lex.embed("weather in Paris"))


def test_from_hidden_normalises_tensors_and_takes_last_row():
    torch = pytest.importorskip("torch")
    h = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    assert np.allclose(from_hidden(h[0]), [0.6, 0.8])
    assert np.allclose(from_hidden(h), [0.0, 1.0])
    assert np.allclose(from_hidden(h, "mean"), np.array([1.5, 3.0]) / np.hypot(1.5, 3.0))
    assert from_hidden(h).dtype == np.float32
    with pytest.raises(ValueError):
        from_hidden(h[0], "mean")  # one vector cannot be mean-pooled
    k = concat_keys(np.array([1.0, 0.0]), np.array([0.0, 2.0]))
    assert k.shape == (4,) and np.linalg.norm(k) == pytest.approx(1.0)
    a, b = np.array([1.0, 0.0]), np.array([0.6, 0.8])
    assert float(concat_keys(a, a) @ concat_keys(b, a)) == pytest.approx((0.6 + 1.0) / 2)


def test_retrieval_service_never_imports_the_engine():
    """Keys that run the target are the caller's (the replica keys by the prompt state its engine's
    prefill hands it); the service imports neither the engine nor the deployments, not even lazily
    inside a function."""
    import re

    # import statements, and module names in strings (importlib)
    banned = re.compile(
        r"^\s*(?:from|import)\s+(?:toolspec_core|deployments|benchmarks)\b|[\"'](?:toolspec_core|deployments)\b", re.M
    )
    for path in sorted((ROOT / "retrieval_service").glob("*.py")):
        assert not banned.search(path.read_text()), path.name


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    from tiny import tiny_model
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    # byte-level BPE like Qwen's (AutoTokenizer maps a qwen2 config to Qwen2Tokenizer, which
    # rebuilds a byte-level BPE from tokenizer.json's vocab + merges)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["user assistant weather in paris hotel tools : ?"] * 4, vocab_size=300, special_tokens=["<s>", "[PAD]"]
    )
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="[PAD]", eos_token="<s>")
    hf_tok.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    model = tiny_model(
        vocab=320, hidden=16, init=0.02, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128
    )
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    hf_tok.save_pretrained(d)
    return d


def test_hf_embedder_mean_and_last_pooling(tiny_model_dir):
    mean = HFEmbedder(str(tiny_model_dir), pooling="mean")
    last = HFEmbedder(str(tiny_model_dir), pooling="last")
    assert mean.dim == 16
    a, b = mean.embed("weather in paris"), last.embed("weather in paris")
    assert a.shape == b.shape == (16,) and not np.allclose(a, b)
    assert np.allclose(mean.embed(mean.tokenizer("weather in paris")["input_ids"]), a, atol=1e-5)  # ids or text
    assert mean.embed_request(MSGS, TOOLS).shape == (16,)
    with pytest.raises(ValueError):
        HFEmbedder(str(tiny_model_dir), pooling="max")
    with pytest.raises(ValueError):
        HFEmbedder(str(tiny_model_dir / "missing"))


def test_hf_embedder_cut_to_its_first_layers_pools_those_layers_states(tiny_model_dir):
    """``layers=N``: the first N decoder layers of the same weights (then the final norm), a
    vector space of its own (the name says so); a depth the model lacks is refused."""
    import torch

    full = HFEmbedder(str(tiny_model_dir))
    cut = HFEmbedder(str(tiny_model_dir), layers=1)
    assert len(cut.model.layers) == 1 < len(full.model.layers)
    assert cut.name == full.name + ":l1"
    ids = full.tokenizer("weather in paris", return_tensors="pt")["input_ids"]  # [1, T]
    with torch.inference_mode():
        states = full.model(input_ids=ids, output_hidden_states=True).hidden_states[1][0]  # [T, H] after layer 1
        want = from_hidden(full.model.norm(states), "mean")
    got = cut.encode(["weather in paris"])[0]
    assert np.allclose(got, want, atol=1e-5) and not np.allclose(got, full.encode(["weather in paris"])[0])
    with pytest.raises(ValueError, match="layers"):
        HFEmbedder(str(tiny_model_dir), layers=99)
