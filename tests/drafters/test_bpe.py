"""The compiled ASCII encoder (``kernels/bpe.c``, ``boundary.native_encoder``) gives the fast
tokenizer's ids exactly, or None where it does not cover the text: random strings over every
character class the pre-tokenizer's regex tells apart (letters, digits, contractions,
punctuation, spaces, tabs, newline runs), the recorded outputs and prompts of the replay,
added tokens' texts and non-ASCII text."""

from __future__ import annotations

import random

import pytest

from benchmarks.replay import RECORDING, replay_target
from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.toolcall.boundary import BoundaryTokenizer, native_encoder

pytestmark = [
    pytest.mark.skipif(tree_kernel.load_bpe() is None, reason="no C compiler / Python headers here"),
    pytest.mark.skipif(not RECORDING.exists(), reason="no recording"),
]


@pytest.fixture(scope="module")
def tok():
    return replay_target().tokenizer


@pytest.fixture(scope="module")
def enc(tok):
    out = native_encoder(tok)
    assert out is not None  # the embedded model's tokenizer is a Qwen2 one
    return out


def _hf(tok, text: str) -> tuple[int, ...]:
    return tuple(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)


ALPHABET = "abcXYZqQ0123456789 \t\n\r\"'{}[]:,._-/\\!?#$%&*()+=<>@^`|~sStTdDmMlLrReEvV"


def test_random_ascii_strings_get_the_tokenizers_ids(tok, enc):
    rng = random.Random(62)
    words = ["'s", "'re", "'LL", "'ve", "'d", "  ", "\n\n", " \n ", "\r\n", '": "', "get_weather", "1234", "    "]
    for _ in range(20000):
        parts = [rng.choice(ALPHABET) if rng.random() < 0.7 else rng.choice(words) for _ in range(rng.randint(0, 24))]
        text = "".join(parts)
        assert enc(text) == _hf(tok, text), repr(text)


def test_recorded_texts_get_the_tokenizers_ids(tok, enc):
    replay = replay_target()
    covered = 0
    for rec in replay.records[:60]:
        for ids in (rec["tokens"], rec["prompt_ids"]):
            text = tok.decode(ids, skip_special_tokens=False)
            for line in [text] + text.split("\n"):
                got = enc(line)
                if got is not None:
                    covered += 1
                    assert got == _hf(tok, line), repr(line[:200])
    assert covered > 100


def test_text_it_does_not_cover_is_left_to_the_tokenizer(tok, enc):
    assert enc('{"city": "Zürich"}') is None  # non-ASCII
    assert enc("a\x0bb") is None and enc("a\x00") is None  # control characters other than tab / LF / CR
    assert enc('</tool_call>\n<tool_call>\n{"name"') is None  # added tokens' texts
    bt = BoundaryTokenizer(tok)
    for text in ('{"city": "Zürich"}', "</tool_call>", "x\x0by"):
        assert bt._encode(text) == _hf(tok, text)


def test_the_reference_boundary_tokenizer_never_uses_it(tok):
    assert BoundaryTokenizer(tok, cache_candidates=False)._native is None
    assert BoundaryTokenizer(tok)._native is not None


def test_compiled_labels_are_the_python_loops(tok):
    """``_label_tokens`` compiled (``kernels/bpe.c``) against its Python loop: candidates of
    several segments over random ASCII text, every token's label."""
    fast, ref = BoundaryTokenizer(tok), BoundaryTokenizer(tok, cache_candidates=False)
    assert fast._label_kernel is not None and ref._label_kernel is None
    rng = random.Random(5)
    for _ in range(3000):
        segs = tuple(
            ("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 9))), rng.choice("abcde"))
            for _ in range(rng.randint(1, 4))
        )
        tail = tuple(rng.randrange(100, 5000) for _ in range(rng.randint(0, 3)))
        assert fast.tokenize(tail, segs) == ref.tokenize(tail, segs), segs


def test_compiled_tokenize_is_the_python_one(tok):
    """``BoundaryTokenizer.tokenize`` in one compiled call against ``tokenize_reference``: segments
    of random text (ASCII, non-ASCII, added tokens' texts, empty ones), raw id segments between
    them, after tails of recorded tokens -- special tokens and multi-byte characters split across
    tokens among them (a tail that decodes to "\\ufffd" is shortened) -- ids and labels alike."""
    fast = BoundaryTokenizer(tok)
    assert fast._kernel_tokenize is not None
    rng = random.Random(11)
    recorded = [t for rec in replay_target().records[:20] for t in rec["tokens"]]
    recorded += tok.encode("Zürich 東京 😀 café", add_special_tokens=False)
    texts = ["", "Zürich", "</tool_call>", '"}', "東京", "x\x0by", " \n", "get_weather"]
    eos = tuple(tok.encode("<|im_end|>", add_special_tokens=False))
    for _ in range(3000):
        segs = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if r < 0.1:
                segs.append((eos if rng.random() < 0.8 else (), "end"))
            elif r < 0.4:
                segs.append((rng.choice(texts), rng.choice("abc")))
            else:
                segs.append(("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 9))), rng.choice("abcde")))
        at = rng.randrange(len(recorded))
        tail = tuple(recorded[max(0, at - rng.randint(0, 3)) : at])
        assert fast.tokenize(tail, tuple(segs)) == fast.tokenize_reference(tail, tuple(segs)), (tail, segs)
