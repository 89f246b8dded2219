"""One request: payload, HTTP + SSE with per-chunk timestamps, tool-call validity, its record."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from toolspec_core.drafters.toolcall.parse import ToolCall, is_name_problem, parse_tool_calls, validate_call

from .metrics import request_timings

ERROR_BODY_CHARS = 200


def parse_endpoint(spec: str) -> tuple[str, str]:
    """'name=url' -> (name, url); a bare URL is named after its host:port."""
    name, sep, url = spec.partition("=")
    if not sep:
        url = spec
        name = url.split("://")[-1].split("/")[0]
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"endpoint URL must start with http(s)://: {spec!r}")
    return name.strip(), url.strip()


def chat_url(base_url: str) -> str:
    """OpenAI base URL ('.../v1', as given to the openai client) -> its chat completions URL."""
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def build_payload(item: dict, opts: dict) -> dict:
    """The chat request of ``item`` under the run's request options (model, max_tokens, stream, ...)."""
    keys = ("model", "max_tokens", "stream")
    payload = {"messages": item["messages"], "temperature": 0, **{k: opts[k] for k in keys}}
    if item["tools"]:
        payload["tools"] = item["tools"]
        if opts.get("tool_choice"):
            payload["tool_choice"] = opts["tool_choice"]
    if opts["stream"] and opts.get("stream_usage", True):
        payload["stream_options"] = {"include_usage": True}
    return payload


# ------------------------------------------------------------------ tool-call validity


def tool_call_problem(calls: list[dict], tools: list[dict]) -> str | None:
    """Why the calls are not valid, or None: the arguments of each must parse as a JSON object, and
    its tool and argument names must be offered (``validate_call``, the benchmark's own rule; a
    missing required argument leaves a call valid). Returns a kind: ``unparsable_arguments``,
    ``unknown_tool`` or ``unknown_argument``."""
    for call in calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "")
        except (TypeError, ValueError):
            return "unparsable_arguments"
        if not isinstance(args, dict):
            return "unparsable_arguments"
        bad = [p for p in validate_call(ToolCall(str(fn.get("name") or ""), args), tools) if is_name_problem(p)]
        if bad:
            return bad[0].split(" '")[0].replace(" ", "_")
    return None


def output_digest(content: str | None, calls: list[dict]) -> str:
    """Hash of what the model produced, to see whether two endpoints answered identically."""
    norm = [[(c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")] for c in calls]
    blob = json.dumps({"content": content or "", "calls": norm}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def text_digest(content: str | None, calls: list[dict]) -> str:
    """Hash of the output read as text and calls: calls a server left in ``content`` (a fenced
    or tagged JSON call its parser did not take) count as calls, arguments compared as JSON
    values -- so a server that returns the model's fenced call as text and one that returns it
    as a tool call agree when the model wrote the same tokens."""
    found = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")) for c in calls]
    norm = []
    for name, args in found:
        try:
            norm.append([name, json.dumps(json.loads(args or ""), sort_keys=True)])
        except ValueError:
            norm.append([name, args])
    text = content or ""
    if not calls and text:
        parsed = parse_tool_calls(text)
        if parsed.calls:
            text = parsed.content or ""
            norm = [[c.name, json.dumps(c.arguments, sort_keys=True)] for c in parsed.calls]
    blob = json.dumps({"content": text.strip(), "calls": norm}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ HTTP


class ServerError(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind = kind


def _merge_tool_call_deltas(acc: dict[int, dict], deltas: list[dict]) -> None:
    """OpenAI streams a call as deltas: id/name first, then argument fragments, keyed by index."""
    for d in deltas:
        slot = acc.setdefault(
            d.get("index", len(acc)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if d.get("id"):
            slot["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]


def call_complete(calls: dict[int, dict], content: list[str], new_content: bool) -> bool:
    """Whether the stream so far holds a whole tool call: its first call's arguments parse as a
    JSON object, or -- a server that leaves the model's fenced or tagged JSON call in ``content``
    (vLLM's hermes parser with the 0.5B model) -- the content parses to a call
    (``parse_tool_calls``, read again only when a chunk brought content)."""
    if calls:
        try:
            return isinstance(json.loads(calls[min(calls)]["function"]["arguments"] or "null"), dict)
        except ValueError:
            return False
    return new_content and bool(parse_tool_calls("".join(content)).calls)


async def read_stream(response) -> dict:
    """Consume an SSE stream; note when each content / tool-call chunk arrived (perf_counter) and
    when its first tool call was complete (:func:`call_complete`)."""
    content, calls, usage, stats, chunk_times, call_done = [], {}, None, None, [], None
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if event.get("error"):
            raise ServerError("stream_error", str(event["error"])[:ERROR_BODY_CHARS])
        usage = event.get("usage") or usage
        stats = event.get("toolspec") or stats
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                chunk_times.append(time.perf_counter())
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("tool_calls"):
                _merge_tool_call_deltas(calls, delta["tool_calls"])
            if call_done is None and chunk_times and call_complete(calls, content, bool(delta.get("content"))):
                call_done = chunk_times[-1]
    if not done:  # the server went away mid-stream (e.g. its replica's node was lost)
        raise ServerError("stream_cut", f"the stream ended without [DONE] after {len(chunk_times)} chunks")
    return {
        "content": "".join(content),
        "tool_calls": [calls[k] for k in sorted(calls)],
        "usage": usage,
        "chunk_times": chunk_times,
        "server_stats": stats,
        "call_done": call_done,
    }


async def send_one(client, url: str, payload: dict, headers: dict) -> dict:
    """One request -> a result dict with perf_counter ``sent``/``finished``; raises on failure."""
    sent = time.perf_counter()
    if payload.get("stream"):
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise ServerError(f"http_{response.status_code}", body[:ERROR_BODY_CHARS])
            out = await read_stream(response)
    else:
        response = await client.post(url, json=payload, headers=headers)
        if response.status_code != 200:
            raise ServerError(f"http_{response.status_code}", response.text[:ERROR_BODY_CHARS])
        body = response.json()
        try:
            message = body["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerError("bad_response", str(body)[:ERROR_BODY_CHARS]) from exc
        out = {
            "content": message.get("content"),
            "tool_calls": message.get("tool_calls") or [],
            "usage": body.get("usage"),
            "chunk_times": None,
            "server_stats": body.get("toolspec"),
            "call_done": None,
        }
    out["sent"], out["finished"] = sent, time.perf_counter()
    return out


def error_kind(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, ServerError):
        return exc.kind
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, (json.JSONDecodeError, httpx.DecodingError)):
        return "bad_response"
    if isinstance(exc, httpx.RemoteProtocolError):  # the connection closed in the middle of a response
        return "connection_lost"
    if isinstance(exc, httpx.HTTPError):
        return "http_error"
    return type(exc).__name__


# ------------------------------------------------------------------ records


RECORD_FIELDS = (  # a request row's fields in the records file's order
    *("index", "item_id", "session", "turn", "ok", "error", "detail", "e2e_ms", "ttft_ms", "tpot_ms", "itl_ms"),
    *("server_first_token_ms", "call_complete_ms"),
    *("prompt_tokens", "completion_tokens", "tool_calls", "tool_call_problem", "gold_name_match", "mat"),
    *("cached_tokens", "server_prefill_ms", "server_decode_ms", "drafted_tokens", "accepted_tokens", "digest"),
    "text_digest",
    *("started", "node"),
    "server_timeline",
)


def new_record(index: int, item: dict, node: str, session: int, turn: int) -> dict:
    """The per-request row; ``started`` is wall time (for the records file), latencies are not."""
    rec = dict.fromkeys(RECORD_FIELDS)
    rec.update(index=index, item_id=item["id"], session=session, turn=turn, ok=False, itl_ms=[], tool_calls=0)
    rec.update(started=time.time(), node=node)
    return rec


def fill_success(rec: dict, item: dict, out: dict) -> None:
    calls = out["tool_calls"]
    usage = out.get("usage") or {}
    stats = out.get("server_stats")
    if isinstance(stats, dict):  # ToolSpec servers report their speculation statistics per response
        number = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        rec.update(mat=number.get("mat"), drafted_tokens=stats.get("drafted_tokens"))
        rec["accepted_tokens"] = stats.get("accepted_tokens")
        # where the server's time went: forwards that held this request's prompt rows / its drafts
        for part in ("prefill", "decode"):
            rec[f"server_{part}_ms"] = 1000 * number[f"{part}_s"] if f"{part}_s" in number else None
        rec["server_first_token_ms"] = server_first_token_ms(stats)
        if isinstance(stats.get("timeline"), dict):  # where its first token waited (wall-clock marks, its first steps)
            rec["server_timeline"] = {
                **stats["timeline"],
                "retrieval": stats.get("retrieval"),
                "early_steps": stats.get("early_steps"),
            }
    chunks = out["chunk_times"]
    tokens = usage.get("completion_tokens", len(chunks) if chunks is not None else None)
    rec.update(request_timings(out["sent"], chunks, out["finished"], tokens))
    if out.get("call_done") is not None:
        rec["call_complete_ms"] = (out["call_done"] - out["sent"]) * 1e3
    details = usage.get("prompt_tokens_details") or {}
    rec.update(
        ok=True,
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        completion_tokens=tokens,
        tool_calls=len(calls),
        digest=output_digest(out["content"], calls),
        text_digest=text_digest(out["content"], calls),
    )
    if calls:
        rec["tool_call_problem"] = tool_call_problem(calls, item["tools"])
    if item["gold_names"]:
        rec["gold_name_match"] = [(c.get("function") or {}).get("name") for c in calls][:1] == item["gold_names"][:1]


def server_first_token_ms(stats: dict) -> float | None:
    """When a ToolSpec server generated the request's first token, in ms after its HTTP route got
    the request (the ``toolspec`` field's ``first_token_ms``, else the timeline's marks where the
    response carries them): beside TTFT, what the first streamed chunk waited for after the
    token -- a call's name is sent whole, so its first chunk follows the name's last token."""
    value = stats.get("first_token_ms")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    marks = stats.get("timeline")
    if isinstance(marks, dict) and isinstance(marks.get("first_token"), (int, float)) and marks.get("http_in"):
        return (marks["first_token"] - marks["http_in"]) * 1e3
    return None
