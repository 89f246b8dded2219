"""One sequence's KV cache: preallocated per-layer storage and a valid length.

The batched forward (:mod:`toolspec_core.model.batch_forward`) writes each sequence's new rows
straight into its storage and attends over a view of it, so a step costs no concatenation; a
verify commit is a gather of the accepted rows followed by a shorter ``length``
(:func:`toolspec_core.engine.commit.commit_kv`), never a copy of the cache. The class speaks the
small part of HF's cache interface the engine uses (``layers[i].keys / .values``,
``get_seq_length``, ``crop``), so a block pool can replace it without touching the engine.
"""

from __future__ import annotations

import torch

GROW = 256  # rows added beyond what a write needs when the storage grows (amortises the copy)


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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def __deepcopy__(self, memo) -> "SeqKV":
        """A copy of the valid rows only (a cached prompt prefix handed to a new request)."""
        out = SeqKV(self.n_layers, self.length + GROW)
        out.length = self.length
        with torch.inference_mode():
            for i in range(self.n_layers):
                if self.k[i] is not None:
                    out.k[i] = self.k[i][:, :, : self.length + GROW].clone()
                    out.v[i] = self.v[i][:, :, : self.length + GROW].clone()
        return out
