"""What a replica's engine hands its HTTP routes for one request: typed events, in order.

``Start`` (the prompt was accepted) or ``Failed`` first; then ``Text`` deltas, each holding
everything the engine committed since the last one (several tokens when a step accepted
several, every step since when the reader was behind); then ``Done`` (the result) or ``Failed``
(the engine failed the request). No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Start:
    prompt_tokens: int


@dataclass(slots=True)
class Text:
    delta: str
    logprobs: list[dict] | None = None  # OpenAI token entries of the tokens the delta came from


@dataclass(slots=True)
class Done:
    """The finished request: its whole text (the authority the streamed deltas are checked
    against), counts, engine statistics and the replica's notes (``extra``)."""

    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict] | None = None


@dataclass(slots=True)
class Failed:
    """The request ends with this OpenAI error (``error``: the body's ``error`` object)."""

    status: int
    error: dict[str, Any]


Event = Start | Text | Done | Failed
