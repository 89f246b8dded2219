"""The failover ingress: a lost engine replica costs its clients a clear, retryable error.

With ``ingress: replica`` Serve's proxy hands each HTTP request to an engine replica, which serves
the OpenAI routes itself. When that replica's node dies mid-request, the proxy turns the actor's
death into a plain 500 (or cuts a stream already started): the app cannot answer for a process
that is gone, and Serve's router retries only requests it has not yet handed to a replica.

With ``ingress: failover`` a thin ``Ingress`` deployment on the head node (where Serve's proxy
runs) is the app's HTTP entry instead. It reads the request body and forwards the ASGI scope and
body through a streaming :class:`DeploymentHandle` to an engine replica's :meth:`asgi` method,
which runs the replica's own API app (:func:`deployments.http.make_api`: still the one place a
request is parsed and validated) and streams its ASGI messages back. :func:`relay` decides what a
replica's death costs:

- before the replica received the request (its receipt, the stream's first, empty batch): the
  request is sent once more (Serve's router has marked the dead replica and picks another) --
  the app never ran it, so nothing it does runs twice;
- after the receipt, before any body byte reached the client (or when the retry fails too):
  ``503`` with ``Retry-After`` and an OpenAI-style error (type ``server_error``, code
  ``replica_lost``) -- the replica may have done the request's work (its library write), so a
  retry is the client's choice;
- a stream already started: an SSE error event with that error object, then ``[DONE]`` (how the
  API ends every stream that failed mid-way).

The price is one more Ray hop per response message (proxy -> Ingress -> replica and back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from .protocol import APIError
from .streaming import sse

log = logging.getLogger("toolspec.failover")

REPLICA_LOST = "replica_lost"
# the ASGI scope keys the replica's app reads; the rest (Serve's own, lifespan state) stays here
SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)

Message = dict
Send = Callable[[Message], Awaitable[None]]


def is_replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica serving the request is gone (its actor died or cannot be
    reached), as opposed to an error the request itself caused."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return True
    return isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), RayActorError)


def lost_error(retry_after_s: int) -> APIError:
    """The error a client gets for a request its replica died under: retryable."""
    return APIError(
        f"The replica serving this request was lost; retry in {retry_after_s} s.",
        503,
        type="server_error",
        code=REPLICA_LOST,
        headers={"Retry-After": str(retry_after_s)},
    )


def _is_sse(start: Message | None) -> bool:
    for k, v in (start or {}).get("headers") or []:
        if k.lower() == b"content-type" and v.split(b";")[0].strip() == b"text/event-stream":
            return True
    return False


async def relay(
    open_stream: Callable[[], AsyncIterator[list[Message]]],
    send: Send,
    retries: int = 1,
    retry_after_s: int = 1,
    lost: Callable[[BaseException], bool] = is_replica_lost,
) -> str:
    """Send the ASGI messages of one request's replica stream (``open_stream()``: batches of
    messages, the first one empty: the replica's receipt, sent before its app runs) to ``send``,
    answering for a lost replica. Only a request whose replica died before its receipt is sent
    again: the app never ran it, so nothing it does (a library write) can happen twice. One lost
    after its receipt but before any body part gets 503 + ``Retry-After`` (the response's start is
    held until its first body part: the client has seen nothing); one lost mid-stream ends with
    an error event. Returns how it ended: ``"ok"``, ``"retried"`` (completed on a later try),
    ``"unavailable"`` (503 sent) or ``"cut"`` (a started stream ended with the error event)."""
    for attempt in range(retries + 1):
        start: Message | None = None
        received = started = ended = False
        try:
            async for batch in open_stream():
                received = True
                for msg in batch:
                    if msg["type"] == "http.response.start":
                        start = msg
                        continue
                    if not started and start is not None:
                        await send(start)
                        started = True
                    await send(msg)
                    if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                        ended = True
            if start is not None and not started:  # a start without a body part
                await send(start)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "retried" if attempt else "ok"
        except Exception as exc:
            if not lost(exc) or ended:
                if ended:  # the client has its whole response; nothing to answer for
                    return "retried" if attempt else "ok"
                raise
            err = lost_error(retry_after_s)
            if not received and attempt < retries:
                log.warning("replica lost before it received the request (%s); retrying", type(exc).__name__)
                continue
            if not started:
                log.warning("replica lost before the response started (%s); 503", type(exc).__name__)
                await _send_json(send, err)
                return "unavailable"
            log.warning("replica lost mid-response (%s)", type(exc).__name__)
            tail = sse(err.body()) + sse("[DONE]") if _is_sse(start) else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return "cut"
    raise AssertionError("unreachable")


async def _send_json(send: Send, err: APIError) -> None:
    import orjson

    body = orjson.dumps(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """The request's body (None when the client went away first), read no further than the
    first part past ``limit`` bytes: the replica's app refuses a body over its limit (413), so
    more of it would only cost the ingress memory."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        part = msg.get("body", b"")
        parts.append(part)
        size += len(part)
        if not msg.get("more_body", False) or (limit is not None and size > limit):
            return b"".join(parts)


async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[list[Message]]:
    """Run ASGI ``app`` on one HTTP request (``scope``, whole ``body``) and yield its messages,
    every one ready in one batch, after an empty first batch: the receipt :func:`relay` reads
    (sent before the app runs). The request never reports a disconnect: the caller going away
    cancels this generator, which cancels the app."""
    out: asyncio.Queue = asyncio.Queue()
    done = object()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # until cancelled
        return {"type": "http.disconnect"}

    async def send(msg: Message) -> None:
        out.put_nowait(msg)

    yield []  # the receipt
    task = asyncio.ensure_future(app({**scope, "state": {}}, receive, send))
    task.add_done_callback(lambda _: out.put_nowait(done))
    try:
        finished = False
        while not finished:
            batch = [await out.get()]
            while not out.empty():
                batch.append(out.get_nowait())
            if batch[-1] is done:
                batch.pop()
                finished = True
            if batch:
                yield batch
        task.result()  # the app's own error, if any, to the caller
    finally:
        task.cancel()


class FailoverApp:
    """The ``Ingress`` deployment's ASGI app: every HTTP request relayed to an engine replica's
    :meth:`asgi` through ``handle`` (a streaming handle of the ``Replica`` deployment)."""

    def __init__(self, handle, retries: int = 1, retry_after_s: int = 1, body_limit: int | None = None):
        self.handle, self.retries, self.retry_after_s = handle, retries, retry_after_s
        self.body_limit = body_limit  # the replica app's limits.body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = await read_body(receive, self.body_limit)
        if body is None:
            return
        plain = {k: scope[k] for k in SCOPE_KEYS if k in scope}
        await relay(lambda: self.handle.asgi.remote(plain, body), send, self.retries, self.retry_after_s)
