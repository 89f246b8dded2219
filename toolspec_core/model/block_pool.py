"""The KV block pool: every sequence's KV in fixed-size blocks of one preallocated store, with
automatic prefix caching across requests.

Why blocks: a replica's KV memory is allocated once (``num_blocks`` x ``block_tokens`` rows), so
admission waits for room instead of failing or growing, and a full block can be shared read-only
by every sequence whose tokens begin with the same prefix -- the system prompt and tools, or an
agent's previous turn with its call and the tool result -- whose rows are then never prefilled
again.

Storage: K and V each [L, H_kv, (num_blocks + 1) * block_tokens, D]; slot ``b * block_tokens + i``
is row ``i`` of block ``b``. The last block is never allocated: it is the scratch block that the
ragged attention's padding reads and writes (:mod:`toolspec_core.model.ragged`), zeroed here so
that whatever reads it is finite. A sequence's :class:`PagedKV` maps its rows to slots through its block
table, fixed when the scheduler admits it (shared prefix blocks, then its own blocks for the rest
of the prompt, ``max_new_tokens`` and one draft tree). Its own blocks are taken as one contiguous
run when the pool has one, so a sequence without a shared prefix attends over a view of the
store; a sequence after a shared prefix gathers its rows (one ``index_select`` a layer).

Prefix caching (vLLM's scheme): a full block is keyed by a hash chained over every token up to its
end, so a key names the whole prefix, never a block's tokens alone. A registered block can be
handed to later sequences (reference counted); once no sequence references it, it waits in an LRU
and is evicted -- key and all, so it is never found again -- when a block is needed and none is
free. Blocks being written are never shared: a sequence registers only full blocks whose rows
are committed.

Not thread-safe: the scheduler's thread owns the pool.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def block_keys(tokens: list[int], block_tokens: int, n_blocks: int, prev: bytes = b"") -> list[bytes]:
    """Chained keys of the first ``n_blocks`` full blocks of ``tokens``: key i names tokens[: (i+1) * bt]."""
    out = []
    for i in range(n_blocks):
        chunk = array("q", tokens[i * block_tokens : (i + 1) * block_tokens]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


_sids = itertools.count(1)


@dataclass
class PoolStats:
    """What /metrics reports of a pool."""

    blocks: int
    block_tokens: int
    used_blocks: int  # referenced by a running sequence
    cached_blocks: int  # unreferenced but still holding a registered prefix (evictable)
    free_blocks: int
    queried_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of which served from cached blocks
    evictions: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.blocks if self.blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockPool:
    """Fixed-size KV blocks of one target, their reference counts and the prefix-cache index."""

    def __init__(
        self,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_tokens: int = 16,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        prefix_caching: bool = True,
    ):
        if num_blocks <= 0 or block_tokens <= 0:
            raise ValueError(f"a pool needs positive num_blocks and block_tokens, got {num_blocks}, {block_tokens}")
        self.n_layers, self.num_blocks, self.block_tokens = n_layers, num_blocks, block_tokens
        self.prefix_caching = prefix_caching  # False: blocks are never registered, so never shared
        self.scratch_block = num_blocks  # padding's block, never allocated
        self.scratch_slot = num_blocks * block_tokens
        shape = (n_layers, kv_heads, (num_blocks + 1) * block_tokens, head_dim)
        # untouched pages cost no host memory until a block is first written
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, H_kv, slots, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, H_kv, slots, D]
        self.k[:, :, self.scratch_slot :] = 0
        self.v[:, :, self.scratch_slot :] = 0
        self.refs = [0] * num_blocks
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free (neither referenced nor cached)
        self._n_free = num_blocks
        self.key_of: dict[int, bytes] = {}  # registered block -> its prefix key
        self.by_key: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, oldest first
        self.queried_tokens = self.hit_tokens = self.evictions = 0
        self._pending: tuple[list[int], list[int]] | None = None  # (src, dst) slots moved at the end of together()

    def open(
        self, table: list[int], shared: int = 0, keys: list[bytes] | None = None, sid: int | None = None
    ) -> "PagedKV":
        """A sequence's cache over ``table`` (blocks the caller holds: ``shared`` leading ones found
        in the prefix cache, with their ``keys``): the one way a :class:`PagedKV` is made, so the
        pool knows every sequence whose rows it holds (``sid``: its id here and on the ranks of a
        tensor-parallel target, whose pool replays this with the replica's ``sid``; else a new
        one, unique in the process)."""
        return PagedKV(self, table, shared, keys, next(_sids) if sid is None else sid)

    def close(self, cache: "PagedKV") -> None:
        """A sequence's blocks come back (:meth:`PagedKV.release`)."""
        self.release(cache.table)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def available(self) -> int:
        """Blocks an allocation can take now: free ones and evictable cached ones."""
        return self._n_free + len(self.lru)

    # ------------------------------------------------------------------ prefix cache
    def match(self, tokens: list[int], limit: int) -> tuple[list[int], list[bytes]]:
        """The cached blocks that begin ``tokens`` (at most ``limit`` rows of them), now referenced
        by the caller, and their keys. ``release`` them if the caller does not go on."""
        n = min(limit, len(tokens)) // self.block_tokens
        keys = block_keys(tokens, self.block_tokens, n)
        blocks = []
        for key in keys:
            b = self.by_key.get(key)
            if b is None:
                break
            self._ref(b)
            blocks.append(b)
        return blocks, keys[: len(blocks)]

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def register(self, table: list[int], keys: list[bytes], tokens: list[int], rows: int) -> list[bytes]:
        """Make the full blocks among the first ``rows`` committed rows of a sequence findable.

        ``keys``: the keys already known for the table's leading blocks (extended and returned).
        A block whose prefix another block already holds stays unregistered (freed at release)."""
        if not self.prefix_caching:
            return keys
        n = min(rows // self.block_tokens, len(table))
        if n > len(keys):
            prev = keys[-1] if keys else b""
            keys = keys + block_keys(tokens[len(keys) * self.block_tokens :], self.block_tokens, n - len(keys), prev)
        for b, key in zip(table[:n], keys[:n]):
            if b not in self.key_of and key not in self.by_key:
                self.key_of[b], self.by_key[key] = key, b
        return keys

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, referenced by the caller: one contiguous run of free blocks when there is
        one, else the lowest free ones and then the least recently used cached ones (evicted)."""
        if n > self.available():
            raise MemoryError(f"KV pool: {n} blocks asked, {self.available()} available")
        if n == 0:
            return []
        start = self._free.find(b"\x01" * n)
        if start >= 0:
            out = list(range(start, start + n))
        else:
            out, i = [], self._free.find(b"\x01")
            while i >= 0 and len(out) < n:
                out.append(i)
                i = self._free.find(b"\x01", i + 1)
            while len(out) < n:
                b, _ = self.lru.popitem(last=False)
                del self.by_key[self.key_of.pop(b)]
                self.evictions += 1
                self._free[b] = 1
                self._n_free += 1
                out.append(b)
        for b in out:
            self._ref(b)
        return out

    def _ref(self, b: int) -> None:
        if self.refs[b] == 0:
            if self._free[b]:
                self._free[b] = 0
                self._n_free -= 1
            else:
                self.lru.pop(b, None)
        self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block: unreferenced registered blocks become evictable (most
        recent last), the others free."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"KV pool: block {b} released more often than referenced")
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.lru[b] = None
                else:
                    self._free[b] = 1
                    self._n_free += 1

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K and V of slots ``src`` [n] to slots ``dst`` [n] in every layer (a verify
        commit). The one storage write outside the forward, so a pool whose storage lives
        elsewhere (the tensor-parallel ranks') can replay it there."""
        for store in (self.k, self.v):
            store.index_copy_(2, dst, store.index_select(2, src))

    def move(self, src: list[int], dst: list[int]) -> None:
        """:meth:`move_slots` of host slot lists: now, or inside :meth:`together` with the others."""
        if not src:
            return
        if self._pending is not None:
            self._pending[0].extend(src)
            self._pending[1].extend(dst)
            return
        dev = self.k.device
        self.move_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))

    @contextmanager
    def together(self):
        """The moves made inside go as one :meth:`move_slots` at the end: a step's verify commits
        of every sequence in one copy per store, not a few kernels per sequence. Sound because a
        commit's source and destination rows are the sequence's own (never shared) and nothing
        reads the KV between the commits of one step."""
        if self._pending is not None:  # nested: the outer one moves
            yield
            return
        self._pending = ([], [])
        try:
            yield
        finally:
            src, dst = self._pending
            self._pending = None
        self.move(src, dst)  # not after an error: the step's KV state is dropped then (Scheduler.fail_all)

    def stats(self) -> PoolStats:
        used = sum(1 for r in self.refs if r > 0)
        return PoolStats(
            self.num_blocks,
            self.block_tokens,
            used,
            len(self.lru),
            self._n_free,
            self.queried_tokens,
            self.hit_tokens,
            self.evictions,
        )


class _PagedLayer:
    """``keys`` / ``values`` of one layer: the sequence's valid rows, [1, H_kv, length, D]."""

    def __init__(self, kv: "PagedKV", index: int):
        self.kv, self.index = kv, index

    @property
    def keys(self) -> torch.Tensor:
        return self.kv.read(self.kv.pool.k, self.index, self.kv.length)

    @property
    def values(self) -> torch.Tensor:
        return self.kv.read(self.kv.pool.v, self.index, self.kv.length)


class PagedKV:
    """One sequence's KV in a :class:`BlockPool`: a fixed block table and a valid length.

    Made by :meth:`BlockPool.open` (at admission, ``Scheduler._place``). It implements
    :class:`~toolspec_core.model.kv.KVCache`, so the per-sequence forward and the verify commit run
    on it unchanged; the ragged attention (:mod:`toolspec_core.model.ragged`) reads its ``table``
    and ``host_slots`` instead of calling ``write``.
    ``shared``: leading blocks of the table found in the prefix cache (read-only; ``length``
    starts past them)."""

    def __init__(
        self, pool: BlockPool, table: list[int], shared: int = 0, keys: list[bytes] | None = None, sid: int = 0
    ):
        self.pool, self.table, self.shared, self.sid = pool, list(table), shared, sid
        self.keys = list(keys or [])  # prefix keys of the table's leading blocks, as far as known
        bt = pool.block_tokens
        self.length = shared * bt
        self.capacity = len(self.table) * bt
        self.layers = [_PagedLayer(self, i) for i in range(pool.n_layers)]
        t = self.host_table = torch.tensor(self.table, dtype=torch.long)  # [blocks] on the host
        self.host_slots = (t[:, None] * bt + torch.arange(bt)).reshape(-1)  # [capacity] row -> slot, on the host
        self.slots = self.host_slots.to(pool.k.device)  # [capacity] the same, where the storage is
        # rows [own, capacity) lie in one contiguous run of slots starting at ``run``, when they do
        own = self.table[shared:]
        self.own_row = shared * bt
        self.run = own[0] * bt if own and own == list(range(own[0], own[0] + len(own))) else None
        self.released = False

    @property
    def contiguous(self) -> bool:
        """Every row in one run of slots: attention reads a view, nothing is gathered."""
        return self.run is not None and self.shared == 0

    def room(self) -> int | None:
        return self.capacity - self.length

    def register(self, tokens: list[int]) -> None:
        """Make the full blocks of the committed ``tokens`` findable by later prompts (the
        sequence keeps using them)."""
        self.keys = self.pool.register(self.table, self.keys, tokens, min(self.length, len(tokens)))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """HF semantics: keep ``max_length`` rows, or drop ``-max_length`` rows when negative."""
        length = max(0, self.length + max_length if max_length < 0 else min(max_length, self.length))
        if length < self.shared * self.pool.block_tokens:
            raise ValueError("cannot crop into the shared prefix blocks")
        self.length = length

    def advance(self, n: int) -> None:
        self.length += n

    def read(self, store: torch.Tensor, layer: int, end: int) -> torch.Tensor:
        """Rows [0, end) of ``layer`` in ``store`` (the pool's K or V): [1, H_kv, end, D]."""
        if self.contiguous:
            return store[layer, :, self.run : self.run + end][None]
        return store[layer].index_select(1, self.slots[:end])[None]

    def _put(self, store: torch.Tensor, layer: int, start: int, rows: torch.Tensor) -> None:
        """Write rows [H_kv, n, D] at the sequence's rows [start, start + n) (never shared ones)."""
        n = rows.shape[1]
        if self.run is not None and start >= self.own_row:
            s = self.run + start - self.own_row
            store[layer, :, s : s + n] = rows
        else:
            store[layer].index_copy_(1, self.slots[start : start + n], rows)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k / v [1, H_kv, n, D] after the valid rows of ``layer``; return K / V [1, H_kv, length + n, D].

        ``length`` moves only in :meth:`advance`, once every layer has written the step's rows."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"sequence KV of {end} rows exceeds its {self.capacity} reserved rows")
        self._put(self.pool.k, layer, self.length, k[0])
        self._put(self.pool.v, layer, self.length, v[0])
        return self.read(self.pool.k, layer, end), self.read(self.pool.v, layer, end)

    def move_rows(self, prefix_len: int, rows: list[int]) -> None:
        """Verify commit: rows ``prefix_len + r`` for r in ``rows`` move to ``prefix_len ..``, in
        order, in every layer at once (rows after the prefix are always the sequence's own); the
        slots are worked out on the host, rows already in place left out."""
        bt, table = self.pool.block_tokens, self.table
        src, dst = [], []
        for k, r in enumerate(rows):
            a, b = prefix_len + r, prefix_len + k
            if a != b:
                src.append(table[a // bt] * bt + a % bt)
                dst.append(table[b // bt] * bt + b % bt)
        self.pool.move(src, dst)

    def release(self, tokens: list[int] | None = None) -> None:
        """Give the blocks back; with ``tokens`` (the sequence's committed tokens) its full blocks
        are registered first, so a later turn that repeats them reuses their KV."""
        if self.released:
            return
        if tokens is not None:
            self.register(tokens)
        self.pool.close(self)
        self.released = True

    def nbytes(self) -> int:
        """Bytes of the pool this sequence holds (its blocks, shared ones included)."""
        per_row = self.pool.k.element_size() * self.pool.k.shape[0] * self.pool.k.shape[1] * self.pool.k.shape[3]
        return 2 * per_row * self.capacity


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of an HF config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K + V bytes one token takes in every layer of a model with this HF config."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def pool_for(model: torch.nn.Module, tokens: int, block_tokens: int = 16, prefix_caching: bool = True) -> BlockPool:
    """A pool of at least ``tokens`` rows shaped for ``model`` (an HF causal LM), on its device and dtype."""
    w = model.model.embed_tokens.weight
    blocks = -(-tokens // block_tokens)
    return BlockPool(*kv_shape(model.config), blocks, block_tokens, w.dtype, w.device, prefix_caching)
