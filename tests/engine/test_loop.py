"""The decode loop on tiny random Qwen2 models: losslessness under any drafter, stops, streaming, stats, errors."""

from __future__ import annotations

import pytest
from scripted import PROMPT, N, ScriptedDrafter, branching, garbage, oracle
from scripted import reference as reference
from scripted import tiny as tiny
from tiny import tiny_target

from toolspec_core.engine.loop import DecodeConfig, generate, prefill
from toolspec_core.engine.sampling import SamplingParams
from toolspec_core.errors import ContextLengthError, InvalidRequestError
from toolspec_core.spec.proposer import NoDrafter


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


def test_end_after_string_ends_the_output_and_stays_in_it(tiny, reference):
    """``end_after`` (a call's closer when parallel calls are off) ends the output at the token that
    writes it, keeps it in the text, and is the same with or without drafts."""
    text = tiny.tokenizer.decode(reference)
    end = text[12:16]
    plain = generate(tiny, PROMPT, NoDrafter(), DecodeConfig(max_new_tokens=N, end_after=(end,)))
    spec = generate(tiny, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=N, end_after=end))
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert spec.finish_reason == "stop" and spec.text == text[: text.index(end) + len(end)]
    assert spec.tokens == reference[: len(spec.tokens)] and len(spec.tokens) < N


@pytest.mark.parametrize("make", [None, oracle, branching], ids=["plain", "oracle", "branching"])
def test_logprobs_are_the_models_whatever_the_drafts(tiny, reference, make):
    """Each token's logprob and top alternatives equal one full forward of the model over prompt +
    output, whether the token came from an accepted draft or was the target's own choice."""
    import torch

    drafter = NoDrafter() if make is None else ScriptedDrafter(make(reference))
    res = generate(tiny, PROMPT, drafter, DecodeConfig(max_new_tokens=N, logprobs=3))
    assert res.tokens == reference and len(res.logprobs) == N
    with torch.no_grad():
        logits = tiny.model(torch.tensor([PROMPT + reference])).logits[0, len(PROMPT) - 1 : -1]
    want = torch.log_softmax(logits.float(), -1)  # [N, V]
    for k, (tok, lp, top) in enumerate(res.logprobs):
        assert tok == reference[k] and lp == pytest.approx(float(want[k, tok]), abs=1e-4)
        vals, ids = want[k].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert generate(tiny, PROMPT, NoDrafter(), DecodeConfig(max_new_tokens=4)).logprobs is None


def test_streaming_callback_sees_every_token_once(tiny, reference):
    seen = []
    res = generate(
        tiny,
        PROMPT,
        ScriptedDrafter(branching(reference)),
        DecodeConfig(max_new_tokens=N),
        on_tokens=lambda ids: seen.extend(ids),
    )
    assert seen == res.tokens == reference
    stop_after = []
    res = generate(
        tiny,
        PROMPT,
        None,
        DecodeConfig(max_new_tokens=N),
        on_tokens=lambda ids: stop_after.extend(ids) or len(stop_after) < 3,
    )
    assert res.finish_reason == "cancelled" and len(res.tokens) == 3


def test_prefill_with_prefix_reuse_is_identical(tiny, reference):
    """A prompt prefilled into a pool leaves its blocks findable: a longer prompt that begins with
    it prefills only the rest, and a decode after both starts from the cached blocks and is
    plain greedy's; the shared prefix is not consumed."""
    pool = tiny.block_pool(256, 4)
    prefix = prefill(tiny, PROMPT[:8], pool)
    assert prefix.cached_tokens == 0 and prefix.hidden.shape == (tiny.model.config.hidden_size,)
    pre = prefill(tiny, PROMPT, pool)
    assert pre.cached_tokens == 8
    res = generate(tiny, PROMPT, None, DecodeConfig(max_new_tokens=N), pool=pool)
    assert res.tokens == reference and res.stats.cached_tokens == 8  # the last block is prefilled: its logits
    shared, _ = pool.match(PROMPT[:8], 8)
    assert len(shared) == 2  # the shared prefix is still cached
    pool.release(shared)


def test_stats_arithmetic(tiny, reference):
    res = generate(tiny, PROMPT, ScriptedDrafter(oracle(reference)), DecodeConfig(max_new_tokens=N))
    st = res.stats
    assert st.generated_tokens == N
    assert sum(st.accepted) + st.forwards == N - 1  # every decode step emits accepted + 1
    assert st.mat == pytest.approx((N - 1) / st.forwards)
    assert st.label_accepted["oracle"] == sum(st.accepted)
    d = st.to_dict()
    assert d["accepted_tokens"] == sum(st.accepted) and d["forwards"] == st.forwards


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(max_new_tokens=1.5)])
def test_a_decode_config_asserts_its_length(kwargs):
    """The output length is checked (a user's error) in toolspec_core.engine.limits; a config
    holding a bad one is a caller's bug, not a 400."""
    with pytest.raises(ValueError, match="positive integer") as err:
        DecodeConfig(**kwargs)
    assert not isinstance(err.value, InvalidRequestError)


def test_bad_decode_config():
    with pytest.raises(InvalidRequestError):
        DecodeConfig(stop=("",))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(seed="x"),
    ],
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
