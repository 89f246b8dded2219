"""Parse tool calls out of whatever layout the model wrote.

Layouts seen: Hermes/Qwen ``<tool_call>{...}</tool_call>`` (one or several), a Markdown
```` ```json ```` fence (pretty-printed, possibly a list), bare JSON objects (compact or pretty),
Llama-3.1 style ``{"name": ..., "parameters": {...}}``. A call is an object with a string
``name`` and an object ``arguments`` (or ``parameters``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)(?:```|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedOutput:
    content: str | None  # text outside the calls (None when there is none)
    calls: list[ToolCall] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(
        default_factory=list
    )  # where the calls are in the text (tags / fences included)


def _as_calls(obj) -> list[ToolCall]:
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return []
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return []
        if not isinstance(args, dict):
            return []
        out.append(ToolCall(it["name"], args))
    return out


def _json_objects(text: str):
    """Yield (start, end, value) for each top-level JSON object/array decodable in ``text``."""
    dec = json.JSONDecoder()
    i = 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            return
        try:
            val, end = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        yield j, end, val
        i = end


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split model output into free text and tool calls (empty list when there are none)."""
    spans: list[tuple[int, int]] = []
    calls: list[ToolCall] = []
    for pattern in (_TAG, _FENCE):
        for m in pattern.finditer(text):
            found = []
            for _, _, val in _json_objects(m.group(1)):
                found.extend(_as_calls(val))
            if found:
                calls.extend(found)
                spans.append(m.span())
        if calls:
            break
    if not calls:
        for s, e, val in _json_objects(text):
            found = _as_calls(val)
            if found:
                calls.extend(found)
                spans.append((s, e))
    spans.sort()
    rest, last = [], 0
    for s, e in spans:
        rest.append(text[last:s])
        last = e
    rest.append(text[last:])
    content = "".join(rest).strip()
    return ParsedOutput(content or None, calls, spans)


def is_name_problem(problem: str) -> bool:
    """Whether a ``validate_call`` problem makes the call invalid (a tool or argument name the
    request does not offer) rather than only incomplete (a missing required argument)."""
    return problem.startswith("unknown")


def validate_call(call: ToolCall, tools: list[dict]) -> list[str]:
    """Problems of ``call`` against OpenAI-style ``tools`` (empty list = valid)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools if t.get("type", "function") == "function"}
    fn = by_name.get(call.name)
    if fn is None:
        return [f"unknown tool {call.name!r}"]
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    problems = [f"unknown argument {a!r}" for a in call.arguments if props and a not in props]
    problems += [f"missing required argument {a!r}" for a in params.get("required", []) if a not in call.arguments]
    return problems
