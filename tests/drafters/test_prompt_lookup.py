"""Prompt lookup: n-gram continuations and greedy output equal to plain decoding."""

from __future__ import annotations

from scripted import PROMPT, N
from scripted import reference as reference
from scripted import tiny as tiny

from toolspec_core.drafters.prompt_lookup import PromptLookupDrafter, ngram_continuations
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.spec.proposer import NoDrafter


def test_no_drafter_and_prompt_lookup_equal_hf(tiny, reference):
    assert generate(tiny, PROMPT, NoDrafter(), DecodeConfig(max_new_tokens=N)).tokens == reference
    res = generate(tiny, PROMPT, PromptLookupDrafter(min_ngram=1), DecodeConfig(max_new_tokens=N), CostModel.flat())
    assert res.tokens == reference


def test_prompt_lookup_continuations():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    assert ngram_continuations(toks, 3, 2, 2, 4) == [[7, 7], [9, 9]]
    assert ngram_continuations([1, 2, 3], 3, 2, 4, 4) == []
