"""Prometheus metrics of the API, recorded by the ingress from each finished request's stats.

One registry per app instance (not the global one), so several apps in one process (tests)
never collide.
"""

from __future__ import annotations


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("toolspec_requests", "Chat completion requests", ["status", "stream"], registry=r)
        self.latency = Histogram(
            "toolspec_request_latency_seconds",
            "End-to-end latency of a chat completion",
            registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.ttft = Histogram(
            "toolspec_time_to_first_token_seconds",
            "Time to the first streamed delta",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
        )
        self.tokens_per_s = Histogram(
            "toolspec_tokens_per_second",
            "Completion tokens per second of decode time, per request",
            registry=r,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
        )
        self.prompt_tokens = Counter("toolspec_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("toolspec_completion_tokens", "Completion tokens", registry=r)
        self.prefix_cached = Counter(
            "toolspec_prefix_cached_tokens", "Prompt tokens served from the prefix KV cache", registry=r
        )
        self.mat = Histogram(
            "toolspec_mean_accepted_tokens",
            "Mean tokens per decode forward (MAT), per request",
            registry=r,
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16),
        )
        self.drafted = Counter("toolspec_draft_tokens", "Drafted tokens by drafting state", ["state"], registry=r)
        self.accepted = Counter(
            "toolspec_accepted_tokens", "Accepted draft tokens by drafting state", ["state"], registry=r
        )
        self.acceptance = Gauge(
            "toolspec_acceptance_rate", "Accepted / drafted tokens so far, by state", ["state"], registry=r
        )
        self.retrieval = Counter("toolspec_retrieval_requests", "Library searches by outcome", ["status"], registry=r)
        self.fallbacks = Counter(
            "toolspec_retrieval_fallbacks", "Requests served without the library (slow or down)", registry=r
        )
        self.inflight = Gauge("toolspec_requests_in_flight", "Requests in flight at this ingress", registry=r)
        # the engine of a replica, read from its info() when /metrics is scraped (label: replica)

        def g(name: str, doc: str, *labels: str):
            return Gauge(name, doc, ["replica", *labels], registry=r)

        self.running = g("toolspec_engine_running_sequences", "Sequences in the replica's running batch")
        self.waiting = g("toolspec_engine_waiting_sequences", "Sequences waiting for admission (batch or KV full)")
        self.step_rows = g("toolspec_engine_step_rows", "Rows per engine forward, mean of the last 64 steps")
        self.step_seqs = g("toolspec_engine_step_sequences", "Sequences per engine step, mean of the last 64 steps")
        self.step_s = g("toolspec_engine_step_seconds", "Seconds per engine step, mean of the last 64 steps")
        self.gc_collections = g("toolspec_gc_collections", "Garbage collections of the replica process", "generation")
        self.gc_seconds = g("toolspec_gc_seconds", "Seconds the replica process spent in collections", "generation")
        self.gc_longest = g("toolspec_gc_longest_seconds", "The replica process's longest collection", "generation")
        self.kv_usage = g("toolspec_kv_pool_usage", "Fraction of KV blocks referenced by running sequences")
        self.kv_blocks = g("toolspec_kv_pool_blocks", "KV blocks by state", "state")
        self.prefix_hit = g("toolspec_prefix_cache_hit_rate", "Prompt tokens found in the KV prefix cache / looked up")
        self.tool_set_hit = g("toolspec_tool_sets_hit_rate", "Tool-set lookups that found the set compiled / lookups")
        self.tool_set_entries = g("toolspec_tool_sets_entries", "Compiled tool sets kept")
        self.tool_set_bytes = g("toolspec_tool_sets_bytes", "Estimated bytes of the compiled tool sets kept (bounded)")
        self.token_table_hit = g(
            "toolspec_tool_sets_token_hit_rate", "Schema candidates' tokens found in the kept sets' token tables"
        )
        self.startup_s = g(
            "toolspec_replica_startup_seconds", "Seconds the replica took to start (weights, KV pool, CUDA graphs)"
        )
        self._totals: dict[str, list[float]] = {}

    def observe_error(self, stream: bool) -> None:
        self.requests.labels("error", str(stream).lower()).inc()

    def observe_done(self, result: dict, stream: bool, latency_s: float) -> None:
        status = "cancelled" if result.get("finish_reason") == "cancelled" else "ok"
        self.requests.labels(status, str(stream).lower()).inc()
        self.latency.observe(latency_s)
        self.prompt_tokens.inc(result.get("prompt_tokens", 0))
        self.completion_tokens.inc(result.get("completion_tokens", 0))
        stats, extra = result.get("stats", {}), result.get("extra", {})
        decode_s = stats.get("decode_s", 0.0)
        if decode_s > 0:
            self.tokens_per_s.observe(result.get("completion_tokens", 0) / decode_s)
        if stats.get("forwards"):
            self.mat.observe(stats.get("mat", 1.0))
        self.prefix_cached.inc(extra.get("prefix_cached_tokens", 0))
        accepted = stats.get("label_accepted", {})
        for state, n in stats.get("label_drafted", {}).items():
            a = accepted.get(state, 0)
            self.drafted.labels(state).inc(n)
            self.accepted.labels(state).inc(a)
            tot = self._totals.setdefault(state, [0.0, 0.0])
            tot[0] += n
            tot[1] += a
            self.acceptance.labels(state).set(tot[1] / tot[0] if tot[0] else 0.0)
        r = extra.get("retrieval") or {}
        if r.get("status"):
            self.retrieval.labels(r["status"]).inc()
            if r["status"] == "fallback":
                self.fallbacks.inc()

    def observe_engine(self, info: dict) -> None:
        """Set the engine gauges from one replica's ``info()`` (a scrape reaches one replica; each
        keeps its own labelled series)."""
        eng = info.get("engine") or {}
        rep = str(info.get("replica", "0"))
        startup = (info.get("startup") or {}).get("total_s")
        if startup is not None:
            self.startup_s.labels(rep).set(startup)
        sets = info.get("tool_sets")
        if sets:
            self.tool_set_hit.labels(rep).set(sets["hit_rate"])
            self.tool_set_entries.labels(rep).set(sets["entries"])
            self.tool_set_bytes.labels(rep).set(sets["bytes"])
            self.token_table_hit.labels(rep).set(sets["token_hit_rate"])
        if eng.get("mode") != "batched":
            return
        self.running.labels(rep).set(eng.get("running", 0))
        self.waiting.labels(rep).set(eng.get("waiting", 0))
        self.step_rows.labels(rep).set(eng.get("step_rows", 0.0))
        self.step_seqs.labels(rep).set(eng.get("step_sequences", 0.0))
        self.step_s.labels(rep).set(eng.get("step_s", 0.0))
        collected = eng.get("gc")
        if collected:
            for g in range(3):
                self.gc_collections.labels(rep, str(g)).set(collected["collections"][g])
                self.gc_seconds.labels(rep, str(g)).set(collected["seconds"][g])
                self.gc_longest.labels(rep, str(g)).set(collected["longest_ms"][g] / 1e3)
        pool = eng.get("kv_pool")
        if pool:
            self.kv_usage.labels(rep).set(pool["usage"])
            for state in ("used", "cached", "free"):
                self.kv_blocks.labels(rep, state).set(pool[f"{state}_blocks"])
            self.prefix_hit.labels(rep).set(pool["prefix_hit_rate"])

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
