"""One request's engine job: everything the engine needs, built once from the HTTP request.

No Ray here. The HTTP route validates the body into a :class:`~deployments.protocol.ChatRequest`
and hands it, with the caller's library tenant, to the replica's engine host; a worker thread of
the host turns it into one :class:`EngineJob` with :func:`build_job` -- the prompt rendered and
tokenized, the output length held to every token limit (the one check of the job's token counts,
:func:`~toolspec_core.engine.limits.token_budget`), the ``tool_choice`` / ``response_format``
grammar, the decode settings, the tenant and what the call-library search needs. Nothing after
it reads the request again: the sequence, the drafter, the search and the learning from the
output all read the job. Tokenising and grammar set-up are CPU work, hence the worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolspec_core.engine.limits import TokenLimits, requested_tokens, token_budget

from .protocol import ChatRequest, chosen_tool, offers_tools, response_schema, stop_strings

if TYPE_CHECKING:  # torch behind them: imported where a job is built, not with this module
    from toolspec_core.drafters.methods import RequestInfo
    from toolspec_core.engine.grammar import GrammarConstraint
    from toolspec_core.engine.sequence import DecodeConfig


@dataclass(frozen=True)
class JobPolicy:
    """What a replica holds every job to, resolved once at start-up: its tokenizer and vocabulary,
    its token limits, the server's default temperature, and whether jobs search a call library
    (``library``) keyed on the request's text (``text_key``; else on the prompt's hidden state)."""

    tokenizer: object
    vocab_size: int | None
    limits: TokenLimits
    default_temperature: float = 0.0
    library: bool = False
    text_key: bool = False


@dataclass(frozen=True, eq=False)
class EngineJob:
    """One request as the engine runs it. ``prompt_ids``: the rendered prompt's tokens (read, never
    changed); ``decode``: output length (within every token limit), stops, sampling, logprobs;
    ``constraint``: the grammar of a forced ``tool_choice`` or a ``response_format`` (its one
    sequence consumes it), None for free text; ``tools``: every tool the request offered (the
    library files the output's calls against them), ``tool_choice`` as :func:`chosen_tool` reads it;
    ``searches``: the call library is searched for this job, keyed on ``search_key`` (the request's
    text) or, with ``search_key`` None, on the prompt's hidden state once the engine has prefilled
    it; ``timeline``: the Done event carries the request's timeline and early steps."""

    prompt_ids: list[int]
    decode: DecodeConfig
    constraint: GrammarConstraint | None
    tools: list[dict]
    tool_choice: str | dict
    tenant: str
    remember: bool
    response_schema: dict | None
    searches: bool
    search_key: str | None
    timeline: bool

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def request_info(self, retrieved: list | None = None, embedding=None) -> RequestInfo:
        """The method's view of the job (:class:`~toolspec_core.drafters.methods.RequestInfo`, the
        drafters' own input): ``retrieved`` the calls found (None: the method searches its own
        library), ``embedding`` the library key the output is filed under."""
        from toolspec_core.drafters.methods import RequestInfo

        return RequestInfo(
            prompt_ids=list(self.prompt_ids),
            tools=list(self.tools),
            tenant=self.tenant,
            embedding=embedding,
            remember=self.remember,
            retrieved=retrieved,
            response_schema=self.response_schema,
        )


def build_job(req: ChatRequest, policy: JobPolicy, tenant: str = "default", timeline: bool = False) -> EngineJob:
    """The job of a validated request (:func:`~deployments.protocol.parse_request` checked its
    fields); raises :class:`~toolspec_core.errors.InvalidRequestError` (a 400) for a prompt or
    output length the replica will not run. ``tenant``: the library tenant (the caller's key's,
    narrowed by ``user``); ``timeline``: asked for by the server or the request's header (the
    body's ``toolspec.timeline`` asks too)."""
    from toolspec_core.engine.grammar import make_tool_constraint
    from toolspec_core.engine.sampling import SamplingParams
    from toolspec_core.engine.sequence import DecodeConfig
    from toolspec_core.model.prompting import render_prompt

    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = chosen_tool(req)
    shown = tools if offers_tools(req) else []
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    prompt = render_prompt(policy.tokenizer, messages, shown or None)
    asked = requested_tokens(req.max_tokens, req.max_completion_tokens, None)  # its range: parse_request
    max_new = token_budget(len(prompt), asked, policy.limits)  # before the grammar: a refusal costs no set-up
    answer = response_schema(req, check=False)  # parse_request checked it
    parallel = req.parallel_tool_calls is not False
    constraint = None
    if (shown and choice not in ("auto", "none")) or answer is not None:
        constraint = make_tool_constraint(policy.tokenizer, shown, choice, policy.vocab_size, parallel, answer)
    temperature = float(req.temperature) if req.temperature is not None else policy.default_temperature
    top_p = float(req.top_p) if req.top_p is not None else 1.0
    sampling = SamplingParams(temperature, top_p, req.top_k or 0, req.seed)
    # no parallel calls: the output ends with the first call's closer (the grammar does that
    # for a forced tool_choice; fences and bare JSON hold one call in the drafted layouts)
    end_after = ("</tool_call>",) if shown and not parallel else ()
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    decode = DecodeConfig(max_new, stop_strings(req), sampling, end_after, logprobs)
    searches = policy.library and bool(shown)  # the library holds tool calls only
    key = None
    if searches and policy.text_key:
        from retrieval_service.embedding import query_text

        key = query_text(messages, shown)
    return EngineJob(
        prompt_ids=prompt,
        decode=decode,
        constraint=constraint,
        tools=tools,
        tool_choice=choice,
        tenant=tenant,
        remember=req.toolspec.remember if req.toolspec else True,
        response_schema=answer,
        searches=searches,
        search_key=key,
        timeline=timeline or bool(req.toolspec and req.toolspec.timeline),
    )
