"""Grammar-constrained tool calls for ``tool_choice`` "required" / a named function.

The output must be a valid call: a JSON object ``{"name": <tool>, "arguments": <its schema>}``,
in any layout the model likes (``<tool_call>`` tags, a ```` ```json ```` fence, bare JSON);
"required" with parallel calls allowed takes one or more tagged calls, one per line. A structured
answer (``response_format``) is JSON of its schema; with tools on "auto", tagged calls or that answer.
llguidance compiles that into a token-level matcher; the engine masks the target's logits with
it at every verified row, and tokens the grammar forces are emitted without verification.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

from toolspec_core.errors import InvalidRequestError

_LLTOK: dict[int, object] = {}
_LOCK = threading.Lock()


def _lltokenizer(tokenizer):
    """llguidance's view of an HF tokenizer (built once per tokenizer: ~3 s for Qwen's vocab)."""
    import llguidance.hf

    with _LOCK:
        key = id(tokenizer)
        if key not in _LLTOK:
            _LLTOK[key] = llguidance.hf.from_tokenizer(tokenizer)
        return _LLTOK[key]


def args_key(tokenizer) -> str:
    """The key a target writes a call's arguments under: "parameters" for Llama 3.1's template."""
    from toolspec_core.spec.layouts import layouts_for

    return layouts_for(tokenizer)[0].args_key if tokenizer is not None else "arguments"


def call_schema(tools: list[dict], only: str | None = None, key: str = "arguments") -> dict:
    """JSON schema of one call of any tool in ``tools`` (or only the one named ``only``), its
    arguments under ``key``."""
    alts = []
    for t in tools:
        fn = t.get("function", t)
        if only is not None and fn.get("name") != only:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        alts.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    if not alts:
        raise InvalidRequestError(f"tool_choice names a tool that is not in tools: {only!r}", "tool_choice")
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


# Whitespace between JSON tokens: compact or pretty-printed (newline + indent), but bounded,
# so a model cannot loop on whitespace forever.
JSON_OPTIONS = {"whitespace_pattern": r"[ \n]{0,20}"}


def _tag(tokenizer, text: str) -> str:
    """A tag as a grammar item: its special token where the tokenizer has one (Qwen does)."""
    tid = tokenizer.convert_tokens_to_ids(text) if tokenizer is not None else None
    if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
        return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(tools: list[dict], only: str | None = None, tokenizer=None, parallel: bool = False) -> str:
    """``parallel``: tagged calls may follow one another (a fence or bare JSON holds one call)."""
    schema = json.dumps({**call_schema(tools, only, args_key(tokenizer)), "x-guidance": JSON_OPTIONS})
    open_tag, close_tag = _tag(tokenizer, "<tool_call>"), _tag(tokenizer, "</tool_call>")
    more = ' ("\\n" tagged)*' if parallel else ""
    lark = (
        f'start: tagged{more} | "```json\\n" call "\\n```" | call\n'
        f'tagged: {open_tag} "\\n" call "\\n" {close_tag}\n'
        f"call: %json {schema}\n"
    )
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarConstraint:
    """Token-level matcher state for one request; fed only tokens that were committed."""

    def __init__(self, matcher, vocab_size: int):
        self.m = matcher
        self.vocab_size = vocab_size

    def mask(self) -> torch.Tensor:
        """bool [V]: tokens allowed next."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.shape[0])
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def consume(self, token: int) -> None:
        if not self.m.consume_token(int(token)):
            raise RuntimeError(f"grammar rejected a token it allowed: {self.m.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar allows no alternative to (skip verification)."""
        if self.m.is_stopped():
            return []
        ff = list(self.m.compute_ff_tokens())
        for t in ff:
            self.consume(t)
        return ff


def answer_grammar(schema: dict, tools: list[dict] | None = None, tokenizer=None, parallel: bool = True) -> str:
    """A JSON answer of ``schema``; with ``tools``, tagged calls as the other choice."""
    answer = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    lark = f"start: answer\nanswer: %json {answer}\n"
    if tools:
        call = json.dumps({**call_schema(tools, key=args_key(tokenizer)), "x-guidance": JSON_OPTIONS})
        open_tag, close_tag = _tag(tokenizer, "<tool_call>"), _tag(tokenizer, "</tool_call>")
        more = ' ("\\n" tagged)*' if parallel else ""
        lark = (
            f"start: answer | tagged{more}\nanswer: %json {answer}\n"
            f'tagged: {open_tag} "\\n" call "\\n" {close_tag}\ncall: %json {call}\n'
        )
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def make_tool_constraint(
    tokenizer,
    tools: list[dict] | None,
    tool_choice,
    vocab_size: int | None = None,
    parallel: bool = True,
    response: dict | None = None,
) -> GrammarConstraint | None:
    """A constraint for ``tool_choice`` "required" (one or more calls; one when ``parallel`` is
    False) or {"type": "function", "function": {"name": ...}} (one call of that function); else,
    with ``response`` (a structured answer's JSON schema), that answer -- or, with tools on
    "auto", tagged calls.

    Returns None for free decoding ("auto" / "none" / absent and no ``response``).
    """
    if tool_choice in (None, "auto", "none"):
        if response is None:
            return None
        import llguidance

        offered = tools if tool_choice == "auto" else None
        grammar = answer_grammar(response, offered, tokenizer, parallel)
        matcher = llguidance.LLMatcher(_lltokenizer(tokenizer), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"response schema cannot be used as a grammar: {matcher.get_error()}", "response_format"
            )
        return GrammarConstraint(matcher, vocab_size or len(tokenizer))
    if not tools:
        raise InvalidRequestError("tool_choice requires tools", "tool_choice")
    if tool_choice == "required":
        only = None
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        only = tool_choice["function"]["name"]
    else:
        raise InvalidRequestError(f"invalid tool_choice {tool_choice!r}", "tool_choice")
    import llguidance

    lltok = _lltokenizer(tokenizer)
    grammar = call_grammar(tools, only, tokenizer, parallel=parallel and only is None)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"tool schema cannot be used as a grammar: {matcher.get_error()}", "tools")
    return GrammarConstraint(matcher, vocab_size or len(tokenizer))
