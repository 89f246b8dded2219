"""Shared by the tool-call drafting tests: tools, a fed tracker, the Qwen tokenizer and gold dev items."""

from __future__ import annotations

import pytest

from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "alerts": {"type": "boolean"},
                    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]

# two described tools with required arguments (end-to-end drafting, grammars, the Llama format)
CITY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]


def tracker(text: str) -> CallTracker:
    t = CallTracker(ToolIndex.from_tools(TOOLS))
    t.feed(text)
    return t


def _texts(cands):
    return ["".join(s for s, _ in c.segs if isinstance(s, str)) for c in cands]


DATE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "date": {"type": "string", "description": "The date. Format: %Y-%m-%d"},
                    "time": {"type": "string", "description": "When it starts"},
                    "slot": {"type": "string", "format": "time"},
                },
                "required": ["city", "date"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))
