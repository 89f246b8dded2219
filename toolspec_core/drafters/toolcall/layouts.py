"""Tool-call layouts as data: how a call is opened, separated and closed, and its JSON style.

A layout is one ``Layout`` record, named once here; the FSM recognises which one the model has
started from the text before the call object (``opened_by``), the priors learn how often each
one opens an output (``layout_of``), and ``render_calls`` writes calls in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    opener: str  # text before the call object ("" for bare JSON)
    closer: str  # text after it
    pretty: bool  # JSON written pretty-printed (newline + indent) or compact
    indent: int = 2
    args_key: str = "arguments"


HERMES = Layout("hermes", "<tool_call>\n", "\n</tool_call>", pretty=False)
FENCE = Layout("fence", "```json\n", "\n```", pretty=True)
BARE_PRETTY = Layout("bare_pretty", "", "", pretty=True)
BARE = Layout("bare", "", "", pretty=False)
LAYOUTS: tuple[Layout, ...] = (HERMES, FENCE, BARE_PRETTY, BARE)

CALL_KEYS = ("name", "arguments", "parameters")


def layout_by_name(name: str) -> Layout:
    for lay in LAYOUTS:
        if lay.name == name:
            return lay
    raise ValueError(f"unknown layout {name!r}; known: {', '.join(lay.name for lay in LAYOUTS)}")


def opened_by(text_before: str) -> Layout:
    """The layout of a call object that starts after ``text_before`` (the text since the last JSON)."""
    before = text_before.rstrip()
    if before.endswith(HERMES.opener.strip()):
        return HERMES
    if before.endswith(FENCE.opener.strip()) or before.endswith("```"):
        return FENCE
    return BARE_PRETTY


def layout_of(output: str) -> Layout:
    """The layout an output that opens with a call is written in (pretty or compact when bare)."""
    s = output.lstrip()
    if s.startswith(HERMES.opener.strip()):
        return HERMES
    if s.startswith("```"):
        return FENCE
    return BARE_PRETTY if s.startswith("{\n") else BARE


def render_calls(calls: list[dict], layout: Layout) -> str:
    """Calls ``[{"name", "arguments"}]`` written as a model writes them in ``layout``, one per line."""
    indent = layout.indent if layout.pretty else None
    objs = [
        json.dumps({"name": c["name"], layout.args_key: c["arguments"]}, ensure_ascii=False, indent=indent)
        for c in calls
    ]
    return "\n".join(layout.opener + o + layout.closer for o in objs)
