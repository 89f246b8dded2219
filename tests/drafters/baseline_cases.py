"""Shared by the baseline drafter tests: a tiny target, prompts with repeats, their plain greedy references."""

from __future__ import annotations

import pytest
from tiny import tiny_target

from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.engine.loop import DecodeConfig, generate

N = 40


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=128)


def run(tiny, method, prompt, cost):
    req = RequestInfo(prompt_ids=list(prompt))
    res = generate(tiny, list(prompt), method.drafter(req), DecodeConfig(max_new_tokens=N), cost)
    method.observe(req, res.tokens, res.text)
    return res
