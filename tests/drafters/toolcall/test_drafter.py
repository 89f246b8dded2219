"""ToolSpec drafting end to end on a tiny random model with the real Qwen tokenizer:
losslessness with schema / retrieval drafts (poisoned library, cold start), constrained
tool_choice, and the retrieval drafter itself."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tiny import tiny_model
from toolcall_cases import CITY_TOOLS as TOOLS

from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.methods import REGISTRY, RequestInfo, make_method, method_class
from toolspec_core.drafters.toolcall.drafter import RetrievalDrafter
from toolspec_core.drafters.toolcall.library import MemoryLibrary, PastCall
from toolspec_core.drafters.toolcall.parse import parse_tool_calls, validate_call
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.grammar import make_tool_constraint
from toolspec_core.engine.loop import DecodeConfig, generate, prefill
from toolspec_core.errors import InvalidRequestError
from toolspec_core.model.prompting import render_prompt
from toolspec_core.model.target import from_model
from toolspec_core.spec.proposer import DraftContext

MESSAGES = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


@pytest.fixture(scope="module")
def tiny_qwen(qwen_tok):
    """Random 2-layer Qwen2 with the real vocabulary (so real tokenization and grammars apply)."""
    return from_model(tiny_model(vocab=151936, max_position_embeddings=2048), qwen_tok, "tiny-qwen")


@pytest.fixture(scope="module")
def closing_qwen(tiny_qwen, qwen_tok):
    """The tiny model with a strong taste for closing quotes/braces, so constrained calls end."""
    ids = {i for t in ('"', '"}', '"}}', "}", "}}", "UTC", "Paris", ' "', '",', '":') for i in qwen_tok.encode(t)}
    bias = torch.zeros(151936)
    bias[list(ids)] = 30.0
    tg = from_model(tiny_qwen.model, qwen_tok, "tiny-qwen-closing")
    plain_logits = tg.logits
    tg.logits = lambda h: plain_logits(h) + bias
    return tg


def _prompt(tok):
    return render_prompt(tok, MESSAGES, TOOLS)


def _poisoned_library(tok, tenant="t1") -> MemoryLibrary:
    lib = MemoryLibrary()
    for city in ("Berlin", "Tokyo", "Lima"):
        text = (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "fahrenheit"}}\n</tool_call>'
            % city
        )
        lib.add(
            tenant, PastCall("get_weather", tok.encode(text), text, {"city": city, "unit": "fahrenheit"}), [1.0, 0.0]
        )
    return lib


def test_greedy_unchanged_by_schema_retrieval_and_poisoned_library(tiny_qwen, qwen_tok):
    prompt = _prompt(qwen_tok)
    cfg = DecodeConfig(max_new_tokens=40)
    plain = generate(tiny_qwen, prompt, None, cfg).tokens
    for name in ("toolspec_schema", "toolspec_retrieval", "toolspec"):
        method = make_method(name, qwen_tok, library=_poisoned_library(qwen_tok))
        req = RequestInfo(prompt, TOOLS, tenant="t1", embedding=[1.0, 0.0])
        res = generate(tiny_qwen, prompt, method.drafter(req), cfg, CostModel.flat())
        assert res.tokens == plain, name


def test_the_library_belongs_to_the_methods_that_draft_from_it(qwen_tok):
    """``uses_library`` is the one flag for a call library: the methods with it are handed the
    shared library, search it and add their calls to it; schema-only drafting keeps none."""
    assert {n for n in REGISTRY if method_class(n).uses_library} == {"toolspec_retrieval", "toolspec"}
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for name in ("toolspec_schema", "toolspec_retrieval", "toolspec"):
        lib = MemoryLibrary()
        method = make_method(name, qwen_tok, library=lib)
        method.observe(RequestInfo([1], TOOLS, embedding=[1.0, 0.0]), qwen_tok.encode(text), text)
        assert len(lib) == (1 if method_class(name).uses_library else 0), name


def test_cold_library_behaves_like_schema_only(tiny_qwen, qwen_tok):
    prompt = _prompt(qwen_tok)
    cfg = DecodeConfig(max_new_tokens=30)
    req = RequestInfo(prompt, TOOLS)
    schema = generate(tiny_qwen, prompt, make_method("toolspec_schema", qwen_tok).drafter(req), cfg, CostModel.flat())
    cold = generate(tiny_qwen, prompt, make_method("toolspec", qwen_tok).drafter(req), cfg, CostModel.flat())
    assert cold.tokens == schema.tokens
    assert cold.stats.drafted == schema.stats.drafted and cold.stats.accepted == schema.stats.accepted


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("method", [None, "toolspec"])
def test_constrained_tool_choice_always_gives_a_valid_call(closing_qwen, qwen_tok, choice, method):
    """Even a random model writes a valid call under the grammar, with or without drafting."""
    tiny_qwen = closing_qwen
    prompt = _prompt(qwen_tok)
    cfg = DecodeConfig(max_new_tokens=120)
    outs = []
    for drafter in (
        [None] if method is None else [None, make_method(method, qwen_tok).drafter(RequestInfo(prompt, TOOLS))]
    ):
        c = make_tool_constraint(qwen_tok, TOOLS, choice, tiny_qwen.model.config.vocab_size)
        res = generate(tiny_qwen, prompt, drafter, cfg, CostModel.flat(), constraint=c)
        outs.append(res.tokens)
        assert res.finish_reason == "stop", res.text
        calls = parse_tool_calls(res.text).calls
        assert len(calls) == 1, res.text
        assert validate_call(calls[0], TOOLS) == []
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == calls[0].name)
        jsonschema.validate(calls[0].arguments, fn["parameters"])
        if isinstance(choice, dict):
            assert calls[0].name == "get_time"
        assert res.stats.forced > 0  # the grammar forced some tokens (no verification needed)
    assert all(o == outs[0] for o in outs)  # drafting does not change the constrained output


@pytest.mark.parametrize("parallel", [True, False])
def test_required_takes_several_calls_unless_parallel_calls_are_off(qwen_tok, parallel):
    """tool_choice "required": one or more tagged calls; with parallel_tool_calls false, one."""
    one = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    c = make_tool_constraint(qwen_tok, TOOLS, "required", len(qwen_tok), parallel=parallel)
    for t in qwen_tok.encode(one):
        c.consume(t)
    second = qwen_tok.encode("\n<tool_call>")
    assert bool(c.mask()[second[0]]) is parallel
    assert bool(c.mask()[qwen_tok.convert_tokens_to_ids("<|im_end|>")]) or c.m.is_accepting()
    named = make_tool_constraint(qwen_tok, TOOLS, {"type": "function", "function": {"name": "get_time"}}, len(qwen_tok))
    for t in qwen_tok.encode(one):
        named.consume(t)
    assert not bool(named.mask()[second[0]])  # a named tool_choice is one call


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "nope"}}, "sometimes", {"type": "function"}]
)
def test_bad_tool_choice(qwen_tok, choice):
    with pytest.raises(InvalidRequestError):
        make_tool_constraint(qwen_tok, TOOLS, choice)


def test_no_constraint_for_auto_and_none(qwen_tok):
    assert make_tool_constraint(qwen_tok, TOOLS, "auto") is None
    assert make_tool_constraint(qwen_tok, TOOLS, "none") is None


def test_retrieval_drafter_continues_a_past_call(qwen_tok):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    ids = qwen_tok.encode(text)
    other = qwen_tok.encode('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    d = RetrievalDrafter(
        [PastCall("get_weather", ids, text), PastCall("get_time", other)], LabelRates({"retrieval": 0.6})
    )
    written = ids[:12]
    ctx = DraftContext([1, 2, 3] + written, 3, 64)
    tree = d.tree(ctx, "get_weather")
    path = [tree.tokens[i] for i in tree.path_to(len(tree) - 1)] if len(tree) else []
    assert path == ids[12 : 12 + len(path)] and len(path) == len(ids) - 12
    # the tool's calls only, once the tool is known
    assert all(t in ids for t in d.tree(ctx, "get_weather").tokens)


def test_online_method_remembers_calls_but_not_private_ones(qwen_tok):
    m = make_method("toolspec", qwen_tok)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    m.observe(RequestInfo([1], TOOLS, tenant="a", remember=False), qwen_tok.encode(text), text)
    assert len(m.library) == 0
    m.observe(RequestInfo([1], TOOLS, tenant="a"), qwen_tok.encode(text), text)
    assert len(m.library) == 1
    assert m.library.search("b", None, None, 5) == []  # another tenant sees nothing
    assert m.priors.tool_counts == {"get_time": 2.0}
    assert json.dumps(m.library.search("a", None, ["get_time"], 5)[0].tool_name) == '"get_time"'


def test_how_outputs_begin_and_what_follows_a_closer_are_learned(qwen_tok):
    """The schema's P(the output opens with a call) and P(text after a closer) move from their
    priors to what this model writes."""
    from toolspec_core.drafters.toolcall.parse import parse_tool_calls

    two = '```json\n{"name": "a", "arguments": {}}\n```\n\nThen:\n```json\n{"name": "b", "arguments": {}}\n```'
    assert [two[:e].endswith("```") for _, e in parse_tool_calls(two).spans] == [
        True,
        True,
    ]  # the closers the prior counts
    m = make_method("toolspec_schema", qwen_tok)
    start, after = m.priors.call_start, m.priors.prose_after
    fence = '```json\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n```\n\nThis returns the time.'
    for _ in range(6):
        m.observe(RequestInfo([1], TOOLS), qwen_tok.encode(fence), fence)
    assert m.priors.call_start > start and m.priors.prose_after > after
    assert (
        m.priors.events.tries == {"call_start": 6.0, "prose_after": 6.0}
        and m.priors.events.hits == m.priors.events.tries
    )
    m.observe(RequestInfo([1], TOOLS), qwen_tok.encode(two), two)  # text after the first closer, none after the second
    assert m.priors.events.tries["prose_after"] == 8.0 and m.priors.events.hits["prose_after"] == 7.0
    prose = "Which city do you mean?"
    for _ in range(12):
        m.observe(RequestInfo([1], TOOLS), qwen_tok.encode(prose), prose)
    assert m.priors.call_start < start  # no call: counted as an output that does not open with one


def test_retrieval_ignores_one_token_matches():
    """A match of only the last token (a quote, a colon) is no evidence: nothing is drafted."""
    calls = [PastCall("t", [5, 6, 7, 8, 9])]
    d = RetrievalDrafter(calls, LabelRates({"retrieval": 0.6, "retrieval+": 0.85}))
    assert len(d.tree(DraftContext([1, 2, 3, 7], 2, 10), "t")) == 0  # only "7" matches
    tree = d.tree(DraftContext([1, 2, 6, 7], 2, 10), "t")  # "6 7" matches
    assert tree.tokens == [8, 9]


def test_history_drafts_per_tenant_and_never_private_outputs(qwen_tok):
    """ToolSpec's suffix history: a tenant's earlier outputs draft for that tenant only, an output
    marked not-to-remember never drafts, and schema-only drafting has no history at all."""
    text = "The forecast for Paris is sunny with a light western wind."
    out = qwen_tok.encode(text)
    ctx = DraftContext([9, 9] + out[:4], 2, 30)

    def drafted(method, tenant):
        tree = method.drafter(RequestInfo([9, 9], TOOLS, tenant=tenant)).propose(ctx)
        return [tree.tokens[i] for i in tree.children(-1)]

    m, schema = make_method("toolspec", qwen_tok), make_method("toolspec_schema", qwen_tok)
    for meth in (m, schema):
        meth.observe(RequestInfo([1, 2], TOOLS, tenant="a", remember=False), out, text)
    assert out[4] not in drafted(m, "a")
    for meth in (m, schema):
        meth.observe(RequestInfo([1, 2], TOOLS, tenant="a"), out, text)
    assert out[4] in drafted(m, "a")
    assert out[4] not in drafted(m, "b") and out[4] not in drafted(schema, "a")


def test_toolspec_and_grammar_sequences_in_one_batch(closing_qwen, qwen_tok):
    """ToolSpec drafting, a grammar-constrained call and plain decoding verified together: each is
    what it is alone, and the constrained one is still a valid call."""
    from toolspec_core.engine.scheduler import run_batch
    from toolspec_core.engine.sequence import Sequence

    tg = closing_qwen
    prompt = _prompt(qwen_tok)
    other = render_prompt(qwen_tok, [{"role": "user", "content": "What time is it in Lima?"}], TOOLS)
    pool = tg.block_pool(4 * (len(prompt) + len(other)) + 1024)
    for p in (prompt, other):  # run through the pool first: the batch's sequences find them cached
        prefill(tg, p, pool)
    cfg = DecodeConfig(max_new_tokens=60)

    def grammar():
        return make_tool_constraint(qwen_tok, TOOLS, "required", tg.model.config.vocab_size)

    def toolspec(p):
        return make_method("toolspec", qwen_tok, library=_poisoned_library(qwen_tok)).drafter(
            RequestInfo(p, TOOLS, tenant="t1", embedding=[1.0, 0.0])
        )

    alone = [
        generate(tg, prompt, toolspec(prompt), cfg, CostModel.flat()).tokens,
        generate(tg, other, None, cfg, constraint=grammar()).tokens,
        generate(tg, other, None, cfg).tokens,
        generate(tg, prompt, toolspec(prompt), cfg, CostModel.flat(), constraint=grammar()).tokens,
    ]
    seqs = [
        Sequence(tg, prompt, toolspec(prompt), cfg),
        Sequence(tg, other, None, cfg, constraint=grammar()),
        Sequence(tg, other, None, cfg),
        Sequence(tg, prompt, toolspec(prompt), cfg, constraint=grammar()),
    ]
    out = run_batch(tg, seqs, CostModel.cpu_reference(), None, pool)
    assert all(s.stats.cached_tokens > 0 for s in seqs)  # each prompt's blocks found in the pool
    assert [r.tokens for r in out] == alone
    for r in (out[1], out[3]):
        calls = parse_tool_calls(r.text).calls
        assert r.finish_reason == "stop" and len(calls) == 1 and validate_call(calls[0], TOOLS) == [], r.text


WEATHER = TOOLS[0]["function"]["parameters"]


def _chain(tree) -> list[int]:
    """The tree's most confident path from the root."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    node, out = -1, []
    while node in kids:
        node = max(kids[node], key=lambda i: tree.conf[i])
        out.append(tree.tokens[node])
    return out


@pytest.mark.parametrize(
    "written, drafted",
    [
        ("", '{"'),  # the answer opens: '{' and a key of the schema
        ('{"city": "Paris"', ', "unit": "'),  # the next key, as the output writes them
        ('{\n  "city": "Paris",\n  ', '"unit": "'),  # pretty-printed, in its own indent
        ('{"city": "Paris", "unit": "celsius"', "}"),  # all keys written: the object closes
    ],
)
def test_a_structured_answer_is_drafted_from_its_schema(qwen_tok, written, drafted):
    """response_format: the answer object is drafted as a call's arguments are (keys, separators,
    enum values, the closing brace), in the layout the output is written in."""
    prompt = qwen_tok.encode("Weather for Paris in celsius, as JSON.")
    gen = qwen_tok.encode(written) if written else []
    drafter = make_method("toolspec_schema", qwen_tok).drafter(RequestInfo(prompt, [], response_schema=WEATHER))
    tree = drafter.propose(DraftContext(prompt + gen, len(prompt), 64, written, len(gen)))
    assert qwen_tok.decode(_chain(tree)).startswith(drafted)
    if written == "":
        keys = {qwen_tok.decode(_chain(tree))[2:6]}
        assert keys <= {"city", "unit"}


@pytest.mark.parametrize("method", ["toolspec_schema", "toolspec"])
def test_a_structured_answer_is_lossless_under_its_grammar(closing_qwen, qwen_tok, method):
    """Drafted or not, a response_format answer is the same tokens, valid JSON of the schema."""
    tg = closing_qwen
    prompt = render_prompt(qwen_tok, MESSAGES, None)
    cfg = DecodeConfig(max_new_tokens=80)

    def grammar():
        return make_tool_constraint(qwen_tok, [], "none", tg.model.config.vocab_size, response=WEATHER)

    plain = generate(tg, prompt, None, cfg, constraint=grammar())
    drafter = make_method(method, qwen_tok).drafter(RequestInfo(prompt, [], response_schema=WEATHER))
    spec = generate(tg, prompt, drafter, cfg, CostModel.flat(), constraint=grammar())
    assert spec.tokens == plain.tokens and spec.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(spec.text), WEATHER)
    assert spec.stats.forced > 0


def test_the_prepared_tool_sets_are_bounded(qwen_tok):
    method = make_method("toolspec_schema", qwen_tok)
    one = method.tool_sets.get([{"type": "function", "function": {"name": "t", "parameters": {}}}], None, qwen_tok)
    method.tool_sets.max_bytes = 4 * one.nbytes + one.nbytes // 2  # room for four such sets
    for i in range(10):
        method._tools([{"type": "function", "function": {"name": f"t{i}", "parameters": {}}}])
    assert len(method.tool_sets.keys()) == 4 and method.tool_sets.nbytes <= method.tool_sets.max_bytes
    method.tool_sets.max_bytes = 1 << 20
    first = method._tools(TOOLS)
    assert method._tools(TOOLS)[0] is first[0]  # a hit is the same prepared index
