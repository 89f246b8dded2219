"""Core engine on tiny random Qwen2 models: tree verification, KV commit, losslessness, stops, errors."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from tiny import hf_greedy, tiny_target
from toolspec_core.engine.budget import CostModel, interpolate
from toolspec_core.drafters.base import DraftContext, NoDrafter
from toolspec_core.drafters.prompt_lookup import PromptLookupDrafter, ngram_continuations
from toolspec_core.engine.loop import DecodeConfig, decode, generate, prefill
from toolspec_core.errors import ContextLengthError, InvalidRequestError
from toolspec_core.engine.sampling import SamplingParams
from toolspec_core.engine.tree import DraftTree, depths, path_probs, prune_to_budget, select
from toolspec_core.engine.commit import commit_kv, kv_rows
from toolspec_core.engine.verify import greedy_walk, tree_inputs

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
N = 24


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


@pytest.fixture(scope="module")
def reference(tiny):
    return hf_greedy(tiny, PROMPT, N)


class ScriptedDrafter:
    """Drafts from a function of the generated-so-far tokens (oracle / garbage / branching)."""

    def __init__(self, fn):
        self.fn = fn
        self.accepted = []

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.fn(ctx)

    def feedback(self, tree, result):
        self.accepted.append(len(result.path))


def oracle(ref):
    def fn(ctx):
        done = len(ctx.generated)
        tree = DraftTree()
        tree.add_path(ref[done : done + 6], 0.9, "oracle")
        return tree

    return fn


def garbage(ref):
    def fn(ctx):
        done = len(ctx.generated)
        tree = DraftTree()
        want = ref[done] if done < len(ref) else 0
        tree.add_path([(want + 1) % 96, 5, 6, 7], 0.9, "garbage")
        return tree

    return fn


def branching(ref):
    """Two wrong branches first, the true continuation as the third branch, plus a wrong sub-branch."""

    def fn(ctx):
        done = len(ctx.generated)
        true = ref[done : done + 5]
        tree = DraftTree()
        if not true:
            return tree
        tree.add_path([(true[0] + 1) % 96, 3, 4], 0.5, "b0")
        tree.add_path([(true[0] + 2) % 96, 9], 0.5, "b1")
        node = tree.add_path(true[:2], 0.5, "b2")
        tree.add_path([(true[2] + 7) % 96 if len(true) > 2 else 1], 0.5, "b3", parent=node)
        tree.add_path(true[2:], 0.5, "b2", parent=node)
        return tree

    return fn


def test_tree_encoding_and_mask():
    tree = DraftTree()
    a = tree.add_path([10, 11, 12], 0.9, "x")
    b = tree.add_path([10, 13], 0.5, "y")  # shares the first node
    assert tree.tokens == [10, 11, 12, 13] and tree.parents == [-1, 0, 1, 0]
    assert (a, b) == (2, 3)
    assert depths(tree.parents) == [1, 2, 3, 2]
    ids, pos, mask = tree_inputs(7, tree, prefix_len=5)
    assert ids.tolist() == [[7, 10, 11, 12, 13]]
    assert pos.tolist() == [[5, 6, 7, 8, 7]]
    visible = (mask[0, 0] == 0).int()
    assert visible[:, :5].all()  # everyone sees the prefix
    assert visible[:, 5:].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]


def test_greedy_walk_takes_longest_matching_path():
    tree = DraftTree()
    tree.add_path([10, 11, 12], 1.0, "x")
    tree.add_path([10, 13, 14], 1.0, "x")
    # choice per row: root->10, node0(10)->13, node1(11)->.., node2(12)->.., node3(13)->14, node4(14)->99
    res = greedy_walk(tree, [10, 13, 0, 0, 14, 99])
    assert res.path == [0, 3, 4] and res.token == 99
    res = greedy_walk(tree, [42, 0, 0, 0, 0, 0])
    assert res.path == [] and res.token == 42


def test_prune_to_budget_keeps_what_pays():
    curve = interpolate({1: 1.0, 2: 2.2, 4: 2.4, 8: 2.7, 16: 3.5, 32: 4.6, 64: 6.6}, 64)
    sure = DraftTree()
    sure.add_path(list(range(10, 20)), 0.99, "schema")
    assert len(prune_to_budget(sure, curve)) == 10
    unsure = DraftTree()
    unsure.add_path([5, 6], 0.3, "guess")
    assert len(prune_to_budget(unsure, curve)) == 0  # a 1-2 token guess never pays on this curve
    flat = interpolate({1: 1.0, 64: 1.0}, 64)
    assert len(prune_to_budget(unsure, flat)) == 2
    # the kept set is closed under parents and ordered by path probability
    wide = DraftTree()
    for t in range(20):
        wide.add_path([100 + t, 200 + t, 300 + t], [0.05, 0.99, 0.99], "name")
    kept = prune_to_budget(wide, curve)
    assert all(p == -1 or p < i for i, p in enumerate(kept.parents))
    assert max(path_probs(kept), default=0) <= 0.05


def test_select_reindexes():
    tree = DraftTree()
    tree.add_path([1, 2, 3], 0.9, "a")
    tree.add_path([4, 5], 0.9, "b")
    sub = select(tree, [0, 1, 3])
    assert sub.tokens == [1, 2, 4] and sub.parents == [-1, 0, -1]


def test_tree_forward_equals_per_branch_runs(tiny):
    """Logits of every tree node equal those of running its branch alone (SDPA + float mask)."""
    pre = prefill(tiny, PROMPT)
    tree = DraftTree()
    tree.add_path([10, 11, 12], 1.0, "x")
    tree.add_path([10, 13], 1.0, "x")
    tree.add_path([20, 21], 1.0, "x")
    cache = pre.cache
    kv = cache.get_seq_length()
    ids, pos, mask = tree_inputs(PROMPT[-1], tree, kv)
    logits = tiny.logits(tiny.hidden(ids, pos, mask, cache))
    for node in range(len(tree)):
        branch = [tree.tokens[i] for i in tree.path_to(node)]
        full = torch.tensor([PROMPT + [PROMPT[-1]] + branch])
        ref = tiny.model(full).logits[0, -1]
        assert torch.allclose(logits[node + 1], ref, atol=2e-5), node


def test_eager_attention_with_our_float_mask_is_right():
    """A bool 4D mask is silently misread under eager attention; our float mask must not be."""
    tg = tiny_target(attn="eager")
    pre = prefill(tg, PROMPT)
    tree = DraftTree()
    tree.add_path([10, 11], 1.0, "x")
    tree.add_path([20, 21], 1.0, "x")
    kv = pre.cache.get_seq_length()
    ids, pos, mask = tree_inputs(PROMPT[-1], tree, kv)
    assert mask.dtype == torch.float32
    logits = tg.logits(tg.hidden(ids, pos, mask, pre.cache))
    branch = [20, 21]
    ref = tg.model(torch.tensor([PROMPT + [PROMPT[-1]] + branch])).logits[0, -1]
    assert torch.allclose(logits[4], ref, atol=2e-5)


def test_commit_kv_keeps_exactly_the_accepted_rows(tiny):
    pre = prefill(tiny, PROMPT)
    cache = pre.cache
    kv = cache.get_seq_length()
    tree = DraftTree()
    tree.add_path([30, 31], 1.0, "x")
    tree.add_path([40, 41, 42], 1.0, "x")
    ids, pos, mask = tree_inputs(PROMPT[-1], tree, kv)
    tiny.hidden(ids, pos, mask, cache)
    path = [2, 3]  # tokens 40, 41
    commit_kv(cache, kv, kv_rows(path))
    assert cache.get_seq_length() == kv + 3
    ref = tiny.new_cache()
    seq = PROMPT + [PROMPT[-1], 40, 41]
    tiny.hidden(torch.tensor([seq]), torch.arange(len(seq))[None], None, ref)
    for a, b in zip(cache.layers, ref.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("make", [oracle, garbage, branching], ids=["oracle", "garbage", "branching"])
def test_greedy_equals_plain_greedy(tiny, reference, make):
    drafter = ScriptedDrafter(make(reference))
    res = generate(tiny, PROMPT, drafter, DecodeConfig(max_new_tokens=N))
    assert res.tokens == reference
    assert res.finish_reason == "length"
    if make is garbage:
        assert sum(drafter.accepted) == 0 and res.stats.forwards == N - 1
    else:
        assert sum(drafter.accepted) > N // 2  # drafts really were accepted
        assert res.stats.forwards < N - 1
        assert res.stats.mat > 1.5


def test_no_drafter_and_prompt_lookup_equal_hf(tiny, reference):
    assert generate(tiny, PROMPT, NoDrafter(), DecodeConfig(max_new_tokens=N)).tokens == reference
    res = generate(tiny, PROMPT, PromptLookupDrafter(min_ngram=1), DecodeConfig(max_new_tokens=N), CostModel.flat())
    assert res.tokens == reference


def test_prompt_lookup_continuations():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    assert ngram_continuations(toks, 3, 2, 2, 4) == [[7, 7], [9, 9]]
    assert ngram_continuations([1, 2, 3], 3, 2, 4, 4) == []


def test_max_new_tokens_inside_an_accepted_draft(tiny, reference):
    for n in (1, 2, 5, 7):
        res = generate(tiny, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=n))
        assert res.tokens == reference[:n] and res.finish_reason == "length"


def test_eos_inside_an_accepted_draft(reference):
    eos = reference[6]
    tg = tiny_target(eos=eos)
    assert eos in tg.eos_ids
    res = generate(tg, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=N))
    assert res.tokens == reference[: reference.index(eos) + 1]
    assert res.finish_reason == "stop"
    assert res.text == tg.tokenizer.decode(reference[: reference.index(eos)])


def test_stop_string_inside_an_accepted_draft(tiny, reference):
    text = tiny.tokenizer.decode(reference)
    stop = text[12:16]  # a stop string that completes mid-draft
    plain = generate(tiny, PROMPT, NoDrafter(), DecodeConfig(max_new_tokens=N, stop=(stop,)))
    spec = generate(tiny, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=N, stop=(stop,)))
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert spec.finish_reason == "stop" and stop not in spec.text
    assert text.startswith(spec.text) and len(spec.tokens) < N


def test_streaming_callback_sees_every_token_once(tiny, reference):
    seen = []
    res = decode(tiny, prefill(tiny, PROMPT), ScriptedDrafter(branching(reference)), DecodeConfig(max_new_tokens=N),
                 on_tokens=lambda ids: seen.extend(ids))
    assert seen == res.tokens == reference
    stop_after = []
    res = decode(tiny, prefill(tiny, PROMPT), None, DecodeConfig(max_new_tokens=N),
                 on_tokens=lambda ids: stop_after.extend(ids) or len(stop_after) < 3)
    assert res.finish_reason == "cancelled" and len(res.tokens) == 3


def test_prefill_with_prefix_reuse_is_identical(tiny, reference):
    prefix = prefill(tiny, PROMPT[:8])
    pre = prefill(tiny, PROMPT, prefix=prefix)
    assert pre.cache.get_seq_length() == len(PROMPT)
    assert decode(tiny, pre, None, DecodeConfig(max_new_tokens=N)).tokens == reference
    assert prefix.cache.get_seq_length() == 8  # the shared prefix is not consumed


def test_stats_arithmetic(tiny, reference):
    res = generate(tiny, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=N))
    st = res.stats
    assert st.generated_tokens == N
    assert sum(st.accepted) + st.forwards == N - 1  # every decode step emits accepted + 1
    assert st.mat == pytest.approx((N - 1) / st.forwards)
    assert st.label_accepted["oracle"] == sum(st.accepted)
    d = st.to_dict()
    assert d["accepted_tokens"] == sum(st.accepted) and d["forwards"] == st.forwards


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(max_new_tokens=1.5), dict(stop=("",))],
)
def test_bad_decode_config(kwargs):
    with pytest.raises(InvalidRequestError):
        DecodeConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(seed="x")],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny):
    with pytest.raises(InvalidRequestError, match="empty"):
        generate(tiny, [], None, DecodeConfig(max_new_tokens=4))
    with pytest.raises(ContextLengthError, match="context window"):
        generate(tiny, [1] * 600, None, DecodeConfig(max_new_tokens=4))
    with pytest.raises(ContextLengthError):
        generate(tiny, [1] * 500, None, DecodeConfig(max_new_tokens=100))


def test_measured_cost_curve_is_relative_and_monotone(tiny):
    from toolspec_core.engine.cost_probe import measure_cost_model

    cm = measure_cost_model(tiny, prefix_len=32, max_nodes=15, repeats=2)
    assert cm.points[1] == 1.0 and set(cm.points) == {1, 2, 3, 4, 6, 8, 12, 16}
    assert all(a <= b + 1e-12 for a, b in zip(cm.curve[1:], cm.curve[2:]))  # never cheaper for more tokens
    assert cm.step_cost(0) == cm.curve[1] == 1.0


def test_cost_model_calibrates_from_real_steps():
    """observe(): the curve follows what steps really cost, relative to 1-token steps; buckets
    decoding never used keep their start-up value; off unless asked."""
    from toolspec_core.engine.budget import CostModel

    fixed = CostModel({1: 1.0, 4: 1.2, 16: 1.5, 64: 3.0})
    fixed.observe(16, 9.0)
    assert fixed.points[16] == 1.5
    cm = CostModel({1: 1.0, 4: 1.2, 16: 1.5, 64: 3.0}, calibrate=True)
    for _ in range(12):  # refits every 16 steps once 8 one-token steps are in
        cm.observe(1, 0.1)
        cm.observe(12, 0.25)  # bucket k=16: 9..16 rows
        cm.observe(16, 0.25)
    assert cm.points[16] == pytest.approx(2.5) and cm.points[4] == 1.2 and cm.points[64] == 3.0
    assert cm.curve[16] == pytest.approx(2.5) and cm.curve[10] > 1.2  # re-interpolated
    assert cm.step_cost(15) == pytest.approx(2.5)


def test_packed_linear_matches_linear():
    """MKL's packed GEMM (inputs zero-padded to the packed row count) is the same function."""
    from toolspec_core.model.cpu_linears import mkl_pack, packed_linear

    w, b = torch.randn(40, 24), torch.randn(40)
    packed = mkl_pack(w, 16)
    assert packed is not None  # the CPU wheel ships MKL: the tuned path is really exercised
    for shape in ((4, 24), (1, 7, 24), (16, 24)):
        x = torch.randn(*shape)
        torch.testing.assert_close(packed_linear(x, packed, w, b, 16), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_onednn_linear_matches_linear():
    """oneDNN on a weight reordered once (the default path for 4+ rows) is the same function."""
    from toolspec_core.model.cpu_linears import onednn_linear, onednn_pack

    w, b = torch.randn(40, 24), torch.randn(40)
    packed = onednn_pack(w)
    assert packed is not None  # the CPU wheel ships oneDNN: the tuned path is really exercised
    for shape in ((4, 24), (1, 7, 24), (16, 24), (1, 64, 24)):
        x = torch.randn(*shape)
        torch.testing.assert_close(onednn_linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(onednn_linear(x, packed, None), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed_rows", [16, 0])
def test_tuned_cpu_linears_keep_greedy_output(reference, packed_rows):
    """The row-count dispatch of ``tune_cpu_linears`` (with and without MKL's packed GEMM)
    computes the same function: same logits (to float tolerance) for 1..64 rows, and drafting
    on the tuned model still gives exactly the plain greedy output of the untouched model."""
    import copy

    from toolspec_core.model.cpu_linears import tune_cpu_linears

    plain = tiny_target()
    tuned = copy.deepcopy(plain)
    n = tune_cpu_linears(tuned.model, packed_rows=packed_rows)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in tuned.model.modules()) > 0
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 64):
        h = torch.randn(rows, plain.model.config.hidden_size)
        torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
    for make in (oracle, branching):
        res = decode(tuned, prefill(tuned, PROMPT), ScriptedDrafter(make(reference)), DecodeConfig(max_new_tokens=N), CostModel.flat())
        assert res.tokens == reference


def test_rows_kernel_is_linear_and_batch_invariant():
    """ToolSpec's few-rows CPU kernel: ``F.linear`` to float tolerance (odd shapes: k tails, weight
    rows that do not fill a block, bias or not, 3D inputs), and a row's output bit for bit the same
    whatever the number of rows sharing the call -- so a verified row's logits are exactly a
    one-row forward's. It builds wherever the CPU has AVX2 (this project's dev and CI machines)."""
    from toolspec_core.model import rows_kernel

    kernel = rows_kernel.load()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel is not None
    if kernel is None:
        pytest.skip("no AVX2 on this CPU: the kernel is not used here")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((37, 900), (40, 24), (3, 7), (128, 896)):
        w = torch.randn(out_f, in_f, generator=g)
        b = torch.randn(out_f, generator=g)
        x = torch.randn(40, in_f, generator=g)
        for bias in (b, None):
            full = kernel.rows_linear(x, w, bias)
            torch.testing.assert_close(full, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 19, 24, 33, 40):
                assert torch.equal(kernel.rows_linear(x[:rows], w, bias), full[:rows]), (out_f, in_f, rows)
        x3 = x[:6].reshape(2, 3, in_f)
        assert torch.equal(kernel.rows_linear(x3, w, b), kernel.rows_linear(x[:6], w, b).reshape(2, 3, out_f))
    with pytest.raises(RuntimeError, match="features"):
        kernel.rows_linear(torch.randn(2, 5), torch.randn(3, 4), None)
    assert kernel.rows_linear(torch.randn(0, 4), torch.randn(3, 4), None).shape == (0, 3)  # no rows: no pass


def test_rows_kernel_builds_agree_bit_for_bit():
    """The AVX-512VL build (bigger tiles in 32 registers) and the AVX2-only build (16 registers) run
    the same per-output arithmetic: same bits for every row count, so a run's outputs do not depend
    on which build a machine got. Needs an AVX-512 CPU to build both (the dev box has one)."""
    from toolspec_core.model import rows_kernel

    if not rows_kernel.wide_registers() or rows_kernel.load() is None:
        pytest.skip("needs an AVX-512 CPU to compare both builds")
    # the AVX2 build an AVX2-only machine gets, cached beside this machine's (rebuilt when the source changes)
    avx2 = rows_kernel.build(rows_kernel.SOURCE, "toolspec_rows_linear_avx2", rows_kernel.build_dir("avx2-check"), rows_kernel.AVX2_FLAGS)
    wide = rows_kernel.load()
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in ((37, 900), (130, 896), (9, 4864)):
        w = torch.randn(out_f, in_f, generator=g)
        x = torch.randn(40, in_f, generator=g)
        for rows in (1, 2, 3, 4, 6, 7, 9, 16, 20, 33, 40):
            assert torch.equal(avx2.rows_linear(x[:rows], w, None), wide.rows_linear(x[:rows], w, None)), (out_f, in_f, rows)


def test_rows_kernel_off_or_unbuildable_keeps_the_other_dispatch(monkeypatch):
    """``TOOLSPEC_ROWS_KERNEL=0`` (or a machine where it cannot build) loads no kernel, and the
    tuned linears still compute the same function through oneDNN / ``F.linear``."""
    import copy

    from toolspec_core.model import rows_kernel
    from toolspec_core.model.cpu_linears import tune_cpu_linears

    rows_kernel.load.cache_clear()
    monkeypatch.setenv("TOOLSPEC_ROWS_KERNEL", "0")
    try:
        assert rows_kernel.load() is None
        plain = tiny_target()
        tuned = copy.deepcopy(plain)
        assert tune_cpu_linears(tuned.model) > 0
        for rows in (1, 3, 8):
            h = torch.randn(rows, plain.model.config.hidden_size)
            torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
    finally:
        rows_kernel.load.cache_clear()


def test_cache_kwarg_follows_the_forward_signature(tiny):
    """transformers >= 5.20 names the KV cache ``cache``; older images (a GPU machine's 5.17) only
    know ``past_key_values``: a wrong name would silently decode without a cache."""
    from toolspec_core.model.target import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return None

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    assert cache_kwarg(tiny.model.model) in ("cache", "past_key_values")
    cache = tiny.new_cache()
    tiny.hidden(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], None, cache)
    assert cache.get_seq_length() == 3  # the cache really was used


def test_small_row_kernel_choice_is_measured_and_dispatched():
    """Without the rows kernel, at 1-3 rows the kernel is whichever was measured faster on this
    CPU; either way the tuned layer computes the same function, and a given choice is what the
    layer uses."""
    import copy

    from toolspec_core.model.cpu_linears import onednn_pack, small_row_kernels, tune_cpu_linears

    w = torch.randn(40, 24)
    choice = small_row_kernels(w, onednn_pack(w), repeats=2)
    assert len(choice) == 3 and all(isinstance(c, bool) for c in choice)
    assert small_row_kernels(w, None) == (False, False, False)  # no oneDNN: F.linear
    plain = tiny_target()
    for forced in ((True, True, True), (False, False, False)):
        tuned = copy.deepcopy(plain)
        kernels = {tuple(m.weight.shape): forced for m in tuned.model.modules() if isinstance(m, torch.nn.Linear)}
        tune_cpu_linears(tuned.model, small_kernels=kernels, rows_kernel=False)
        calls = []
        import toolspec_core.model.cpu_linears as linears_mod

        orig = linears_mod.onednn_linear
        with patch.object(linears_mod, "onednn_linear", lambda *a: calls.append(1) or orig(*a)):
            for rows in (1, 2, 3):
                h = torch.randn(rows, plain.model.config.hidden_size)
                torch.testing.assert_close(tuned.logits(h), plain.logits(h), rtol=1e-5, atol=1e-5)
        assert bool(calls) == forced[0]
