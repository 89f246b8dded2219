"""The ``/v1/chat/completions`` route in its pieces: the body's limits, parsing, the gate, the
answer (one JSON response or an SSE stream).

No Ray here. Each piece is a function tests call directly; :func:`chat_completions` is the route
(:func:`deployments.http.make_api` mounts it). The request crosses three objects on its way in --
the body's bytes (:func:`read_body`, :func:`decode_body`: ``limits.body_bytes`` and
``limits.json_depth``), a :class:`~deployments.protocol.ChatRequest` (:func:`parse_chat`: every
field's type, range and count limit) and the replica's :class:`~deployments.job.EngineJob` (built
by the backend in a worker thread: the token limits) -- and comes back as the engine's typed
events (:mod:`deployments.events`), which :func:`sse_events` turns into SSE chunks and
:func:`json_answer` into one ``chat.completion``. Every piece refuses bad input with an
:class:`~deployments.protocol.APIError` (OpenAI's JSON error body, a 4xx); the route counts each
refusal once in the gate's metrics.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from .config import RequestLimits, ServeAppConfig
from .events import Done, Event, Failed, Text
from .gate import summary
from .keys import ApiKey
from .protocol import APIError, ChatRequest, chat_completion, parse_mode, parse_request, schema_size
from .streaming import StreamShaper, sse, sse_many

log = logging.getLogger("toolspec.serve")

TIMELINE_HEADER = "x-toolspec-timeline"


def wants_timeline(headers) -> bool:
    """Whether the request's headers ask for its timeline (``X-ToolSpec-Timeline: 1`` or ``true``):
    a load tester can ask every server so, where a body field might be refused."""
    return headers.get(TIMELINE_HEADER, "").strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------------------- limits


def _too_large(most: int) -> APIError:
    return APIError(f"Request body over {most} bytes (limits.body_bytes)", 413, code="request_too_large")


async def read_body(headers, chunks: AsyncIterator[bytes], limits: RequestLimits) -> bytes:
    """The body's bytes, at most ``limits.body_bytes`` (a 413 otherwise): refused on its
    ``content-length`` before it is read, else as soon as what was read passes the limit."""
    most = limits.body_bytes
    sent = headers.get("content-length", "")
    if sent.isdigit() and int(sent) > most:
        raise _too_large(most)
    raw = b""
    async for part in chunks:
        raw += part
        if len(raw) > most:
            raise _too_large(most)
    return raw


def decode_body(raw: bytes, limits: RequestLimits) -> Any:
    """The body's JSON value, nested at most ``limits.json_depth`` levels (a 400 otherwise, as for
    bytes that are not JSON)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly.)",
            400,
            code="invalid_json",
        ) from None
    except RecursionError:  # nested beyond the parser's stack
        body = None
    depth = schema_size(body, limits.json_depth, 10**9)[0] if body is not None else None
    if depth is None or depth > limits.json_depth:
        raise APIError(
            f"The request body nests deeper than {limits.json_depth} levels (limits.json_depth)",
            400,
            code="json_too_deep",
        )
    return body


# ---------------------------------------------------------------------------------------- parsing


def asks_stream(body: Any) -> bool:
    """Whether a decoded body asks for a stream (what its errors are counted as)."""
    return isinstance(body, dict) and body.get("stream") is True


def parse_chat(body: Any, cfg: ServeAppConfig, model: str) -> ChatRequest:
    """The validated request of a decoded body under the server's limits (a 4xx otherwise)."""
    return parse_request(body, model, cfg.max_tokens_limit, cfg.limits)


# ---------------------------------------------------------------------------------------- the gate


async def admit(gate, key: ApiKey) -> None:
    """Ask the gate once for a key with limits (a 429 with ``Retry-After`` when it is over one);
    a key without limits never waits on it."""
    refused = await gate.admit(key) if key.limited else None
    if refused is None:
        return
    limit, wait = refused
    retry = max(1, math.ceil(wait))
    raise APIError(
        f"Rate limit reached for this key ({limit}); retry in {retry} s.",
        429,
        type="tokens" if limit == "tokens_per_minute" else "requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry)},
    )


def tokens_of(result) -> int:
    """Prompt + completion tokens of a finished request's ``Done`` (0 for anything else)."""
    return result.prompt_tokens + result.completion_tokens if isinstance(result, Done) else 0


# ---------------------------------------------------------------------------------------- the answer


@dataclass(frozen=True)
class Call:
    """One admitted request as the answer's pieces need it: the request, the caller's tenant and
    key, whether its timeline is asked for, when the route got it (``t0``: perf counter,
    ``wall0``: wall clock)."""

    req: ChatRequest
    key: ApiKey
    tenant: str
    timeline: bool
    t0: float
    wall0: float

    @property
    def parse(self) -> bool | str:
        return parse_mode(self.req)


def first_token_ms(extra: dict | None, wall0: float) -> None:
    """The ``toolspec`` field's ``first_token_ms``: the engine's first generated token, in ms after
    this route got the request (its ``first_token_at`` mark, replaced). Beside the client's time to
    its first chunk it shows what the chunk waited for after the token: a call's name is streamed
    whole, so a call's first chunk follows the name's last token."""
    if extra is None:
        return
    at = extra.pop("first_token_at", None)
    extra["first_token_ms"] = None if at is None else round((at - wall0) * 1e3, 3)


def finished(call: Call, done: Done, model: str) -> dict:
    """The non-streaming ``chat.completion`` of a finished request."""
    first_token_ms(done.extra, call.wall0)
    return chat_completion(done, call.parse, model)


async def sse_events(
    events: AsyncIterator[Event], shaper: StreamShaper, call: Call, gate, release: Callable[[Done | None], None]
) -> AsyncIterator[bytes]:
    """The SSE body of a stream whose first event was ``Start``: one body part per engine event
    (every chunk a delta makes, in one write), the last chunk and usage on ``Done``, a ``Failed``
    event or a failure mid-stream told in band, then ``[DONE]``. ``release``: the request's end,
    told to the gate once with its ``Done`` (None when it did not finish)."""
    gate.inflight += 1
    ttft, done = None, None
    try:
        yield sse(shaper.start())
        async for ev in events:
            if isinstance(ev, Text):
                part = sse_many(shaper.feed(ev.delta, ev.logprobs))
                if part:
                    ttft = ttft if ttft is not None else time.perf_counter() - call.t0
                    yield part
            elif isinstance(ev, Done):
                done = ev
                marks = (ev.extra or {}).get("timeline")
                if isinstance(marks, dict):  # asked for: the route's marks beside the engine's
                    marks.update(http_in=call.wall0, first_chunk=None if ttft is None else call.wall0 + ttft)
                first_token_ms(ev.extra, call.wall0)
                yield sse_many(shaper.finish(ev))
                if shaper.mismatch:
                    log.warning("stream deltas diverged from the final parse (request %s)", shaper.id)
                gate.observe(("done", summary(ev), True, time.perf_counter() - call.t0, ttft))
            elif isinstance(ev, Failed):  # the engine failed the request: tell the client in-band
                gate.observe(("error", True))
                yield sse({"error": ev.error})
                break
    except Exception as exc:  # mid-stream failure: tell the client in-band, then end
        if is_cancellation(exc):  # the client went away (Serve cancelled the replica's stream)
            log.debug("stream cancelled (%s)", type(exc).__name__)
            return
        log.exception("stream failed")
        gate.observe(("error", True))
        yield sse(APIError(f"internal error: {type(exc).__name__}", 500, type="server_error").body())
    finally:
        gate.inflight -= 1
        release(done)
    yield sse("[DONE]")


_CANCELLED = ("CancelledError", "TaskCancelledError", "RequestCancelledError", "ClientDisconnect")


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` only says the request was cancelled -- its client went away (asyncio's
    ``CancelledError``, Ray's ``TaskCancelledError`` / Serve's ``RequestCancelledError``,
    Starlette's ``ClientDisconnect`` while the body is still being read, or a group of nothing
    else): normal, so it is not logged as an error."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_cancellation(e) for e in exc.exceptions)
    return any(c.__name__ in _CANCELLED for c in type(exc).__mro__)


def cancelled_response():
    """What a cancelled request answers, should anyone still read it (nginx's "client closed request")."""
    from fastapi.responses import Response

    return Response(status_code=499)


def error_response(status: int, error: dict, headers: dict[str, str] | None = None):
    """The OpenAI-style JSON error answer (``error``: the body's ``error`` object) -- every refusal
    the API makes, from a Failed event or an :class:`~deployments.protocol.APIError`."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": error}, status_code=status, headers=headers or None)


@dataclass(frozen=True)
class ChatRoute:
    """What the route answers with: the replica's backend (``stream`` / ``generate`` of a
    ``ChatRequest``, :class:`~deployments.http.LocalBackend`), the server's config and served
    model name, the gate that counts limits and metrics."""

    backend: Any
    cfg: ServeAppConfig
    model: str
    gate: Any

    def release(self, call: Call) -> Callable[[Done | None], None]:
        """The request's end told to the gate (a key with limits only)."""
        return lambda result: self.gate.release(call.key, tokens_of(result)) if call.key.limited else None

    async def json_answer(self, call: Call):
        """The non-streaming answer: the engine's ``Done`` as one ``chat.completion``, or its
        ``Failed`` as OpenAI's error."""
        from fastapi.responses import JSONResponse

        result, gate = None, self.gate
        gate.inflight += 1
        try:
            result = await self.backend.generate(call.req, call.tenant, call.timeline)
        except Exception as exc:
            if not is_cancellation(exc):
                raise
            log.debug("request cancelled (%s)", type(exc).__name__)
            return cancelled_response()
        finally:
            gate.inflight -= 1
            self.release(call)(result)
        if not isinstance(result, Done):
            gate.observe(("error", False))
            return error_response(result.status, result.error)
        gate.observe(("done", summary(result), False, time.perf_counter() - call.t0, None))
        return JSONResponse(finished(call, result, self.model))

    async def stream_answer(self, call: Call):
        """The streaming answer: an SSE response once the engine has taken the request (its first
        event ``Start``), or OpenAI's error when it refused it (a ``Failed`` first event)."""
        from fastapi.responses import StreamingResponse

        release = self.release(call)
        try:
            events = self.backend.stream(call.req, call.tenant, call.timeline).__aiter__()
            first = await events.__anext__()
        except Exception as exc:
            release(None)
            if not is_cancellation(exc):
                raise
            log.debug("request cancelled (%s)", type(exc).__name__)
            return cancelled_response()
        except BaseException:
            release(None)
            raise
        if isinstance(first, Failed):
            release(None)
            self.gate.observe(("error", True))
            await events.aclose()
            return error_response(first.status, first.error)
        include_usage = bool(call.req.stream_options and call.req.stream_options.include_usage)
        shaper = StreamShaper(self.model, call.parse, include_usage)
        body = sse_events(events, shaper, call, self.gate, release)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def chat_completions(route: ChatRoute, request):
    """``POST /v1/chat/completions``: the body read within its limits, parsed, admitted by the
    gate, then answered as JSON or as a stream. A refusal is an :class:`APIError` (OpenAI's error
    body), counted once in the metrics."""
    t0, wall0 = time.perf_counter(), time.time()
    cfg, stream = route.cfg, False
    try:
        body = decode_body(await read_body(request.headers, request.stream(), cfg.limits), cfg.limits)
        stream = asks_stream(body)
        req = parse_chat(body, cfg, route.model)
        key = request.state.key
        await admit(route.gate, key)
    except APIError:
        route.gate.observe(("error", stream))
        raise
    timeline = cfg.timeline or wants_timeline(request.headers)
    call = Call(req, key, key.library_tenant(req.user), timeline, t0, wall0)
    return await (route.stream_answer(call) if req.stream else route.json_answer(call))
