"""Streaming: the replica's text deltas and logprob entries, and the ingress's OpenAI chunks.

Replica side: the engine thread commits tokens into the request's ``Detokenizer``; the event loop
reads snapshots of its text (:class:`~deployments.bridge.SequenceStream`) and
:func:`text_events` turns them into ``text`` events -- :class:`TextStreamer` decides what of the
text is safe to send (stop strings may still cut it), :class:`TokenText` writes the logprob
entries. Ingress side: :class:`StreamShaper` turns those events into ``chat.completion.chunk``
dicts, tool calls streamed as OpenAI streams them (name, then argument fragments).
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Iterator

import orjson

from toolspec_core.drafters.toolcall.parse import CallScan, raw_arguments, scan_calls, stream_calls

from .bridge import Progress
from .events import Done, Text
from .protocol import TAGS, call_id, choice_logprobs, completion_id, finish_reason, split_output, stats_extra, usage

log = logging.getLogger("toolspec.serve")


# ---------------------------------------------------------------------------------------- replica side


class TextStreamer:
    """Safe-to-send part of the output text: always a prefix of the engine's final text.

    It is fed the request's decoded text (``Detokenizer.text``, complete characters only, decoded
    once by the engine and shared with stop strings and the drafter) and does no decoding: with
    stop strings it holds back the tail that could still become one (the final text is cut
    before it), searching only the new text plus that lookback; ``end_after`` strings end the
    text after them (:func:`~toolspec_core.engine.sequence.end_text`).
    """

    def __init__(self, stop: list[str], end_after: tuple[str, ...] = ()):
        self.stop, self.end_after = list(stop), tuple(end_after)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.back = max((len(s) for s in (*self.stop, *self.end_after)), default=1) - 1
        self.text = ""  # the text last fed; ``text[:sent]`` has been sent
        self.sent = 0
        self.logprobs_sent = 0  # the output's logprob entries sent (set by text_events)
        self.cut: int | None = None  # where the text ends (a stop string's start), once seen
        self._searched = 0

    def feed(self, text: str) -> str:
        """The delta safe to send now that the output's text is ``text`` (an extension of the last)."""
        self.text = text
        if self.cut is None and (self.stop or self.end_after):
            start = max(0, self._searched - self.back)
            hits = [k for k in (text.find(s, start) for s in self.stop) if k >= 0]
            hits += [k + len(s) for s in self.end_after if (k := text.find(s, start)) >= 0]
            self._searched = len(text)
            if hits:
                self.cut = min(hits)
        end = self.cut if self.cut is not None else len(text) - self.hold
        return self._delta(text, end)

    def _delta(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.text[: self.sent]):
            log.warning("streamed text diverged from the final text")
            return ""
        self.text = final_text
        return self._delta(final_text, len(final_text))


class TokenText:
    """OpenAI's logprob entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``) of engine
    ``TokenLogprob`` tuples. A byte-level BPE token's bytes come from its own symbols, so a token
    holding part of a character still has its exact bytes; EOS tokens are not output text and get
    no entry."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos = tokenizer, set(eos_ids)
        self._bytes: dict[int, bytes] = {}
        try:
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

            self._decoder = {c: b for b, c in bytes_to_unicode().items()}
        except ImportError:
            self._decoder = {}

    def bytes_of(self, tid: int) -> bytes:
        out = self._bytes.get(tid)
        if out is None:
            piece = self.tokenizer.convert_ids_to_tokens(int(tid))
            if isinstance(piece, str) and piece and all(c in self._decoder for c in piece):
                out = bytes(self._decoder[c] for c in piece)
            else:
                out = self.tokenizer.decode([int(tid)]).encode()
            self._bytes[tid] = out
        return out

    def entry(self, tid: int, logprob: float) -> dict:
        raw = self.bytes_of(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def entries(self, logprobs) -> list[dict]:
        return [
            {**self.entry(t, lp), "top_logprobs": [self.entry(a, alp) for a, alp in top]}
            for t, lp, top in logprobs
            if t not in self.eos
        ]


async def text_events(
    updates: AsyncIterator[Progress], streamer: TextStreamer, token_text: TokenText, logprobs
) -> AsyncIterator[Text]:
    """``Text`` events of a sequence's progress: ``updates`` yields its
    :class:`~deployments.bridge.Progress` snapshots, ``logprobs`` is the sequence's list of
    ``TokenLogprob`` (None: not asked for). Ends when the updates end; what was sent is then a
    prefix of the final text and entries (``streamer.sent``, ``streamer.logprobs_sent``)."""
    async for progress in updates:
        n = progress.logprobs
        delta = streamer.feed(progress.text)
        lps = logprobs[streamer.logprobs_sent : n] if n > streamer.logprobs_sent else None
        if delta or lps:
            streamer.logprobs_sent = max(streamer.logprobs_sent, n)
            yield Text(delta, token_text.entries(lps) if lps else None)


def final_text_event(streamer: TextStreamer, token_text: TokenText, result) -> Text | None:
    """The last ``Text`` event of a finished sequence: the rest of its final text and logprobs."""
    tail = streamer.finish(result.text)
    rest = result.logprobs[streamer.logprobs_sent :] if result.logprobs is not None else None
    if not (tail or rest):
        return None
    return Text(tail, token_text.entries(rest) if rest else None)


# ---------------------------------------------------------------------------------------- ingress side

_CALL_OPENERS = ("<tool_call>", "```", "{", "[", "<|python_tag|>")


def _hold_from(text: str, tags_only: bool = False) -> tuple[int, bool]:
    """Index from which text might belong to a tool call (held back until it is parsed), and
    whether a whole opener starts there. Once one does, the index never moves however the text
    goes on: no opener's beginning holds another opener, so none can start before it later."""
    cut, whole = len(text), False
    for op in _CALL_OPENERS[:1] if tags_only else _CALL_OPENERS:
        i = text.find(op)
        if 0 <= i < cut or (i == cut and i >= 0):
            cut, whole = i, True
        # a partial opener at the very end ("<tool", "``")
        for k in range(min(len(op) - 1, len(text)), 0, -1):
            if text.endswith(op[:k]):
                if len(text) - k < cut:
                    cut, whole = len(text) - k, False
                break
    return cut, whole


_TAG = "<tool_call>"
_WS = " \t\r\n"  # JSON's whitespace, as the parser skips it


class CallScanner:
    """:func:`~toolspec_core.drafters.toolcall.parse.stream_calls` of an output that only grows,
    without reading all of it again at every delta.

    Once the text holds a ``<tool_call>`` tag the parser reads calls from tags alone, and so it
    will however the text goes on: each tag's region is read until its JSON value closes (or
    shows it cannot be calls) and kept from then on -- a closed value, or a refusal, is decided
    by the text up to it alone -- so a delta reads only the regions still open. Before any tag
    (fences or bare JSON, whose reading a later tag may still change) the text is read whole.
    """

    def __init__(self, tags_only: bool = False):
        self.tags_only = tags_only
        self.tags: list[int] = []  # where each tag starts
        self.searched = 0  # text searched for tags so far
        self.kept: dict[int, list[CallScan] | None] = {}  # a tag's region once decided (None: no calls)

    @property
    def by_tags(self) -> bool:
        """Calls are read from tags, for good (a kept call stays as it is)."""
        return bool(self.tags)

    def calls(self, text: str) -> list[CallScan]:
        i = max(0, self.searched - len(_TAG) + 1)
        while (k := text.find(_TAG, i)) >= 0:
            self.tags.append(k)
            i = k + len(_TAG)
        self.searched = len(text)
        if not self.tags:
            return stream_calls(text, self.tags_only)
        out: list[CallScan] = []
        for t in self.tags:
            if t in self.kept:
                scans = self.kept[t]
            else:
                scans, decided = self._region(text, t)
                if decided:
                    self.kept[t] = scans
            out.extend(scans or ())
        return out

    @staticmethod
    def _region(text: str, tag: int) -> tuple[list[CallScan] | None, bool]:
        """The calls of the tag at ``tag`` as far as the text goes, and whether that is final."""
        i = tag + len(_TAG)
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return None, False
        if text[i] not in "{[":
            return None, True
        found = scan_calls(text, i)
        if found is None:
            return None, True
        return found[0], found[1] is not None


class StreamShaper:
    """Turns replica events into OpenAI ``chat.completion.chunk`` dicts.

    Content is streamed as it is generated, except text that may start a tool call. A call is
    streamed as OpenAI streams one: its ``id`` / ``type`` / ``function.name`` once the name is
    complete, then ``arguments`` fragments as the model writes them (the arguments string is the
    model's own text, so the fragments are prefixes of it), in every layout the parser reads.
    ``finish`` checks what was sent against the full-text parse the non-streaming response uses
    and sends the rest, so the deltas reassemble to the same message.
    """

    def __init__(self, model: str, parse: bool | str, include_usage: bool = False, cid: str | None = None):
        self.model, self.parse, self.include_usage = model, parse, include_usage
        self.tags_only = parse == TAGS
        self.id, self.created = cid or completion_id(), int(time.time())
        self.text = ""
        self.sent_content = ""
        self.sent_calls: list[tuple[str, str]] = []  # (name, arguments sent so far) per call index
        self.mismatch = False
        self.logprobs: list[dict] = []  # token entries not sent yet (they ride on the next chunk)
        self.calls = CallScanner(self.tags_only)
        self.opener: int | None = None  # where a call's opener starts, once one has (content ends there)
        self.settled = 0  # leading calls closed, kept by the scanner and sent whole: nothing more to send

    def chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        out.update(extra)
        return out

    def start(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""})

    def _content_delta(self, content: str) -> Iterator[dict]:
        if content.startswith(self.sent_content):
            new = content[len(self.sent_content) :]
            if new:
                self.sent_content = content
                yield self.chunk({"content": new})
        else:
            self.mismatch = True

    def _call_delta(self, index: int, name: str, args: str) -> Iterator[dict]:
        """The deltas taking call ``index`` to ``name`` with ``args`` (a header first if it is new)."""
        if index == len(self.sent_calls):
            self.sent_calls.append((name, ""))
            head = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            yield self.chunk({"tool_calls": [head]})
        sent_name, sent = self.sent_calls[index]
        if sent_name != name or not args.startswith(sent):
            self.mismatch = True
            return
        if len(args) > len(sent):
            self.sent_calls[index] = (name, args)
            yield self.chunk({"tool_calls": [{"index": index, "function": {"arguments": args[len(sent) :]}}]})

    def _with_logprobs(self, chunks: Iterator[dict]) -> Iterator[dict]:
        """The chunks, the token logprobs waiting so far on the first of them."""
        for ch in chunks:
            if self.logprobs:
                ch["choices"][0]["logprobs"] = choice_logprobs(self.logprobs)
                self.logprobs = []
            yield ch

    def feed(self, delta: str, logprobs: list[dict] | None = None) -> Iterator[dict]:
        """Chunks for ``delta`` of text; ``logprobs``: the entries of the tokens it came from."""
        self.logprobs += logprobs or []
        yield from self._with_logprobs(self._feed(delta))

    def _feed(self, delta: str) -> Iterator[dict]:
        self.text += delta
        if not self.parse:
            yield from self._content_delta(self.text)
            return
        if self.opener is None:  # after an opener the content before it is all sent
            cut, whole = _hold_from(self.text, self.tags_only)
            yield from self._content_delta(self.text[:cut].strip())
            if whole:
                self.opener = cut
        calls = self.calls.calls(self.text)
        for index in range(self.settled if self.calls.by_tags else 0, len(calls)):
            scan = calls[index]
            if self.mismatch or not scan.ready(self.text):
                return
            yield from self._call_delta(index, scan.name, raw_arguments(self.text, scan) or "")
            if scan.end is None:  # a later call cannot have begun
                return
            if self.calls.by_tags and index == self.settled and not self.mismatch:
                self.settled += 1  # kept as it is: its deltas are all sent

    def finish(self, result: Done) -> Iterator[dict]:
        """Flush against the authoritative full text; then the finish (and usage) chunks."""
        yield from self._with_logprobs(self._finish(result))

    def _finish(self, result: Done) -> Iterator[dict]:
        text = result.text
        if text.startswith(self.text) and len(text) > len(self.text):
            self.text = text
        parsed = split_output(text, self.parse)
        if len(parsed.calls) < len(self.sent_calls):
            self.mismatch = True
        for index, call in enumerate(parsed.calls):
            if self.mismatch:
                break
            yield from self._call_delta(index, call.name, call.arguments_json())
        yield from self._content_delta(parsed.content or "")
        reason = finish_reason(result.finish_reason, bool(parsed.calls))
        extra = {"toolspec": stats_extra(result.stats, result.extra)}
        yield self.chunk({}, reason, **extra)
        if self.include_usage:
            u = self.chunk({}, None, usage=usage(result))
            u["choices"] = []
            yield u


def sse(obj: dict | str) -> bytes:
    """One server-sent event (orjson: UTF-8 as it is, the chunk dicts' types only)."""
    if isinstance(obj, str):
        return b"data: " + obj.encode() + b"\n\n"
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_many(chunks) -> bytes:
    """The events of ``chunks`` in one body part (b"" when there are none)."""
    return b"".join(b"data: " + orjson.dumps(ch) + b"\n\n" for ch in chunks)
