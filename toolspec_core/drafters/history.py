"""Per-tenant history of earlier outputs for suffix drafting, bounded in tokens and tenants.

A depth-limited suffix trie grows by up to ``depth`` nodes per token, so an unbounded history on a
long-running replica would grow without limit. Each tenant keeps its most recent documents; when
they pass ``max_tokens`` the trie is rebuilt from the newest half (rare: after every
``max_tokens / 2`` tokens of output, off the decode path). The least recently used tenant goes
when there are more than ``max_tenants``. A tenant's documents never reach another tenant's trie.

Thread-safe for a server's decode threads: writers hold a lock; readers (drafters, which only walk
and snapshot child dicts) need none, and a rebuilt trie replaces the old one whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from toolspec_core.drafters.suffix_trie import SuffixTrie


class TenantHistories:
    def __init__(self, depth: int = 32, max_tokens: int = 32768, max_tenants: int = 64):
        self.depth, self.max_tokens, self.max_tenants = depth, max_tokens, max_tenants
        self._tries: OrderedDict[str, SuffixTrie] = OrderedDict()
        self._docs: dict[str, deque[tuple[int, list[int]]]] = {}
        self._keys: dict[str, set[int]] = {}
        self._tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def trie(self, tenant: str) -> SuffixTrie:
        """The tenant's trie (an empty one for a tenant with no history)."""
        with self._lock:
            if tenant not in self._tries:
                return SuffixTrie(self.depth)
            self._tries.move_to_end(tenant)
            return self._tries[tenant]

    def add(self, tenant: str, output_ids, lead=(), dedupe: bool = True) -> bool:
        """Remember an output (``lead``: the tail of its prompt, so a match can start at the
        assistant header) unless ``dedupe`` and the same output is already there (a past call
        retrieved from the library that this replica wrote itself). True if added."""
        if not output_ids:
            return False
        key = hash(tuple(output_ids))
        with self._lock:
            keys = self._keys.setdefault(tenant, set())
            if dedupe and key in keys:
                return False
            if tenant not in self._tries:
                self._tries[tenant] = SuffixTrie(self.depth)
                self._docs[tenant], self._tokens[tenant] = deque(), 0
                while len(self._tries) > self.max_tenants:
                    self._drop(next(iter(self._tries)))
            doc = list(lead) + list(output_ids)
            keys.add(key)
            self._docs[tenant].append((key, doc))
            self._tokens[tenant] += len(doc)
            self._tries[tenant].add_document(doc)
            self._tries.move_to_end(tenant)
            if self._tokens[tenant] > self.max_tokens:
                self._shrink(tenant)
            return True

    def tokens(self, tenant: str) -> int:
        return self._tokens.get(tenant, 0)

    def forget(self, tenant: str) -> int:
        """Drop the history of ``tenant`` and its users (``tenant/...``); how many outputs it held."""
        with self._lock:
            gone = [t for t in self._tries if t == tenant or t.startswith(tenant + "/")]
            n = sum(len(self._docs.get(t, ())) for t in gone)
            for t in gone:
                self._drop(t)
            return n

    def _shrink(self, tenant: str) -> None:
        docs = self._docs[tenant]
        while docs and self._tokens[tenant] > self.max_tokens // 2:
            key, doc = docs.popleft()
            self._keys[tenant].discard(key)
            self._tokens[tenant] -= len(doc)
        trie = SuffixTrie(self.depth)
        for _, doc in docs:
            trie.add_document(doc)
        self._tries[tenant] = trie

    def _drop(self, tenant: str) -> None:
        for d in (self._tries, self._docs, self._keys, self._tokens):
            d.pop(tenant, None)
