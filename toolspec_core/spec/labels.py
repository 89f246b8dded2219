"""Draft labels: the source or FSM state of each draft node, one constant each.

Labels key the per-state statistics and the online acceptance rates; a copy label with ``+``
appended is the continuation of a copy that has started matching."""

from __future__ import annotations

# FSM states of a tool call (drafters.toolcall.fsm), also the labels of schema drafts
TEXT = "text"  # free text outside a call
CALL_KEY = "schema"  # structure / fixed keys of the call object
TOOL_NAME = "tool_name"
ARG_NAME = "arg_name"
VALUE = "value"
BETWEEN = "between_args"
END = "end_of_call"
OPENER = "opener"  # the text that opens a call (a tag, a fence)
NEXT_CALL = "next_call"  # the head of an object that follows a finished call (see _Builder.head_label)
OBJ_KEY = "object_key"  # keys of objects no tool schema describes, from the objects seen so far (objkeys)
SUFFIX_STATES = (TEXT, VALUE, END)  # FSM states whose text the schema cannot draft: suffix drafting fills them

# Copy-draft labels (one place, so the chain rule below knows them all): once a copy starts
# matching it tends to go on, so its first token and its continuation learn separate rates.
PLD = "pld"  # prompt lookup (n-gram over the context)
RETRIEVAL = "retrieval"  # retrieved past calls (values in candidates, whole calls in toolcall.drafter)
SPAN = "span"  # argument value copied from the context (values.value_spans)
DERIVED = "derived"  # values rendered from the context in the call's form (dates: values.date_values)
PATTERN = "pattern"  # a counting run a value has begun, continued (values.digit_run)
OWN_CALL = "own_call"  # a value a call earlier in this output passed (a repeated or parallel call)
CHAIN_LABELS = (PLD, RETRIEVAL, SPAN, DERIVED, PATTERN, OWN_CALL)

# Generic drafters and the engine's own labels
SUFFIX = "suffix"  # suffix matches over the context + the tenant's earlier outputs (suffix.SuffixDrafter)
TOKEN_RECYCLING = "token_recycling"  # the static tree of Token Recycling (token_recycling.TokenRecyclingDrafter)
PROBE = "probe"  # the random chains the start-up cost probe verifies (engine.cost_probe)
NONE = "none"  # a step's label when it drafted nothing (engine.stats.record_step)


def base_label(key: str) -> str:
    """ "pld:long+" -> "pld": the draft source a rate key belongs to."""
    return key.split(":")[0].rstrip("+")


def is_chain(key: str) -> bool:
    return base_label(key) in CHAIN_LABELS


def match_label(label: str, n: int, long_at: int) -> str:
    """Copy drafts found by a longer context match are right more often: learn them apart."""
    return label + ":long" if n >= long_at else label
