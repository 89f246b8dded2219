"""The stream shaper reads a growing output incrementally and sends exactly what reading the whole
text at every delta sends: the call scanner equals the parser's ``stream_calls`` at every prefix,
and the chunks (content, call names, argument fragments, their order, the finish) are the same
as a shaper that parses the whole text each time, on dev-set calls in every layout, split
anyhow."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.datasets import dev_set, read_jsonl
from deployments.events import Done
from deployments.protocol import TAGS
from deployments.streaming import _CALL_OPENERS, CallScanner, StreamShaper
from toolspec_core.drafters.toolcall.parse import raw_arguments, stream_calls
from toolspec_core.spec.layouts import LAYOUTS, LLAMA, LLAMA_TAG, render_calls

CALL = '{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TRICKY = [
    f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
    f"{CALL}\nthen a tag after bare JSON: <tool_call>\n{CALL}\n</tool_call>",  # the reading changes
    f"```json\n{CALL}\n```\n<tool_call>\n{CALL}\n</tool_call>",  # fence, then a tag
    '<tool_call>\n{"name": "f", "arguments": {"q": "a <tool_call> inside a string"}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"q": "<tool_call>\\n{\\"name\\": 1}"}}</tool_call><tool_call>[',
    "<tool_call>\nnot json at all</tool_call>\n<tool_call>\n" + CALL,
    "<tool_call>   \n\n  " + CALL,
    "<tool_call>\n[" + CALL + ", " + CALL + "]\n</tool_call>",
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call><tool_call>\n' + CALL,
    '<tool_call>\n{"arguments": {"a": [1, {"b": "}"}]}, "name": "late_name"}</tool_call>',
    '<tool_call>\n{"name": "s", "arguments": "{\\"city\\": \\"Par\\u00eds\\"}"}</tool_call>',
    "Use {a: 1} or [x] here ``` and `` then <tool",
    "plain text, no call at all   ",
    "<tool_call><tool_call>" + CALL,
    "<|python_tag|>" + '{"name": "f", "parameters": {"x": 1}}',
]


def dev_texts(n_per: int = 12):
    rng = random.Random(0)
    for bench in ("api_bank", "bfcl_v3", "toolalpaca", "bfcl_v3_multi_turn"):
        for it in read_jsonl(dev_set(bench), n_per):
            calls = it.get("gold_calls") or []
            if not calls:
                continue
            for layout in (*LAYOUTS, LLAMA, LLAMA_TAG):
                text = render_calls(calls, layout)
                yield text
                yield "Sure, I will call it.\n" + text
                yield text[: rng.randrange(1, len(text))]  # cut off (max_tokens)


TEXTS = TRICKY + list(dev_texts())


def _reference_hold(text: str, tags_only: bool) -> int:
    cut = len(text)
    for op in _CALL_OPENERS[:1] if tags_only else _CALL_OPENERS:
        i = text.find(op)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(op) - 1, len(text)), 0, -1):
            if text.endswith(op[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class WholeTextShaper(StreamShaper):
    """The reference: every delta parses the whole text again."""

    def _feed(self, delta):
        self.text += delta
        if not self.parse:
            yield from self._content_delta(self.text)
            return
        yield from self._content_delta(self.text[: _reference_hold(self.text, self.tags_only)].strip())
        for index, scan in enumerate(stream_calls(self.text, self.tags_only)):
            if self.mismatch or not scan.ready(self.text):
                return
            yield from self._call_delta(index, scan.name, raw_arguments(self.text, scan) or "")
            if scan.end is None:
                return


def _normal(chunks: list[dict]) -> list[str]:
    """The chunks with their random parts (call ids) taken out."""
    out = []
    for ch in chunks:
        for c in ch.get("choices", []):
            for tc in c["delta"].get("tool_calls") or []:
                if "id" in tc:
                    tc["id"] = "call"
        out.append(json.dumps({k: v for k, v in ch.items() if k not in ("id", "created")}, sort_keys=True))
    return out


def _splits(n: int, rng: random.Random):
    yield [1 if n < 300 else 4] * n
    yield [3] * (n // 3 + 1)
    yield [rng.randrange(1, 12) for _ in range(n)]


@pytest.mark.parametrize("tags_only", [False, True])
def test_the_call_scanner_is_stream_calls_at_every_prefix(tags_only):
    for text in TRICKY + TEXTS[len(TRICKY) :: 4]:
        scanner = CallScanner(tags_only)
        step = 1 if len(text) < 400 else 5
        for i in list(range(0, len(text), step)) + [len(text)]:
            assert scanner.calls(text[:i]) == stream_calls(text[:i], tags_only), (text[:i], tags_only)


@pytest.mark.parametrize("parse", [True, TAGS, False])
def test_the_shaper_sends_what_parsing_the_whole_text_sends(parse):
    rng = random.Random(1)
    texts = TRICKY + TEXTS[len(TRICKY) :: 2 if parse is True else 5]
    for text in texts:
        for sizes in _splits(len(text), rng):
            got, want = StreamShaper("m", parse, True), WholeTextShaper("m", parse, True)
            chunks = {"got": [got.start()], "want": [want.start()]}
            i = 0
            for n in sizes:
                if i >= len(text):
                    break
                chunks["got"] += list(got.feed(text[i : i + n]))
                chunks["want"] += list(want.feed(text[i : i + n]))
                i += n
            done = Done(text, "stop", 1, 2)
            chunks["got"] += list(got.finish(done))
            chunks["want"] += list(want.finish(done))
            assert _normal(chunks["got"]) == _normal(chunks["want"]), text
            assert got.mismatch == want.mismatch
