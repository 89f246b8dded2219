"""The request's way in, piece by piece, without Ray or a model: the chat route's pieces
(deployments/chat.py: limits, parsing, the gate, the SSE stream) and the one job built from a
request (deployments/job.py), over the embedded model's tokenizer."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from serve_fixtures import TOOLS, chat_request

from deployments.chat import Call, admit, decode_body, parse_chat, read_body, sse_events
from deployments.config import RequestLimits, ServeAppConfig
from deployments.events import Done, Failed, Text
from deployments.gate import LocalGate
from deployments.job import EngineJob, JobPolicy, build_job
from deployments.keys import OPEN, ApiKey
from deployments.protocol import APIError, parse_request, request_error
from deployments.streaming import StreamShaper
from toolspec_core.engine.limits import TokenLimits
from toolspec_core.errors import ContextLengthError, InvalidRequestError

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def policy(tok, **kw) -> JobPolicy:
    limits = kw.pop("limits", TokenLimits(context=4096, max_tokens=1000, default=20))
    return JobPolicy(tok, len(tok), limits, **kw)


def openai_error(exc: APIError) -> dict:
    """The JSON body the route answers for ``exc``: OpenAI's error object, nothing else."""
    body = json.loads(json.dumps(exc.body()))
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------------------------------- the job


def test_the_job_holds_the_request_as_the_engine_reads_it(tok):
    from toolspec_core.model.prompting import render_prompt

    req = parse_request(
        {
            "messages": MSG,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_current_weather"}},
            "max_completion_tokens": 7,
            "stop": "x",
            "user": "acme",
            "toolspec": {"remember": False},
            "seed": 3,
        },
        "m",
        100,
    )
    job = build_job(req, policy(tok, default_temperature=0.5), OPEN.library_tenant(req.user))
    assert isinstance(job, EngineJob)
    assert job.tool_choice == {"type": "function", "function": {"name": "get_current_weather"}}
    assert job.decode.max_new_tokens == 7 and job.decode.stop == ("x",)
    assert job.tenant == "default/acme" and job.remember is False
    assert job.decode.sampling.temperature == 0.5 and job.decode.sampling.seed == 3  # the server's default
    assert job.constraint is not None  # a named tool_choice: the output is a call of it
    assert job.prompt_ids == render_prompt(tok, MSG, TOOLS)
    assert job.tools == TOOLS and job.tool_names == [t["function"]["name"] for t in TOOLS]
    info = job.request_info([], "key")  # the method's view, every field named
    assert (info.prompt_ids, info.tools, info.tenant, info.embedding, info.remember, info.retrieved) == (
        job.prompt_ids,
        job.tools,
        "default/acme",
        "key",
        False,
        [],
    )
    with pytest.raises(Exception):  # frozen: built once, never changed
        job.tenant = "other"


def test_tool_choice_none_keeps_the_tools_but_shows_and_searches_none(tok):
    from toolspec_core.model.prompting import render_prompt

    p = policy(tok, library=True, text_key=True)
    auto = build_job(parse_request({"messages": MSG, "tools": TOOLS}, "m", 10), p)
    assert auto.tool_choice == "auto" and auto.searches and isinstance(auto.search_key, str)
    none = build_job(parse_request({"messages": MSG, "tools": TOOLS, "tool_choice": "none"}, "m", 10), p)
    assert none.tool_choice == "none" and none.tools == auto.tools and not none.searches
    assert none.prompt_ids == render_prompt(tok, MSG, None) and none.search_key is None
    bare = build_job(parse_request({"messages": MSG}, "m", 10), p)
    assert bare.tool_choice == "none" and not bare.searches
    hidden = build_job(parse_request({"messages": MSG, "tools": TOOLS}, "m", 10), policy(tok, library=True))
    assert hidden.searches and hidden.search_key is None  # keyed on the prompt's state, once prefilled


def test_the_job_is_where_a_timeline_is_asked_for(tok):
    """The body's ``toolspec.timeline``, or the server's option / the request's header (the
    ``timeline`` argument), ask for it; the job holds the one answer."""
    plain = parse_request({"messages": MSG}, "m", 10)
    field = parse_request({"messages": MSG, "toolspec": {"timeline": True}}, "m", 10)
    p = policy(tok)
    assert build_job(plain, p).timeline is False
    assert build_job(field, p).timeline is True and build_job(field, p, timeline=False).timeline is True
    assert build_job(plain, p, timeline=True).timeline is True


def test_token_limits_are_checked_once_before_any_grammar(tok, monkeypatch):
    """One call of the limit function per job; a refusal is a 400 naming the parameter and costs
    no grammar set-up."""
    import toolspec_core.engine.grammar as grammar
    from deployments import job as job_mod

    calls = []
    budget = job_mod.token_budget

    def counting(*args):
        calls.append(args)
        return budget(*args)

    monkeypatch.setattr(job_mod, "token_budget", counting)
    p = policy(tok, limits=TokenLimits(context=600, max_tokens=1000, default=20, prompt_tokens=450))
    build_job(chat_request(MSG, tools=TOOLS, tool_choice="required", max_tokens=10), p)
    assert len(calls) == 1

    def no_grammar(*a, **k):
        raise AssertionError("a refused job built its grammar")

    monkeypatch.setattr(grammar, "make_tool_constraint", no_grammar)
    long = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(InvalidRequestError) as over:
        build_job(chat_request(long, tools=TOOLS, tool_choice="required"), p)
    err = openai_error(request_error(over.value))
    assert request_error(over.value).status == 400 and "limits.prompt_tokens" in err["message"]
    assert err["param"] == "messages" and err["code"] == "invalid_value"
    with pytest.raises(ContextLengthError) as window:
        build_job(chat_request(MSG, tools=TOOLS, tool_choice="required", max_tokens=590), p)
    assert openai_error(request_error(window.value))["code"] == "context_length_exceeded"
    assert len(calls) == 3


def test_no_parallel_calls_end_the_output_after_the_first_call(tok):
    p = policy(tok)
    assert build_job(chat_request(MSG, tools=TOOLS), p).decode.end_after == ()
    one = build_job(chat_request(MSG, tools=TOOLS, parallel_tool_calls=False), p)
    assert one.decode.end_after == ("</tool_call>",)
    assert build_job(chat_request(MSG, parallel_tool_calls=False), p).decode.end_after == ()  # no tools shown


# ---------------------------------------------------------------------------------------- limits


def chunks(*parts: bytes):
    async def gen():
        for p in parts:
            yield p

    return gen()


def test_the_body_is_refused_past_its_byte_limit_before_or_while_it_is_read():
    limits = RequestLimits(body_bytes=1024)
    assert asyncio.run(read_body({}, chunks(b"x" * 512, b"y" * 512), limits)) == b"x" * 512 + b"y" * 512
    with pytest.raises(APIError) as sent:
        asyncio.run(read_body({"content-length": "1025"}, chunks(), limits))
    with pytest.raises(APIError) as read:
        asyncio.run(read_body({}, chunks(b"x" * 512, b"y" * 513), limits))
    for e in (sent.value, read.value):
        assert e.status == 413 and openai_error(e)["code"] == "request_too_large"
        assert "limits.body_bytes" in e.message


@pytest.mark.parametrize(
    "raw,code",
    [(b"{not json", "invalid_json"), (b"\xff\xfe", "invalid_json"), (b"[" * 40 + b"]" * 40, "json_too_deep")],
)
def test_a_body_that_is_not_json_or_nests_too_deep_is_a_400(raw, code):
    with pytest.raises(APIError) as err:
        decode_body(raw, RequestLimits(json_depth=32))
    assert err.value.status == 400 and openai_error(err.value)["code"] == code
    assert decode_body(b'{"a": [1]}', RequestLimits(json_depth=32)) == {"a": [1]}


# ---------------------------------------------------------------------------------------- parsing


def test_parsing_checks_every_field_under_the_servers_limits():
    cfg = ServeAppConfig(
        model="scripted", max_tokens_limit=100, max_tokens_default=50, limits=RequestLimits(messages=2)
    )
    req = parse_chat({"messages": MSG, "max_tokens": 5}, cfg, "m")
    assert req.max_tokens == 5
    for body, param, code in (
        ({"messages": MSG * 3}, "messages", "too_many_messages"),
        ({"messages": MSG, "max_tokens": 101}, "max_tokens", "invalid_value"),
        ({"messages": MSG, "nope": 1}, "nope", "invalid_value"),
        ({"messages": MSG, "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ):
        with pytest.raises(APIError) as err:
            parse_chat(body, cfg, "m")
        e = openai_error(err.value)
        assert err.value.status == 400 and e["param"] == param and e["code"] == code, body
    with pytest.raises(APIError) as other:
        parse_chat({"messages": MSG, "model": "other"}, cfg, "m")
    assert other.value.status == 404 and openai_error(other.value)["code"] == "model_not_found"


# ---------------------------------------------------------------------------------------- the gate


def test_the_gate_refuses_a_key_over_its_limit_with_retry_after():
    gate = LocalGate()
    key = ApiKey("acme", requests_per_minute=1, id="k1")
    asyncio.run(admit(gate, key))
    with pytest.raises(APIError) as err:
        asyncio.run(admit(gate, key))
    assert err.value.status == 429 and openai_error(err.value)["code"] == "rate_limit_exceeded"
    assert int(err.value.headers["Retry-After"]) >= 1 and "requests_per_minute" in err.value.message

    class NeverAsked:
        async def admit(self, key):
            raise AssertionError("a key without limits waited on the gate")

    asyncio.run(admit(NeverAsked(), OPEN))


# ---------------------------------------------------------------------------------------- streaming


def events(*evs):
    async def gen():
        for ev in evs:
            yield ev

    return gen()


class RecordingGate(LocalGate):
    """The in-process gate, keeping every record the route tells it."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple] = []

    def observe(self, record: tuple) -> None:
        self.records.append(record)
        super().observe(record)


def sse_parts(evs, parse=False, include_usage=True):
    gate, released = RecordingGate(), []
    call = Call(chat_request(MSG), OPEN, "default", False, 0.0, 0.0)
    shaper = StreamShaper("m", parse, include_usage)

    async def go():
        return [p async for p in sse_events(evs, shaper, call, gate, released.append)]

    parts = asyncio.run(go())
    data = [ln[6:] for p in parts for ln in p.decode().split("\n\n") if ln.startswith("data: ")]
    return data, gate, released


def test_the_stream_is_one_sse_part_per_event_ending_in_done():
    done = Done("Hello", "stop", 3, 2, {"mat": 1.0}, {"first_token_at": None})
    data, gate, released = sse_parts(events(Text("Hel"), Text("lo"), done))
    assert data[-1] == "[DONE]"
    chunks_ = [json.loads(d) for d in data[:-1]]
    assert chunks_[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks_ if c["choices"])
    assert text == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in chunks_ if c["choices"]][-1] == "stop"
    assert chunks_[-1]["choices"] == [] and chunks_[-1]["usage"]["total_tokens"] == 5  # include_usage
    assert released == [done] and gate.inflight == 0
    assert [(r[0], r[2]) for r in gate.records] == [("done", True)]  # one ended streamed request


def test_an_engine_failure_mid_stream_is_told_in_band_then_done():
    failed = Failed(500, {"message": "internal error: boom", "type": "server_error", "param": None, "code": None})
    data, gate, released = sse_parts(events(Text("Hel"), failed))
    assert json.loads(data[-2]) == {"error": failed.error} and data[-1] == "[DONE]"
    assert released == [None] and gate.inflight == 0 and gate.records == [("error", True)]


# ---------------------------------------------------------------------------------------- the search


def test_a_search_begun_from_another_thread_runs_on_the_loop_and_its_calls_always_end(tok):
    from deployments.search import Search

    class Retrieval:
        def __init__(self, fail: bool):
            self.fail, self.asked = fail, []

        async def search(self, tenant, key, names):
            self.asked.append((tenant, key, names))
            if self.fail:
                raise RuntimeError("down")
            return ["call"], {"status": "ok", "hits": 1}

    job = build_job(chat_request(MSG, tools=TOOLS), policy(tok, library=True, text_key=True), "t")

    async def go(fail):
        retrieval = Retrieval(fail)
        search = Search(retrieval, job, asyncio.get_running_loop())
        assert await search.report() == {"status": "not_started"}
        threading.Thread(target=search.begin, args=(job.search_key,)).start()
        calls = await asyncio.wrap_future(search.calls)
        return retrieval.asked, calls, search

    asked, calls, search = asyncio.run(go(False))
    assert asked == [("t", job.search_key, job.tool_names)] and calls == ["call"]
    assert search.wire_embedding() == job.search_key
    asked, calls, _ = asyncio.run(go(True))
    assert calls == []  # a failed search finds nothing; the drafter goes on without it
