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

# Llama 3.1's chat template asks for {"name": ..., "parameters": {...}}, bare (custom tools) or
# after <|python_tag|>; the turn then ends with <|eot_id|> (or <|eom_id|>)
PYTHON_TAG = "<|python_tag|>"
LLAMA = Layout("llama", "", "", pretty=False, args_key="parameters")
LLAMA_TAG = Layout("llama_tag", PYTHON_TAG, "", pretty=False, args_key="parameters")
LLAMA_LAYOUTS: tuple[Layout, ...] = (LLAMA, LLAMA_TAG)

CALL_KEYS = ("name", "arguments", "parameters")


def layouts_for(tokenizer) -> tuple[Layout, ...]:
    """The layouts a target writes calls in, read from its chat template once: a template that
    asks for "parameters" (Llama 3.1) and has no ``<tool_call>`` tag gets the Llama layouts."""
    tmpl = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(tmpl, dict):  # named templates
        tmpl = " ".join(str(t) for t in tmpl.values())
    if isinstance(tmpl, list):
        tmpl = " ".join(str(t.get("template", "")) for t in tmpl if isinstance(t, dict))
    if '"parameters"' in tmpl and "<tool_call>" not in tmpl:
        return LLAMA_LAYOUTS
    return LAYOUTS


def layout_by_name(name: str) -> Layout:
    for lay in LAYOUTS + LLAMA_LAYOUTS:
        if lay.name == name:
            return lay
    known = ", ".join(lay.name for lay in LAYOUTS + LLAMA_LAYOUTS)
    raise ValueError(f"unknown layout {name!r}; known: {known}")


def opened_by(text_before: str, family: tuple[Layout, ...] = LAYOUTS) -> Layout:
    """The layout of a call object that starts after ``text_before`` (the text since the last JSON),
    among the target's ``family`` of layouts."""
    before = text_before.rstrip()
    if before.endswith(HERMES.opener.strip()):
        return HERMES
    if before.endswith(FENCE.opener.strip()) or before.endswith("```"):
        return FENCE
    if before.endswith(PYTHON_TAG):
        return LLAMA_TAG
    return LLAMA if family is LLAMA_LAYOUTS else BARE_PRETTY


def layout_of(output: str) -> Layout:
    """The layout an output that opens with a call is written in (pretty or compact when bare)."""
    s = output.lstrip()
    if s.startswith(HERMES.opener.strip()):
        return HERMES
    if s.startswith("```"):
        return FENCE
    if s.startswith(PYTHON_TAG):
        return LLAMA_TAG
    if s.startswith("{") and '"parameters"' in s[:200] and '"arguments"' not in s[:200]:
        return LLAMA
    return BARE_PRETTY if s.startswith("{\n") else BARE


def render_calls(calls: list[dict], layout: Layout) -> str:
    """Calls ``[{"name", "arguments"}]`` written as a model writes them in ``layout``, one per line."""
    indent = layout.indent if layout.pretty else None
    objs = [
        json.dumps({"name": c["name"], layout.args_key: c["arguments"]}, ensure_ascii=False, indent=indent)
        for c in calls
    ]
    return "\n".join(layout.opener + o + layout.closer for o in objs)
