"""``ServiceLibrary``: the core's CallLibrary over the retrieval service, keyed by request text the
way the Retrieval deployment keys it (the benchmark's ``--retrieval-key`` path)."""

from __future__ import annotations

import numpy as np

from retrieval_service.embedding import query_text
from retrieval_service.keys import TextKeyer
from retrieval_service.library import CachedKeyer, ServiceLibrary
from toolspec_core.drafters.toolcall.library import PastCall


def _tools(*names):
    return [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]


def _lib():
    return ServiceLibrary(CachedKeyer(TextKeyer("lexical", lexical_dim=256)))


def test_add_then_search_by_text_key():
    lib = _lib()
    weather = query_text(
        [{"role": "user", "content": "what is the weather in Paris"}], _tools("get_weather", "get_time")
    )
    time_q = query_text([{"role": "user", "content": "what time is it in Tokyo"}], _tools("get_weather", "get_time"))
    lib.add("t", PastCall("get_weather", [1, 2, 3], 'get_weather({"city": "Paris"})', {"city": "Paris"}), weather)
    lib.add("t", PastCall("get_time", [4, 5], 'get_time({"city": "Tokyo"})', {"city": "Tokyo"}), time_q)
    assert len(lib) == 2 and lib.svc.config.dim == 256

    q = query_text([{"role": "user", "content": "the weather in Paris please"}], _tools("get_weather", "get_time"))
    hits = lib.search("t", q, ["get_weather", "get_time"], k=2)
    assert [h["tool_name"] for h in hits] == ["get_weather", "get_time"]  # the closer text first
    assert hits[0]["token_ids"] == [1, 2, 3] and hits[0]["arguments"] == {"city": "Paris"}
    assert hits[0]["score"] > hits[1]["score"]
    assert [h["tool_name"] for h in lib.search("t", q, ["get_time"], k=5)] == ["get_time"]  # tool filter
    # the core's drafter takes the service's dicts as past calls
    from toolspec_core.drafters.toolcall.library import as_past_call

    past = as_past_call(hits[0])
    assert isinstance(past, PastCall) and past.tool_name == "get_weather" and past.token_ids == [1, 2, 3]
    assert lib.search("other", q, None, k=5) == []  # tenant scoped


def test_text_keys_are_cached_and_empty_text_finds_and_stores_nothing():
    keyer = CachedKeyer(TextKeyer("lexical", lexical_dim=64))
    lib = ServiceLibrary(keyer)
    lib.add("t", PastCall("f", [1], "f()", {}), "call f")
    lib.search("t", "call f", None, k=1)
    assert keyer.encoded == 1  # the add's key served the search
    np.testing.assert_array_equal(keyer.key("call f"), TextKeyer("lexical", lexical_dim=64).key("call f"))
    lib.add("t", PastCall("g", [2], "g()", {}), "  ")
    assert len(lib) == 1 and lib.search("t", "", None, k=3) == []
    lib.add("t", PastCall("h", [3], "h()", {}), "call f", remember=False)
    assert len(lib) == 1


def test_vector_keys_pass_through():
    lib = ServiceLibrary(CachedKeyer(TextKeyer("lexical", lexical_dim=8)))
    v = np.eye(8, dtype=np.float32)[2]
    lib.add("t", PastCall("f", [1], "f()", {}), v)
    assert lib.search("t", v, None, k=1)[0]["tool_name"] == "f"
