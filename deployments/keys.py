"""API keys: who is calling (their library tenant, whether they may administer libraries) and the
limits of their key.

Keys come from ``api_keys_file`` (a JSON list, e.g. a Kubernetes Secret mounted as a file), each
``{"sha256": <hex of the key> | "key": <the key>, "tenant": str, "admin": bool,
"requests_per_minute": int, "tokens_per_minute": int, "max_concurrent": int}`` -- only hashes are
kept in memory -- or, as a one-tenant shorthand, the single ``api_key`` (tenant "default", admin).
Without keys the server is open: one local tenant, "default".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    admin: bool = False
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    id: str = ""  # the key's sha256: what limits are counted by

    @property
    def limited(self) -> bool:
        """Whether the key has any limit (only then is it counted)."""
        return not (self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent is None)

    def library_tenant(self, user: str | None) -> str:
        """The tenant a request's calls are stored under: the key's, narrowed by ``user``."""
        return f"{self.tenant}/{user}" if user else self.tenant


OPEN = ApiKey(DEFAULT_TENANT, admin=True, id="open")  # every caller of a server without keys


def key_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _positive(entry: dict, name: str) -> int | None:
    v = entry.get(name)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"api key entry: {name} must be a positive integer, got {v!r}")
    return v


class KeyRing:
    """Keys by their sha256; ``lookup`` of a presented token."""

    def __init__(self, keys: dict[str, ApiKey]):
        self.keys = keys

    @classmethod
    def from_entries(cls, entries: list[dict]) -> "KeyRing":
        keys: dict[str, ApiKey] = {}
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("tenant"), str) or not e["tenant"]:
                raise ValueError(f"api key entry {i}: needs a non-empty 'tenant'")
            if "/" in e["tenant"]:
                raise ValueError(f"api key entry {i}: a tenant name cannot hold '/' (it separates users)")
            digest = e.get("sha256") or (key_hash(e["key"]) if isinstance(e.get("key"), str) and e["key"] else None)
            if not isinstance(digest, str) or len(digest) != 64:
                raise ValueError(f"api key entry {i}: needs 'sha256' (64 hex digits) or a non-empty 'key'")
            digest = digest.lower()
            keys[digest] = ApiKey(
                e["tenant"],
                bool(e.get("admin", False)),
                _positive(e, "requests_per_minute"),
                _positive(e, "tokens_per_minute"),
                _positive(e, "max_concurrent"),
                digest,
            )
        return cls(keys)

    @classmethod
    def load(cls, path: str | None, single_key: str | None) -> "KeyRing | None":
        """The keys of ``path`` plus ``single_key``; None when there are none (an open server)."""
        entries: list[dict] = []
        if path:
            data = json.loads(Path(path).read_text())
            entries += data["keys"] if isinstance(data, dict) else data
        if single_key:
            entries.append({"key": single_key, "tenant": DEFAULT_TENANT, "admin": True})
        return cls.from_entries(entries) if entries else None

    def lookup(self, token: str) -> ApiKey | None:
        return self.keys.get(key_hash(token)) if token else None


class KeyLimiter:
    """Per key: requests and tokens in the last minute (sliding windows), requests in flight.
    One per app, in the ``Gate`` deployment (:mod:`deployments.gate`): every replica counts here."""

    WINDOW_S = 60.0

    def __init__(self):
        self._requests: dict[str, deque] = defaultdict(deque)  # (time,) per admitted request
        self._tokens: dict[str, deque] = defaultdict(deque)  # (time, tokens) per finished request
        self._open: Counter = Counter()

    def _trim(self, key: ApiKey, now: float) -> None:
        for q in (self._requests[key.id], self._tokens[key.id]):
            while q and now - q[0][0] >= self.WINDOW_S:
                q.popleft()

    def admit(self, key: ApiKey, now: float | None = None) -> tuple[str, float] | None:
        """None: admitted (call ``done`` when it ends); else (which limit, seconds until a retry can pass)."""
        now = time.monotonic() if now is None else now
        self._trim(key, now)
        reqs, toks = self._requests[key.id], self._tokens[key.id]
        if key.max_concurrent is not None and self._open[key.id] >= key.max_concurrent:
            return "max_concurrent", 1.0
        if key.requests_per_minute is not None and len(reqs) >= key.requests_per_minute:
            return "requests_per_minute", self.WINDOW_S - (now - reqs[0][0])
        if key.tokens_per_minute is not None and sum(n for _, n in toks) >= key.tokens_per_minute:
            return "tokens_per_minute", self.WINDOW_S - (now - toks[0][0])
        reqs.append((now,))
        self._open[key.id] += 1
        return None

    def done(self, key: ApiKey, tokens: int = 0, now: float | None = None) -> None:
        self._open[key.id] = max(0, self._open[key.id] - 1)
        if tokens:
            self._tokens[key.id].append((time.monotonic() if now is None else now, int(tokens)))
