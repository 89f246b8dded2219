"""A target that costs nothing (``model: scripted``), to measure what the serving stack itself carries.

:class:`ScriptedTarget` has the embedded model's tokenizer and chat template and a tiny random
Qwen2 for everything the engine sizes from a model (the KV block pool, the vocabulary), but its
step runs no forward and writes no K/V (the caches' lengths move as usual): each row's next token is read from a script -- a tool
call, repeated -- by the row's position. So a replica serving it spends its time in HTTP, Ray,
request preparation, the engine bridge, the scheduler's bookkeeping and streaming alone
(``python -m benchmarks.studies.loadtest_local --scripted-target``). Its output is the script whatever
the prompt, and it never ends before ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from toolspec_core.model.step_plan import StepPlan
from toolspec_core.model.step_runner import StepOutput, answer
from toolspec_core.model.target import Target, from_model
from toolspec_core.spec.proposer import DrafterBase

SCRIPT = (
    '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
)


def tiny_qwen2(tokenizer, hidden: int = 64, layers: int = 2, context: int = 2048, seed: int = 0):
    """A random Qwen2 of ``layers`` layers of width ``hidden`` over ``tokenizer``'s vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


@dataclasses.dataclass
class ScriptedTarget(Target):
    """A target whose every logit row's argmax is ``script[(position + 1) % len(script)]``."""

    script: tuple[int, ...] = ()
    step_s: float = 0.0  # the time each step takes (what a forward would cost)

    def step(self, plan: StepPlan, pool=None) -> StepOutput:
        if self.step_s:
            time.sleep(self.step_s)
        segments, index = plan.segments, plan.logits
        pos = torch.cat([s.pos for s in segments])  # [N] every row's position
        for s in segments:  # the rows count as cached (their K/V slots are left as they are)
            s.cache.advance(len(s))
        script = torch.tensor(self.script, dtype=torch.long)
        choice = script[(pos[index.rows] + 1) % len(script)]  # [M] the argmax of every logit row
        full = None
        if index.full:  # one-hot rows for the sequences that read logits (sampling, a grammar, logprobs)
            vocab = self.model.config.vocab_size
            full = torch.full((len(index.full), vocab), -1e4)
            full[torch.arange(len(index.full)), choice[index.full]] = 0.0
        hidden = torch.zeros(len(plan.hidden_rows), self.model.config.hidden_size) if plan.hidden_rows else None
        return answer(plan, choice, full, hidden)  # the walks, as every target's step ends


def scripted_target(context: int = 32768, step_s: float = 0.0) -> ScriptedTarget:
    """The scripted target over the embedded model's tokenizer (``context``: its window; ``step_s``:
    seconds each step takes)."""
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    base = from_model(tiny_qwen2(tok, hidden=8, layers=1, context=context), tok, name="scripted")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Target)}
    return ScriptedTarget(**fields, script=tuple(tok.encode(SCRIPT)), step_s=step_s)


class ScriptedDrafter(DrafterBase):
    """Drafts the next ``k - 1`` tokens of the script (all accepted): a step that commits ``k``
    tokens, as speculative decoding does, for the serving path's ceiling at ``k`` tokens a step."""

    def __init__(self, script: tuple[int, ...], k: int):
        self.script, self.k = script, k

    def propose(self, ctx):
        from toolspec_core.spec.labels import PLD
        from toolspec_core.spec.tree import DraftTree

        p, n = len(ctx.tokens) - 1, len(self.script)  # the root's position
        tree = DraftTree()
        tree.add_path([self.script[(p + 1 + j) % n] for j in range(min(self.k - 1, ctx.max_depth))], 1.0, PLD)
        return tree

    def feedback(self, tree, result) -> None:
        return None


class ScriptedMethod:
    """The method of ``model: scripted`` with ``scripted_tokens_per_step`` k > 1."""

    name = "scripted"
    uses_history = uses_library = False

    def __init__(self, script: tuple[int, ...], k: int):
        self.script, self.k = script, k

    def drafter(self, req) -> ScriptedDrafter:
        return ScriptedDrafter(self.script, self.k)

    def observe(self, req, output_ids, text) -> None:
        return None
