"""Render chat requests (OpenAI-style messages + tools) into the target's prompt token ids."""

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
