"""What is sent: single requests from dataset JSONL files, or agent conversations replayed step by step.

A workload is a list of *units*; a unit is a list of request items sent one after the other by
one client (a single request is a unit of one). A seeded shuffle fixes the order of the units,
so every endpoint and every level sees the same sequence.

Agent conversations (``bfcl_v3_multi_turn``, one dataset row per (conversation, turn), each row's
messages extending the previous row's): a turn with gold calls c1..cm becomes m + 1 requests,
the turn's messages, then with (assistant c1, tool result r1) appended, ..., up to cm / rm, just as
an agent backend sees them; the tool results are the dataset's real ones (the next turn's history
where there is one, else ``meta.gold_call_results``). Consecutive requests of a conversation
share their prefix, so a server's history library and prefix cache see realistic reuse.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from ..datasets import CONVERSATIONS, SINGLE_TURN, dev_set, read_jsonl


def api_name(name: str) -> str:
    """A tool name as OpenAI-compatible servers accept it (``^[a-zA-Z0-9_-]{1,64}$``); BFCL's dotted
    names map ``.`` to ``_`` as BFCL itself does."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64]


def _renamed_tools(tools: list[dict]) -> list[dict]:
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        if "name" in fn and api_name(fn["name"]) != fn["name"]:
            tool = dict(tool, function=dict(fn, name=api_name(fn["name"])))
        out.append(tool)
    return out


def _renamed_messages(messages: list[dict]) -> list[dict]:
    """History with its earlier calls and results under the names the request offers."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                dict(c, function=dict(c["function"], name=api_name(c["function"]["name"]))) for c in m["tool_calls"]
            ]
            m = dict(m, tool_calls=calls)
        if m.get("role") == "tool" and m.get("name"):
            m = dict(m, name=api_name(m["name"]))
        out.append(m)
    return out


def _item(row: dict, item_id: str, messages: list[dict], gold_names: list[str]) -> dict:
    tools = _renamed_tools(row.get("tools") or [])
    return {
        "id": item_id,
        "messages": _renamed_messages(messages),
        "tools": tools,
        "gold_names": list(map(api_name, gold_names)),
    }


def read_rows(path: str | Path) -> list[dict]:
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"no items in {path}")
    return rows


def load_items(path: str | Path, limit: int | None = None) -> list[dict]:
    """Dataset rows reduced to what a request needs (benchmarks/datasets/README.md format)."""
    rows = read_rows(path)[:limit] if limit else read_rows(path)
    return [
        _item(row, row.get("id", str(n)), row["messages"], [c["name"] for c in row.get("gold_calls") or []])
        for n, row in enumerate(rows)
    ]


def _call_messages(row: dict, first_id: int) -> list[dict]:
    """(assistant call, tool result) pairs of a turn's gold calls, built from the row itself."""
    out = []
    results = (row.get("meta") or {}).get("gold_call_results") or []
    for j, call in enumerate(row.get("gold_calls") or []):
        cid = f"call_{first_id + j}"
        fn = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        out.append(
            {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": fn}]}
        )
        result = results[j] if j < len(results) else "ok"
        out.append({"role": "tool", "tool_call_id": cid, "name": call["name"], "content": result})
    return out


def _leading_call_pairs(messages: list[dict]) -> list[dict]:
    """The (assistant call, tool result) pairs a turn's history starts with, up to the next user message."""
    n = 0
    while n + 1 < len(messages) and messages[n]["role"] == "assistant" and messages[n + 1]["role"] == "tool":
        n += 2
    return messages[:n]


def load_conversations(path: str | Path, limit: int | None = None) -> list[list[dict]]:
    """Conversations (in file order) as units of requests, one per agent step (see module doc)."""
    by_entry: dict[str, list[dict]] = {}
    for row in read_rows(path):
        meta = row.get("meta") or {}
        by_entry.setdefault(meta.get("entry_id", row.get("id")), []).append(row)
    units = []
    for entry, rows in list(by_entry.items())[:limit] if limit else by_entry.items():
        rows.sort(key=lambda r: (r.get("meta") or {}).get("turn", 0))
        steps, calls_so_far = [], 0
        for t, row in enumerate(rows):
            history = row["messages"]
            if t + 1 < len(rows) and rows[t + 1]["messages"][: len(history)] == history:
                following = _leading_call_pairs(rows[t + 1]["messages"][len(history) :])
            else:
                following = _call_messages(row, calls_so_far)
            gold = [c["name"] for c in row.get("gold_calls") or []]
            for j in range(len(following) // 2 + 1):
                steps.append(_item(row, f"{row.get('id', entry)}-s{j}", history + following[: 2 * j], gold[j : j + 1]))
            calls_so_far += len(following) // 2
        units.append(steps)
    if not units:
        raise ValueError(f"no conversations in {path}")
    return units


def prompt_chars(item: dict) -> int:
    """How long a request's prompt is, without a tokenizer: its messages and tools as JSON."""
    return len(json.dumps(item["messages"])) + len(json.dumps(item["tools"]))


def load_workload(
    kind: str, datasets: list[str], limit: int | None, seed: int, span: tuple[int, int | None] | None = None
) -> list[list[dict]]:
    """Units of the workload, in the seeded order every endpoint and level replays; with ``span``
    only those whose first request's prompt_chars lies in [min, max]."""
    if kind == "conversations":
        units = [u for path in datasets for u in load_conversations(path, limit)]
    else:
        units = [[item] for path in datasets for item in load_items(path, limit)]
    if span:
        low, high = span
        units = [u for u in units if low <= prompt_chars(u[0]) <= (high if high is not None else float("inf"))]
        if not units:
            raise ValueError(f"no request of {', '.join(datasets)} has {span[0]}..{span[1] or ''} prompt characters")
    random.Random(seed).shuffle(units)
    return units


def default_datasets(kind: str) -> list[str]:
    names = (CONVERSATIONS,) if kind == "conversations" else SINGLE_TURN
    return [str(dev_set(n)) for n in names]


def level_sessions(units: list[list[dict]], n: int, offset: int = 0) -> tuple[list[list[tuple[int, dict]]], int]:
    """Sessions holding *n* requests in all, from ``offset`` in the unit order (cycling); the last
    conversation is cut to fit. Each request gets its index in the level; returns the sessions and
    how many units they used."""
    sessions, index, used = [], 0, 0
    while index < n:
        unit = units[(offset + used) % len(units)][: n - index]
        sessions.append([(index + k, item) for k, item in enumerate(unit)])
        index += len(unit)
        used += 1
    return sessions, used


NONCE_HEX = 16  # hex digits of a request's nonce line: 64 bits, no two requests of a run share one


def request_nonce(salt: str, level: str | int, index: int, item_id: str) -> str:
    """The nonce of one request of a run: a hash of the run's ``salt``, the level (or "warmup"), the
    request's index in it and its item id. Every endpoint of the run is sent the same request at
    the same (level, index), so each gets the same prompt and outputs compare request by request;
    no other request of the run has the same nonce, so no two prompts share a prefix."""
    key = f"{salt}\x00{level}\x00{index}\x00{item_id}".encode()
    return hashlib.sha256(key).hexdigest()[:NONCE_HEX]


def with_nonce(item: dict, nonce: str) -> dict:
    """``item`` with ``nonce`` as its own line at the very start of its prompt: first in its system
    message (a string content or a list of content parts), or, where it has none, as a system
    message of its own -- chat templates render the tools into the system turn, before the first
    user message (Qwen2.5's writes its default system text and the tool list there), so a nonce in
    the user message would follow the tool list every request shares. No other prompt then has
    the same first tokens: a server's prefix cache holds none of it and every token is prefilled."""
    messages = list(item["messages"])
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [{"type": "text", "text": nonce + "\n"}, *content]
        else:
            first["content"] = f"{nonce}\n{content or ''}"
        return dict(item, messages=[first, *messages[1:]])
    return dict(item, messages=[{"role": "system", "content": nonce + "\n"}, *messages])


def unique_prefix_sessions(sessions: list[list[tuple[int, dict]]], salt: str, level: str | int) -> list:
    """A level's sessions (:func:`level_sessions`) with every request's nonce line (:func:`with_nonce`)."""
    return [[(i, with_nonce(item, request_nonce(salt, level, i, item["id"]))) for i, item in s] for s in sessions]
