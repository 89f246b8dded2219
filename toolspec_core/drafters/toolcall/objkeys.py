"""Keys of JSON objects the conversation (and the output so far) shows: drafts for objects no
tool schema describes.

Models write JSON that is not a call: nested argument objects, arrays of records, and -- small
models especially -- a made-up tool result after their call, shaped like the tool results and
output descriptions in the context (API-Bank: ``{"output_parameters": {"temperature": ...,
"humidity": ...}}`` after a ToolSearcher result listing exactly those output parameters). Values
there are free, but which key comes next is not: it is the key that followed the same key in an
object of the context, or the first key of the objects that appeared under the same parent key
(an array's next record repeats the previous record's keys).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

CLOSE = "}"  # key_candidates' entry for "the object ends here"


@dataclass(frozen=True)
class ObjectKeys:
    parent: str | None  # the key the object is the value of (an array element: the array's key)
    keys: tuple[str, ...]


class KeyIndex:
    """Finished objects, indexed for ``key_candidates`` as they come (a step looks up a key, never
    rescans the objects): per key, what followed it; per parent key, the objects' first keys."""

    def __init__(self):
        self.objects: list[ObjectKeys] = []
        self.after: dict[str, list[tuple[str | None, str]]] = defaultdict(list)  # key -> (parent, next key or CLOSE)
        self.first: dict[str | None, list[str]] = defaultdict(list)  # parent -> first keys
        self.keys: set[str] = set()

    def add(self, parent: str | None, keys) -> None:
        keys = tuple(k for k in keys if k is not None)
        if not keys:
            return
        self.objects.append(ObjectKeys(parent, keys))
        self.first[parent].append(keys[0])
        self.keys.update(keys)
        for i, k in enumerate(keys):
            self.after[k].append((parent, keys[i + 1] if i + 1 < len(keys) else CLOSE))


@dataclass
class _Open:
    kind: str  # "{" | "["
    parent: str | None
    keys: list[str] = field(default_factory=list)


class KeyScanner:
    """Incremental scan of text for JSON objects and their key order (prose around them is
    skipped; a quote with no closing quote on its line is not a string)."""

    def __init__(self, max_depth: int = 32):
        self.index = KeyIndex()
        self.max_depth = max_depth
        self._stack: list[_Open] = []
        self._str: list[str] | None = None  # characters of the string being read
        self._esc = False
        self._pending: str | None = None  # a string just closed: a key if ':' follows

    def feed(self, text: str) -> "KeyScanner":
        for ch in text:
            self._char(ch)
        return self

    def _char(self, ch: str) -> None:
        if self._str is not None:
            if self._esc:
                self._esc = False
                self._str.append(ch)
            elif ch == "\\":
                self._esc = True
                self._str.append(ch)
            elif ch == '"':
                self._pending, self._str = "".join(self._str), None
            elif ch == "\n":
                self._str = None
            else:
                self._str.append(ch)
            return
        if ch in " \t\r\n":
            return
        pending, self._pending = self._pending, None
        top = self._stack[-1] if self._stack else None
        if ch == ":" and pending is not None and top is not None and top.kind == "{":
            top.keys.append(pending)
        elif ch == '"':
            self._str = []
        elif ch in "{[":
            if len(self._stack) >= self.max_depth:
                self._stack.clear()
            parent = (
                (top.keys[-1] if top.keys else None)
                if top is not None and top.kind == "{"
                else (top.parent if top else None)
            )
            self._stack.append(_Open(ch, parent))
        elif ch in "}]" and top is not None:
            self._stack.pop()
            if top.kind == "{":
                self.index.add(top.parent, top.keys)


def key_candidates(
    sources: list[tuple[KeyIndex, float]],
    parent: str | None,
    used: list[str],
    prefix: str = "",
    schema_keys: list[str] | tuple = (),
    limit: int = 4,
) -> list[tuple[str, float]]:
    """What comes next in an object under ``parent`` whose keys so far are ``used``: up to
    ``limit`` keys (or ``CLOSE``) with their share of the evidence, most likely first.

    Evidence, weighted per source (the output's own objects count more than the prompt's): the key
    that followed ``used[-1]`` in an object (twice as much under the same parent), or, for the
    first key, the first key of the objects seen under the same parent; the schema's unused keys
    in declared order. With ``prefix`` (a key being typed), any seen key that starts with it.
    """
    votes: dict[str, float] = defaultdict(float)
    for index, weight in sources:
        if used:
            for par, nxt in index.after.get(used[-1], ()):
                votes[nxt] += weight * (2.0 if parent is not None and par == parent else 1.0)
        elif parent is not None:
            for k in index.first.get(parent, ()):
                votes[k] += weight
    free = [k for k in schema_keys if k not in used]
    for rank, k in enumerate(free):
        votes[k] += 1.0 if rank == 0 else 0.5
    if used and not free and schema_keys:
        votes[CLOSE] += 1.0
    if prefix and not any(k.startswith(prefix) and k != CLOSE for k in votes):
        for index, weight in sources:
            for k in index.keys:
                if k.startswith(prefix):
                    votes[k] += weight
    cands = [
        (k, v)
        for k, v in votes.items()
        if (k == CLOSE and not prefix) or (k != CLOSE and k not in used and k.startswith(prefix))
    ]
    total = sum(v for _, v in cands)
    cands.sort(key=lambda kv: -kv[1])
    return [(k, v / total) for k, v in cands[:limit]] if total > 0 else []
