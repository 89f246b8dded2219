"""Compiled tool sets (``toolcall/compiled.py``): the cache's key, its byte bound and LRU order,
and the tables' answers equal to the schema functions'. That drafting with the tables gives the
reference drafter's trees node for node on recorded traffic is
``tests/drafters/test_batch_drafting.py``."""

from __future__ import annotations

from toolcall_cases import CITY_TOOLS, qwen_tok  # noqa: F401 -- the fixture

from toolspec_core.drafters.toolcall.compiled import (
    ToolSetCache,
    compile_tools,
    percentile,
    tokenizer_identity,
    value_start,
)
from toolspec_core.drafters.toolcall.schema import enum_values, variants

RICH = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "when": {"type": "string", "description": "date of the trip, Format: %Y-%m-%d"},
                    "cls": {"enum": ["eco", "biz", 3, True]},
                    "n": {"type": ["integer", "null"], "minimum": 1},
                    "pet": {"anyOf": [{"type": "boolean"}, {"const": "maybe"}]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "ref": {"$ref": "#/$defs/R"},
                },
                "required": ["when"],
                "$defs": {"R": {"type": "object", "properties": {"id": {"type": "string"}}}},
            },
        },
    }
]


def _tool(i: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}]


class OtherTok:
    """A tokenizer that is not Qwen's: only its identity matters to the cache."""

    name_or_path = "other/tokenizer"

    def __len__(self) -> int:
        return 1000


def test_the_tables_answer_what_the_schema_functions_answer():
    c = compile_tools(RICH, {"type": "object", "properties": {"a": {"enum": ["x"]}}})
    seen = 0
    for name in c.index.params:
        for arg, schema in c.index.properties(name).items():
            assert c.variants(schema) == variants(schema)
            assert c.enum_values(schema) == enum_values(schema)
            for v in c.variants(schema):
                assert c.start(v) == value_start(v)
            seen += 1
    assert seen == 7
    when = c.index.properties("book")["when"]
    assert c.date_string("when", when) is not None and c.date_string("cls", c.index.properties("book")["cls"]) is None
    assert value_start(c.index.properties("book")["cls"]).enum_json == ('"eco"', '"biz"', "3", "true")
    assert c.variants({"type": "string"}) == [{"type": "string"}]  # a dict it does not hold: computed


def test_same_tools_hit_and_a_different_tokenizer_or_schema_misses(qwen_tok):  # noqa: F811
    cache = ToolSetCache()
    a = cache.get(CITY_TOOLS, None, qwen_tok)
    reordered = [{"function": dict(reversed(list(t["function"].items()))), "type": t["type"]} for t in CITY_TOOLS]
    assert cache.get(reordered, None, qwen_tok) is a  # the same schemas, keys in another order
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.get(CITY_TOOLS, None, OtherTok()) is not a  # another tokenizer: its own entry
    assert cache.get(CITY_TOOLS, {"type": "object"}, qwen_tok) is not a  # another answer schema
    assert cache.get(CITY_TOOLS[:1], None, qwen_tok) is not a
    assert (cache.hits, cache.misses) == (1, 4)
    assert tokenizer_identity(qwen_tok) != tokenizer_identity(OtherTok())
    st = cache.stats()
    assert st["entries"] == 4 and st["hit_rate"] == 0.2 and st["compile_ms_p99"] >= st["compile_ms_p50"] > 0
    assert st["bytes"] == cache.nbytes > 0


def test_the_byte_bound_holds_and_the_least_recently_used_go_first():
    one = compile_tools(_tool(0), None).nbytes
    cache = ToolSetCache(max_bytes=3 * one + one // 2)  # room for three sets of this size
    keys = [cache.get(_tool(i), None, None).key for i in range(3)]
    assert cache.keys() == keys and cache.nbytes <= cache.max_bytes
    cache.get(_tool(0), None, None)  # 0 is now the most recent: 1 goes first
    cache.get(_tool(3), None, None)
    assert cache.keys()[:2] == [keys[2], keys[0]] and keys[1] not in cache.keys()
    for i in range(4, 40):
        cache.get(_tool(i), None, None)
        assert cache.nbytes <= cache.max_bytes
    assert len(cache.keys()) == 3


def test_a_growing_token_table_counts_against_the_bound():
    cache = ToolSetCache()
    a = cache.get(_tool(0), None, None)
    cache.max_bytes = a.nbytes + a.nbytes // 2
    b = cache.get(_tool(1), None, None)  # a and b do not both fit: a (least recent) goes
    assert cache.keys() == [b.key]
    before = b.nbytes
    for i in range(200):  # b's token table fills past the bound
        b.candidate(lambda tail, segs: ((1, 2, 3), ("x", "x", "x")), (i,), (("t", "x"),))
    assert b.nbytes > before and (b.token_hits, b.token_misses) == (0, 200)
    assert b.candidate(lambda tail, segs: 1 / 0, (5,), (("t", "x"),)) == ((1, 2, 3), ("x", "x", "x"))
    st = cache.stats()  # the token table's share of the bytes and its lookups
    assert (st["token_entries"], st["token_lookups"]) == (200, 201) and st["token_hit_rate"] == 1 / 201
    assert st["schema_bytes"] + st["token_bytes"] == st["bytes"] and st["token_bytes"] == b.token_bytes > 0
    cache.get(_tool(2), None, None)  # the next lookup restores the bound
    assert cache.nbytes <= cache.max_bytes and b.key not in cache.keys()


def test_a_set_larger_than_the_bound_is_used_but_not_kept():
    cache = ToolSetCache(max_bytes=10)
    c = cache.get(RICH, None, None)
    assert c.index.names == ["book"] and cache.keys() == [] and cache.nbytes == 0


def test_percentile_by_nearest_rank():
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99
