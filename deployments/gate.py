"""What the engine replicas count together: per-key rate limits and the request metrics.

Every replica serves HTTP itself, so a count kept in one replica would be a count per replica.
:class:`GateServer` holds the one :class:`~deployments.keys.KeyLimiter` and the one
:class:`~deployments.metrics.Metrics` registry of an app; in a Serve app it is the ``Gate``
deployment (one replica), reached through :class:`RemoteGate` -- one call to admit a request
of a key with limits, one fire-and-forget call when any request ends --, in a single process
(tests, :class:`~deployments.http.LocalBackend`) through :class:`LocalGate`. No Ray here: the
handle is whatever the app passes.

A request of a key without limits (an open server, or keys without ``*_per_minute`` /
``max_concurrent``) never waits on the gate: its end is reported after the response.
"""

from __future__ import annotations

import logging

from .keys import ApiKey, KeyLimiter
from .metrics import Metrics

log = logging.getLogger("toolspec.serve")


def summary(result) -> dict:
    """What the metrics read of a finished request's ``Done`` event (small: it crosses Ray)."""
    stats, extra = result.stats or {}, result.extra or {}
    keep = ("decode_s", "forwards", "mat", "label_drafted", "label_accepted")
    r = extra.get("retrieval") or {}
    return {
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "stats": {k: stats[k] for k in keep if k in stats},
        "extra": {
            "prefix_cached_tokens": extra.get("prefix_cached_tokens", 0),
            "retrieval": {"status": r["status"]} if r.get("status") else None,
        },
    }


class GateServer:
    """One app's limits and metrics. ``admit`` / ``release`` count a key's requests and tokens
    (:class:`KeyLimiter`); ``observe`` records ended requests; ``render`` is the /metrics body."""

    def __init__(self, cfg=None):
        self.limiter = KeyLimiter()
        self.metrics = Metrics()
        self.inflight: dict[str, int] = {}  # requests in flight per replica, as each last said

    def admit(self, key: ApiKey):
        return self.limiter.admit(key)

    def release(self, key: ApiKey, tokens: int = 0) -> None:
        self.limiter.done(key, tokens)

    def observe(self, replica: str, inflight: int, records: list[tuple]) -> None:
        """``records``: ("done", summary, stream, latency_s, ttft_s | None) | ("error", stream)."""
        self.inflight[replica] = inflight
        m = self.metrics
        for rec in records:
            if rec[0] == "done":
                _, result, stream, latency, ttft = rec
                m.observe_done(result, stream, latency)
                if ttft is not None:
                    m.ttft.observe(ttft)
            else:
                m.observe_error(rec[1])
        m.inflight.set(sum(self.inflight.values()))

    def render(self, replica: str, inflight: int, info: dict | None, records=()) -> tuple[bytes, str]:
        self.observe(replica, inflight, list(records))
        if info is not None:
            self.metrics.observe_engine(info)
        return self.metrics.render()


class LocalGate:
    """A :class:`GateServer` in this process, with the async interface the API uses."""

    def __init__(self, server: GateServer | None = None, replica: str = "local"):
        self.server, self.replica, self.inflight = server or GateServer(), replica, 0

    async def admit(self, key: ApiKey):
        return self.server.admit(key)

    def release(self, key: ApiKey, tokens: int = 0) -> None:
        self.server.release(key, tokens)

    def observe(self, record: tuple) -> None:
        self.server.observe(self.replica, self.inflight, [record])

    async def render(self, info: dict | None) -> tuple[bytes, str]:
        return self.server.render(self.replica, self.inflight, info)


class RemoteGate(LocalGate):
    """The ``Gate`` deployment through its Serve handle. A key's admission is one call it waits
    for; its release is one fire-and-forget call. Ended requests' metrics are sent in batches,
    at most every ``flush_s`` seconds and before /metrics renders (a handle call costs the gate
    more CPU than a request's whole record): their order does not matter, and an unreachable
    gate loses metrics, never a request."""

    def __init__(self, handle, replica: str, flush_s: float = 1.0):
        self.handle, self.replica, self.inflight, self.flush_s = handle, replica, 0, flush_s
        self._records: list[tuple] = []
        self._timer = None

    async def admit(self, key: ApiKey):
        return await self.handle.admit.remote(key)

    def release(self, key: ApiKey, tokens: int = 0) -> None:
        self._send(self.handle.release.remote(key, tokens))

    def observe(self, record: tuple) -> None:
        self._records.append(record)
        if self._timer is None:
            import asyncio

            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        records, self._records = self._records, []
        if records:
            self._send(self.handle.observe.remote(self.replica, self.inflight, records))

    async def render(self, info: dict | None) -> tuple[bytes, str]:
        records, self._records = self._records, []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return await self.handle.render.remote(self.replica, self.inflight, info, records)

    @staticmethod
    def _send(response) -> None:
        """A handle call is sent when it is made; nobody waits for its answer."""
        del response
