"""Drafting along a known output (no model): how much of it a drafter would get accepted.

Used by tests (tokenization at boundaries, FSM coverage) and by the offline studies
(``benchmarks/studies``, which cut each tree to a cost budget by wrapping the drafter): the
"target" is replaced by the known tokens, so a step accepts the longest tree path that agrees.
"""

from __future__ import annotations

from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.spec.proposer import DraftContext
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult


def oracle_walk(tree: DraftTree, truth: list[int]) -> VerifyResult:
    node, path = ROOT, []
    for tok in truth:
        nxt = tree.child(node, tok)
        if nxt < 0:
            break
        path.append(nxt)
        node = nxt
    bonus = truth[len(path)] if len(path) < len(truth) else -1
    return VerifyResult(path, bonus)


def simulate(drafter, prompt_ids: list[int], output_ids: list[int], trace: list | None = None, tokenizer=None) -> dict:
    """Steps/MAT of ``drafter`` if the target wrote ``output_ids`` (the first comes from prefill).

    With ``tokenizer``, the committed tokens are decoded by a ``Detokenizer`` and the contexts
    carry its text, as ``decode`` builds them (without, a drafter that needs text spells it).
    """
    tokens = list(prompt_ids) + output_ids[:1]
    detok = Detokenizer(tokenizer) if tokenizer is not None else None
    steps, accepted = 0, 0
    while len(tokens) - len(prompt_ids) < len(output_ids):
        done = len(tokens) - len(prompt_ids)
        ctx = DraftContext(tokens, len(prompt_ids), len(output_ids) - done - 1)
        if detok is not None:
            detok.feed(tokens[len(prompt_ids) + len(detok.ids) :])
            ctx.text, ctx.text_tokens = detok.text, detok.read
        tree = drafter.propose(ctx)
        res = oracle_walk(tree, output_ids[done:])
        drafter.feedback(tree, res)
        if trace is not None:
            trace.append((done, len(tree), len(res.path), tree.labels[res.path[0]] if res.path else None))
        steps += 1
        accepted += len(res.path)
        tokens += [tree.tokens[i] for i in res.path] + ([res.token] if res.token >= 0 else [])
    n = len(output_ids) - 1
    return {"tokens": len(output_ids), "steps": steps, "accepted": accepted, "mat": n / steps if steps else 1.0}
