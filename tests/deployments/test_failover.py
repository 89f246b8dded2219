"""The failover ingress's decisions (deployments/failover.py) without a cluster: a scripted
replica stream that dies (Ray's ActorDiedError) before or after the response started."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments.failover import REPLICA_LOST, is_replica_lost, read_body, relay, run_asgi

SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
JSON_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


class Scripted:
    """``open_stream`` of a replica per try: each try yields its batches, then raises its error."""

    def __init__(self, *tries):
        self.tries, self.opened = list(tries), 0

    def __call__(self):
        batches, error = self.tries[self.opened]
        self.opened += 1

        async def gen():
            for b in batches:
                yield b
            if error is not None:
                raise error

        return gen()


def run(stream, retries: int = 1):
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    outcome = asyncio.run(relay(stream, send, retries=retries, retry_after_s=2))
    return outcome, sent


def payload(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_replica_lost_recognises_actor_death_and_nothing_else():
    assert is_replica_lost(ActorDiedError()) and is_replica_lost(ActorUnavailableError("gone", None))
    assert not is_replica_lost(ValueError("bad request")) and not is_replica_lost(asyncio.CancelledError())


def test_death_before_the_receipt_is_retried_and_the_client_sees_only_the_retry():
    ok = [[], [JSON_START, body(b'{"ok": 1}')]]
    stream = Scripted(([], ActorUnavailableError("gone", None)), (ok, None))
    outcome, sent = run(stream)
    assert outcome == "retried" and stream.opened == 2
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and payload(sent) == b'{"ok": 1}'


def assert_lost_503(sent):
    assert sent[0]["status"] == 503 and (b"retry-after", b"2") in sent[0]["headers"]
    err = json.loads(payload(sent))["error"]
    assert err["type"] == "server_error" and err["code"] == REPLICA_LOST
    assert sent[-1]["more_body"] is False


def test_death_after_the_receipt_before_the_start_is_a_503_never_a_second_run():
    """The replica may have done the request's work (its library write): not sent again."""
    for batches in ([[]], [[], [JSON_START]]):
        stream = Scripted((batches, ActorDiedError()), ([[], [JSON_START, body(b"{}")]], None))
        outcome, sent = run(stream)
        assert outcome == "unavailable" and stream.opened == 1
        assert_lost_503(sent)


def test_death_on_every_try_before_the_receipt_is_a_503_with_retry_after():
    stream = Scripted(([], ActorDiedError()), ([], ActorUnavailableError("gone", None)))
    outcome, sent = run(stream)
    assert outcome == "unavailable" and stream.opened == 2
    assert_lost_503(sent)


def test_no_retries_means_the_first_death_is_the_503():
    stream = Scripted(([], ActorDiedError()), ([[JSON_START, body(b"{}")]], None))
    outcome, sent = run(stream, retries=0)
    assert outcome == "unavailable" and stream.opened == 1 and sent[0]["status"] == 503


def test_death_after_the_stream_started_ends_it_with_a_retryable_error_event_then_done():
    chunks = [[], [SSE_START, body(b'data: {"id": 1}\n\n', more=True)]]
    stream = Scripted((chunks, ActorDiedError()))
    outcome, sent = run(stream)
    assert outcome == "cut" and stream.opened == 1  # never sent twice once the client saw a byte
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    events = [e[6:] for e in payload(sent).decode().split("\n\n") if e]
    assert events[0] == '{"id": 1}' and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == REPLICA_LOST


def test_a_death_after_the_whole_response_costs_nothing():
    stream = Scripted(([[JSON_START, body(b"{}")]], ActorDiedError()))
    outcome, sent = run(stream)
    assert outcome == "ok" and payload(sent) == b"{}" and len(sent) == 2


def test_other_errors_are_not_answered_for_here():
    with pytest.raises(ValueError):
        run(Scripted(([], ValueError("app bug"))))
    with pytest.raises(RayTaskError):
        run(Scripted(([], RayTaskError("f", "tb", ValueError("app bug")))))


def test_run_asgi_streams_an_apps_messages_and_its_request_body():
    async def app(scope, receive, send):
        msg = await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send(body(msg["body"] + scope["path"].encode(), more=True))
        await asyncio.sleep(0)
        await send(body(b"!"))

    async def collect():
        return [b async for b in run_asgi(app, {"type": "http", "path": "/p"}, b"hi")]

    batches = asyncio.run(collect())
    assert batches[0] == []  # the receipt, before the app ran
    sent = [m for b in batches for m in b]
    assert sent[0]["status"] == 201 and payload(sent) == b"hi/p!"


def test_run_asgi_raises_the_apps_error():
    async def app(scope, receive, send):
        raise KeyError("boom")

    async def collect():
        return [b async for b in run_asgi(app, {"type": "http"}, b"")]

    with pytest.raises(KeyError):
        asyncio.run(collect())


def test_the_body_is_read_no_further_than_one_part_past_the_limit():
    parts = [b"ab", b"cd", b"ef", b"gh"]

    def receiver():
        it = iter(parts)

        async def receive():
            part = next(it)
            return {"type": "http.request", "body": part, "more_body": part != parts[-1]}

        return receive

    assert asyncio.run(read_body(receiver())) == b"abcdefgh"
    assert asyncio.run(read_body(receiver(), limit=3)) == b"abcd"  # over the limit: the replica's 413
