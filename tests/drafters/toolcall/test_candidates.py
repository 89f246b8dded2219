"""Schema candidates and their draft trees: names, arguments, values, closers, next calls, retrieval branches."""

from __future__ import annotations

import pytest
from toolcall_cases import DATE_TOOLS, TOOLS, _texts, tracker
from toolcall_cases import qwen_tok as qwen_tok

from benchmarks.datasets import dev_set, read_jsonl
from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.drafters.simulate import oracle_walk, simulate
from toolspec_core.drafters.toolcall.boundary import BoundaryTokenizer
from toolspec_core.drafters.toolcall.candidates import Cand, Priors, continuations
from toolspec_core.drafters.toolcall.drafter import DEFAULT_RATES, SchemaMethod, candidates_to_tree
from toolspec_core.drafters.toolcall.fsm import CallTracker, ToolIndex
from toolspec_core.spec.labels import CALL_KEY, TOOL_NAME
from toolspec_core.spec.layouts import layout_by_name, render_calls
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import path_probs


def _gold_items(n_per=20):
    for bench in ("api_bank", "bfcl_v3", "toolalpaca"):
        yield from read_jsonl(dev_set(bench), n_per)


def _next_texts(text: str, idx: ToolIndex | None = None, eos: int = 0, levels: int = 2) -> list[str]:
    """The texts of the schema's continuations of ``text`` (``idx``: the tools, default TOOLS;
    ``eos``: the end-of-turn id)."""
    idx = ToolIndex.from_tools(TOOLS) if idx is None else idx
    return _texts(continuations(tracker(text), idx, Priors(), [eos], levels=levels))


def test_candidates_tool_names_consistent_with_prefix():
    texts = _next_texts('<tool_call>\n{"name": "get_', levels=1)
    assert any(t.startswith('weather", "arguments": {"') for t in texts)
    assert any(t.startswith('time", "arguments": {"tz": ') for t in texts)
    assert not any("ping" in t for t in texts)


def test_candidates_argument_names_required_first_unused_only():
    t = tracker('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", ')
    cands = continuations(t, ToolIndex.from_tools(TOOLS), Priors(), [0], levels=1)
    texts = _texts(cands)
    assert texts[0].startswith('"city": ')
    assert not any(x.startswith('"unit"') for x in texts)


def test_value_type_drafting_enum_bool_and_closing():
    idx = ToolIndex.from_tools(TOOLS)
    texts = _next_texts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": ', idx)
    assert any(x.startswith('"celsius"') for x in texts) and any(x.startswith('"fahrenheit"') for x in texts)
    texts = _next_texts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "alerts": ', idx)
    assert any(x.startswith("true") for x in texts) and any(x.startswith("false") for x in texts)
    texts = _next_texts('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"', idx, eos=7)
    assert "}}\n</tool_call>" in texts
    texts = _next_texts('{"name": "ping", "arguments": ', idx, eos=7)
    assert texts[0] == "{}}" and all(
        t.startswith("{}}\n{") for t in texts[1:]
    )  # empty arguments, close the call (bare: no closer; a next object may follow)


@pytest.mark.parametrize(
    "text,want",
    [
        ('<tool_call>\n{"name": "get_time",', ' "arguments": {"tz": '),
        ('{"name": "get_time", ', '"arguments": {"tz": '),
        ('```json\n{\n  "name": "get_time",\n', '  "arguments": {\n    "tz": '),
        ('```json\n{\n  "name": "get_time",', '\n  "arguments": {\n    "tz": '),
    ],
)
def test_after_the_comma_that_follows_the_tool_name_the_arguments_key_is_drafted(text, want):
    # a step may end right after the comma (`",` or `",\n` is one token); the schema still knows what follows
    texts = _next_texts(text)
    assert texts and texts[0].startswith(want), texts[:2]


@pytest.mark.parametrize(
    "text,want",
    [
        ('{"name":', ' "get_'),
        ('{"name": "get_time", "arguments":', ' {"tz": '),
        ('{"name": "get_time", "arguments": {"tz":', ' "'),
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "unit":', ' "celsius"'),
        ('{"name": "get_time", "arguments": {"tz": ', '"'),  # the space written: not drafted again
    ],
)
def test_a_step_that_ends_on_the_colon_gets_the_separators_space_drafted(text, want):
    # `":` is one token and ` "` the next: a step often ends between them; the drafts go on with the space
    texts = _next_texts(text)
    assert texts and any(x.startswith(want) for x in texts[:2]), texts[:2]
    assert all(x.startswith(" ") == want.startswith(" ") for x in texts), texts


def test_compact_json_is_drafted_without_spaces():
    t = tracker('{"name":"get_weather","arguments":{"city":"Oslo","days":3,"unit":')
    assert t.kv_sep == ":" and t.item_sep == ","
    texts = _texts(continuations(t, ToolIndex.from_tools(TOOLS), Priors(), [0], levels=2))
    assert texts and texts[0].startswith('"') and any(x.startswith('"celsius","') for x in texts)


def test_a_next_call_repeats_the_tools_and_values_this_output_called():
    from toolspec_core.spec.labels import OWN_CALL

    idx = ToolIndex.from_tools(TOOLS)
    priors = Priors(tool_counts={"get_weather": 20.0})  # the tool most requests call
    text = '{"name": "get_time", "arguments": {"tz": "UTC"}}\n{"name": "'
    own = [("get_time", {"tz": "UTC"})]
    without = continuations(tracker(text), idx, priors, [0], levels=2)
    assert _texts(without)[0].startswith("get_weather")
    with_own = continuations(tracker(text), idx, priors, [0], levels=2, own=own)
    assert _texts(with_own)[0].startswith('get_time", "arguments": {"tz": "UTC"')
    assert any(seg == ('"UTC"', OWN_CALL) for c in with_own for seg in c.segs)
    assert sum(c.prob for c in with_own if _texts([c])[0].startswith("get_time")) > 0.5


def test_the_drafter_passes_the_calls_this_output_finished(qwen_tok):
    from toolspec_core.model.prompting import render_prompt

    prompt = render_prompt(qwen_tok, [{"role": "user", "content": "Time in UTC, twice."}], TOOLS)
    first = '{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    drafter = SchemaMethod(qwen_tok).drafter(RequestInfo(prompt, TOOLS))
    gen = qwen_tok.encode(first + '{"name":')
    tree = drafter.propose(DraftContext(prompt + gen, len(prompt), 40))
    assert drafter._own_calls() == [("get_time", {"tz": "UTC"})]
    truth = qwen_tok.encode(first + '{"name": "get_time", "arguments": {"tz": "UTC"}}')[len(gen) :]
    res = oracle_walk(tree, truth)
    assert len(res.path) >= len(truth) - 1  # the repeat drafted whole (the budget decides what is kept)


def test_prepare_builds_the_first_nodes_and_changes_no_tree(qwen_tok):
    """``prepare`` builds the expansion graph's first nodes beside the prefill: the first step
    then builds few, and every step's tree is the one an unprepared drafter drafts. Once the
    priors have learned the outputs' layout, it builds that layout's part only."""
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.layouts import FENCE, HERMES

    prompt = render_prompt(qwen_tok, [{"role": "user", "content": "Time in UTC."}], TOOLS)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    out = qwen_tok.encode(text)
    method = SchemaMethod(qwen_tok)
    ready, cold = method.drafter(RequestInfo(prompt, TOOLS)), method.drafter(RequestInfo(prompt, TOOLS))
    ready.prepare(prompt)
    prebuilt = sum(n is not None for n in ready._graph.nodes)
    assert prebuilt > 20 and not cold._graph.nodes
    for k in range(1, len(out)):
        a = ready.propose(DraftContext(prompt + out[:k], len(prompt), 40))
        b = cold.propose(DraftContext(prompt + out[:k], len(prompt), 40))
        assert (a.tokens, a.parents, a.conf, a.labels) == (b.tokens, b.parents, b.conf, b.labels), k
        if k == 1:
            assert sum(n is not None for n in ready._graph.nodes) - prebuilt < len(cold._graph.nodes) / 2
    for _ in range(20):
        method.observe(RequestInfo(prompt, TOOLS), out, text)
    learned = method.drafter(RequestInfo(prompt, TOOLS))
    learned.prepare(prompt)
    assert {r.name for r in learned._graph.refs if r.__class__ is FENCE.__class__} == {HERMES.name}


def test_an_object_after_a_finished_call_is_labelled_apart():
    from toolspec_core.spec.labels import NEXT_CALL

    idx = ToolIndex.from_tools(TOOLS)
    first = continuations(tracker('{"'), idx, Priors(), [0], levels=1)
    assert first and all(c.segs[0][1] == CALL_KEY for c in first)
    # a second bare object after a call: a parallel call, or (some models) an invented tool result
    second = continuations(
        tracker('{"name": "get_time", "arguments": {"tz": "UTC"}}\n{"'), idx, Priors(), [0], levels=1
    )
    assert second and all(c.segs[0][1] == NEXT_CALL for c in second)
    assert _texts(second)[0].startswith('name": "')
    # drafted before the model has begun it (a new line after a bare call), the head is labelled the same way
    ahead = continuations(tracker('{"name": "get_time", "arguments": {"tz": "UTC"}}\n'), idx, Priors(), [0], levels=1)
    assert [c.segs[1][1] for c in ahead if len(c.segs) > 1] and all(
        c.segs[1][1] == NEXT_CALL for c in ahead if len(c.segs) > 1
    )
    # calls inside a list are parallel calls by construction
    listed = continuations(
        tracker('[{"name": "get_time", "arguments": {"tz": "UTC"}}, {"'), idx, Priors(), [0], levels=1
    )
    assert listed and all(c.segs[0][1] == CALL_KEY for c in listed)


def test_a_call_announced_in_prose_gets_its_opener_drafted_but_inline_code_does_not():
    idx = ToolIndex.from_tools(TOOLS)

    def openers(text):
        cands = continuations(tracker(text), idx, Priors(), [0], levels=1)
        out: dict[str, float] = {}
        for t, c in zip(_texts(cands), cands):
            out[t.split("{")[0]] = out.get(t.split("{")[0], 0.0) + c.prob
        return out

    announced = openers("Here is the call:\n\n")
    assert (
        "```json\n" in announced and "<tool_call>\n" in announced and "" in announced
    )  # every layout may open on a new line
    assert sum(announced.values()) > sum(openers("Some prose.\n\n").values())  # a colon announces the call
    assert openers("Use the `") == {}  # a backtick inside a line is inline code, not the start of a fence
    assert "``json\n" in openers("Here it is:\n`")  # a backtick that begins a line may be one


def test_context_dates_become_value_branches_of_date_arguments_only():
    from toolspec_core.drafters.toolcall.values import context_dates
    from toolspec_core.spec.labels import DERIVED

    idx = ToolIndex.from_tools(DATE_TOOLS)
    dates = context_dates("The current year is 2023. Book Oslo for March 19th at 9:30 AM.")

    def cands(text):
        t = CallTracker(idx)
        t.feed(text)
        return continuations(t, idx, Priors(), [0], levels=2, dates=dates)

    start = cands('{"name": "book", "arguments": {"city": "Oslo", "date": ')
    assert any(x.startswith('"2023-03-19", "') for x in _texts(start))
    assert any(lab == DERIVED for c in start for _, lab in c.segs)
    mid = _texts(cands('{"name": "book", "arguments": {"city": "Oslo", "date": "2023-0'))
    assert any(x.startswith('3-19"') for x in mid)
    assert any(x.startswith('3-19 09:30:00"') for x in mid)  # the time forms are branches too
    assert not any(lab == DERIVED for c in cands('{"name": "book", "arguments": {"city": ') for _, lab in c.segs)
    assert not any(
        c.segs[0][1] == DERIVED for c in cands('{"name": "book", "arguments": {"city": "Os')
    )  # city's own text
    # without dates in the conversation the tree is what it was
    t = CallTracker(idx)
    t.feed('{"name": "book", "arguments": {"city": "Oslo", "date": ')
    assert not any(lab == DERIVED for c in continuations(t, idx, Priors(), [0], levels=2) for _, lab in c.segs)


@pytest.mark.parametrize("layout", ["hermes", "fence"])
def test_drafting_along_gold_calls_yields_canonical_tokens(qwen_tok, layout):
    """Along real gold calls, every schema-drafted step proposes exactly the canonical tokens."""
    from toolspec_core.model.prompting import render_prompt

    method = SchemaMethod(qwen_tok)
    checked = 0
    for it in _gold_items():
        prompt = render_prompt(qwen_tok, it["messages"], it["tools"])
        out = qwen_tok.encode(render_calls(it["gold_calls"], layout_by_name(layout))) + [151645]
        drafter = method.drafter(RequestInfo(prompt, it["tools"]))
        trace = []
        res = simulate(drafter, prompt, out, trace, tokenizer=qwen_tok)
        # the first schema step (opener + name + ...) reaches at least the tool name's end
        name_tokens = len(
            qwen_tok.encode(
                render_calls(it["gold_calls"][:1], layout_by_name(layout)).split(it["gold_calls"][0]["name"])[0]
                + it["gold_calls"][0]["name"]
            )
        )
        assert trace[0][2] + 2 >= name_tokens - 1, (it["id"], trace[:2])
        assert res["mat"] > 2.0, it["id"]
        checked += 1
    assert checked == 60


def test_candidates_tree_mass_and_conf(qwen_tok):
    bt = BoundaryTokenizer(qwen_tok)
    t = tracker('<tool_call>\n{"name": "get_')
    prompt = qwen_tok.encode('<tool_call>\n{"name": "get_')
    cands = continuations(t, ToolIndex.from_tools(TOOLS), Priors(), [151645], levels=1)
    tree = candidates_to_tree(bt, prompt, cands, LabelRates(DEFAULT_RATES))
    roots = tree.children(-1)
    assert {qwen_tok.decode([tree.tokens[i]]) for i in roots} == {"weather", "time"}
    assert sum(tree.conf[i] for i in roots) <= 1.0 + 1e-9
    assert all(0 < p <= 1 for p in path_probs(tree))
    # deep along one branch the conf is the deterministic schema rate
    deep = [i for i in range(len(tree)) if tree.parents[i] >= 0 and tree.labels[i] == "schema"]
    assert deep and all(tree.conf[i] == pytest.approx(DEFAULT_RATES["schema"], rel=1e-6) for i in deep[:3])


def test_candidates_past_the_budget_node_cap_are_not_tokenized(qwen_tok):
    """With ``max_nodes``, the least probable candidates are left out once ``max_nodes`` nodes each
    hold more mass than all of them together; the tree built is the full one's first nodes."""
    bt = BoundaryTokenizer(qwen_tok)
    prompt = qwen_tok.encode("<tool_call>\n{")
    rates = LabelRates(DEFAULT_RATES)
    segs = [('"name": "get_weather"}', TOOL_NAME), ('"name": "get_time"}', TOOL_NAME), ('"x"', TOOL_NAME)]
    cands = [Cand([segs[0]], 0.45), Cand([segs[1]], 0.45), Cand([segs[2]], 0.1)]
    full = candidates_to_tree(bt, prompt, cands, rates)
    capped = candidates_to_tree(bt, prompt, cands, rates, max_nodes=4)
    first_two = candidates_to_tree(bt, prompt, cands[:2], rates)
    assert len(full) > len(capped) and capped.tokens == first_two.tokens == full.tokens[: len(capped)]
    # a cap the tree reaches only with every candidate in, or a tail too heavy to leave out
    assert candidates_to_tree(bt, prompt, cands, rates, max_nodes=len(first_two) + 1).tokens == full.tokens
    heavy = [Cand([segs[0]], 0.45), Cand([segs[1]], 0.1), Cand([segs[2]], 0.45)]
    assert len(candidates_to_tree(bt, prompt, heavy, rates, max_nodes=5)) == len(full)


def test_a_closer_that_is_text_is_drafted_both_ending_the_turn_and_followed_by_prose(qwen_tok):
    # "```" + end of turn, or "```\n\n" + prose: canonical BPE splits the latter "``" + "`\n\n"
    bt = BoundaryTokenizer(qwen_tok)
    out = '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "tz": "UTC"\n  }\n}'
    cands = continuations(tracker(out), ToolIndex.from_tools(TOOLS), Priors(), [151645], levels=1)
    assert _texts(cands) == ["\n```", "\n```\n\n"]
    tree = candidates_to_tree(bt, qwen_tok.encode(out), cands, LabelRates(DEFAULT_RATES))
    for text in ("\n```<|im_end|>", "\n```\n\nThis"):
        truth = qwen_tok.encode(text)
        assert len(oracle_walk(tree, truth).path) == len(truth) - (text.endswith("This")), text
    # bare JSON has no closer: the turn ends (or another object follows on the next line)
    texts = _next_texts('{"name": "get_time", "arguments": {"tz": "UTC"}}', eos=7, levels=1)
    assert texts[0] == "" and all(t.startswith('\n{"name": "') for t in texts[1:])


@pytest.mark.parametrize(
    "truth",
    [
        '}}\n{"output_parameters": {"time": "10:00"}}',
        '}}\n{"name": "get_weather", "arguments": {}}',
        "}}\n<|im_end|>",
        "}}<|im_end|>",
    ],
)
def test_after_a_bare_call_the_end_of_turn_and_a_next_object_are_both_drafted(qwen_tok, truth):
    # small models go on after a bare call with a second object (a made-up tool result, another
    # call) on the next line; Qwen writes "}}\n" as one token, so the next line is drafted with the closer
    bt, idx, rates = BoundaryTokenizer(qwen_tok), ToolIndex.from_tools(TOOLS), LabelRates(DEFAULT_RATES)
    out = '{"name": "get_time", "arguments": {"tz": "UTC"'
    steps = [(out, truth)] + (
        [(out + "}}\n", truth[3:])] if truth.startswith("}}\n") else []
    )  # at the value's end; on the new line
    for done, rest in steps:
        gen, want = qwen_tok.encode(done), qwen_tok.encode(rest)
        tree = candidates_to_tree(bt, gen, continuations(tracker(done), idx, Priors(), [151645], levels=1), rates)
        assert oracle_walk(tree, want).path, (done, rest)  # the first token at least


def test_oracle_walk():
    from toolspec_core.spec.tree import DraftTree

    tree = DraftTree()
    tree.add_path([1, 2, 3], 1.0, "x")
    tree.add_path([1, 4], 1.0, "x")
    assert oracle_walk(tree, [1, 4, 9]).path == [0, 3]


def test_value_drafted_from_the_conversation(qwen_tok):
    """Inside a string value, the drafter continues it as the user wrote it (canonical tokens)."""
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.proposer import DraftContext

    msgs = [{"role": "user", "content": "What's the weather in San Francisco de Campeche today?"}]
    prompt = render_prompt(qwen_tok, msgs, TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San'
    gen = qwen_tok.encode(call)
    drafter = SchemaMethod(qwen_tok).drafter(RequestInfo(prompt, TOOLS))
    tree = drafter.propose(DraftContext(prompt + gen, len(prompt), 40))
    truth = qwen_tok.encode(call + ' Francisco de Campeche"')[len(gen) :]
    res = oracle_walk(tree, truth)
    assert len(res.path) == len(truth) - 1 and res.token == truth[-1]  # the span runs on past the value
    assert "span" in {tree.labels[i] for i in res.path}


def test_the_call_closes_after_whitespace_a_step_already_wrote():
    """Pretty JSON: a step may end on the arguments' ``}`` plus its newline ("  }\n" is one token);
    the call's ``}`` then follows without a second newline."""
    idx = ToolIndex.from_tools(TOOLS)
    body = '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "tz": "UTC"\n  }'
    for written, want in ((body, "\n}\n```"), (body + "\n", "}\n```")):
        texts = _next_texts(written, idx, eos=7)
        assert texts and all(t.startswith(want) for t in texts), (written, texts)


def test_a_copied_value_is_drafted_on_through_what_follows_it(qwen_tok):
    """A span that closes the value carries the schema's continuation, tokenized with it: the
    closing quote merges with what follows (``"}}``), so the span alone would end on a token the
    target does not write."""
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.labels import SPAN

    msgs = [{"role": "user", "content": 'Run {"tz": "Europe/Paris"} through get_time.'}]
    prompt = render_prompt(qwen_tok, msgs, TOOLS)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe'
    gen = qwen_tok.encode(call)
    rest = '/Paris"}}\n</tool_call>'
    truth = qwen_tok.encode(call + rest)[len(gen) :] + [151645]
    assert '"' not in [qwen_tok.decode([t]) for t in truth]  # the quote is merged with what follows
    tree = (
        SchemaMethod(qwen_tok).drafter(RequestInfo(prompt, TOOLS)).propose(DraftContext(prompt + gen, len(prompt), 40))
    )
    res = oracle_walk(tree, truth)
    assert (
        len(res.path) == len(truth) and tree.labels[res.path[0]] == SPAN
    )  # the value, the call's end, the end of the turn


def test_a_value_copied_from_prose_may_end_where_the_word_does(qwen_tok):
    """From prose a span runs on past the value ("UTC please ..."): the value ending where the
    source's word ends is a branch of its own, well above the schema's any-position end."""
    from toolspec_core.drafters.toolcall.drafter import SchemaDrafter
    from toolspec_core.model.prompting import render_prompt
    from toolspec_core.spec.labels import SPAN

    prompt = render_prompt(qwen_tok, [{"role": "user", "content": "What time is it in UTC please?"}], TOOLS)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC'
    gen = qwen_tok.encode(call)
    truth = qwen_tok.encode(call + '"}}\n</tool_call>')[len(gen) :] + [151645]
    tree = (
        SchemaMethod(qwen_tok).drafter(RequestInfo(prompt, TOOLS)).propose(DraftContext(prompt + gen, len(prompt), 40))
    )
    res = oracle_walk(tree, truth)
    assert len(res.path) == len(truth) and tree.labels[res.path[0]] == SPAN
    assert tree.conf[res.path[0]] >= SchemaDrafter.WORD_END * DEFAULT_RATES[SPAN] * 0.99


def test_retrieved_values_and_argument_order_become_branches():
    """Past calls of the tool: their values (in this output's style) and their argument order."""
    past = [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Paris", "days": 5}),
        ("get_time", {"tz": "UTC"}),
    ]
    tools = ToolIndex.from_tools(TOOLS)

    def texts(t, **kw):
        return {
            "".join(s for s, _ in c.segs if isinstance(s, str)): c
            for c in continuations(t, tools, Priors(), [151645], levels=1, **kw)
        }

    at_value = texts(tracker('{"name": "get_weather", "arguments": {"city": '), past=past)
    assert any(k.startswith('"Paris"') for k in at_value)
    paris = [c for k, c in at_value.items() if k.startswith('"Paris"')]
    assert all(('"Paris"', "retrieval") in c.segs for c in paris)
    assert sum(c.prob for c in paris) == pytest.approx(2 / 3)  # 2 of 2 calls (+1 smoothing), over what may follow
    inside = texts(tracker('{"name": "get_weather", "arguments": {"city": "Pa'), past=past)
    assert any(k.startswith('ris"') for k in inside)
    assert not any(k.startswith('ris"') for k in texts(tracker('{"name": "get_weather", "arguments": {"city": "Pa')))
    # after "city" both past calls went on with "days": it outweighs the schema's order ("unit" first)
    nxt = continuations(
        tracker('{"name": "get_weather", "arguments": {"city": "Paris", "'),
        tools,
        Priors(),
        [151645],
        levels=0,
        past=past,
    )
    assert "".join(s for s, _ in nxt[0].segs if isinstance(s, str)).startswith("days")
    # values of another tool's calls are never offered
    assert not any("UTC" in k for k in at_value)


def test_copy_rates_learn_by_match_length():
    from toolspec_core.drafters.base import LabelRates, rate_key
    from toolspec_core.spec.labels import match_label
    from toolspec_core.spec.tree import DraftTree

    assert match_label("pld", 2, 3) == "pld" and match_label("pld", 3, 3) == "pld:long"
    rates = LabelRates({"pld": 0.5, "pld+": 0.8})
    assert rates.rate("pld:long") == 0.5 and rates.rate("pld:long+") == 0.8  # prior of the draft source
    t = DraftTree()
    t.add_path([1, 2], [0.5, 0.8], "pld:long")
    assert [rate_key(t, i) for i in range(2)] == ["pld:long", "pld:long+"]


def test_a_misspelt_tool_name_takes_the_schema_of_the_closest_offered_tool():
    # models write names the request does not offer (getFruitsByFamily for getFruitByFamily)
    idx = ToolIndex.from_tools(TOOLS)
    assert idx.resolve("get_weather") == "get_weather" and idx.resolve("get_weathers") == "get_weather"
    assert (
        idx.resolve("calculateMonthlySalary") is None
        and idx.free("calculateMonthlySalary")
        and not idx.free("get_weathers")
    )
    texts = _next_texts('{"name": "get_weathers", "arguments": {', idx, levels=1)
    assert texts[0].startswith('"city": ')


def test_a_call_of_an_unknown_tool_still_gets_its_structure_drafted():
    # no schema: argument names are free, but the key's end, the separator and the closing braces are not
    idx = ToolIndex.from_tools(TOOLS)
    texts = _next_texts('```json\n{\n  "name": "calculateSalary",', idx)
    assert texts == ['\n  "arguments": {\n    "']
    texts = _next_texts('```json\n{\n  "name": "calculateSalary",\n  "arguments": {\n    "sal', idx)
    assert texts == ['": ']
    texts = _next_texts('{"name": "calculateSalary", "arguments": {"salary": 5000', idx, eos=7)
    assert ', "' in texts and "}}" in texts
    assert _next_texts('{"name": "calculateSalary", "arguments": {"', idx) == []


def test_the_budget_floor_ends_candidates_where_their_branch_falls_below_it():
    """``min_prob``: a branch less probable than the floor is not expanded; the segments before it
    end a candidate with its probability (its nodes could not be kept; the mass it adds to the
    nodes above it is kept). Every such candidate is a prefix of one the full expansion drafts."""
    idx = ToolIndex.from_tools(TOOLS)
    t = tracker('<tool_call>\n{"name": "')
    full = _texts(continuations(t, idx, Priors(), [0], max_cands=10_000, bounded=False))
    above = continuations(t, idx, Priors(), [0], min_prob=0.4)  # every tool is a third
    assert sorted(_texts(above)) == ['get_time"', 'get_weather"', 'ping"']
    assert [c.prob for c in above] == pytest.approx([1 / 3] * 3)
    between = continuations(t, idx, Priors(), [0], min_prob=0.2)
    assert 3 < len(between) < len(continuations(t, idx, Priors(), [0]))
    assert sum(c.prob for c in between) == pytest.approx(1.0)
    assert all(any(f.startswith(x) for f in full) for x in _texts(between))
    assert _texts(continuations(t, idx, Priors(), [0], min_prob=0.0)) == _next_texts(
        '<tool_call>\n{"name": "', levels=3
    )


@pytest.mark.parametrize("min_prob", [0.05, 0.3])
def test_bounded_expansion_under_a_floor_keeps_the_floored_full_expansions_candidates(min_prob):
    """The budget's floor changes what is expanded, not the bounded expansion's guarantee: at every
    character of real gold calls, bounded and full expansion under the same floor agree."""
    checked = 0
    for it in _gold_items(3):
        idx = ToolIndex.from_tools(it["tools"])
        text = render_calls(it["gold_calls"], layout_by_name("hermes"))
        past = [(c["name"], c.get("arguments") or {}) for c in it["gold_calls"]]
        t = CallTracker(idx)
        for k in range(len(text) + 1):
            if k:
                t.feed(text[k - 1])
            kw = dict(max_cands=64, past=past, min_prob=min_prob)
            full = continuations(t, idx, Priors(), [7], bounded=False, **kw)
            cut = continuations(t, idx, Priors(), [7], **kw)
            assert [(c.segs, c.prob) for c in cut] == [(c.segs, c.prob) for c in full], (it["id"], text[:k])
            checked += 1
    assert checked > 500


@pytest.mark.parametrize("layout", ["hermes", "fence"])
def test_bounded_expansion_keeps_the_full_expansions_candidates(layout):
    """At every character of real gold calls (three dev sets, past calls as retrieved values, the
    conversation's numbers and dates): the bounded expansion's kept candidates are the full
    expansion's, candidate for candidate (segments, probability, order), at both cuts the drafter
    uses (64 for a step's tree, 8 after a copied value)."""
    from toolspec_core.drafters.toolcall.values import context_dates, context_numbers

    checked = big = 0
    for it in _gold_items(8):
        idx = ToolIndex.from_tools(it["tools"])
        text = render_calls(it["gold_calls"], layout_by_name(layout))
        prose = " ".join(str(m.get("content") or "") for m in it["messages"])
        past = [(c["name"], c.get("arguments") or {}) for c in it["gold_calls"]]
        extra = dict(past=past, numbers=context_numbers(prose), dates=context_dates(prose))
        t = CallTracker(idx)
        for k in range(len(text) + 1):
            if k:
                t.feed(text[k - 1])
            for keep in (64, 8):
                full = continuations(t, idx, Priors(), [7], max_cands=keep, bounded=False, **extra)
                cut = continuations(t, idx, Priors(), [7], max_cands=keep, **extra)
                assert [(c.segs, c.prob) for c in cut] == [(c.segs, c.prob) for c in full], (it["id"], text[:k])
                checked += 1
                big += len(full) == keep
    assert checked > 2000 and big > 100
