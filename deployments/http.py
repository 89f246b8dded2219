"""The FastAPI app of an engine replica: OpenAI routes, auth, errors, SSE, /health, /metrics.

``make_api(backend, cfg)`` takes any backend with async ``stream(req)`` (an async iterator of
the engine's typed events, :mod:`deployments.events`), ``generate(req)`` and ``info()``: the
replica's own ``EngineHost`` (:class:`LocalBackend`), in a Serve replica as in unit tests.
"""

import asyncio
import json
import logging
import math
import time

from .config import ServeAppConfig, served_name
from .events import Done, Failed, Text
from .gate import LocalGate, summary
from .keys import OPEN, KeyRing
from .protocol import APIError, EngineRequest, chat_completion, engine_request, parse_request, parses_tools, schema_size
from .streaming import StreamShaper, sse, sse_many

log = logging.getLogger("toolspec.serve")


class LocalBackend:
    """An ``EngineHost`` in this process (tests, single-process use)."""

    def __init__(self, host):
        self.host = host

    def stream(self, req: EngineRequest):
        return self.host.stream(req)

    async def generate(self, req: EngineRequest) -> dict:
        return await self.host.generate(req)

    async def info(self) -> dict:
        return self.host.info()

    async def library(self, op: str, tenant: str) -> dict:
        return await self.host.library_admin(op, tenant)


def _tokens(result) -> int:
    """Prompt + completion tokens of a finished request's ``Done`` (0 for anything else)."""
    return result.prompt_tokens + result.completion_tokens if isinstance(result, Done) else 0


def _error(exc: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


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


class QuietCancellation:
    """ASGI middleware: a request cancelled because its client went away -- Serve cancels the
    ingress, its replica call, or the ``send`` of a response already streaming, and Starlette's
    streaming task group raises that in an exception group -- ends here, logged at debug level.
    Nothing else is caught."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if not is_cancellation(exc):
                raise
            log.debug("request cancelled (%s)", type(exc).__name__)
            if not started and scope["type"] == "http":
                try:
                    await cancelled_response()(scope, receive, send)
                except Exception:  # nobody is listening any more
                    pass


class KeyAuth:
    """ASGI middleware: the caller's key (its tenant and limits) in ``request.state.key``; an open
    server's callers are all the one local tenant. ``/v1/*`` without a known key is a 401. Plain
    ASGI, so a request's exceptions reach the app's handlers as they were raised (no task group
    wraps them)."""

    def __init__(self, app, keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = OPEN
        if self.keys is not None and "/v1/" in scope["path"] + "/":
            sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            key = self.keys.lookup(sent[7:] if sent.lower().startswith("bearer ") else "")
            if key is None:
                err = APIError("Incorrect API key provided.", 401, param=None, code="invalid_api_key")
                return await _error(err)(scope, receive, send)
        scope.setdefault("state", {})["key"] = key
        return await self.app(scope, receive, send)


def first_token_ms(extra: dict | None, wall0: float) -> None:
    """The ``toolspec`` field's ``first_token_ms``: the engine's first generated token, in ms after
    this route got the request (its ``first_token_at`` mark, replaced). Beside the client's time to
    its first chunk it shows what the chunk waited for after the token: a call's name is streamed
    whole, so a call's first chunk follows the name's last token."""
    if extra is None:
        return
    at = extra.pop("first_token_at", None)
    extra["first_token_ms"] = None if at is None else round((at - wall0) * 1e3, 3)


TIMELINE_HEADER = "x-toolspec-timeline"


def wants_timeline(headers) -> bool:
    """Whether the request's headers ask for its timeline (``X-ToolSpec-Timeline: 1`` or ``true``):
    a load tester can ask every server so, where a body field might be refused."""
    return headers.get(TIMELINE_HEADER, "").strip().lower() in ("1", "true", "yes")


def make_api(backend, cfg: ServeAppConfig, gate=None):
    """Build the app (no ``from __future__ import annotations`` here: FastAPI reads the
    handlers' annotations, and ``Request`` is imported lazily in this scope). ``gate``: where
    per-key limits and metrics are counted (:mod:`deployments.gate`; default: in this process)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="ToolSpec", docs_url=None, redoc_url=None)
    gate = gate if gate is not None else LocalGate()
    model = served_name(cfg)
    keys = KeyRing.load(cfg.api_keys_file, cfg.resolved_api_key())
    app.state.gate = gate

    def error(stream: bool) -> None:
        gate.observe(("error", stream))

    app.add_middleware(KeyAuth, keys=keys)
    app.add_middleware(QuietCancellation)  # outermost of ours: a cancellation raised anywhere inside ends here

    def admin(request: Request, tenant: str):
        if not request.state.key.admin:
            raise APIError("This key may not administer libraries.", 403, type="permission_error", code="not_admin")
        if not tenant or "/" in tenant:
            raise APIError(f"Invalid tenant {tenant!r}", 400, param="tenant", code="invalid_value")

    @app.delete("/v1/toolspec/library/{tenant}")
    async def forget_library(request: Request, tenant: str):
        """Forget every stored call of ``tenant`` and its users (admin keys only)."""
        admin(request, tenant)
        return await backend.library("forget", tenant)

    @app.get("/v1/toolspec/library/{tenant}/stats")
    async def library_stats(request: Request, tenant: str):
        admin(request, tenant)
        return await backend.library("stats", tenant)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(str(exc.detail), exc.status_code, type=kind))

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError):
        return _error(APIError(str(exc), 400))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        if is_cancellation(exc):  # the client went away (a cancellation the route did not see)
            log.debug("request cancelled (%s)", type(exc).__name__)
            return cancelled_response()
        log.exception("unhandled error")
        return _error(APIError(f"internal error: {type(exc).__name__}", 500, type="server_error"))

    @app.get("/health")
    async def health():
        try:
            info = await asyncio.wait_for(backend.info(), 10.0)
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, status_code=503)
        return {"status": "ok", "model": model, "engine": info}

    @app.get("/metrics")
    async def prometheus():
        info = None
        try:  # this replica's engine gauges; the request counters are the app's (the gate's)
            info = await asyncio.wait_for(backend.info(), 2.0)
        except Exception as exc:
            log.debug("engine info for /metrics unavailable: %s", exc)
        body, ctype = await gate.render(info)
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "toolspec"}]}

    @app.get("/v1/models/{name}")
    async def model_info(name: str):
        if name != model:
            raise APIError(
                f"The model '{name}' does not exist",
                404,
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return {"id": model, "object": "model", "created": 0, "owned_by": "toolspec"}

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0, wall0 = time.perf_counter(), time.time()
        most = cfg.limits.body_bytes
        sent = request.headers.get("content-length", "")
        if sent.isdigit() and int(sent) > most:  # refused before it is read
            error(False)
            raise APIError(f"Request body over {most} bytes (limits.body_bytes)", 413, code="request_too_large")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > most:
                error(False)
                raise APIError(f"Request body over {most} bytes (limits.body_bytes)", 413, code="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            error(False)
            raise APIError(
                "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly.)",
                400,
                code="invalid_json",
            )
        except RecursionError:  # nested beyond the parser's stack
            body = None
        depth = schema_size(body, cfg.limits.json_depth, 10**9)[0] if body is not None else None
        if depth is None or depth > cfg.limits.json_depth:
            error(False)
            raise APIError(
                f"The request body nests deeper than {cfg.limits.json_depth} levels (limits.json_depth)",
                400,
                code="json_too_deep",
            )
        try:
            req = parse_request(body, model, cfg.max_tokens_limit, cfg.limits)
        except APIError:
            error(bool(isinstance(body, dict) and body.get("stream") is True))
            raise
        key = request.state.key
        ereq = engine_request(req, key.library_tenant(req.user), cfg.timeline or wants_timeline(request.headers))
        parse = parses_tools(ereq)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        limited = key.limited
        refused = await gate.admit(key) if limited else None
        if refused is not None:
            limit, wait = refused
            error(req.stream)
            raise APIError(
                f"Rate limit reached for this key ({limit}); retry in {max(1, math.ceil(wait))} s.",
                429,
                type="tokens" if limit == "tokens_per_minute" else "requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

        def release(result) -> None:
            if limited:
                gate.release(key, _tokens(result))

        if not req.stream:
            result = None
            gate.inflight += 1
            try:
                result = await backend.generate(ereq)
            except Exception as exc:
                if not is_cancellation(exc):
                    raise
                log.debug("request cancelled (%s)", type(exc).__name__)
                return cancelled_response()
            finally:
                gate.inflight -= 1
                release(result)
            if not isinstance(result, Done):
                error(False)
                return JSONResponse({"error": result.error}, status_code=result.status)
            first_token_ms(result.extra, wall0)
            gate.observe(("done", summary(result), False, time.perf_counter() - t0, None))
            return JSONResponse(chat_completion(result, parse, model))

        try:
            events = backend.stream(ereq).__aiter__()
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
            error(True)
            await events.aclose()
            return JSONResponse({"error": first.error}, status_code=first.status)

        async def body_iter():
            """One body part per engine event: every chunk a delta makes, in one SSE write."""
            shaper = StreamShaper(model, parse, include_usage)
            gate.inflight += 1
            ttft, done = None, None
            try:
                yield sse(shaper.start())
                async for ev in events:
                    if isinstance(ev, Text):
                        part = sse_many(shaper.feed(ev.delta, ev.logprobs))
                        if part:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            yield part
                    elif isinstance(ev, Done):
                        done = ev
                        marks = (ev.extra or {}).get("timeline")
                        if isinstance(marks, dict):  # asked for: the route's marks beside the engine's
                            marks.update(http_in=wall0, first_chunk=None if ttft is None else wall0 + ttft)
                        first_token_ms(ev.extra, wall0)
                        yield sse_many(shaper.finish(ev))
                        if shaper.mismatch:
                            log.warning("stream deltas diverged from the final parse (request %s)", shaper.id)
                        gate.observe(("done", summary(ev), True, time.perf_counter() - t0, ttft))
                    elif isinstance(ev, Failed):  # the engine failed the request: tell the client in-band
                        error(True)
                        yield sse({"error": ev.error})
                        break
            except Exception as exc:  # mid-stream failure: tell the client in-band, then end
                if is_cancellation(exc):  # the client went away (Serve cancelled the replica's stream)
                    log.debug("stream cancelled (%s)", type(exc).__name__)
                    return
                log.exception("stream failed")
                error(True)
                yield sse(APIError(f"internal error: {type(exc).__name__}", 500, type="server_error").body())
            finally:
                gate.inflight -= 1
                release(done)
            yield sse("[DONE]")

        return StreamingResponse(body_iter(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app
