"""Boundary tokenization: drafts tokenized the way the target writes them after the committed text."""

from __future__ import annotations

from toolcall_cases import qwen_tok as qwen_tok

from toolspec_core.drafters.toolcall.boundary import BoundaryTokenizer


def test_boundary_tokens_are_canonical(qwen_tok):
    bt = BoundaryTokenizer(qwen_tok)
    full = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    ids = qwen_tok.encode(full)
    for cut in range(1, len(ids)):
        assert bt.continuation(ids[:cut], qwen_tok.decode(ids[cut:])) == ids[cut:], cut
    # a merge across the boundary: committed '":' then ' "' must not be drafted as one token
    compact = qwen_tok.encode('{"name": "get_weather"')
    k = [qwen_tok.decode([i]) for i in compact].index('":')
    assert bt.continuation(compact[: k + 1], ' "get_weather"') == compact[k + 1 :]


def test_boundary_encodes_like_the_tokenizer(qwen_tok):
    """The Rust backend gives the wrapper's ids (special tokens in the text, unicode, whitespace)."""
    bt = BoundaryTokenizer(qwen_tok)
    assert bt._backend is not None  # the embedded tokenizer is a fast one: the backend path is tested
    texts = [
        '<|im_end|>\n<|im_start|>assistant\n```json\n{"a": 1}',
        '": "',
        " é中文 😀 ",
        "  }\n}\n```<|im_end|>",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "\n\n\t x",
    ]
    for text in texts:
        assert list(bt._encode_uncached(text)) == qwen_tok.encode(text, add_special_tokens=False), text


def test_a_candidates_tokens_are_kept_per_tail_and_candidate(qwen_tok):
    """``candidate`` gives the uncached tokenization (text segments tokenized together after the
    tail, raw ids as they are, a label per token) and a second sequence at the same boundary with
    the same candidate is served from the cache."""
    bt, ref = BoundaryTokenizer(qwen_tok), BoundaryTokenizer(qwen_tok, cache_candidates=False)
    tail = tuple(qwen_tok.encode('{"name":'))[-3:]
    segs = ((' "get_', "tool_name"), ('weather", "arguments": {', "call_key"), ((7,), "end"))
    ids, labels = bt.candidate(tail, segs)
    assert (ids, labels) == ref.candidate(tail, segs)
    assert ids[-1] == 7 and labels[0] == "tool_name" and labels[-1] == "end" and "call_key" in labels
    assert list(ids[:-1]) == bt.continuation(tail, ' "get_weather", "arguments": {')
    before = bt._candidate.cache_info().hits
    assert bt.candidate(tail, segs) == (ids, labels)
    assert bt._candidate.cache_info().hits == before + 1 and ref._candidate.cache_info().currsize == 0
