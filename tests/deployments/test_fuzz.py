"""Property-based fuzzing of the HTTP API: generated requests -- well-formed, malformed and hostile
mixed -- never get a 5xx, never hang, and the replica serves a normal request afterwards."""

from __future__ import annotations

import asyncio
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deployments.config import ServeAppConfig  # noqa: E402
from deployments.engine_host import EngineHost  # noqa: E402

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=40)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=24,
)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SCHEMAS = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.integers(0, 80).map(_nested),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "$ref", "anyOf", "enum"]), JSON, max_size=4),
    JSON,
)
CONTENT = st.one_of(st.text(max_size=200), st.lists(st.dictionaries(st.sampled_from(["type", "text"]), JSON)), JSON)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"])},
    optional={
        "content": CONTENT,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "function": st.fixed_dictionaries(
                        {"name": st.text(max_size=20), "arguments": st.one_of(st.text(max_size=40), JSON)}
                    )
                },
                optional={"id": st.text(max_size=10), "type": st.just("function")},
            ),
            max_size=2,
        ),
        "tool_call_id": st.text(max_size=10),
        "name": JSON,
    },
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "retrieval"]),
        "function": st.fixed_dictionaries(
            {"name": st.one_of(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True), st.text(max_size=70))},
            optional={"description": st.text(max_size=40), "parameters": SCHEMAS, "strict": st.booleans()},
        ),
    }
)
BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), JSON)},
    optional={
        "tools": st.one_of(st.lists(TOOL, max_size=3), JSON),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", "sometimes"]),
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=12)})}
            ),
            JSON,
        ),
        "max_tokens": st.one_of(st.integers(-5, 5000), JSON),
        "temperature": st.one_of(st.floats(-1, 3), JSON),
        "top_p": st.one_of(st.floats(-1, 2), JSON),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), JSON),
        "stream": st.booleans(),
        "logprobs": st.one_of(st.booleans(), JSON),
        "top_logprobs": st.one_of(st.integers(-3, 30), JSON),
        "parallel_tool_calls": st.one_of(st.booleans(), JSON),
        "response_format": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": st.text(max_size=10), "schema": SCHEMAS}),
                }
            ),
            JSON,
        ),
        "user": st.one_of(st.text(max_size=10), JSON),
        "seed": st.one_of(st.integers(), JSON),
        "n": st.integers(-1, 3),
        "unknown_field": JSON,
    },
)


# bodies nested from a little to far beyond the JSON parser's stack (raw bytes: json.dumps would overflow too)
DEEP = st.integers(1, 100_000).map(
    lambda n: b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": ' + b"[" * n + b"]" * n + b"}}"
)


@pytest.fixture(scope="module")
def fuzz_app(tiny_model_dir):
    from deployments.http import LocalBackend, make_api

    cfg = ServeAppConfig(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="reference",
        max_tokens_default=8,
        max_tokens_limit=16,
        retrieval={"enabled": False},
    )
    host = EngineHost.build(cfg)
    yield make_api(LocalBackend(host), cfg)
    host.close()


async def _send(app, body, raw: bytes | None = None):
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
        r = await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        await r.aread()
        return r


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=BODY, junk=st.one_of(st.none(), st.binary(max_size=64), DEEP))
def test_generated_requests_never_get_a_5xx_or_hang(fuzz_app, body, junk):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep each decode short; the range stays tested below 1
    r = asyncio.run(asyncio.wait_for(_send(fuzz_app, body, junk), 60))
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    assert "server_error" not in r.text, (r.text[:300], body)  # nor a failure inside a stream
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err


def test_the_replica_serves_normally_after_the_fuzzing(fuzz_app):
    r = asyncio.run(_send(fuzz_app, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
