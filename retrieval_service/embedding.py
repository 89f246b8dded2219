"""Request keys for the history library.

* ``HFEmbedder`` -- any local HF model directory, mean- (or last-token-) pooled: the Retrieval
  deployment's own encoder (the embedded Qwen2.5-Coder-0.5B by default, a Qwen embedding model
  where one is available) over ``query_text``. Every engine replica, whatever its target, sends
  text and the deployment keys it, so all replicas search one vector space (``retrieval.key:
  qwen``, what ``auto`` is wherever the encoder has cores or a GPU of its own; ``hybrid`` puts the
  lexical vector beside it).
* ``LexicalEmbedder`` -- hashed word / char n-gram TF of the last user message + the offered tool
  names. No model, deterministic across processes (crc32, not Python's salted ``hash``).
* the target's own last-layer states (``retrieval.key: hidden``): of the final prompt token
  (``pooling="last"``, free at serving time: the engine's prefill hands it to the sequence's
  ``on_prompt`` hook) or their mean over the prompt
  (``"mean"``); ``from_hidden`` makes the key. This package never runs the target: the caller
  hands it the states (the replica: those its engine's prefill gives ``on_prompt``).
  Its space changes with the target, so replicas of different models cannot share it. What
  ``retrieval.key: auto`` is where the encoder would share a CPU target's cores.

Which key ranks best was measured on the three dev sets
(``benchmarks/results/retrieval/retrieval-key-eval-3bench-*``, which say the command; the study's
code is in git at ``5afc378``, ``benchmarks/studies/retrieval_key_eval.py``): with the search restricted to the
offered tools, the top-1 call is of the right tool for about 0.8 of the requests with every key
(the embedded Qwen read at its 6th layer 0.835, at its top 0.817, lexical 0.788, hidden 0.788, an
RRF fusion of qwen and lexical searches 0.839; means of the sets and two orders); only RRF beats
lexical with significance, on one set. The text key is the deployment's Qwen encoder at layer 6:
as good as any key, the one model-based key shared across targets, a quarter of the full
encoder's work (``deployments.config.EMBEDDED_ENCODER_LAYERS``); the serving default ``auto``
picks it wherever the encoder does not share a CPU target's cores
(``deployments.config.resolve_key``).

Keys from different embedders live in different vector spaces (and dims): one collection per
embedder (its ``name``).
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Embedder(Protocol):
    """What the library keys a request with. Model-free ones live here; one that runs the serving
    target lives with the caller, which may import the engine."""

    name: str
    dim: int

    def embed(self, x: Any) -> np.ndarray:
        """A unit float32 vector [dim] for prompt token ids or text (what each embedder accepts)."""
        ...

    def embed_request(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray: ...


def normalise(v) -> np.ndarray:
    """float32 [D] with unit L2 norm (a zero vector stays zero; the store rejects it)."""
    if hasattr(v, "detach"):
        v = v.detach().cpu().float().numpy()
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    n = float(np.linalg.norm(v))
    return v / n if n > 0 and np.isfinite(n) else v


def from_hidden(hidden, pooling: str = "last") -> np.ndarray:
    """Last-layer hidden states to a retrieval key: one prompt's last state [H] as is, or from
    all prompt states [T, H] the last row (``"last"``) or their mean (``"mean"``)."""
    if pooling not in ("last", "mean"):
        raise ValueError("pooling must be 'last' or 'mean'")
    if hasattr(hidden, "detach"):
        hidden = hidden.detach().cpu().float().numpy()
    h = np.asarray(hidden, dtype=np.float32)
    if h.ndim == 2:
        h = h.mean(0) if pooling == "mean" else h[-1]
    elif pooling == "mean":
        raise ValueError("mean pooling needs all prompt states [T, H], not one vector")
    return normalise(h)


def concat_keys(*keys: np.ndarray) -> np.ndarray:
    """One key from several unit keys: the cosine of the result is the mean of their cosines."""
    return normalise(np.concatenate([normalise(k) for k in keys]))


def _content(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return " ".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c if isinstance(c, str) else ""


def tool_names(tools: Sequence[dict] | None) -> list[str]:
    out = []
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn.get("name"), str):
            out.append(fn["name"])
    return out


def last_user_message(messages: Sequence[dict]) -> str:
    for m in reversed(list(messages or [])):
        if isinstance(m, dict) and m.get("role") == "user":
            return _content(m)
    return ""


def request_text(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """The text a text embedder keys on: last user message, then the offered tool names."""
    names = tool_names(tools)
    text = last_user_message(messages)
    return f"{text}\nTools: {', '.join(names)}" if names else text


def prior_calls(messages: Sequence[dict], limit: int = 4) -> list[str]:
    """The conversation's last ``limit`` tool calls, as ``name(arguments)`` strings."""
    out: list[str] = []
    for m in messages or []:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        for c in m.get("tool_calls") or []:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                import json

                args = json.dumps(args, sort_keys=True)
            if isinstance(fn.get("name"), str):
                out.append(f"{fn['name']}({args[:200]})")
    return out[-limit:]


def query_text(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """What the Retrieval deployment's encoder embeds for a request (and for the calls stored
    from it): the last user message, the offered tool names, the conversation's prior calls."""
    text = request_text(messages, tools)
    calls = prior_calls(messages)
    return f"{text}\nCalls: {'; '.join(calls)}" if calls else text


# ----------------------------------------------------------------------------- lexical

_WORD = re.compile(r"[a-z0-9]+")


def lexical_features(text: str, names: Sequence[str] = (), char_n: tuple[int, ...] = (3, 4)) -> dict[str, float]:
    """Word unigrams + bigrams, char n-grams inside words, and whole tool names (weighted x2: the
    tool set says most about which calls are likely)."""
    words = _WORD.findall(text.lower())
    feats: dict[str, float] = {}

    def put(f: str, w: float = 1.0) -> None:
        feats[f] = feats.get(f, 0.0) + w

    for i, w in enumerate(words):
        put("w:" + w)
        if i:
            put(f"b:{words[i - 1]} {w}")
        padded = f"#{w}#"
        for n in char_n:
            for j in range(max(0, len(padded) - n + 1)):
                put(f"c{n}:{padded[j : j + n]}", 0.5)
    for name in names:
        put("t:" + name, 2.0)
    return feats


class LexicalEmbedder:
    """Signed feature hashing into ``dim`` buckets, sublinear TF, unit norm."""

    name = "lexical"

    def __init__(self, dim: int = 1024):
        if dim <= 0:
            raise ValueError("dim must be positive")
        self.dim = int(dim)

    def vector(self, feats: dict[str, float]) -> np.ndarray:
        v = np.zeros(self.dim, np.float32)
        for f, tf in feats.items():
            h = zlib.crc32(f.encode("utf-8"))
            v[h % self.dim] += (1.0 if (h >> 31) & 1 else -1.0) * (1.0 + np.log(tf) if tf >= 1 else tf)
        return normalise(v)

    def embed(self, x) -> np.ndarray:
        """Text, or a request dict ``{"messages": [...], "tools": [...]}``."""
        if isinstance(x, dict):
            return self.embed_request(x.get("messages") or [], x.get("tools"))
        if not isinstance(x, str):
            raise TypeError("LexicalEmbedder embeds text or a {'messages', 'tools'} dict, not token ids")
        return self.vector(lexical_features(x))

    def embed_request(self, messages, tools=None) -> np.ndarray:
        return self.vector(lexical_features(last_user_message(messages), tool_names(tools)))


# ----------------------------------------------------------------------------- any HF model


def _keep_layers(config, layers: int) -> None:
    """Cut a decoder config to its first ``layers`` layers (the later layers' weights are then
    never loaded): the final norm follows the last kept layer."""
    total = int(config.num_hidden_layers)
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in 1..{total} for this model, got {layers}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, layers)


class HFEmbedder:
    """Pooled states of a local HF model (the embedded Qwen by default; a Qwen embedding model
    where one is available), after its top layer or after layer ``layers``: the Retrieval
    deployment's own encoder, so every engine replica, whatever its target, queries one vector
    space.

    ``pooling="mean"`` averages over real tokens (the key evaluation's best unfiltered ranking);
    ``"last"`` takes the final token (what Qwen3-Embedding is trained for, with ``prefix`` set to
    its query instruction). :meth:`encode` embeds a batch in one forward: right-padded, so each
    text's states never see the padding (causal attention) and its vector is its own.
    """

    def __init__(
        self,
        model_dir: str,
        pooling: str = "mean",
        max_length: int = 512,
        prefix: str = "",
        threads: int | None = None,
        device: str = "cpu",
        layers: int | None = None,
    ):
        import torch
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        if pooling not in ("mean", "last"):
            raise ValueError("pooling must be 'mean' or 'last'")
        if threads:
            torch.set_num_threads(threads)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            config = AutoConfig.from_pretrained(str(model_dir))
            if layers is not None:
                _keep_layers(config, layers)
            self.model = AutoModel.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval().to(device)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not load an embedding model from {model_dir}: {exc}") from exc
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pooling, self.max_length, self.prefix, self.device = pooling, max_length, prefix, device
        self.dim = int(self.model.config.hidden_size)
        # the name keys the collection: vectors of another pooling or depth live in another space
        self.name = f"hf:{Path(str(model_dir)).name}:{pooling}" + (f":l{layers}" if layers is not None else "")

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors [len(texts), dim] of non-empty texts, in one forward."""
        import torch

        if not texts or any(not isinstance(x, str) or not x.strip() for x in texts):
            raise ValueError("nothing to embed: every text must be non-empty")
        enc = self.tokenizer(
            [self.prefix + x for x in texts],
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)  # [B, T] each
        with torch.inference_mode():
            h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [B, T, H]
        if self.pooling == "mean":
            m = mask[..., None].to(h.dtype)
            v = (h * m).sum(1) / m.sum(1)  # [B, H]
        else:
            v = h[torch.arange(h.shape[0]), mask.sum(1) - 1]  # [B, H] each text's last real token
        return np.stack([normalise(x) for x in v.cpu()])

    def embed(self, x) -> np.ndarray:
        import torch

        if isinstance(x, str):
            return self.encode([x])[0]
        ids = list(x)[-self.max_length :]
        if not ids:
            raise ValueError("nothing to embed")
        with torch.inference_mode():
            h = self.model(input_ids=torch.tensor([ids], device=self.device)).last_hidden_state[0]
        return normalise(h.mean(0) if self.pooling == "mean" else h[-1])

    def embed_request(self, messages, tools=None) -> np.ndarray:
        return self.embed(query_text(messages, tools))
