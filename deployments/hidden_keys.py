"""Retrieval keys from the serving target: the ``retrieval_service.embedding.Embedder`` that runs it.

The retrieval service never reaches into the engine; a caller that has the target (the
deployments, the benchmarks) supplies this implementation. The replica itself needs none of it:
its ``key: hidden`` is ``from_hidden`` of the state the engine's own prefill of the request hands
to the sequence's ``on_prompt`` hook, free.
"""

from __future__ import annotations

import numpy as np

from retrieval_service.embedding import from_hidden


class HiddenStateEmbedder:
    """The target's last-layer states. ``pooling="last"``: the final prompt token's -- at serving
    time the state the engine's prefill of the request hands to ``Sequence.on_prompt`` (free);
    ``"mean"``: the mean over all prompt tokens (better only for unrestricted searches, see
    ``retrieval_service.embedding``; the engine does not expose it, so it costs this embedder's
    own prefill). ``embed`` runs a prefill through the step scheduler, its KV in a block pool
    (:func:`toolspec_core.engine.loop.prefill`)."""

    def __init__(self, target, pooling: str = "last"):
        if pooling not in ("last", "mean"):
            raise ValueError("pooling must be 'last' or 'mean'")
        self.target, self.pooling = target, pooling
        self.name = f"hidden_{pooling}"
        self.dim = int(target.model.config.hidden_size)

    def states(self, prompt_ids: list[int]):
        """(the :class:`~toolspec_core.engine.loop.Prompt` -- its last state ``hidden`` [H], its
        prefill ``seconds`` --, all the prompt's last-layer states [T, H]) from one prefill."""

        from toolspec_core.engine.loop import prefill

        pre = prefill(self.target, list(prompt_ids), states=True)
        return pre, pre.states

    def embed(self, x) -> np.ndarray:
        ids = self.target.tokenizer(x, add_special_tokens=False)["input_ids"] if isinstance(x, str) else list(x)
        pre, states = self.states(ids)
        return from_hidden(pre.hidden) if self.pooling == "last" else from_hidden(states, "mean")

    def embed_request(self, messages, tools=None) -> np.ndarray:
        from toolspec_core.model.prompting import render_prompt

        return self.embed(render_prompt(self.target.tokenizer, list(messages), list(tools or []) or None))
