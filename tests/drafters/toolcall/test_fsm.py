"""The call FSM: states, layouts, nesting, several calls, a pure function of the text."""

from __future__ import annotations

import pytest
from toolcall_cases import TOOLS, tracker

from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex
from toolspec_core.spec.labels import ARG_NAME, BETWEEN, CALL_KEY, END, TEXT, TOOL_NAME, VALUE


@pytest.mark.parametrize(
    "text,state",
    [
        ("", TEXT),
        ("Sure, I can help with that.", TEXT),
        ("<tool_call>\n", TEXT),
        ("<tool_call>\n{", CALL_KEY),
        ('<tool_call>\n{"na', CALL_KEY),
        ('<tool_call>\n{"name": "get_', TOOL_NAME),
        ('<tool_call>\n{"name": "get_time"', CALL_KEY),
        ('<tool_call>\n{"name": "get_time", "arguments": {', ARG_NAME),
        ('<tool_call>\n{"name": "get_time", "arguments": {"t', ARG_NAME),
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eu', VALUE),
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"', BETWEEN),
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', END),
        ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "days": 3', VALUE),
        ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "days": 3,\n    "', ARG_NAME),
    ],
)
def test_fsm_states(text, state):
    assert tracker(text).state == state


def test_fsm_escaped_quotes_nested_values_and_arrays():
    t = tracker(
        '{"name": "get_weather", "arguments": {"city": "Say \\"hi\\", {x}", "where": {"lat": 1.5}, "tags": ["a", "b, c"]'
    )
    assert t.state == BETWEEN
    args = t.frame("args")
    assert args.keys == ["city", "where", "tags"]
    t.feed("}}")
    assert t.state == END and t.calls == [{"name": "get_weather", "keys": ["name", "arguments"]}]


def test_fsm_two_calls_in_one_turn_and_text_before():
    t = tracker(
        'Let me check both.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n<tool_call>\n{"name": "get_w'
    )
    assert t.state == TOOL_NAME and t.layout.name == "hermes"
    assert [c["name"] for c in t.calls] == ["get_time"]
    t.feed('eather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert [c["name"] for c in t.calls] == ["get_time", "get_weather"] and t.state == END


def test_fsm_call_that_never_comes():
    t = tracker("I cannot do that: the {weather} service is down.\nSorry!")
    assert t.state == TEXT and t.calls == []


def test_fsm_is_a_pure_function_of_text():
    text = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Rome",\n    "unit": "cel'
    whole = tracker(text)
    pieces = CallTracker(ToolIndex.from_tools(TOOLS))
    for i in range(0, len(text), 3):
        pieces.feed(text[i : i + 3])
    assert (pieces.state, pieces.name, pieces.pretty, pieces.indent_unit, pieces.buf) == (
        whole.state,
        whole.name,
        whole.pretty,
        whole.indent_unit,
        whole.buf,
    )
    assert whole.pretty is True and whole.indent_unit == 2 and whole.name == "get_weather"


def test_a_fork_of_the_tracker_leaves_it_as_it_was():
    t = tracker('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    fork = t.fork()
    fork.feed('is", "days": 3')
    assert fork.state == VALUE and fork.frame("args").keys == ["city", "days"]
    assert (
        t.state == VALUE and t.buf == "Par" and t.frame("args").keys == ["city"] and t.frame("args").expect == "value"
    )


def test_tool_index_keys_are_the_schemas_own_on_every_dev_tool():
    """``properties`` / ``required`` (kept per tool) equal the schema functions on the tool's
    parameters, for offered names, misspelt ones and unknown ones, asked twice."""
    from benchmarks.datasets import dev_set, read_jsonl
    from toolspec_core.drafters.toolcall.schema import properties, required

    n = 0
    for bench in ("api_bank", "bfcl_v3", "toolalpaca"):
        for it in read_jsonl(dev_set(bench), 20):
            idx = ToolIndex.from_tools(it.get("tools") or [])
            for name in idx.names + [idx.names[0][:-1] + "x" if idx.names else "x", "no_such_tool_at_all"]:
                for _ in range(2):
                    assert idx.properties(name) == properties(idx.params_of(name))
                    assert idx.required(name) == required(idx.params_of(name))
                    n += 1
    assert n > 100
