"""A request's tool set compiled once and shared by every request that sends the same tools.

Agent traffic sends the same tool list every turn, and drafting asks the same questions of it at
every step of every sequence: which alternatives a value's schema allows (``variants``), the JSON
text of each enum value, whether a string argument may hold a date, and how each schema
candidate (tool name, argument key, enum value, fixed text) is tokenized after the committed
tokens. ``compile_tools`` answers the schema questions once per tool set; the tokenizations are
kept per tool set in a token table filled at the boundaries that occur (a candidate's tokens
depend on the last ``TAIL_TOKENS`` committed tokens and its segments only, see ``boundary``), so
a second request with the same tools tokenizes nothing its predecessors did.

``ToolSetCache`` holds the compiled sets: keyed by a hash of the canonical schemas and the
tokenizer's identity, least recently used dropped once the estimated bytes of all entries pass
a bound, with hit / miss counts and compile times. The tables answer exactly what the schema
functions answer, so drafting with them gives the same trees (``tests/drafters/test_batch_drafting.py``
holds them node for node to the reference drafter, which compiles nothing).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from toolspec_core.drafters.toolcall.fsm import ToolIndex
from toolspec_core.drafters.toolcall.schema import enum_values, variants
from toolspec_core.drafters.toolcall.values import wants_date

# bytes an entry of a token table is taken to cost beyond its tokens (the two tuples, the key's
# tail and segments with their text, the dict slot): an estimate
TOKEN_ENTRY_BYTES = 400
TOKEN_BYTES = 48  # one id (an int object and its reference) and one label reference
TOKEN_TABLE_ENTRIES = 8192  # a tool set's token table keeps at most this many boundaries (oldest dropped)


def tokenizer_identity(tokenizer) -> str:
    """What makes two tokenizers give different ids: class, name, vocabulary size and, where the
    fast backend is there, a hash of its serialized model (computed once per tokenizer object)."""
    if tokenizer is None:
        return "none"
    cached = getattr(tokenizer, "_toolspec_identity", None)
    if isinstance(cached, str):
        return cached
    parts = [type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", ""))]
    try:
        parts.append(str(len(tokenizer)))
    except TypeError:
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        parts.append(hashlib.sha256(backend.to_str().encode()).hexdigest())
    ident = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
    try:
        tokenizer._toolspec_identity = ident
    except AttributeError:  # slotted objects: recomputed next time
        pass
    return ident


def tool_set_key(tools: list[dict], response: dict | None, tokenizer_id: str) -> str:
    """The cache key of a tool set: its canonical JSON (sorted keys) with the tokenizer's identity."""
    canon = json.dumps([tools or [], response], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256((tokenizer_id + "\x00" + canon).encode()).hexdigest()


@dataclass
class ValueStart:
    """What one alternative of an argument's schema opens with (``candidates._typed_start``)."""

    kind: str  # "enum" | "boolean" | "null" | "number" | "string" | "array" | "object" | ""
    enum_json: tuple[str, ...] = ()  # the enum's values as JSON text (kind "enum")


def value_start(schema: dict) -> ValueStart:
    """The opening kind of one schema alternative, enum values rendered once."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, (str, int, float, bool)) for e in enum):
        return ValueStart("enum", tuple(json.dumps(e, ensure_ascii=False) for e in enum))
    typ = schema.get("type")
    if typ in ("boolean", "null", "string", "array", "object"):
        return ValueStart(typ)
    if typ in ("integer", "number"):
        return ValueStart("number")
    return ValueStart("")


@dataclass
class CompiledTools:
    """One tool set's schema answers and token table. Schema dicts are looked up by identity: the
    entry holds every dict it answers for, so no other live dict can share one's id, and a dict it
    does not know is answered by the schema functions as usual."""

    key: str
    index: ToolIndex
    compile_s: float = 0.0
    _variants: dict[int, list[dict]] = field(default_factory=dict, repr=False)
    _starts: dict[int, ValueStart] = field(default_factory=dict, repr=False)
    _enums: dict[int, list | None] = field(default_factory=dict, repr=False)
    _dates: dict[tuple[str, int], dict | None] = field(default_factory=dict, repr=False)
    _held: list = field(default_factory=list, repr=False)  # every dict keyed by id above
    tokens: OrderedDict = field(default_factory=OrderedDict, repr=False)  # (tail, segs) -> (ids, labels)
    schema_bytes: int = 0
    token_bytes: int = 0
    token_hits: int = 0
    token_misses: int = 0

    @property
    def nbytes(self) -> int:
        """Estimated bytes of this entry: its schema tables and its token table."""
        return self.schema_bytes + self.token_bytes

    def variants(self, schema) -> list[dict]:
        out = self._variants.get(id(schema))
        return out if out is not None else variants(schema)

    def start(self, schema: dict) -> ValueStart:
        out = self._starts.get(id(schema))
        return out if out is not None else value_start(schema)

    def enum_values(self, schema) -> list | None:
        key = id(schema)
        return self._enums[key] if key in self._enums else enum_values(schema)

    def date_string(self, key: str, schema: dict) -> dict | None:
        """The string alternative a date may be rendered into for argument ``key`` (``_Builder.derived``), or None."""
        k = (key, id(schema))
        if k in self._dates:
            return self._dates[k]
        return _date_string(key, schema, variants(schema))

    def candidate(self, tokenize, tail: tuple[int, ...], segs: tuple) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """A schema candidate's (ids, labels) after ``tail`` from the token table; ``tokenize(tail,
        segs)`` on a miss, kept (the oldest boundaries dropped past ``TOKEN_TABLE_ENTRIES``)."""
        k = (tail, segs)
        out = self.tokens.get(k)
        if out is not None:
            self.token_hits += 1
            return out
        self.token_misses += 1
        out = tokenize(tail, segs)
        self.tokens[k] = out
        self.token_bytes += token_entry_bytes(out)
        if len(self.tokens) > TOKEN_TABLE_ENTRIES:
            _, old = self.tokens.popitem(last=False)
            self.token_bytes -= token_entry_bytes(old)
        return out


def token_entry_bytes(entry: tuple) -> int:
    return TOKEN_ENTRY_BYTES + TOKEN_BYTES * len(entry[0])


def _date_string(key: str, schema: dict, alts: list[dict]) -> dict | None:
    strings = [v for v in alts if v.get("type", "string") == "string" and "enum" not in v]
    return strings[0] if strings and wants_date(key, strings[0]) else None


def compile_tools(tools: list[dict], response: dict | None, key: str = "") -> CompiledTools:
    """Compile a tool set: the index (``ToolIndex.from_tools``), every tool's properties and
    required keys, and for each argument schema its alternatives, their openings, its enum
    values and its date string."""
    t0 = time.perf_counter()
    index = ToolIndex.from_tools(tools, response)
    out = CompiledTools(key, index)
    for name in list(index.params):
        for arg, schema in index.properties(name).items():
            if not isinstance(schema, dict):
                continue
            alts = variants(schema)
            out._variants[id(schema)] = alts
            out._enums[id(schema)] = enum_values(schema)
            out._dates[(arg, id(schema))] = _date_string(arg, schema, alts)
            out._held.append(schema)
            for v in alts:
                out._starts[id(v)] = value_start(v)
                out._held.append(v)
        index.required(name)
    out.schema_bytes = deep_size(out.index) + deep_size([out._variants, out._starts, out._enums, out._dates])
    out.compile_s = time.perf_counter() - t0
    return out


def deep_size(obj, limit: int = 200_000) -> int:
    """Estimated bytes of ``obj`` and what it references (``sys.getsizeof`` summed over containers,
    dataclass fields and strings, each object once, at most ``limit`` objects)."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif hasattr(o, "__dict__"):
            stack.append(vars(o))
    return total


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``xs`` by nearest rank (0 for none)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ToolSetCache:
    """Compiled tool sets by key, least recently used dropped past ``max_bytes`` (estimated: each
    entry's schema tables at compile, its token table as it fills). The bound is restored at every
    lookup; an entry larger than the whole bound is compiled and used but not kept. Thread safe:
    a server's request threads look sets up while its engine thread drafts."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CompiledTools] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_s: list[float] = []  # per compiled set, in compile order (the last 4096)

    def get(self, tools: list[dict], response: dict | None, tokenizer) -> CompiledTools:
        key = tool_set_key(tools, response, tokenizer_identity(tokenizer))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self._shrink()
                return hit
            self.misses += 1
        compiled = compile_tools(tools, response, key)  # outside the lock
        with self._lock:
            self.compile_s = (self.compile_s + [compiled.compile_s])[-4096:]
            if compiled.nbytes <= self.max_bytes:
                self._entries[key] = self._entries.get(key, compiled)
                self._entries.move_to_end(key)
                compiled = self._entries[key]
            self._shrink()
        return compiled

    def _shrink(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        while total > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            total -= old.nbytes

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        """Hits, misses, hit rate, compile time per set (p50 / p99, ms), bytes per entry (schema
        tables and token tables apart), and the token tables' lookups of the sets held."""
        with self._lock:
            entries = list(self._entries.values())
            sizes = [e.nbytes for e in entries]
            n = self.hits + self.misses
            token_hits = sum(e.token_hits for e in entries)
            token_lookups = token_hits + sum(e.token_misses for e in entries)
            return {
                "entries": len(sizes),
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / n if n else 0.0,
                "compile_ms_p50": 1e3 * percentile(self.compile_s, 0.5),
                "compile_ms_p99": 1e3 * percentile(self.compile_s, 0.99),
                "bytes": sum(sizes),
                "bytes_per_entry_mean": sum(sizes) / len(sizes) if sizes else 0.0,
                "bytes_per_entry_max": max(sizes, default=0),
                "max_bytes": self.max_bytes,
                "schema_bytes": sum(e.schema_bytes for e in entries),
                "token_bytes": sum(e.token_bytes for e in entries),
                "token_entries": sum(len(e.tokens) for e in entries),
                "token_lookups": token_lookups,
                "token_hit_rate": token_hits / token_lookups if token_lookups else 0.0,
            }
