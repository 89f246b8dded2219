"""Tool-call layouts as data: how a call is opened, separated and closed, and its JSON style.

The FSM recognises which layout the model has started from the text itself; these records say
what text to draft around the JSON object of a call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    opener: str  # text before the call object ("" for bare JSON)
    closer: str  # text after it
    pretty: bool  # JSON written pretty-printed (newline + indent) or compact
    indent: int = 2
    args_key: str = "arguments"


LAYOUTS: tuple[Layout, ...] = (
    Layout("hermes", "<tool_call>\n", "\n</tool_call>", pretty=False),
    Layout("fence", "```json\n", "\n```", pretty=True),
    Layout("fence_compact", "```json\n", "\n```", pretty=False),
    Layout("bare_pretty", "", "", pretty=True),
    Layout("bare", "", "", pretty=False),
    Layout("llama", "", "", pretty=False, args_key="parameters"),
)

CALL_KEYS = ("name", "arguments", "parameters")
