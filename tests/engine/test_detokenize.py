"""The request's incremental detokenizer: its text equals a full decode (real Qwen tokenizer on real
dev texts and tricky unicode, toy tokenizers), it decodes short windows only, and stop strings,
the drafter's FSM and the engine's final text all read it."""

from __future__ import annotations

import random

import pytest
from scripted import PROMPT, N, ScriptedDrafter, branching, oracle
from tiny import CharTokenizer, tiny_target

from benchmarks.datasets import dev_set, read_jsonl
from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.drafters.simulate import simulate
from toolspec_core.drafters.toolcall.drafter import SchemaMethod
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.engine.sequence import Stopper as _Stopper
from toolspec_core.spec.layouts import layout_by_name, render_calls
from toolspec_core.spec.proposer import DraftContext

QWEN_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>
TRICKY = [
    "停 😀 日本語 é中文 🇫🇷 👩‍👩‍👧 ",
    "naïve café — “quotes” … ½ ∑",
    "\ufffd a real replacement character \ufffd",
    '<tool_call>\n{"name": "f", "arguments": {"q": "东京 🗼"}}\n</tool_call>',
    "  \n\n\t x  ",
    "é" * 40,
]


@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


class Counting:
    """A tokenizer wrapper that records how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=False):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class ByteTok:
    """Token i <-> the bytes ``pieces[i]``: tokens may end (or start) inside a UTF-8 character."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


class LeadingSpaceTok:
    """SentencePiece-like: "▁" marks a space, and a decode drops the space its first piece starts with."""

    def __init__(self, words: list[str]):
        self.words = words

    def decode(self, ids, skip_special_tokens=False):
        text = "".join(self.words[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def _feed(detok: Detokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = []
    for k in range(0, len(ids), chunk):
        deltas.append(detok.feed(ids[k : k + chunk]))
        assert not detok.text.endswith("\ufffd")  # an unfinished character (or a lone bad byte) waits
    return deltas


def _check(tok, ids: list[int], eos=(), chunks=(1, 2, 7)):
    want = tok.decode([i for i in ids if i not in eos], skip_special_tokens=False)
    for chunk in chunks:
        d = Detokenizer(tok, eos)
        deltas = _feed(d, ids, chunk)
        assert "".join(deltas) == d.text and want.startswith(d.text), chunk
        assert d.final() == want, (chunk, want[:60], d.final()[:60])


def _dev_texts(n_per: int = 25):
    for bench in ("api_bank", "bfcl_v3", "toolalpaca", "bfcl_v3_multi_turn", "toolbench_examples"):
        for it in read_jsonl(dev_set(bench), n_per):
            yield from (m["content"] for m in it["messages"] if isinstance(m.get("content"), str) and m["content"])
            for layout in ("hermes", "fence"):
                if it.get("gold_calls"):
                    yield render_calls(it["gold_calls"], layout_by_name(layout))


def test_qwen_text_equals_a_full_decode_on_dev_texts_and_tricky_unicode(qwen_tok):
    texts = list(_dev_texts()) + TRICKY
    assert len(texts) > 300
    for text in texts:
        ids = qwen_tok.encode(text, add_special_tokens=False)
        _check(qwen_tok, ids + [151645], QWEN_EOS)  # EOS ends the output and is not text
        _check(qwen_tok, ids, QWEN_EOS, chunks=(3,))


def test_qwen_split_characters_special_tokens_and_random_ids(qwen_tok):
    for text in TRICKY:
        ids = qwen_tok.encode(text, add_special_tokens=False)
        # single-byte tokens: every multi-byte character arrives in pieces
        byte_ids = [
            qwen_tok.convert_tokens_to_ids(qwen_tok.convert_ids_to_tokens(i)[k])
            for i in ids
            for k in range(len(qwen_tok.convert_ids_to_tokens(i)))
        ]
        assert qwen_tok.decode(byte_ids) == qwen_tok.decode(ids)
        _check(qwen_tok, byte_ids)
    specials = [
        151644,
        151657,
        151658,
        151652,
        151659,
    ]  # <|im_start|>, <tool_call>, </tool_call>, <|vision_start|>, <|fim_prefix|>
    rng = random.Random(0)
    for _ in range(40):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(151643) for _ in range(rng.randrange(1, 60))
        ]
        _check(qwen_tok, ids, QWEN_EOS)


def test_an_unfinished_character_waits_and_final_writes_it_as_a_full_decode_does(qwen_tok):
    ids = [qwen_tok.convert_tokens_to_ids(t) for t in "".join(qwen_tok.convert_ids_to_tokens(qwen_tok.encode("😀")))]
    a = qwen_tok.encode("a")
    assert len(ids) == 4  # the emoji's four bytes, one token each
    d = Detokenizer(qwen_tok)
    assert d.feed(a) == "a"
    for k in range(3):
        assert d.feed(ids[k : k + 1]) == "" and d.text == "a" and d.read == 1
    assert d.final() == qwen_tok.decode(a + ids[:3]) and d.final().endswith("\ufffd")
    assert d.feed(ids[3:]) == "😀" and d.text == "a😀" and d.read == 5 and d.pending == ""


def test_each_feed_decodes_a_short_window_never_the_output(qwen_tok):
    text = "\n".join(list(_dev_texts(6)) + TRICKY)
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    tok = Counting(qwen_tok)
    d = Detokenizer(tok)
    _feed(d, ids, 1)
    assert d.final() == qwen_tok.decode(ids)
    assert len(tok.sizes) <= 2 * len(ids) and max(tok.sizes) <= 8


def test_toy_tokenizers():
    chars = CharTokenizer(96)
    rng = random.Random(1)
    _check(chars, [rng.randrange(96) for _ in range(50)], eos=(95,))
    pieces = [
        b"a",
        b"b\xe5",
        b"\x81\x9c",
        b"\xf0\x9f",
        b"\x98\x80",
        b" ",
        b"\xff",
        b"\x80",
    ]  # \xff, \x80: invalid bytes
    for _ in range(30):
        _check(ByteTok(pieces), [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 30))])
    words = ["▁the", "▁cat", "s", "▁sat", ",", "▁on", "▁mat", "."]
    sp = LeadingSpaceTok(words)
    for _ in range(30):
        _check(sp, [rng.randrange(len(words)) for _ in range(rng.randrange(1, 20))])


# ---------------------------------------------------------------- readers: stop strings, drafter, final text


def _full_decode_stop(tok, ids: list[int], stop: tuple[str, ...], eos=()) -> int | None:
    """Index of the token after which the full decode of the output first contains a stop string."""
    for i in range(len(ids)):
        if ids[i] in eos:
            return None
        if any(s in tok.decode(ids[: i + 1]) for s in stop):
            return i
    return None


def _stop_at(tok, ids: list[int], stop: tuple[str, ...]) -> int | None:
    st = _Stopper(Detokenizer(tok), (), DecodeConfig(max_new_tokens=10**6, stop=stop))
    return next((i for i in range(len(ids)) if st.done(ids[: i + 1])), None)


def test_a_stop_string_counts_at_the_token_that_writes_it_even_inside_a_character():
    tok = ByteTok([b"a", b"b\xe5", b"\x81\x9c", b"c", b"d"])  # "a", "b" + first bytes of "停", the rest, "c", "d"
    ids = [0, 1, 2, 3, 4]
    for stop, at in ((("ab",), 1), (("b停",), 2), (("停c", "zz"), 3), (("d",), 4), (("x",), None), (("a", "cd"), 0)):
        assert _stop_at(tok, ids, stop) == at == _full_decode_stop(tok, ids, stop), stop
    rng = random.Random(2)
    words = ["ab", "b", "停", "a", "ba", "\n", "停停"]
    chars = ByteTok([w.encode() for w in words] + [b"\xe5", b"\x81\x9c"])
    for _ in range(200):
        ids = [rng.randrange(9) for _ in range(rng.randrange(1, 25))]
        stop = tuple(rng.sample(["aba", "b\n", "停a", "a停停", "\n\n", "bb", "abab"], 2))
        assert _stop_at(chars, ids, stop) == _full_decode_stop(chars, ids, stop), (ids, stop)


def test_a_steps_tokens_taken_at_once_end_where_token_by_token_would():
    """Without stop strings a step's tokens go in at once (``Stopper.take``): as many kept, the same
    reason (EOS first, then the length) and the same text as :meth:`Stopper.done` token by token,
    over steps of random sizes with EOS and multi-byte characters split across tokens."""
    eos = 9
    tok = ByteTok([b"a", b"b\xe5", b"\x81\x9c", b"c", b"\n", b"\xe5", b"\x81", b"\x9c", b"dd", b"<eos>"])
    rng = random.Random(4)
    for _ in range(400):
        cfg = DecodeConfig(max_new_tokens=rng.randint(1, 20))
        one, many = _Stopper(Detokenizer(tok, (eos,)), (eos,), cfg), _Stopper(Detokenizer(tok, (eos,)), (eos,), cfg)
        gen_one: list[int] = []
        gen_many: list[int] = []
        reason_one = reason_many = None
        while reason_one is None:
            step = [rng.choice(range(10)) if rng.random() < 0.9 else eos for _ in range(rng.randint(1, 6))]
            for t in step:
                gen_one.append(t)
                reason_one = one.done(gen_one)
                if reason_one:
                    break
            n, reason_many = many.take(len(gen_many), step)
            gen_many += step[:n]
            assert (gen_many, reason_many) == (gen_one, reason_one)
            assert many.detok.text + many.detok.pending == one.detok.text + one.detok.pending
        assert many.text() == one.text()


def test_decode_stops_where_a_full_decode_first_shows_a_stop_string_and_cuts_before_it():
    tiny = tiny_target()
    plain = generate(tiny, PROMPT, None, DecodeConfig(max_new_tokens=N))
    text = tiny.tokenizer.decode(plain.tokens)
    for a, b in ((3, 5), (10, 13), (0, 1), (20, 24)):
        stop = (text[a:b], "never")
        at = _full_decode_stop(tiny.tokenizer, plain.tokens, stop)
        for drafter in (None, ScriptedDrafter(oracle(plain.tokens)), ScriptedDrafter(branching(plain.tokens))):
            res = generate(tiny, PROMPT, drafter, DecodeConfig(max_new_tokens=N, stop=stop))
            assert res.tokens == plain.tokens[: at + 1] and res.finish_reason == "stop"
            full = tiny.tokenizer.decode(res.tokens)
            assert res.text == full[: full.find(stop[0])]


def test_drafters_and_the_caller_read_the_one_text_of_the_request():
    eos = 30
    tiny = tiny_target(eos=eos)
    ref = generate(tiny, PROMPT, None, DecodeConfig(max_new_tokens=N)).tokens
    seen: list[tuple[str, int, list[int]]] = []

    def fn(ctx: DraftContext):
        seen.append((ctx.text, ctx.text_tokens, list(ctx.generated)))
        return oracle(ref)(ctx)

    detok = Detokenizer(tiny.tokenizer, tiny.eos_ids)
    texts = []
    res = generate(
        tiny,
        PROMPT,
        ScriptedDrafter(fn),
        DecodeConfig(max_new_tokens=N),
        on_tokens=lambda ids: texts.append(detok.text),
        detokenizer=detok,
    )
    assert seen and texts
    for text, n, gen in seen:
        assert n == len(gen) and text == tiny.tokenizer.decode(gen)
    ids = res.tokens[:-1] if res.tokens[-1] == eos else res.tokens
    assert texts[-1] == detok.final() == res.text == tiny.tokenizer.decode(ids)


def test_the_schema_fsm_reads_the_shared_text_as_the_tokenizer_spells_it(qwen_tok):
    """The FSM's text is the output's text: tool-call tags are text, not skipped special tokens, so
    it equals the decode without special tokens on real outputs; engine-built and hand-built
    contexts (the drafter then spells the tokens itself) draft the same trees."""
    from toolspec_core.model.prompting import render_prompt

    method = SchemaMethod(qwen_tok)
    n = 0
    for it in read_jsonl(dev_set("api_bank"), 6):
        prompt = render_prompt(qwen_tok, it["messages"], it["tools"])
        for layout in ("hermes", "fence"):
            out = qwen_tok.encode("Sure 😀 停. " + render_calls(it["gold_calls"], layout_by_name(layout))) + [151645]
            shared, own = (
                method.drafter(RequestInfo(prompt, it["tools"])),
                method.drafter(RequestInfo(prompt, it["tools"])),
            )
            detok = Detokenizer(qwen_tok, QWEN_EOS)
            for k in range(1, len(out)):
                detok.feed(out[k - 1 : k])
                gen = out[:k]
                ctx = DraftContext(prompt + gen, len(prompt), 64, detok.text, detok.read)
                a = shared.propose(ctx)
                b = own.propose(DraftContext(prompt + gen, len(prompt), 64))
                assert (a.tokens, a.parents, a.labels) == (b.tokens, b.parents, b.labels), (it["id"], k)
                assert shared.tracker.text == qwen_tok.decode(gen[: detok.read], skip_special_tokens=True)
                assert shared.tracker.text == own.tracker.text
                n += 1
            assert "<tool_call>" in shared.tracker.text or layout != "hermes"
    assert n > 300
    # offline simulation builds its contexts like decode when given the tokenizer
    it = read_jsonl(dev_set("bfcl_v3"), 1)[0]
    prompt = render_prompt(qwen_tok, it["messages"], it["tools"])
    out = qwen_tok.encode(render_calls(it["gold_calls"], layout_by_name("hermes"))) + [151645]
    with_text = simulate(method.drafter(RequestInfo(prompt, it["tools"])), prompt, out, tokenizer=qwen_tok)
    assert with_text == simulate(method.drafter(RequestInfo(prompt, it["tools"])), prompt, out)


def test_the_backend_decode_is_the_tokenizers_own(qwen_tok, monkeypatch):
    """The Detokenizer calls a fast tokenizer's Rust decode directly only where that is exactly
    ``tokenizer.decode(ids, skip_special_tokens=False)``; any other tokenizer goes through decode."""
    from toolspec_core.engine.detokenize import backend_decode, tokenizer_decode

    fast = backend_decode(qwen_tok)
    assert fast is not None and Detokenizer(qwen_tok)._decode.__qualname__ == fast.__qualname__
    assert tokenizer_decode(qwen_tok) is tokenizer_decode(qwen_tok)  # probed once per tokenizer
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.choice((151644, 151645, 151657)) if rng.random() < 0.1 else rng.randrange(151643) for _ in range(8)]
        assert fast(ids) == qwen_tok.decode(ids, skip_special_tokens=False)
    assert backend_decode(CharTokenizer(96)) is None
    real = qwen_tok.decode
    monkeypatch.setattr(qwen_tok, "decode", lambda ids, **kw: real(ids, **kw).replace(" ,", ","))
    assert backend_decode(qwen_tok) is None  # a decode that differs from the backend's on the probe
    monkeypatch.setattr(qwen_tok, "decode", real)
    assert backend_decode(qwen_tok) is not None
    monkeypatch.setattr(qwen_tok, "clean_up_tokenization_spaces", True)
    assert backend_decode(qwen_tok) is None  # a decode that cleans spaces up is not the backend's
