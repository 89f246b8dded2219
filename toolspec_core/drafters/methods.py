"""Decoding methods by name: one place that the benchmark, the server and the tests share.

A *method* holds what lives across requests (online acceptance rates, a history of past
outputs, a token-recycling matrix, a handle to the call library) and makes a fresh drafter
per request. ``observe`` feeds a finished request back (online learning) -- never the request
being decoded, so history methods cannot peek at their own answer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

from toolspec_core.spec.proposer import Drafter, NoDrafter


@dataclass
class RequestInfo:
    """Everything a method may use about one request (all optional but the prompt).

    The methods import it, the tool-call ones included, so the call library's types are named in
    words, not imported (``toolcall.library.RequestKey``, ``PastCall``): an import of ``toolcall``
    here would make ``methods`` and ``toolcall`` import each other."""

    prompt_ids: list[int]
    tools: list[dict] = field(default_factory=list)
    tenant: str = "default"
    embedding: object = None  # the library's key for this request (a RequestKey: its text or a vector)
    remember: bool = True  # False: never store this request's output in any history
    # past calls fetched for this request (retrieval methods): PastCall, or the retrieval service's
    # result dict (``as_past_call``); None: not fetched, the method searches its own library
    retrieved: list | None = None
    response_schema: dict | None = None  # the answer is JSON of this schema (response_format; {}: any object)


class Method(Protocol):
    """What a method can do is said by two class attributes, never by its name:
    ``uses_history`` (it learns from finished outputs of the stream, so a benchmark runs it with a
    cold, online and warm library) and ``uses_library`` (it drafts from a shared ``CallLibrary`` of
    past calls, taken as its ``library`` option, and adds its own calls to it)."""

    name: str
    uses_history: bool
    uses_library: bool

    def drafter(self, req: RequestInfo) -> Drafter: ...

    def observe(self, req: RequestInfo, output_ids: list[int], text: str) -> None: ...


class AutoregressiveMethod:
    name = "ar"
    uses_history = uses_library = False

    def __init__(self, tokenizer=None, **opts):
        if opts:
            raise ValueError(f"method 'ar' takes no options, got {sorted(opts)}")

    def drafter(self, req: RequestInfo) -> Drafter:
        return NoDrafter()

    def observe(self, req: RequestInfo, output_ids: list[int], text: str) -> None:
        return None


# name -> "module:factory"; factory(tokenizer, **options) -> Method
REGISTRY: dict[str, str] = {
    "ar": "toolspec_core.drafters.methods:AutoregressiveMethod",
    "pld": "toolspec_core.drafters.prompt_lookup:PromptLookupMethod",
    "suffix": "toolspec_core.drafters.suffix:SuffixMethod",
    "token_recycling": "toolspec_core.drafters.token_recycling:TokenRecyclingMethod",
    "toolspec_schema": "toolspec_core.drafters.toolcall.drafter:SchemaMethod",
    "toolspec_retrieval": "toolspec_core.drafters.toolcall.drafter:RetrievalMethod",
    "toolspec": "toolspec_core.drafters.toolcall.drafter:ToolSpecMethod",
}


def method_class(name: str) -> type:
    """The class of the method ``name`` (see ``REGISTRY``), for its capabilities, without building it."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(REGISTRY)}")
    module, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def make_method(name: str, tokenizer=None, **options) -> Method:
    """Build the method ``name``: ``factory(tokenizer, **options)``."""
    return method_class(name)(tokenizer, **options)
