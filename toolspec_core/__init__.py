"""ToolSpec's engine: lossless speculative decoding for tool calls (pure Python + torch + transformers).

The pipeline is in the subpackages' names: ``drafters`` propose draft trees (``drafters.toolcall``
for the schema FSM and retrieved calls) through the contract in ``spec`` (the tree, the typed
proposer interface), ``engine`` verifies them against the target in one
forward and commits the accepted path to the KV cache, ``model`` is the target itself.

The names a user of the library needs are importable from here::

    from toolspec_core import load_target, render_prompt, make_method, RequestInfo, generate

They load on first use, so ``import toolspec_core`` stays cheap and imports nothing heavy.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_EXPORTS = {
    "load_target": "toolspec_core.model.target",
    "from_model": "toolspec_core.model.target",
    "Target": "toolspec_core.model.target",
    "embedded_model_dir": "toolspec_core.model.embedded",
    "render_prompt": "toolspec_core.model.prompting",
    "DecodeConfig": "toolspec_core.engine.loop",
    "prefill": "toolspec_core.engine.loop",
    "generate": "toolspec_core.engine.loop",
    "GenerationResult": "toolspec_core.engine.stats",
    "SamplingParams": "toolspec_core.engine.sampling",
    "CostModel": "toolspec_core.engine.budget",
    "measure_cost_model": "toolspec_core.engine.cost_probe",
    "make_tool_constraint": "toolspec_core.engine.grammar",
    "DraftTree": "toolspec_core.spec.tree",
    "Drafter": "toolspec_core.spec.proposer",
    "DrafterBase": "toolspec_core.spec.proposer",
    "DraftContext": "toolspec_core.spec.proposer",
    "make_method": "toolspec_core.drafters.methods",
    "RequestInfo": "toolspec_core.drafters.methods",
    "REGISTRY": "toolspec_core.drafters.methods",
    "CallLibrary": "toolspec_core.drafters.toolcall.library",
    "MemoryLibrary": "toolspec_core.drafters.toolcall.library",
    "PastCall": "toolspec_core.drafters.toolcall.library",
    "parse_tool_calls": "toolspec_core.drafters.toolcall.parse",
    "ToolSpecError": "toolspec_core.errors",
    "InvalidRequestError": "toolspec_core.errors",
    "ContextLengthError": "toolspec_core.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'toolspec_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
