"""Benchmark items in the common JSONL format (benchmarks/datasets/README.md) and warm-library documents."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.model.prompting import render_prompt, turn_end_tokens

from .datasets import open_text

# How the gold calls of a warm item are written out, i.e. the layout the model itself uses.
# "fence": a ```json fence with an indent-2 object per call -- what the embedded
# Qwen2.5-Coder-0.5B writes; "template": the chat template's own rendering of an assistant
# tool-call message (Qwen: <tool_call>\n{...}\n</tool_call>).
LAYOUTS = ("fence", "template")


def load_items(path: str | Path, structured: bool = False) -> list[dict]:
    """All items of one JSONL file; ``benchmark`` defaults to the file stem. ``structured``: the
    structured-output tasks made from them instead (:func:`structured_item`)."""
    items = []
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "id" not in item or "messages" not in item:
                raise ValueError(f"{path}:{line_no}: an item needs 'id' and 'messages'")
            item.setdefault("benchmark", Path(path).stem.split(".")[0])
            item.setdefault("tools", [])
            item.setdefault("gold_calls", [])
            items.append(item)
    if structured:
        items = [s for s in map(structured_item, items) if s is not None]
    return items


def select_items(items: list[dict], limit: int | None, seed: int | None) -> list[dict]:
    """``limit`` items drawn at random with ``seed`` (None: the first ``limit``), kept in file
    order -- the file order is the stream order the online library sees."""
    if limit is None or limit >= len(items):
        return list(items)
    if seed is None:
        return list(items[:limit])
    keep = set(random.Random(seed).sample(range(len(items)), limit))
    return [it for i, it in enumerate(items) if i in keep]


def interleave(streams: list[list[dict]]) -> list[dict]:
    """Round-robin over benchmarks so an interrupted run covers every benchmark evenly."""
    out, i = [], 0
    while any(i < len(s) for s in streams):
        out.extend(s[i] for s in streams if i < len(s))
        i += 1
    return out


def load_stream(paths: list[str], limit: int | None, seed: int | None, structured: bool = False) -> list[dict]:
    streams = [select_items(load_items(p, structured), limit, seed) for p in paths]
    seen: set[str] = set()
    for s in streams:
        for it in s:
            if it["id"] in seen:
                raise ValueError(f"duplicate item id {it['id']!r} across data files")
            seen.add(it["id"])
    return interleave(streams)


STRUCTURED_SYSTEM = (
    "Extract the arguments of the function `{name}` ({description}) from the user's request. "
    "Answer with the JSON object of its arguments only."
)


def structured_item(item: dict) -> dict | None:
    """The structured-output task made from a tool-call item: produce the arguments object of its
    (first) gold call as a JSON answer to a ``response_format`` json_schema -- the tool's parameters
    schema -- from the same conversation, no tools offered. None when the item has no gold call of
    an offered tool with named parameters."""
    gold = (item.get("gold_calls") or [None])[0]
    tools = {t["function"]["name"]: t["function"] for t in item.get("tools") or [] if "function" in t}
    fn = tools.get(gold["name"]) if gold else None
    params = (fn or {}).get("parameters") or {}
    if not fn or not params.get("properties"):
        return None
    system = STRUCTURED_SYSTEM.format(name=fn["name"], description=(fn.get("description") or "").strip().rstrip("."))
    convo = [m for m in item["messages"] if m.get("role") in ("user", "assistant") and not m.get("tool_calls")]
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", fn["name"])[:64]
    return {
        "id": f"structured-{item['id']}",
        "benchmark": f"structured_{item['benchmark']}",
        "messages": [{"role": "system", "content": system}, *convo],
        "tools": [],
        "gold_calls": [],
        "gold_answer": gold.get("arguments"),
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": params, "strict": True}},
    }


def response_schema(item: dict) -> dict | None:
    """The JSON schema an item's answer must follow (``response_format``), None for free text."""
    rf = item.get("response_format") or {}
    if rf.get("type") == "json_object":
        return {"type": "object"}
    if rf.get("type") == "json_schema":
        return (rf.get("json_schema") or {}).get("schema") or {"type": "object"}
    return None


def prompt_ids(tokenizer, item: dict) -> list[int]:
    return render_prompt(tokenizer, item["messages"], item.get("tools"))


def _end_token(tokenizer, eos_ids) -> list[int]:
    ends = turn_end_tokens(tokenizer)
    return ends[:1] if ends else ([eos_ids[0]] if eos_ids else [])


def _template_text(tokenizer, item: dict) -> str | None:
    """The chat template's rendering of an assistant message carrying the gold calls."""
    from toolspec_core.model.prompting import _normalise_messages, render_text

    calls = [
        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in item["gold_calls"]
    ]
    msgs = _normalise_messages(item["messages"]) + [{"role": "assistant", "content": "", "tool_calls": calls}]
    prompt = render_text(tokenizer, item["messages"], item.get("tools"))
    full = tokenizer.apply_chat_template(msgs, tools=item.get("tools") or None, tokenize=False)
    if not full.startswith(prompt):
        return None
    rest = full[len(prompt) :]
    end = rest.find("<|im_end|>")
    return rest[:end] if end >= 0 else rest.rstrip("\n")


def gold_output_text(tokenizer, item: dict, layout: str = "fence") -> str:
    """The gold call(s) written the way the model writes calls (see ``LAYOUTS``)."""
    if layout == "template":
        text = _template_text(tokenizer, item)
        if text is not None:
            return text
        body = [
            json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False) for c in item["gold_calls"]
        ]
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in body)
    if layout != "fence":
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    body = [
        json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False, indent=2)
        for c in item["gold_calls"]
    ]
    return "\n".join(f"```json\n{b}\n```" for b in body)


def warm_documents(tokenizer, items: list[dict], eos_ids=(), layout: str = "fence", embed=None):
    """(RequestInfo, output ids, text) per warm item with gold calls, for ``method.observe``.

    ``embed(item, prompt_ids)`` gives the retrieval key (prefill hidden state) when wanted.
    """
    docs = []
    for item in items:
        if not item.get("gold_calls"):
            continue
        ids = prompt_ids(tokenizer, item)
        text = gold_output_text(tokenizer, item, layout)
        out = list(tokenizer.encode(text, add_special_tokens=False)) + _end_token(tokenizer, eos_ids)
        emb = embed(item, ids) if embed is not None else None
        docs.append((RequestInfo(prompt_ids=ids, tools=item.get("tools") or [], embedding=emb), out, text))
    return docs


def gold_requests(per_set: int, sets=("api_bank", "bfcl_v3", "toolalpaca")):
    """The first ``per_set`` dev items of each set with what a request's drafter derives from
    them: (item, its ``ToolIndex``, the candidate builder's request inputs -- the gold calls as
    retrieved past calls, the conversation's numbers and dates). For the checks that expand
    schema candidates along the gold calls."""
    from toolspec_core.drafters.toolcall.fsm import ToolIndex
    from toolspec_core.drafters.toolcall.values import context_dates, context_numbers

    from .datasets import dev_set, read_jsonl

    for name in sets:
        for it in read_jsonl(dev_set(name), per_set):
            prose = " ".join(str(m.get("content") or "") for m in it["messages"])
            past = [(c["name"], c.get("arguments") or {}) for c in it["gold_calls"]]
            inputs = dict(past=past, numbers=context_numbers(prose), dates=context_dates(prose))
            yield it, ToolIndex.from_tools(it["tools"]), inputs
