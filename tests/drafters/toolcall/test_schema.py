"""Schema constructs the drafter reads: $ref / $defs, anyOf / oneOf, type lists with null, const,
numbers within their bounds -- each drafted, and none able to recurse without bound."""

from __future__ import annotations

import pytest
from toolcall_cases import qwen_tok as qwen_tok

from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.drafters.toolcall.schema import MAX_DEPTH, enum_values, inline_refs, items, properties, variants
from toolspec_core.drafters.toolcall.values import context_numbers, numbers_for
from toolspec_core.spec.proposer import DraftContext

PARAMS = {
    "type": "object",
    "$defs": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "place": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "properties": {
        "where": {"$ref": "#/$defs/place"},
        "unit": {"$ref": "#/$defs/unit"},
        "days": {"type": ["integer", "null"], "minimum": 1, "maximum": 14},
        "mode": {"anyOf": [{"const": "fast"}, {"type": "string", "enum": ["slow", "exact"]}]},
        "detail": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/unit"}},
    },
    "required": ["where", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Forecast", "parameters": PARAMS}}]


def test_refs_are_inlined_and_alternatives_listed():
    p = inline_refs(PARAMS)
    assert "$defs" not in p and properties(p["properties"]["where"]) == PARAMS["$defs"]["place"]["properties"]
    assert items(p["properties"]["tags"]) == PARAMS["$defs"]["unit"]
    assert [v["type"] for v in variants(p["properties"]["days"])] == ["integer", "null"]
    assert enum_values(p["properties"]["mode"]) == ["fast", "slow", "exact"]
    assert [v.get("type") for v in variants(p["properties"]["detail"])] == ["boolean", "null"]


def test_self_referencing_and_deep_schemas_stop():
    node = {"$ref": "#/$defs/node"}
    tree = {"$defs": {"node": {"type": "object", "properties": {"child": node}}}, **node}
    out = inline_refs(tree)  # a cycle: cut at the depth cap, not a RecursionError
    assert out["type"] == "object"
    deep: dict = {"type": "object"}
    for _ in range(500):
        deep = {"anyOf": [deep]}
    assert variants(deep) == [{}] and inline_refs(deep) is not None
    assert MAX_DEPTH < 100


def test_numbers_respect_the_schema():
    nums = context_numbers("Book 3 rooms for -2 degrees, 2.5 hours, code 007 and 20 days")
    assert nums == ["20", "2.5", "-2", "3"]
    assert numbers_for(nums, {"type": "integer", "minimum": 1, "maximum": 14}) == ["3"]
    assert numbers_for(nums, {"type": "number", "exclusiveMinimum": 0}) == ["20", "2.5", "3"]


def _drafted(tok, written: str, prompt_text: str) -> list[str]:
    """The texts of the drafted tree's root-to-leaf paths after ``written`` (a Hermes call)."""
    prompt = tok.encode(prompt_text)
    gen = tok.encode(written)
    drafter = make_method("toolspec_schema", tok).drafter(RequestInfo(prompt, TOOLS))
    tree = drafter.propose(DraftContext(prompt + gen, len(prompt), 64, written, len(gen)))
    leaves = set(range(len(tree))) - set(tree.parents)
    out = []
    for leaf in leaves:
        path, node = [], leaf
        while node != -1:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        out.append(tok.decode(path[::-1]))
    return out


HEAD = '<tool_call>\n{"name": "forecast", "arguments": {'


@pytest.mark.parametrize(
    "written, want",
    [
        ('"where": {"', ["city", "zip"]),  # $ref to an object: its keys
        ('"unit": ', ['"celsius"', '"fahrenheit"']),  # $ref to an enum
        ('"days": ', ["3", "null"]),  # type list with null; numbers in bounds from the context
        ('"mode": "', ["fast", "slow", "exact"]),  # anyOf of const and enum
        ('"detail": ', ["true", "false", "null"]),  # oneOf boolean / null
    ],
)
def test_each_construct_is_drafted(qwen_tok, written, want):
    paths = _drafted(qwen_tok, HEAD + written, "Forecast for Paris, 3 days, -5 is too cold, 40 too many.")
    for w in want:
        assert any(p.startswith(w) for p in paths), (w, paths[:8])
    if written.startswith('"days"'):
        assert not any(p.startswith(("-5", "40")) for p in paths)  # out of bounds: never drafted
