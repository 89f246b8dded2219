"""The FastAPI app of an engine replica: OpenAI routes, auth, errors, SSE, /health, /metrics.

``make_api(backend, cfg)`` takes any backend with async ``stream(req, tenant, timeline)`` (an
async iterator of the engine's typed events, :mod:`deployments.events`, for a
:class:`~deployments.protocol.ChatRequest`), ``generate(req, tenant, timeline)`` and ``info()``:
the replica's own ``EngineHost`` (:class:`LocalBackend`), in a Serve replica as in unit tests.
The chat route's pieces (limits, parsing, the gate, the answer) are :mod:`deployments.chat`.
"""

import asyncio
import logging
from typing import AsyncIterator

from .chat import (  # noqa: F401  (first_token_ms, wants_timeline: the route's helpers, imported from here too)
    ChatRoute,
    cancelled_response,
    chat_completions,
    error_response,
    first_token_ms,
    is_cancellation,
    wants_timeline,
)
from .config import ServeAppConfig, served_name
from .events import Done, Event, Failed
from .gate import LocalGate
from .keys import OPEN, KeyRing
from .protocol import APIError, ChatRequest

log = logging.getLogger("toolspec.serve")


class LocalBackend:
    """An ``EngineHost`` in this process (tests, single-process use)."""

    def __init__(self, host):
        self.host = host

    def stream(self, req: ChatRequest, tenant: str = "default", timeline: bool = False) -> AsyncIterator[Event]:
        return self.host.stream(req, tenant, timeline)

    async def generate(self, req: ChatRequest, tenant: str = "default", timeline: bool = False) -> Done | Failed:
        return await self.host.generate(req, tenant, timeline)

    async def info(self) -> dict:
        return self.host.info()

    async def library(self, op: str, tenant: str) -> dict:
        return await self.host.library_admin(op, tenant)


def _error(exc: APIError):
    return error_response(exc.status, exc.body()["error"], exc.headers)


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


def make_api(backend, cfg: ServeAppConfig, gate=None):
    """Build the app: its middleware, error handlers and routes. ``gate``: where per-key limits
    and metrics are counted (:mod:`deployments.gate`; default: in this process)."""
    from fastapi import FastAPI

    app = FastAPI(title="ToolSpec", docs_url=None, redoc_url=None)
    gate = gate if gate is not None else LocalGate()
    model = served_name(cfg)
    app.state.gate = gate
    app.add_middleware(KeyAuth, keys=KeyRing.load(cfg.api_keys_file, cfg.resolved_api_key()))
    app.add_middleware(QuietCancellation)  # outermost of ours: a cancellation raised anywhere inside ends here
    add_error_handlers(app)
    add_admin_routes(app, backend)
    add_info_routes(app, backend, gate, model)
    add_chat_route(app, ChatRoute(backend, cfg, model, gate))
    return app


# FastAPI reads the handlers' annotations: ``Request`` is imported in each function that declares
# a handler taking it (no ``from __future__ import annotations`` in this module)


def add_error_handlers(app) -> None:
    """Every error an OpenAI client can read: ``APIError`` as it is, FastAPI's 404 / 405 and
    validation errors in OpenAI's shape, anything else a logged 500 (a cancellation a quiet 499)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

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

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc)


def add_admin_routes(app, backend) -> None:
    """The call library's admin routes (admin keys only)."""
    from fastapi import Request

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


def add_info_routes(app, backend, gate, model: str) -> None:
    """``/health``, ``/metrics`` and the model list."""
    from fastapi.responses import JSONResponse, Response

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


def add_chat_route(app, route: ChatRoute) -> None:
    """``POST /v1/chat/completions`` (:func:`deployments.chat.chat_completions`)."""
    from fastapi import Request

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await chat_completions(route, request)
