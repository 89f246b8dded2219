"""One sequence's KV cache: preallocated per-layer storage and a valid length.

The batched forward (:mod:`toolspec_core.model.batch_forward`) writes each sequence's new rows
straight into its storage and attends over a view of it, so a step costs no concatenation; a
verify commit is a gather of the accepted rows followed by a shorter ``length``
(:func:`toolspec_core.engine.commit.commit_kv`), never a copy of the cache.

Every cache the engine holds speaks one protocol, :class:`KVCache`: :class:`SeqKV` (a sequence's
own growing storage), :class:`~toolspec_core.model.block_pool.PagedKV` (a block table in the
replica's pool, the tensor-parallel replica's storage-less shadow of the ranks' pool included)
and :class:`HFKV` (HF's own cache, for the model families the batched forward does not cover).
The engine calls the protocol and never asks which kind it holds.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

GROW = 256  # rows added beyond what a write needs when the storage grows (amortises the copy)


@runtime_checkable
class KVCache(Protocol):
    """One sequence's KV as the engine and the batched forward use it.

    ``write`` stores a step's rows of one layer and returns the K / V the step attends over;
    ``advance`` makes them valid once every layer has written; ``move_rows`` (verify commit)
    moves the accepted rows after ``prefix_len`` into place and ``crop`` drops the rest;
    ``room`` is how many more rows fit (None: the storage grows); ``register`` makes the
    committed rows findable by later prompts (a pooled cache's prefix cache); ``release``
    gives the storage back (with ``tokens``, registering its committed rows first)."""

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, n: int) -> None: ...

    def crop(self, max_length: int) -> None: ...

    def move_rows(self, prefix_len: int, rows: list[int]) -> None: ...

    def room(self) -> int | None: ...

    def register(self, tokens: list[int]) -> None: ...

    def release(self, tokens: list[int] | None = None) -> None: ...


def gather_rows(layers, prefix_len: int, rows: list[int]) -> None:
    """Move rows ``prefix_len + r`` (r in ``rows``) to ``prefix_len ..``, in order, in every layer
    of a cache whose ``layers[i].keys / .values`` [B, H_kv, S, D] are views of its storage."""
    src = torch.tensor([prefix_len + r for r in rows], dtype=torch.long, device=layers[0].keys.device)
    end = prefix_len + len(rows)
    with torch.inference_mode():  # cache tensors are inference tensors
        for layer in layers:
            layer.keys[:, :, prefix_len:end] = layer.keys.index_select(2, src)
            layer.values[:, :, prefix_len:end] = layer.values.index_select(2, src)


class _LayerView:
    """``keys`` / ``values`` of one layer: views of the valid rows, [1, H_kv, length, D]."""

    def __init__(self, kv: "SeqKV", index: int):
        self.kv, self.index = kv, index

    @property
    def keys(self) -> torch.Tensor:
        return self.kv.k[self.index][:, :, : self.kv.length]

    @property
    def values(self) -> torch.Tensor:
        return self.kv.v[self.index][:, :, : self.kv.length]


class SeqKV:
    """KV of one sequence. Storage per layer: [1, H_kv, capacity, D], allocated at the first write."""

    def __init__(self, n_layers: int, capacity: int = 0):
        self.n_layers, self.capacity, self.length = n_layers, capacity, 0
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.layers = [_LayerView(self, i) for i in range(n_layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """HF semantics: keep ``max_length`` rows, or drop ``-max_length`` rows when negative."""
        self.length = max(0, self.length + max_length if max_length < 0 else min(max_length, self.length))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k / v [1, H_kv, n, D] after the valid rows of ``layer``; return K / V [1, H_kv, length + n, D].

        ``length`` moves only in :meth:`advance`, once every layer has written the step's rows.
        """
        end = self.length + k.shape[2]
        if self.k[layer] is None or end > self.k[layer].shape[2]:
            self._grow(layer, k, end)
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def _grow(self, layer: int, k: torch.Tensor, end: int) -> None:
        cap = max(end + GROW, self.capacity, 2 * (0 if self.k[layer] is None else self.k[layer].shape[2]))
        b, h, _, d = k.shape
        new_k, new_v = k.new_empty(b, h, cap, d), k.new_empty(b, h, cap, d)
        if self.k[layer] is not None:
            new_k[:, :, : self.length] = self.k[layer][:, :, : self.length]
            new_v[:, :, : self.length] = self.v[layer][:, :, : self.length]
        self.k[layer], self.v[layer] = new_k, new_v

    def advance(self, n: int) -> None:
        self.length += n

    def move_rows(self, prefix_len: int, rows: list[int]) -> None:
        gather_rows(self.layers, prefix_len, rows)

    def room(self) -> int | None:
        return None  # the storage grows

    def register(self, tokens: list[int]) -> None:
        """Nothing to register: a sequence's own storage is never shared."""

    def release(self, tokens: list[int] | None = None) -> None:
        """Nothing to give back: the storage goes with the object."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class HFKV:
    """HF's own cache (a ``DynamicCache``) behind :class:`KVCache`: the model families the batched
    forward does not cover run HF's forward over ``hf`` (:meth:`~toolspec_core.model.target.Target.hidden`).
    HF's ``update`` counts the rows as it stores them, so ``advance`` has nothing left to do."""

    def __init__(self, hf):
        self.hf = hf

    @property
    def layers(self):
        return self.hf.layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.hf.get_seq_length(layer_idx)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hf.update(k, v, layer)

    def advance(self, n: int) -> None:
        """HF's ``update`` has counted the rows already."""

    def crop(self, max_length: int) -> None:
        self.hf.crop(max_length)

    def move_rows(self, prefix_len: int, rows: list[int]) -> None:
        gather_rows(self.hf.layers, prefix_len, rows)

    def room(self) -> int | None:
        return None

    def register(self, tokens: list[int]) -> None:
        """Nothing to register: the cache is the sequence's own."""

    def release(self, tokens: list[int] | None = None) -> None:
        """Nothing to give back."""
