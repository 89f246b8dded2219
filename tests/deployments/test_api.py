"""The HTTP API without Ray: wire-format validation, streaming reassembly, and the real FastAPI app
over an in-process engine (tiny random Qwen2), called with the official openai client via ASGI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest
from serve_fixtures import TOOLS, WEATHER_MESSAGES, chat_request

from deployments.config import ServeAppConfig
from deployments.engine_host import EngineHost
from deployments.events import Done, Start, Text
from deployments.protocol import APIError, chat_completion, parse_request
from deployments.streaming import StreamShaper, TextStreamer
from retrieval_service.embedding import query_text

MSG = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------- protocol


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MSG, "temperature": "0"}, "temperature"),
        ({"messages": MSG, "temperature": 5}, "temperature"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 10**6}, "max_tokens"),
        ({"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": MSG, "stream": "yes"}, "stream"),
        ({"messages": MSG, "bogus_field": 1}, "bogus_field"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": MSG, "n": 2}, "n"),
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {
                "messages": MSG,
                "tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}],
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": MSG,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}},
                        },
                    }
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": MSG,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {"type": "object", "properties": {}, "required": ["x"]},
                        },
                    }
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
        ({"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": MSG, "toolspec": {"remember": "no"}}, "toolspec.remember"),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MSG, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "messages": MSG,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            },
            "response_format.json_schema.schema",
        ),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_requests_are_openai_errors(body, param):
    with pytest.raises(APIError) as err:
        parse_request(body, "m", 4096)
    e = err.value
    assert 400 <= e.status < 500
    assert e.body()["error"]["type"] == "invalid_request_error"
    assert e.param == param


def test_a_200_deep_schema_is_a_400_not_a_recursion():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    for body, param in (
        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}, "tools"),
        (
            {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}},
            "response_format",
        ),
    ):
        with pytest.raises(APIError) as err:
            parse_request(body, "m", 100)
        assert err.value.status == 400 and err.value.code == "schema_too_large" and err.value.param.startswith(param)


def test_request_limits_are_4xx_naming_the_limit(local, monkeypatch):
    """limits.*: body bytes (413, refused before the engine), messages, tools, stop strings, prompt
    tokens -- each a 4xx whose message names the limit, and the server serves on."""
    import httpx

    from deployments.config import RequestLimits
    from deployments.http import LocalBackend, make_api

    host, _, cfg, _ = local
    tight = cfg.model_copy(
        update={"limits": RequestLimits(body_bytes=2048, messages=3, tools=1, stop=2, prompt_tokens=40)}
    )
    from deployments.engine_host import serving_limits

    app = make_api(LocalBackend(host), tight)
    monkeypatch.setattr(host, "cfg", tight)
    monkeypatch.setattr(
        host,
        "policy",
        dataclasses.replace(host.policy, limits=serving_limits(tight, host.target, host.engine.scheduler)),
    )

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        post = lambda body: http.post("/v1/chat/completions", json={"max_tokens": 4, **body})  # noqa: E731
        return [
            await post({"messages": [{"role": "user", "content": "x" * 4000}]}),
            await post({"messages": MSG * 4}),
            await post({"messages": MSG, "tools": TOOLS}),
            await post({"messages": MSG, "stop": ["a", "b", "c"]}),
            await post({"messages": [{"role": "user", "content": "word " * 60}]}),
            await post({"messages": MSG}),
        ]

    big, msgs, tools, stop, prompt, ok = run(go())
    assert big.status_code == 413 and "limits.body_bytes" in big.json()["error"]["message"]
    assert msgs.status_code == 400 and msgs.json()["error"]["code"] == "too_many_messages"
    assert tools.status_code == 400 and "limits.tools" in tools.json()["error"]["message"]
    assert stop.status_code == 400 and "limits.stop" in stop.json()["error"]["message"]
    assert prompt.status_code == 400 and "limits.prompt_tokens" in prompt.json()["error"]["message"]
    assert ok.status_code == 200


def test_every_token_limit_is_the_same_400_over_http(local, monkeypatch):
    """Each token limit a request can break over HTTP answers the 400 JSON the limit function
    (toolspec_core.engine.limits) gives for the same numbers, streamed or not: the output length
    asked (range, both fields), the prompt's limit, the context window, the KV pool. And a request
    inside every limit is served with the length the function resolves."""
    import httpx

    from deployments.config import RequestLimits
    from deployments.engine_host import request_error
    from deployments.http import LocalBackend, make_api
    from toolspec_core.engine.limits import TokenLimits, requested_tokens, token_budget
    from toolspec_core.errors import InvalidRequestError
    from toolspec_core.model.prompting import render_prompt

    host, _, cfg, _ = local
    tight = cfg.model_copy(update={"max_tokens_limit": 900, "limits": RequestLimits(prompt_tokens=300)})
    window = host.target.max_context
    # a pool smaller than the window, so the window and the pool refuse different requests
    pool = window // 4
    limits = TokenLimits(window, pool, 64, tight.max_tokens_limit, tight.max_tokens_default, 300)
    monkeypatch.setattr(host, "cfg", tight)
    monkeypatch.setattr(host, "policy", dataclasses.replace(host.policy, limits=limits))
    app = make_api(LocalBackend(host), tight)
    short = MSG
    long = [{"role": "user", "content": "word " * 250}]
    n_short, n_long = (len(render_prompt(host.target.tokenizer, m)) for m in (short, long))
    assert n_short < n_long <= 300 and n_long + 64 < pool and pool - n_short - 64 < 900  # the cases mean what they say
    cases = [  # (body, the limit function's answer for the same numbers)
        ({"messages": short, "max_tokens": 0}, lambda: requested_tokens(0, None, 900)),
        ({"messages": short, "max_tokens": 901}, lambda: requested_tokens(901, None, 900)),
        ({"messages": short, "max_completion_tokens": -2}, lambda: requested_tokens(None, -2, 900)),
        ({"messages": short, "max_tokens": 3, "max_completion_tokens": 4}, lambda: requested_tokens(3, 4, 900)),
        (
            {"messages": long * 2},
            lambda: token_budget(len(render_prompt(host.target.tokenizer, long * 2)), None, limits),
        ),
        ({"messages": short, "max_tokens": 900}, lambda: token_budget(n_short, 900, limits)),  # the pool
        (
            {"messages": long, "max_tokens": pool - n_long - 63},
            lambda: token_budget(n_long, pool - n_long - 63, limits),
        ),
    ]
    wide = TokenLimits(window, None, 0, 10**6, 20, None)  # no pool: the window refuses
    wide_cases = [
        ({"messages": short, "max_tokens": window}, lambda: token_budget(n_short, window, wide)),
        (
            {"messages": long, "max_tokens": window - n_long + 1},
            lambda: token_budget(n_long, window - n_long + 1, wide),
        ),
    ]

    def want(call):
        with pytest.raises(InvalidRequestError) as err:
            call()
        return request_error(err.value).body()

    async def go(rows):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        return [
            [await http.post("/v1/chat/completions", json={**b, "stream": st}) for st in (False, True)] for b, _ in rows
        ]

    seen = run(go(cases))
    monkeypatch.setattr(host, "policy", dataclasses.replace(host.policy, limits=wide))
    app = make_api(LocalBackend(host), tight.model_copy(update={"max_tokens_limit": 10**6}))
    seen += run(go(wide_cases))
    codes = []
    for (body, call), answers in zip(cases + wide_cases, seen):
        for r in answers:
            assert r.status_code == 400 and r.json() == want(call), (body.keys(), r.text)
        codes.append(answers[0].json()["error"]["code"])
    assert codes == ["invalid_value"] * 5 + ["context_length_exceeded"] * 4

    async def ok():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        return await http.post("/v1/chat/completions", json={"messages": short, "max_tokens": 5, "temperature": 0})

    r = run(ok())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= token_budget(n_short, 5, wide)


def test_a_body_nested_beyond_the_parser_is_a_400(local):
    """100,000 nested arrays (200 kB) would overflow the JSON parser's stack: a 400, not a 500."""
    import httpx

    _, app, _, _ = local

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        deep = b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
        nested: object = 1
        for _ in range(70):
            nested = [nested]
        mid = {"messages": MSG, "metadata": {"a": nested}}
        return (
            await http.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"}),
            await http.post("/v1/chat/completions", json=mid),
        )

    deep, mid = run(go())
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "json_too_deep"
    assert mid.status_code == 400 and "limits.json_depth" in mid.json()["error"]["message"]


def test_wrong_model_is_404_and_body_must_be_object():
    with pytest.raises(APIError) as err:
        parse_request({"model": "gpt-4", "messages": MSG}, "m", 10)
    assert err.value.status == 404 and err.value.code == "model_not_found"
    with pytest.raises(APIError):
        parse_request([1, 2], "m", 10)


def test_a_schema_is_checked_once_and_answers_the_same(monkeypatch):
    """A tool schema's metaschema check is kept per schema (an agent sends the same tools every
    request): the same schema is checked once and answers as the check itself does, valid or not;
    a schema differing anywhere is checked on its own; the kept checks are bounded."""
    import collections

    from jsonschema import Draft202012Validator

    from deployments import protocol

    monkeypatch.setattr(protocol, "_SCHEMA_CHECKS", collections.OrderedDict())
    monkeypatch.setattr(protocol, "SCHEMA_CHECKS_KEPT", 3)
    checked = []
    real = Draft202012Validator.check_schema.__func__

    def counting(cls, schema, *a, **kw):
        checked.append(schema)
        return real(cls, schema, *a, **kw)

    monkeypatch.setattr(Draft202012Validator, "check_schema", classmethod(counting))

    def tool(params):
        return {"type": "function", "function": {"name": "f", "parameters": params}}

    # schemas with a pattern: the fast walk leaves them to the metaschema check, whose answers are kept
    good = {
        "type": "object",
        "properties": {"x": {"type": "string", "pattern": "^a"}, "n": {"type": "integer", "minimum": 1}},
    }
    bad = {"type": "object", "properties": {"x": {"type": "nope", "pattern": "^a"}}}
    answers = []
    for schema in (good, bad, good, bad, json.loads(json.dumps(good))):
        try:
            parse_request({"messages": MSG, "tools": [tool(schema)]}, "m", 10)
            answers.append(None)
        except APIError as exc:
            answers.append((exc.code, exc.param, exc.message))
    assert len(checked) == 2  # one check per distinct schema
    assert answers[0] is None and answers[2] is None and answers[4] is None
    assert answers[1] == answers[3] and answers[1][0] == "invalid_function_parameters" and "nope" in answers[1][2]
    near = {**good, "properties": {**good["properties"], "n": {"type": "integer", "minimum": 1.0}}}
    assert protocol.schema_problem(near) is None and len(checked) == 3  # 1 and 1.0 are different schemas
    assert protocol.schema_problem({"type": "object", "minimum": "1"}) is not None  # a fourth: the oldest goes
    assert len(protocol._SCHEMA_CHECKS) == 3
    assert protocol.schema_problem({"type": "object", "properties": {"x": {"type": "string"}}}) is None
    assert len(checked) == 4  # taken by the fast walk: not checked, not kept
    for schema in (good, bad, near, {"type": "object", "minimum": "1"}):  # the kept answers are the check's own
        assert protocol.schema_problem(schema) == protocol._schema_problem(schema)


def test_the_metaschema_keywords_are_every_one_the_metaschema_describes():
    """plainly_valid lets a keyword outside METASCHEMA_KEYWORDS hold anything: the list must be the
    draft 2020-12 metaschema's own (every vocabulary's properties)."""
    from jsonschema import Draft202012Validator
    from jsonschema_specifications import REGISTRY

    from deployments.protocol import METASCHEMA_KEYWORDS

    meta = Draft202012Validator.META_SCHEMA
    keys = set(meta["properties"])
    for ref in meta["allOf"]:
        keys |= set(REGISTRY.contents("https://json-schema.org/draft/2020-12/" + ref["$ref"])["properties"])
    assert keys == METASCHEMA_KEYWORDS


def _mutations(schema, rng, n: int):
    """``n`` copies of ``schema`` with one value somewhere replaced by a value of another kind."""
    import copy

    odd = ["x", 3, -1, 2.5, 0, True, None, [], ["a", "a"], {}, {"type": 7}, [{"type": "nope"}], "string", ["string"]]
    out = []
    for _ in range(n):
        s = copy.deepcopy(schema)
        node, path = s, []
        while isinstance(node, dict) and node and rng.random() < 0.7:
            key = rng.choice(list(node))
            if not isinstance(node[key], (dict, list)) or rng.random() < 0.4:
                break
            path.append(key)
            node = node[key] if isinstance(node[key], dict) else {}
        if isinstance(node, dict):
            key = rng.choice(list(node) + ["type", "required", "items", "minLength", "enum", "anyOf", "pattern"])
            node[key] = copy.deepcopy(rng.choice(odd))
        out.append(s)
    return out


def test_a_plainly_valid_schema_is_valid_by_the_metaschema():
    """The fast walk never accepts what the metaschema check refuses: every dev-set tool schema and
    thousands of mutations of them (a value of another kind somewhere); and it takes the common
    schemas itself (most dev-set tools never reach jsonschema)."""
    import random

    from benchmarks.loadtest.workloads import load_items
    from deployments.protocol import _schema_problem, plainly_valid

    here = Path(__file__).resolve().parents[2] / "benchmarks" / "datasets"
    items = [it for b in ("api_bank", "bfcl_v3", "toolalpaca") for it in load_items(f"{here}/{b}.dev.jsonl.gz")]
    schemas = list(
        {
            json.dumps(t["function"].get("parameters") or {}): t["function"].get("parameters") or {}
            for it in items
            for t in it["tools"]
        }.values()
    )
    rng = random.Random(0)
    plain = [s for s in schemas if plainly_valid(s)]
    assert len(plain) >= 0.8 * len(schemas)
    for s in plain:
        assert _schema_problem(s) is None, s
    taken = refused = 0
    for s in rng.sample(schemas, min(400, len(schemas))):
        for m in _mutations(s, rng, 8):
            if plainly_valid(m):
                taken += 1
                assert _schema_problem(m) is None, m
            else:
                refused += _schema_problem(m) is not None
    assert taken > 100 and refused > 100  # both sides were exercised
    for bad in ({"type": "nope"}, {"required": ["a", "a"]}, {"minLength": -1}, {"items": [{}]}, {"anyOf": []}):
        assert not plainly_valid(bad) and _schema_problem(bad) is not None, bad
    assert plainly_valid({"type": "object", "nullable": True, "x-anything": {"type": 5}})  # unknown keywords: any value


CALL = '{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
LAYOUTS = {
    "hermes": f"<tool_call>\n{CALL}\n</tool_call>",
    "hermes_two": f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
    + '{"name": "send_email", "arguments": {"to": "a@b.c", "subject": "hi"}}'
    + "\n</tool_call>",
    "fence": '```json\n{\n  "name": "get_current_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    "bare": CALL,
    "list": "[" + CALL + ", " + CALL + "]",
    "text_with_braces": "Use a dict like {a: 1} or [x] here, not a call.",
    "plain": "The weather in Paris is sunny.   ",
    "unclosed": '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Par',
    "unclosed_name": '<tool_call>\n{"name": "get_curr',
    "llama": '{"name": "get_current_weather", "parameters": {"city": "Paris", "days": [1, 2]}}',
    "llama_tag": '<|python_tag|>{"name": "get_current_weather", "parameters": {"city": "Paris", "days": [1, 2]}}',
    "string_args": '{"name": "get_current_weather", "arguments": "{\\"city\\": \\"Par\\u00eds\\"}"}',
    "name_last": '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_current_weather"}\n</tool_call>',
    "json_answer": 'Here: {"temperature": 21, "unit": "celsius"}',
}
# the layouts holding a call whose arguments are long enough to see streamed in pieces
STREAMED = ["hermes", "hermes_two", "fence", "bare", "list", "llama", "llama_tag", "string_args", "unclosed"]


def reassemble(chunks: list[dict]) -> dict:
    """What an OpenAI client builds from a stream: content, tool calls by index, finish reason."""
    content, calls, finish, role = "", {}, None, None
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            role = d.get("role", role)
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            finish = c.get("finish_reason") or finish
    return {"role": role, "content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def non_stream_view(text: str, parse: bool, reason: str = "stop") -> dict:
    resp = chat_completion(Done(text, reason, 1, 1), parse, "m")
    msg = resp["choices"][0]["message"]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg.get("tool_calls", [])
    ]
    return {"content": msg["content"] or "", "calls": calls, "finish": resp["choices"][0]["finish_reason"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_deltas_reassemble_to_the_non_streaming_message(layout, step):
    text = LAYOUTS[layout]
    for parse in (True, False):
        sh = StreamShaper("m", parse, include_usage=True)
        chunks = [sh.start()]
        for i in range(0, len(text), step):
            chunks += list(sh.feed(text[i : i + step]))
        chunks += list(sh.finish(Done(text, "stop", 1, 2)))
        got = reassemble(chunks)
        want = non_stream_view(text, parse)
        assert not sh.mismatch
        assert got["role"] == "assistant" and got["finish"] == want["finish"]
        assert got["content"] == want["content"]
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (c["name"], c["arguments"]) for c in want["calls"]
        ]
        assert all(c["id"].startswith("call_") for c in got["calls"])
        assert chunks[-1]["usage"]["total_tokens"] == 3 and chunks[-1]["choices"] == []


@pytest.mark.parametrize("layout", STREAMED)
def test_calls_stream_their_name_then_arguments_while_they_are_written(layout):
    """Fed a character at a time, the first call's name is sent before its arguments end, and
    its arguments arrive in several fragments, each sent before the call's text is complete."""
    text = LAYOUTS[layout]
    sh = StreamShaper("m", True)
    seen = []  # (characters fed, the first call's arguments so far) after each feed
    chunks = []
    for i in range(len(text)):
        chunks += list(sh.feed(text[i]))
        calls = reassemble(chunks)["calls"]
        if calls:
            seen.append((i + 1, calls[0]["arguments"]))
    whole = non_stream_view(text, True)["calls"][0]
    assert seen and seen[0][0] < len(text) - len(whole["arguments"]) // 2
    assert reassemble(chunks)["calls"][0]["name"] == whole["name"]
    partial = {a for n, a in seen if 0 < len(a) < len(whole["arguments"])}
    assert len(partial) >= 3 and all(whole["arguments"].startswith(a) for a in partial)
    assert not sh.mismatch


def test_a_cut_off_call_reports_the_arguments_written_so_far():
    resp = chat_completion(Done(LAYOUTS["unclosed"], "length", 1, 1), True, "m")
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_current_weather", '{"city": "Par')
    ]


def test_hermes_calls_stream_before_generation_ends():
    sh = StreamShaper("m", True)
    out = list(sh.feed(LAYOUTS["hermes_two"][: LAYOUTS["hermes_two"].index("</tool_call>") + 12]))
    assert any("tool_calls" in c["choices"][0]["delta"] for c in out)
    assert reassemble(out)["content"] == "Let me check."


def test_text_streamer_ends_after_an_end_after_string():
    s = TextStreamer([], ("</tool_call>",))
    sent = s.feed("a <tool_call>{}</tool") + s.feed("a <tool_call>{}</tool_call>\nmore")
    assert sent == "a <tool_call>{}</tool_call>" and s.finish("a <tool_call>{}</tool_call>") == ""


class _CharTok:
    """Byte-level toy tokenizer: multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _stream(text_ids, stop, chunk=1, eos=(999,)):
    """Deltas a TextStreamer sends for ``text_ids`` fed ``chunk`` at a time through a Detokenizer."""
    from toolspec_core.engine.detokenize import Detokenizer

    d, s, deltas = Detokenizer(_CharTok(), eos), TextStreamer(stop), []
    for k in range(0, len(text_ids), chunk):
        d.feed(text_ids[k : k + chunk])
        deltas.append((s.feed(d.text), len(d.text)))
    return d, s, deltas


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_text_streamer_holds_partial_chars_and_stop_strings(chunk):
    d, s, deltas = _stream(list("héllo wörld STOP tail".encode()), ["STOP"], chunk)
    sent = "".join(x for x, _ in deltas)
    assert "\ufffd" not in sent and "STOP" not in sent
    final = "héllo wörld "
    assert d.final().startswith(final) and final.startswith(sent)
    assert sent + s.finish(final) == final
    _, s2, deltas = _stream(list("ab".encode()) + [999], [], chunk)
    assert "".join(x for x, _ in deltas) == "ab" and s2.finish("ab") == ""


def test_text_streamer_sends_every_safe_prefix_and_cuts_at_the_first_stop():
    text = "a wörld of XY and ZZ and more"
    for stop in (["ZZ", "XY"], ["Y and", "nope"], ["nope"], ["a"]):
        cuts = [text.find(x) for x in stop if x in text]
        final = text[: min(cuts)] if cuts else text
        hold = max(map(len, stop)) - 1
        for chunk in (1, 3):
            d, s, deltas = _stream(list(text.encode()), stop, chunk)
            sent = ""
            for delta, n in deltas:
                sent += delta
                assert final.startswith(sent)
                assert len(sent) >= min(len(final), n - hold)  # nothing held back needlessly
            assert sent + s.finish(final) == final, (stop, chunk)


# ---------------------------------------------------------------------------------------- config


def test_config_validates_once_and_accepts_the_k8s_args():
    from deployments.app import build_app, check_method

    cfg = ServeAppConfig.model_validate(
        {
            "model": "/models/Qwen2.5-72B-Instruct",
            "tensor_parallel_size": "8",
            "dtype": "bfloat16",
            "qdrant_url": "http://qdrant:6333",
            "qdrant_api_key_env": "QDRANT_API_KEY",
            "api_key_env": "TOOLSPEC_API_KEY",
            "max_ongoing_requests": 8,
            "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4},
            "retrieval": {"enabled": True},
        }
    )
    assert cfg.tensor_parallel_size == 8
    assert cfg.store_config(1024)["backend"] == "qdrant_url"
    assert cfg.deployment_options()["autoscaling_config"]["max_replicas"] == 4
    for bad in (
        {"tensor_parallel_size": 0},
        {"autoscaling": {"min_replicas": 3, "max_replicas": 1}},
        {"unknown": 1},
        {"max_tokens_default": 10, "max_tokens_limit": 5},
        {"device": "cpu", "dtype": "float16"},
    ):
        with pytest.raises(ValueError):
            ServeAppConfig.model_validate(bad)
    for removed, says in (("engine", "batched step scheduler"), ("prefix_cache_entries", "prefix_caching")):
        with pytest.raises(ValueError, match=says):
            ServeAppConfig.model_validate({removed: "threads" if removed == "engine" else 8})
    with pytest.raises(ValueError, match="unknown method"):
        check_method("nope")
    with pytest.raises(ValueError):
        build_app({"method": "nope"})


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert ServeAppConfig(api_key_env="MY_KEY").resolved_api_key() == "s3cret"
    assert ServeAppConfig(api_key="k", api_key_env="MY_KEY").resolved_api_key() == "k"
    monkeypatch.delenv("MY_KEY")
    assert ServeAppConfig(api_key_env="MY_KEY").resolved_api_key() is None


# ---------------------------------------------------------------------------------------- app over ASGI


class FakeHandle:
    """A Serve handle stand-in over an in-process RetrievalServer; ``down`` makes calls fail."""

    def __init__(self, server):
        self.server, self.down, self.adds = server, False, 0
        outer = self

        class _M:
            def __init__(self, name):
                self.name = name

            def remote(self, *a, **kw):
                async def call():
                    if outer.down:
                        raise ConnectionError("retrieval replica died")
                    if self.name == "add":
                        outer.adds += 1
                    return await getattr(outer.server, self.name)(*a, **kw)

                return call()

        self._method = _M

    def __getattr__(self, name):  # handle.<method>.remote(...), as on a Serve handle
        if name.startswith("_"):
            raise AttributeError(name)
        return self._method(name)


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    from deployments.http import LocalBackend, make_api
    from deployments.retrieval import RetrievalClient, RetrievalServer

    cfg = ServeAppConfig(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="reference",
        max_tokens_default=20,
        served_model_name="tiny",
        retrieval={"store": {"backend": "memory"}, "timeout_s": 2.0, "key": "lexical"},
    )
    handle = FakeHandle(RetrievalServer(cfg.store_config(cfg.retrieval.lexical_dim), cfg.retrieval))
    host = EngineHost.build(cfg, RetrievalClient(handle, cfg.retrieval))
    app = make_api(LocalBackend(host), cfg)
    yield host, app, cfg, handle
    host.close()


def run(coro):
    return asyncio.run(coro)


def aclient(app, api_key: str = "unused"):
    import httpx
    import openai

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http, max_retries=0)


def engine_greedy(host, messages, tools, n):
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.proposer import NoDrafter

    ids = render_prompt(host.target.tokenizer, messages, tools or None)
    return generate(host.target, ids, NoDrafter(), DecodeConfig(max_new_tokens=n)).text


def test_greedy_through_the_api_equals_plain_greedy(local):
    host, app, _, _ = local
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]

    async def go():
        c = aclient(app)
        r1 = await c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=20)
        r2 = await c.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=20
        )  # prefix hit
        return r1, r2

    r1, r2 = run(go())
    want = engine_greedy(host, messages, None, 20)
    assert r1.choices[0].message.content == want == r2.choices[0].message.content
    assert r2.model_extra["toolspec"]["prefix_cached_tokens"] > 0
    assert r1.usage.completion_tokens == 20 and r1.choices[0].finish_reason == "length"


def test_concurrent_requests_are_independent(local):
    """Requests in flight together are verified together (one engine thread, batched steps) and
    each gets what it gets alone."""
    host, app, _, _ = local
    prompts = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": f"question number {i} " * (i + 1)}]
        for i in range(5)
    ]

    async def one(c, m):
        r = await c.chat.completions.create(model="tiny", messages=m, tools=TOOLS, temperature=0, max_tokens=16)
        return r.choices[0].message.content, [
            (t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []
        ]

    async def go():
        c = aclient(app)
        single = [await one(c, m) for m in prompts]
        mark = len(host.engine.scheduler.steps)
        together = await asyncio.gather(*(one(c, m) for m in prompts))
        return single, list(together), host.engine.scheduler.steps[mark:]

    single, together, steps = run(go())
    assert single == together
    assert len(set(map(str, single))) > 1
    assert max(s.sequences for s in steps) > 1  # decoded in shared forwards, not one forward each
    assert host.engine.load()["running"] == 0


def test_stream_matches_non_stream(local):
    _, app, _, _ = local

    async def go():
        c = aclient(app)
        full = await c.chat.completions.create(
            model="tiny", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=20
        )
        stream = await c.chat.completions.create(
            model="tiny",
            messages=WEATHER_MESSAGES,
            tools=TOOLS,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch.model_dump() async for ch in stream]
        return full, chunks

    full, chunks = run(go())
    got = reassemble(chunks)
    msg = full.choices[0].message
    assert got["content"] == (msg.content or "")
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls or []
    ]
    assert got["finish"] == full.choices[0].finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == full.usage.completion_tokens


def test_logprobs_equal_plain_decoding_and_stream_with_the_chunks(local):
    """logprobs / top_logprobs: one entry per output token, equal to what plain decoding of the
    same model reports, the same streamed (spread over the chunks) as in the whole response."""
    from toolspec_core.engine.loop import DecodeConfig, generate
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.proposer import NoDrafter

    host, app, _, _ = local
    kw = dict(model="tiny", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=20)

    async def go():
        c = aclient(app)
        full = await c.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
        stream = await c.chat.completions.create(**kw, logprobs=True, top_logprobs=3, stream=True)
        chunks = [ch.model_dump() async for ch in stream]
        bare = await c.chat.completions.create(**kw)
        return full, chunks, bare

    full, chunks, bare = run(go())
    got = full.choices[0].logprobs.content
    ids = render_prompt(host.target.tokenizer, WEATHER_MESSAGES, TOOLS)
    plain = generate(host.target, ids, NoDrafter(), DecodeConfig(max_new_tokens=20, logprobs=3))
    want = [e for e in plain.logprobs if e[0] not in host.target.eos_ids]
    assert len(got) == len(want) > 0
    for entry, (tok, lp, top) in zip(got, want):
        assert bytes(entry.bytes) == host.token_text.bytes_of(tok)
        assert entry.logprob == pytest.approx(lp, abs=1e-4) and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
    text = (full.choices[0].message.content or "").encode()
    assert text in b"".join(bytes(e.bytes) for e in got)  # the entries spell the output
    streamed = [e for ch in chunks for c in ch["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e.token, e.bytes) for e in got]
    assert [e["logprob"] for e in streamed] == pytest.approx([e.logprob for e in got], abs=1e-5)
    assert bare.choices[0].logprobs is None


def test_bad_input_gets_4xx_and_the_engine_keeps_serving(local):
    import httpx

    host, app, cfg, _ = local

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        out = []
        out.append(
            await http.post(
                "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
            )
        )
        out.append(await http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": "ten"}))
        out.append(
            await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 2100}]})
        )
        out.append(
            await http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 2100}], "stream": True}
            )
        )
        out.append(
            await http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2040})
        )  # prompt + max_tokens > context
        out.append(
            await http.post(
                "/v1/chat/completions",
                json={"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            )
        )
        ok = await http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})
        return out, ok

    out, ok = run(go())
    for r in out:
        assert 400 <= r.status_code < 500, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert out[2].json()["error"]["code"] == "context_length_exceeded"
    assert out[3].json()["error"]["code"] == "context_length_exceeded"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_models_health_metrics(local):
    import httpx

    _, app, _, _ = local

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        await http.post("/v1/chat/completions", json={"messages": WEATHER_MESSAGES, "tools": TOOLS, "max_tokens": 8})
        before = (await http.get("/health")).json()["engine"]["tool_sets"]
        await http.post("/v1/chat/completions", json={"messages": WEATHER_MESSAGES, "tools": TOOLS, "max_tokens": 8})
        return [before] + [await http.get(p) for p in ("/v1/models", "/health", "/metrics", "/v1/models/other")]

    before, models, health, metrics, missing = run(go())
    assert models.json()["data"][0]["id"] == "tiny"
    assert health.json()["status"] == "ok"
    text = metrics.text
    for name in (
        "toolspec_requests_total",
        "toolspec_request_latency_seconds_bucket",
        "toolspec_tokens_per_second",
        "toolspec_mean_accepted_tokens",
        "toolspec_draft_tokens_total",
        "toolspec_retrieval_fallbacks_total",
        "toolspec_engine_running_sequences",
        "toolspec_engine_waiting_sequences",
        "toolspec_engine_step_rows",
        "toolspec_engine_step_sequences",
        "toolspec_engine_step_seconds",
        "toolspec_kv_pool_usage",
        'toolspec_kv_pool_blocks{replica="',
        "toolspec_prefix_cache_hit_rate",
        'toolspec_gc_collections{generation="2",replica="',
        "toolspec_gc_seconds",
        "toolspec_gc_longest_seconds",
        'toolspec_tool_sets_hit_rate{replica="',
        "toolspec_tool_sets_entries",
        "toolspec_tool_sets_bytes",
        "toolspec_tool_sets_token_hit_rate",
    ):
        assert name in text, name
    sets = health.json()["engine"]["tool_sets"]  # the same tools again: compiled once, found the second time
    assert sets["hits"] > before["hits"] and sets["misses"] == before["misses"] >= 1
    assert sets["entries"] >= 1 and 0 < sets["bytes"] <= sets["max_bytes"]
    assert health.json()["engine"]["engine"]["kv_pool"]["blocks"] > 0
    collected = health.json()["engine"]["engine"]["gc"]
    assert len(collected["collections"]) == len(collected["seconds"]) == len(collected["longest_ms"]) == 3
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_bearer_auth(tiny_model_dir, local):
    import openai

    from deployments.http import LocalBackend, make_api

    host, _, cfg, _ = local
    app = make_api(LocalBackend(host), ServeAppConfig.model_validate({**cfg.model_dump(), "api_key": "s3cret"}))

    async def go(key):
        return await aclient(app, key).chat.completions.create(model="tiny", messages=MSG, max_tokens=2)

    with pytest.raises(openai.AuthenticationError) as err:
        run(go("wrong"))
    assert err.value.status_code == 401
    assert run(go("s3cret")).usage.completion_tokens == 2


def test_retrieval_down_falls_back_and_is_counted(local):
    host, app, _, handle = local
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather in Rome please"}]

    async def go(tag):
        c = aclient(app)
        r = await c.chat.completions.create(
            model="tiny",
            messages=msgs[:1] + [{"role": "user", "content": tag}],
            tools=TOOLS,
            temperature=0,
            max_tokens=12,
            user="acme",
        )
        return r

    up = run(go("weather in Rome please"))
    assert up.model_extra["toolspec"]["retrieval"]["status"] == "ok"
    handle.down = True
    try:
        down = run(go("weather in Oslo please"))
    finally:
        handle.down = False
    assert down.model_extra["toolspec"]["retrieval"]["status"] == "fallback"
    assert host.retrieval.counters()["fallback"] >= 1
    assert down.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_streamed_deltas_with_stop_strings_are_the_final_text(local):
    host, _, _, _ = local
    base = chat_request(
        [{"role": "user", "content": "Say something long."}],
        max_tokens=40,
        temperature=0.0,
        toolspec={"remember": False},
    )

    async def events(stop):
        return [ev async for ev in host.stream(base.model_copy(update={"stop": stop}))]

    full = run(events([]))[-1].text
    assert len(full) > 24
    for stop in ([], [full[5:8]], [full[20:22], "never"], [full[-3:]]):
        evs = run(events(stop))
        deltas = [e.delta for e in evs if isinstance(e, Text)]
        assert "".join(deltas) == evs[-1].text == (full[: full.find(stop[0])] if stop else full), stop
        assert len(deltas) > 1 or len(evs[-1].text) < 8


@pytest.mark.parametrize("how", ["aclose", "task_cancel"])
def test_a_client_that_leaves_cancels_its_decode_quietly(local, caplog, how):
    """Serve closes the replica's stream (or cancels its task) when the HTTP client goes away: the
    engine drops the sequence at its next step, its KV blocks go back to the pool, nothing is
    logged as an error, and the next request is served."""
    import logging

    host, _, _, _ = local
    req = chat_request([{"role": "user", "content": "go on forever"}], max_tokens=1500, temperature=0.0)
    before = host.stats.cancelled

    async def go():
        gen = host.stream(req)
        if how == "aclose":
            async for ev in gen:
                if isinstance(ev, Text):
                    break
            await gen.aclose()
            return
        first_text = asyncio.Event()

        async def consume():
            async for ev in gen:
                if isinstance(ev, Text):
                    first_text.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(first_text.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO):
        run(go())
        deadline = time.time() + 30
        while (host.engine.load()["running"] or host.engine.load()["waiting"]) and time.time() < deadline:
            time.sleep(0.02)
    assert host.stats.cancelled == before + 1
    load = host.engine.load()
    assert load["running"] == 0 and load["waiting"] == 0  # the sequence left the batch, long before 1500 tokens
    assert load["kv_pool"]["used_blocks"] == 0  # and gave its KV blocks back
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    done = run(host.generate(req.model_copy(update={"max_tokens": 4})))
    assert isinstance(done, Done) and done.completion_tokens == 4


def test_completed_calls_go_to_the_library_unless_told_not_to(local):
    host, _, _, handle = local
    from toolspec_core.drafters.methods import RequestInfo

    text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    ids = host.target.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def go(remember):
        before = handle.adds
        host.library.note_tools("acme", TOOLS)
        emb = query_text([{"role": "user", "content": "weather in Lima"}], TOOLS)
        await host.retrieval.search("acme", emb, ["get_current_weather"])  # binds the client to this loop
        info = RequestInfo(ids, TOOLS, "acme", emb, remember, [])
        await asyncio.to_thread(host.method.observe, info, ids, text)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if handle.adds > before:
                break
        return handle.adds - before

    assert run(go(False)) == 0
    assert run(go(True)) == 1
    hits = asyncio.run(
        handle.server.search(
            "acme",
            query_text([{"role": "user", "content": "weather in Lima"}], TOOLS),
            ["get_current_weather"],
            5,
        )
    )
    assert hits and hits[0]["tool_name"] == "get_current_weather" and hits[0]["arguments"] == {"city": "Lima"}


def _keys_app(local, tmp_path, entries):
    import json as _json

    from deployments.http import LocalBackend, make_api

    host, _, cfg, handle = local
    path = tmp_path / "keys.json"
    path.write_text(_json.dumps(entries))
    return make_api(LocalBackend(host), cfg.model_copy(update={"api_keys_file": str(path)})), host, handle


KEYS = [
    {"key": "sk-acme", "tenant": "acme"},
    {"sha256": __import__("hashlib").sha256(b"sk-beta").hexdigest(), "tenant": "beta", "requests_per_minute": 2},
    {"key": "sk-admin", "tenant": "ops", "admin": True},
]


def test_a_key_is_its_tenant_and_user_only_narrows_within_it(local, tmp_path):
    """Tenant isolation through the HTTP API: two keys, the same request -- only the key whose
    tenant holds the past call gets it as a draft source; `user` narrows to tenant/user."""
    app, host, handle = _keys_app(local, tmp_path, KEYS)
    msgs = [{"role": "user", "content": "weather in Quito please"}]
    emb = query_text(msgs, TOOLS)
    text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Quito"}}\n</tool_call>'
    ids = host.target.tokenizer(text, add_special_tokens=False)["input_ids"]
    for tenant in ("acme", "acme/bob"):
        run(handle.server.add(tenant, "get_current_weather", "", text, ids, {"city": "Quito"}, emb))

    async def hits(key, **kw):
        c = aclient(app, api_key=key)
        r = await c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, temperature=0, **kw)
        return r.model_extra["toolspec"]["retrieval"]["hits"]

    assert run(hits("sk-acme")) >= 1 and run(hits("sk-acme", user="bob")) >= 1
    assert run(hits("sk-beta")) == 0 and run(hits("sk-beta", user="bob")) == 0  # not acme's calls
    assert run(hits("sk-acme", user="eve")) == 0  # another user of acme: not bob's

    async def unauthorised():
        import httpx

        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        no_key = await http.post("/v1/chat/completions", json={"messages": MSG})
        wrong = await http.post("/v1/chat/completions", json={"messages": MSG}, headers={"Authorization": "Bearer x"})
        return no_key.status_code, wrong.json()["error"]["code"]

    assert run(unauthorised()) == (401, "invalid_api_key")


def test_only_an_admin_key_forgets_or_counts_a_tenants_library(local, tmp_path):
    import httpx

    app, host, handle = _keys_app(local, tmp_path, KEYS)
    emb = query_text(MSG, TOOLS)
    for tenant in ("gamma", "gamma/u1", "gamma/u2", "gammax"):
        run(handle.server.add(tenant, "get_current_weather", "", "t", [1, 2], {"city": "X"}, emb))

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        admin = {"Authorization": "Bearer sk-admin"}
        return [
            await http.get("/v1/toolspec/library/gamma/stats", headers={"Authorization": "Bearer sk-acme"}),
            await http.delete("/v1/toolspec/library/gamma", headers={"Authorization": "Bearer sk-acme"}),
            await http.get("/v1/toolspec/library/gamma/stats", headers=admin),
            await http.delete("/v1/toolspec/library/gamma", headers=admin),
            await http.get("/v1/toolspec/library/gamma/stats", headers=admin),
            await http.get("/v1/toolspec/library/gammax/stats", headers=admin),
        ]

    denied, denied_delete, before, forget, after, other = run(go())
    assert denied.status_code == 403 and denied_delete.status_code == 403
    assert denied.json()["error"]["code"] == "not_admin"
    assert before.json() == {"tenant": "gamma", "records": 3, "sub_tenants": 3}
    assert forget.status_code == 200 and forget.json()["deleted"] == 3
    assert after.json()["records"] == 0 and other.json()["records"] == 1  # "gammax" is another tenant


def test_a_key_over_its_rate_limit_gets_429_with_retry_after(local, tmp_path):
    import httpx

    app, _, _ = _keys_app(local, tmp_path, KEYS)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        beta = {"Authorization": "Bearer sk-beta"}
        body = {"messages": MSG, "max_tokens": 2}
        out = [await http.post("/v1/chat/completions", json=body, headers=beta) for _ in range(3)]
        out.append(await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-acme"}))
        return out

    first, second, third, other = run(go())
    assert first.status_code == second.status_code == 200
    assert third.status_code == 429 and 1 <= int(third.headers["retry-after"]) <= 60
    err = third.json()["error"]
    assert (
        err["code"] == "rate_limit_exceeded" and err["type"] == "requests" and "requests_per_minute" in err["message"]
    )
    assert other.status_code == 200  # another key is not limited by beta's


def test_hidden_state_retrieval_key(tiny_model_dir):
    """retrieval.key=hidden: the engine prefills the prompt in its block pool like any other (the
    pool counts it; nothing is prefilled beside the engine), the search is keyed on the prompt's
    last hidden state -- the key a separate prefill of the prompt gives -- and its calls reach the
    drafter before the first draft (in time); the output is remembered under that key."""
    import numpy as np

    from deployments.app import retrieval_dim
    from deployments.retrieval import RetrievalClient, RetrievalServer
    from retrieval_service.embedding import from_hidden
    from toolspec_core.engine.loop import prefill
    from toolspec_core.model.prompting import render_prompt

    cfg = ServeAppConfig(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="none",
        retrieval={"store": {"backend": "memory"}, "key": "hidden", "timeout_s": 2.0},
    )
    assert retrieval_dim(cfg) == 64
    handle = FakeHandle(RetrievalServer(cfg.store_config(retrieval_dim(cfg))))
    client = RetrievalClient(handle, cfg.retrieval)
    keys = []
    search = client.search

    async def recording(tenant, embedding, names):
        keys.append(np.asarray(embedding))
        return await search(tenant, embedding, names)

    client.search = recording
    host = EngineHost.build(cfg, client)
    req = chat_request(WEATHER_MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=6)
    pool = host.engine.scheduler.pool
    own = []  # caches made outside the pool
    host.target.new_cache = lambda: own.append(1)
    try:
        done = run(host.generate(req, "t"))
        again = run(host.generate(req, "t"))
        handle.down = True  # the search fails: the held first draft goes on with the fallback drafter
        other = [{"role": "user", "content": "and the weather in Oslo?"}]
        down = run(host.generate(chat_request(other, tools=TOOLS, tool_choice="auto", max_tokens=6), "t"))
    finally:
        del host.target.new_cache
        host.close()
    assert isinstance(done, Done) and done.extra["retrieval"]["status"] == "ok" and done.extra["retrieval"]["in_time"]
    assert again.extra["retrieval"]["status"] == "ok" and again.text == done.text
    assert isinstance(down, Done) and down.extra["retrieval"]["status"] == "fallback"
    assert own == []  # the prompt is prefilled by the engine, in its pool
    ids = render_prompt(host.target.tokenizer, WEATHER_MESSAGES, TOOLS)
    other_ids = render_prompt(host.target.tokenizer, other, TOOLS)
    assert pool.stats().queried_tokens == 2 * len(ids) + len(other_ids)  # admitted into the pool, every time
    want = from_hidden(prefill(host.target, ids).hidden)
    assert len(keys) == 3 and all(np.allclose(k, want, atol=1e-5) for k in keys[:2])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_current_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_choice_is_a_valid_call_even_from_a_random_model(local, tool_choice):
    """The grammar constraint guarantees a schema-valid call whatever the target prefers (as long
    as max_tokens lets it close: a random model may write a free-text value forever)."""
    from toolspec_core.drafters.toolcall.parse import ToolCall, validate_call

    _, app, _, _ = local

    async def go():
        return await aclient(app).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=0,
            max_tokens=400,
            logprobs=True,
        )

    r = run(go())
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    call = r.choices[0].message.tool_calls[0]
    assert validate_call(ToolCall(call.function.name, json.loads(call.function.arguments)), TOOLS) == []
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_current_weather"
    assert r.model_extra["toolspec"]["constrained"] is True and r.model_extra["toolspec"]["forced_tokens"] > 0
    # tokens the grammar forced are certain under it: logprob 0
    certain = sum(e.logprob == 0.0 for e in r.choices[0].logprobs.content)
    assert certain >= r.model_extra["toolspec"]["forced_tokens"]


def test_parallel_tool_calls_false_ends_the_output_after_one_call(local):
    """auto: the output ends with the first call's closer; required: a one-call grammar."""
    host = local[0]
    base = parse_request({"messages": MSG, "tools": TOOLS}, "tiny", 100)
    assert host.job(base).decode.end_after == ()
    off = parse_request({"messages": MSG, "tools": TOOLS, "parallel_tool_calls": False}, "tiny", 100)
    assert host.job(off).decode.end_after == ("</tool_call>",)
    tok = host.target.tokenizer
    one = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    for parallel, allowed in ((True, True), (False, False)):
        job = host.job(base.model_copy(update={"tool_choice": "required", "parallel_tool_calls": parallel}))
        for t in tok.encode(one):
            job.constraint.consume(t)
        assert bool(job.constraint.mask()[tok.encode("\n<tool_call>")[0]]) is allowed


ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["answer", "answer_or_call"])
def test_response_format_json_schema_gives_valid_json_even_from_a_random_model(local, stream, tools):
    """response_format json_schema: the answer is JSON of the schema (the grammar sees to it, the
    schema drafter drafts it); with tools on auto a tagged call is the other choice, and a JSON
    answer is never taken for a bare call."""
    import jsonschema

    _, app, _, _ = local
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER, "strict": True}}
    kw = dict(model="tiny", messages=MSG, temperature=0, max_tokens=60, response_format=fmt)
    if tools:
        kw["tools"] = tools

    async def go():
        c = aclient(app)
        if not stream:
            return await c.chat.completions.create(**kw)
        chunks = [ch.model_dump() async for ch in await c.chat.completions.create(**kw, stream=True)]
        return reassemble(chunks)

    r = run(go())
    if stream:
        content, calls, finish = r["content"], r["calls"], r["finish"]
    else:
        msg = r.choices[0].message
        content, calls, finish = msg.content, msg.tool_calls or [], r.choices[0].finish_reason
        assert r.model_extra["toolspec"]["constrained"] is True
    if calls:
        assert tools and finish == "tool_calls"
    else:
        assert finish == "stop"
        jsonschema.validate(json.loads(content), ANSWER)


def test_response_format_json_object_and_text(local):
    _, app, _, _ = local

    async def go(fmt):
        return await aclient(app).chat.completions.create(
            model="tiny", messages=MSG, temperature=0, max_tokens=40, response_format=fmt
        )

    obj = run(go({"type": "json_object"}))
    if obj.choices[0].finish_reason == "stop":  # a random model may not close its object in 40 tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert obj.model_extra["toolspec"]["constrained"] is True
    assert run(go({"type": "text"})).model_extra["toolspec"]["constrained"] is False


def _bridge(max_running: int = 4):
    """An engine bridge over a tiny target and a block pool of its own."""
    from tiny import tiny_target

    from deployments.bridge import EngineBridge
    from toolspec_core.engine.scheduler import BatchLimits

    tg = tiny_target()
    pool = tg.block_pool(2048, 16, True)
    return tg, pool, EngineBridge(tg, None, BatchLimits(max_running=max_running), pool)


def test_the_bridge_fails_a_broken_step_cleanly_and_keeps_serving():
    """A step that raises ends the sequences it held with an EngineError (their requests do not
    hang, their blocks are released) and the engine thread goes on with the next ones."""
    from deployments.bridge import EngineError
    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.engine.sequence import Sequence

    tg, pool, bridge = _bridge()

    async def one(max_new: int):
        stream = bridge.submit(Sequence(tg, [1, 2, 3], None, DecodeConfig(max_new_tokens=max_new)))
        return await asyncio.wait_for(stream.result(), 30)

    try:
        step = tg.step
        tg.step = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))
        with pytest.raises(EngineError, match="device lost"):
            run(one(4))
        assert pool.stats().used_blocks == 0
        tg.step = step
        assert len(run(one(4)).tokens) == 4
    finally:
        bridge.close()


def test_the_bridge_streams_to_the_loop_and_cancels_at_the_next_step():
    """Updates reach the request's event loop with the text so far (growing, ending at the final
    text); a cancelled sequence ends "cancelled" long before its max_tokens and frees its blocks,
    and the sequences beside it are untouched."""
    from tiny import hf_greedy

    from toolspec_core.engine.loop import DecodeConfig
    from toolspec_core.engine.sequence import Sequence

    tg, pool, bridge = _bridge()
    prompt = [1, 2, 3, 4, 5]
    want = hf_greedy(tg, prompt, 40)

    async def go():
        left = bridge.submit(Sequence(tg, prompt, None, DecodeConfig(max_new_tokens=400)))
        stays = bridge.submit(Sequence(tg, prompt, None, DecodeConfig(max_new_tokens=40)))
        texts = []
        async for progress in left.updates():
            texts.append(progress.text)
            if len(texts) == 3:
                left.cancel()
        return texts, await left.result(), await stays.result()

    try:
        texts, gone, kept = run(go())
    finally:
        bridge.close()
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert gone.finish_reason == "cancelled" and len(gone.tokens) < 400
    assert kept.finish_reason == "length" and kept.tokens == want
    assert pool.stats().used_blocks == 0


def test_an_engine_failure_is_an_openai_error_and_the_replica_serves_on(local, caplog):
    """The engine fails a step: the non-streaming request gets a 500 server_error in OpenAI's
    shape, the streaming one the same error in band; the next request is answered."""
    import logging

    import httpx

    host, app, _, _ = local
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            step = host.target.step
            host.target.step = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))
            try:
                plain = await http.post("/v1/chat/completions", json=body)
                streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
            finally:
                host.target.step = step
            after = await http.post("/v1/chat/completions", json=body)
        return plain, streamed, after

    with caplog.at_level(logging.ERROR):
        plain, streamed, after = run(go())
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert "device lost" in plain.json()["error"]["message"]
    events = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert "engine step failed" in caplog.text  # logged once, by the engine thread


class _CancelledBackend:
    """A backend whose replica call is cancelled the way Serve cancels it when the client goes
    away (``RequestCancelledError``): before the first event, or mid-stream."""

    def __init__(self, when: str):
        self.when = when

    async def stream(self, req, *caller):
        from ray.serve.exceptions import RequestCancelledError

        if self.when == "mid":
            yield Start(3)
            yield Text("Hel")
        raise RequestCancelledError("req-1")

    async def generate(self, req, *caller):
        from ray.serve.exceptions import RequestCancelledError

        raise RequestCancelledError("req-1")

    async def info(self):
        return {}


def _chat_scope(body: bytes) -> dict:
    """The ASGI scope of a POST to /v1/chat/completions with ``body``, for driving the app directly."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }


def test_a_client_gone_before_its_body_is_read_is_a_quiet_499(caplog):
    """A client that closes its connection while its body is still arriving: Starlette raises
    ClientDisconnect from the body read; that is a cancellation (499, nothing logged at warning or
    above, the backend never called), never a 500."""
    import logging

    from deployments.http import make_api

    class Backend(_CancelledBackend):
        async def stream(self, req, *caller):
            raise AssertionError("a request whose body never arrived reached the backend")
            yield

        async def generate(self, req, *caller):
            raise AssertionError("a request whose body never arrived reached the backend")

    app = make_api(Backend("first"), ServeAppConfig(served_model_name="m"))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    incoming = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.DEBUG):
        run(asyncio.wait_for(app(_chat_scope(body), receive, send), 30))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text
    assert "request cancelled (ClientDisconnect)" in caplog.text


def test_a_send_cancelled_mid_stream_is_quiet(caplog):
    """Serve cancels the ``send`` of a response already streaming when the client goes away (the
    cancellation surfaces from Starlette's streaming task group): the app returns quietly."""
    import logging

    from ray.serve.exceptions import RequestCancelledError

    from deployments.http import make_api

    class Backend(_CancelledBackend):
        async def stream(self, req, *caller):
            for ev in (Start(3), Text("Hel")):
                yield ev
            await asyncio.sleep(3600)  # the rest never comes: the client is gone

    app = make_api(Backend("mid"), ServeAppConfig(served_model_name="m"))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    sent, received = [], []

    async def receive():
        if not received:
            received.append(body)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the disconnect comes as the failed send

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 2:
            raise RequestCancelledError("req-1")

    with caplog.at_level(logging.DEBUG):
        run(asyncio.wait_for(app(_chat_scope(body), receive, send), 30))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text
    assert "request cancelled" in caplog.text


@pytest.mark.parametrize("when,stream", [("first", True), ("mid", True), ("first", False)])
def test_a_cancelled_replica_call_is_quiet_at_the_ingress(caplog, when, stream):
    """A client that leaves is normal: whether Serve cancels the replica call before the first
    event, mid-stream or in a non-streaming request, the ingress logs no error (and no traceback)
    and answers 499 or ends the stream without an error event."""
    import logging

    import httpx

    from deployments.http import make_api

    app = make_api(_CancelledBackend(when), ServeAppConfig(served_model_name="m"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            return await http.post("/v1/chat/completions", json=body)

    with caplog.at_level(logging.DEBUG, logger="toolspec.serve"):
        r = run(go())
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text
    if when == "mid":
        assert r.status_code == 200 and "error" not in r.text and "[DONE]" not in r.text
    else:
        assert r.status_code == 499


def test_an_agents_next_turn_reuses_the_previous_turns_kv(local):
    """Turn 2 repeats turn 1's prompt and the call the model wrote, then adds the tool result:
    those tokens come from the prefix cache (usage.prompt_tokens_details.cached_tokens) and the
    answer is still plain greedy's."""
    host, app, _, _ = local
    turn1 = [
        {"role": "system", "content": "You are an agent. Call tools when you need facts."},
        {"role": "user", "content": "Check the weather in Oslo and then email it to me at a@b.c, please."},
    ]

    async def go():
        c = aclient(app)
        r1 = await c.chat.completions.create(model="tiny", messages=turn1, tools=TOOLS, temperature=0, max_tokens=24)
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        turn2 = turn1 + [
            {"role": "assistant", "content": r1.choices[0].message.content or "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 4, "sky": "rain"}'},
        ]
        r2 = await c.chat.completions.create(model="tiny", messages=turn2, tools=TOOLS, temperature=0, max_tokens=16)
        return r1, r2, turn2

    r1, r2, turn2 = run(go())
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert cached >= r1.usage.prompt_tokens // 16 * 16 > 0  # at least all of turn 1's full blocks
    assert cached < r2.usage.prompt_tokens
    assert r2.model_extra["toolspec"]["prefix_cached_tokens"] == cached
    assert not r2.choices[0].message.tool_calls  # a random model writes text: compare it whole
    assert r2.choices[0].message.content == engine_greedy(host, turn2, TOOLS, 16)


def test_a_small_kv_pool_queues_requests_and_refuses_what_never_fits(tiny_model_dir):
    """A pool of 256 tokens holds two of these requests at once: the others wait for blocks and
    still answer as plain greedy does; a request the pool could never hold is a 400."""
    import httpx

    from deployments.http import LocalBackend, make_api

    cfg = ServeAppConfig(
        model=tiny_model_dir,
        method="toolspec",
        cost_model="flat",
        served_model_name="tiny",
        kv_pool_tokens=256,
        max_tokens_default=1000,
        max_tokens_limit=2000,
        retrieval={"enabled": False},
    )
    host = EngineHost.build(cfg)
    app = make_api(LocalBackend(host), cfg)
    prompts = [[{"role": "user", "content": f"list {i} things " * (1 + i % 2)}] for i in range(5)]
    waited = []

    async def go():
        c = aclient(app)

        async def watch():
            while True:
                waited.append(host.engine.load()["waiting"])
                await asyncio.sleep(0.01)

        w = asyncio.ensure_future(watch())
        rs = await asyncio.gather(
            *(c.chat.completions.create(model="tiny", messages=m, temperature=0, max_tokens=20) for m in prompts)
        )
        w.cancel()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        too_big = await http.post("/v1/chat/completions", json={"messages": prompts[0], "max_tokens": 400})
        default = await http.post("/v1/chat/completions", json={"messages": prompts[0]})  # capped to the pool
        return rs, too_big, default

    try:
        rs, too_big, default = run(go())
        assert [r.choices[0].message.content for r in rs] == [engine_greedy(host, m, None, 20) for m in prompts]
        assert max(waited) > 0  # some requests waited for KV blocks
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "context_length_exceeded"
        assert "KV pool" in too_big.json()["error"]["message"]
        assert default.status_code == 200, default.text
        u = default.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] <= 256
        assert host.engine.load()["kv_pool"]["used_blocks"] == 0
    finally:
        host.close()


def test_the_scripted_target_writes_its_script_through_the_engine():
    """model: scripted (the free target the serving-ceiling load test runs): each output token is
    the script's at its position, through the whole request path, streamed or not."""
    import httpx

    from deployments.http import LocalBackend, make_api
    from deployments.scripted import ScriptedTarget

    cfg = ServeAppConfig(
        model="scripted", method="ar", cost_model="none", served_model_name="s", retrieval={"enabled": False}
    )
    host = EngineHost.build(cfg)
    app = make_api(LocalBackend(host), cfg)
    assert isinstance(host.target, ScriptedTarget)
    req = chat_request(MSG, max_tokens=40)

    async def go():
        done = await host.generate(req)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"messages": MSG, "max_tokens": 40, "stream": True}
            streamed = await http.post("/v1/chat/completions", json=body)
        return done, streamed

    try:
        done, streamed = run(go())
    finally:
        host.close()
    script, n = host.target.script, done.prompt_tokens
    want = host.target.tokenizer.decode([script[(n + i) % len(script)] for i in range(40)])
    assert done.completion_tokens == 40 and done.text == want
    chunks = [json.loads(ln[6:]) for ln in streamed.text.splitlines() if ln.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want


def test_the_timeline_rides_on_a_response_only_when_asked():
    """A response's ``toolspec`` field carries the request's timeline and early engine steps (~3 KB)
    only when asked -- the X-ToolSpec-Timeline header (what ``toolspec loadtest --timeline`` sends),
    the ``toolspec.timeline`` request field, or the server's ``timeline`` option --, so the OpenAI
    response stays lean by default."""
    import httpx

    from deployments.http import LocalBackend, make_api

    cfg = ServeAppConfig(
        model="scripted", method="ar", cost_model="none", served_model_name="s", retrieval={"enabled": False}
    )
    host = EngineHost.build(cfg)
    apps = {
        False: make_api(LocalBackend(host), cfg),
        True: make_api(LocalBackend(host), cfg.model_copy(update={"timeline": True})),
    }

    async def post(always: bool, stream: bool, headers=None, **extra) -> dict:
        body = {"messages": MSG, "max_tokens": 8, "stream": stream, **extra}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[always]), base_url="http://t") as http:
            r = await http.post("/v1/chat/completions", json=body, headers=headers or {})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["toolspec"]
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        return [c["toolspec"] for c in chunks if "toolspec" in c][-1]

    async def go():
        return {
            "plain": await post(False, True),
            "plain_whole": await post(False, False),
            "header": await post(False, True, {"X-ToolSpec-Timeline": "1"}),
            "field": await post(False, False, toolspec={"timeline": True}),
            "server": await post(True, True),
        }

    try:
        got = run(go())
    finally:
        host.close()
    for name in ("plain", "plain_whole"):
        assert "timeline" not in got[name] and "early_steps" not in got[name], name
        assert got[name]["method"] == "ar"  # the rest of the field as before
    for name in ("header", "field", "server"):
        t = got[name]["timeline"]
        assert t["replica_in"] <= t["prepared"] <= t["first_token"] <= t["first_text"], name
        assert got[name]["early_steps"][0]["kind"] == "prefill", name
    for name in ("header", "server"):  # streamed: the route's own marks beside the engine's
        t = got[name]["timeline"]
        assert t["http_in"] <= t["replica_in"] and t["first_text"] <= t["first_chunk"], name
