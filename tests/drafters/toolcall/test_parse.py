"""Reading calls out of model text, whole and while it is still being written."""

from __future__ import annotations

import json

import pytest

from toolspec_core.drafters.toolcall.parse import parse_tool_calls, raw_arguments, scan_call, stream_calls

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"b\\" {c}"}}'
TEXTS = {
    "hermes": f"<tool_call>\n{CALL}\n</tool_call>",
    "two_tags": f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
    + '{"name": "f", "arguments": {}}\n</tool_call>',
    "fence": '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    "bare": CALL,
    "list": f"[{CALL}, {CALL}]",
    "llama": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "n": -1.5e3, "ok": true}}',
    "string_args": '{"name": "get_weather", "arguments": "{\\"city\\": \\"Par\\u00eds \\ud83d\\ude00\\"}"}',
    "prose_braces": 'A set {1, 2} and {"name": "get_weather", "arguments": {"city": "Rome"}} then text',
}


@pytest.mark.parametrize("layout", sorted(TEXTS))
def test_the_arguments_string_is_the_models_own_text(layout):
    text = TEXTS[layout]
    calls = parse_tool_calls(text).calls
    assert calls and all(json.loads(c.arguments_json()) == c.arguments for c in calls)
    if layout != "string_args":  # a JSON-string value is reported decoded
        assert all(c.arguments_json() in text for c in calls)
    assert parse_tool_calls(text, partial=True).calls == calls
    if layout in ("hermes", "fence", "bare", "list", "llama", "string_args"):
        assert parse_tool_calls(text).content is None  # tags, fences and <|python_tag|> are the call's


@pytest.mark.parametrize("layout", sorted(TEXTS))
def test_every_prefix_shows_a_prefix_of_the_finished_calls(layout):
    """Reading a text as it grows never fails, never renames a call and never takes back
    arguments text: what a stream sends from a prefix is a prefix of the final call."""
    text = TEXTS[layout]
    final = [(c.name, c.arguments_json()) for c in parse_tool_calls(text).calls]
    for i in range(len(text) + 1):
        prefix = text[:i]
        ready = [s for s in stream_calls(prefix) if s.ready(prefix)]
        assert len(ready) <= len(final)
        for scan, (name, args) in zip(ready, final):
            assert scan.name == name
            assert args.startswith(raw_arguments(prefix, scan) or "")


def test_a_partial_parse_reports_the_call_being_written():
    text = TEXTS["hermes"][: TEXTS["hermes"].index("Paris") + 3]
    assert parse_tool_calls(text).calls == []  # whole-text parsing: not a call
    got = parse_tool_calls(text, partial=True)
    assert [(c.name, c.arguments_json()) for c in got.calls] == [("get_weather", '{"city": "Par')]
    assert got.content is None
    head = TEXTS["two_tags"][: TEXTS["two_tags"].rindex("{}") + 1]  # the second call cut inside
    got = parse_tool_calls(head, partial=True)
    assert [c.name for c in got.calls] == ["get_weather", "f"] and got.content == "Sure."
    unnamed = '<tool_call>\n{"name": "get_wea'  # no name yet: still text
    assert parse_tool_calls(unnamed, partial=True).calls == []


@pytest.mark.parametrize(
    "text",
    ['{"name": 5, "arguments": {}}', '{"name": "f", "arguments": [1, 2]}', "{name: f}", '{"a": 1} x'],
)
def test_what_cannot_be_a_call_is_never_streamed_as_one(text):
    for i in range(len(text) + 1):
        assert not any(s.ready(text[:i]) for s in stream_calls(text[:i]))
    assert parse_tool_calls(text, partial=True).calls == []


def test_scan_reads_nested_values_and_strings_with_braces():
    text = '{"arguments": {"q": "}{\\"", "r": [{"s": "]"}]}, "name": "n"}'
    scan = scan_call(text, 0)
    assert scan.end == len(text) and scan.name == "n"
    assert json.loads(text[scan.args_start : scan.args_end]) == {"q": '}{"', "r": [{"s": "]"}]}
