"""The chat template: render chat requests (OpenAI-style messages + tools) into the target's prompt
token ids, and the tokens that end the assistant's turn."""

from __future__ import annotations

import copy
import json

from toolspec_core.errors import InvalidRequestError


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """OpenAI sends tool-call arguments as a JSON string; HF chat templates expect a dict."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError("each message must be an object with a 'role'", "messages")
        m = copy.deepcopy(m)
        if m.get("content") is None:
            m["content"] = ""
        elif isinstance(m["content"], list):  # content parts: keep the text ones
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc)
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
        out.append(m)
    return out


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant turn header."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    ids = tokenizer.apply_chat_template(
        _normalise_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # BatchEncoding in recent transformers
        ids = ids["input_ids"]
    return list(ids)


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(
        _normalise_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=False
    )


# Tokens that end a chat turn, the chat template's own first: Qwen / ChatML, Llama 3, Phi, and the
# document end token some templates close a turn with.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>")


def turn_end_tokens(tokenizer) -> list[int]:
    """Ids of the ``TURN_END_TOKENS`` this tokenizer has, in that order."""
    ids: list[int] = []
    for tok in TURN_END_TOKENS:
        try:
            tid = tokenizer.convert_tokens_to_ids(tok)
        except (AttributeError, KeyError, TypeError):
            tid = None
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None) and tid not in ids:
            ids.append(tid)
    return ids


def turn_end_ids(tokenizer) -> list[int]:
    """Tokens that end an assistant turn: the turn-end tokens, then the tokenizer's EOS.

    Chat models end a turn with these even when generation_config does not say so.
    """
    ids = turn_end_tokens(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in ids:
        ids.append(eos)
    return ids


def eos_ids_of(model, tokenizer) -> tuple[int, ...]:
    """Every token that ends generation for this model: the turn-end ids and the EOS ids its
    generation_config names (a chat model stops on either)."""
    ids = set(turn_end_ids(tokenizer))
    src = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(src, int):
        ids.add(src)
    elif isinstance(src, (list, tuple)):
        ids.update(int(x) for x in src)
    return tuple(sorted(ids))
