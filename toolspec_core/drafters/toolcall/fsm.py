"""Tool-call FSM: where in a tool call the committed text stands.

A character-level JSON follower, fed only committed text, so its state is a pure function of
that text (rejected drafts never touch it; re-feeding the same text gives the same state).
It knows the call structure: free text -> (opener) -> call object {"name": <tool name>,
"arguments": {<argument name>: <value typed by the schema>, ...}} -> closer -> next call. It
follows whatever layout and whitespace the model writes (tags, fence, bare; compact or pretty,
key order included) and records that style so drafts continue in it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from toolspec_core.drafters.toolcall.objkeys import KeyIndex
from toolspec_core.drafters.toolcall.schema import inline_refs
from toolspec_core.drafters.toolcall.schema import items as schema_items
from toolspec_core.drafters.toolcall.schema import properties as schema_properties
from toolspec_core.drafters.toolcall.schema import required as schema_required
from toolspec_core.spec.labels import ARG_NAME, BETWEEN, CALL_KEY, END, TEXT, TOOL_NAME, VALUE
from toolspec_core.spec.layouts import LAYOUTS, PYTHON_TAG, Layout, opened_by


@dataclass
class Frame:
    kind: str  # "obj" | "arr"
    role: str  # "calls" (array of calls) | "call" | "args" | "value"
    indent: int  # leading spaces of the line where the container opened
    schema: dict | None = None  # JSON schema of the container (args: the tool's parameters)
    expect: str = "key"  # obj: key | colon | value | next ; arr: value | next
    key: str | None = None
    keys: list[str] = field(default_factory=list)
    parent_key: str | None = None  # the key this container is the value of (array elements: the array's)


# The schema of a structured answer (response_format) is held as the parameters of a tool of this
# name, which no offered tool can have: the answer object is then drafted as a call's arguments are.
RESPONSE = "\x00response"


@dataclass
class ToolIndex:
    """The request's tools, prepared once: name -> parameters schema (and the structured answer's
    schema under :data:`RESPONSE`, which is not among the names a call may take)."""

    names: list[str]
    params: dict[str, dict]
    _resolved: dict = field(default_factory=dict, repr=False, compare=False)
    # (properties, required) per described tool: ``params`` is the index's own (inlined) copy,
    # never changed after ``from_tools``, so each is computed once (drafting reads them at
    # every branch of every step); callers only read what these return
    _keys: dict = field(default_factory=dict, repr=False, compare=False)

    # a written name this similar to a tool's (difflib ratio) is taken for a misspelling of it
    SIMILAR = 0.75

    @classmethod
    def from_tools(cls, tools: list[dict], response: dict | None = None) -> "ToolIndex":
        names, params = [], {}
        if response and schema_properties(response):  # else: a free object (json_object)
            params[RESPONSE] = inline_refs(response)
        for t in tools or []:
            fn = t.get("function", t) if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                continue
            names.append(fn["name"])
            p = fn.get("parameters") or {}
            params[fn["name"]] = inline_refs(p) if isinstance(p, dict) else {}
        return cls(names, params)

    def resolve(self, name: str | None) -> str | None:
        """The tool whose schema describes a call written as ``name``: itself, or -- models write
        names the request does not offer (``getFruitsByFamily`` for ``getFruitByFamily``) -- the
        most similar offered name; None when nothing is close (the arguments are then free)."""
        if not name:
            return None
        if name in self.params:
            return name
        if name == RESPONSE:  # a structured answer with no schema of its own: a free object
            return None
        if name not in self._resolved:
            import difflib

            if len(self._resolved) >= 1024:  # the index lives as long as its tool set: keep it bounded
                self._resolved.clear()
            close = difflib.get_close_matches(name, self.names, 1, self.SIMILAR)
            self._resolved[name] = close[0] if close else None
        return self._resolved[name]

    def params_of(self, name: str | None) -> dict:
        return self.params.get(self.resolve(name) or "", {}) or {}

    def _keys_of(self, name: str | None) -> tuple[dict, list[str]]:
        tool = self.resolve(name) or ""
        keys = self._keys.get(tool)
        if keys is None:
            params = self.params.get(tool, {}) or {}
            keys = self._keys[tool] = (schema_properties(params), schema_required(params))
        return keys

    def properties(self, name: str | None) -> dict:
        return self._keys_of(name)[0]

    def required(self, name: str | None) -> list[str]:
        return self._keys_of(name)[1]

    def free(self, name: str | None) -> bool:
        """A call of a tool no schema describes: its argument names and types are unknown."""
        return bool(name) and self.resolve(name) is None


class CallTracker:
    """Incremental, deterministic parser of the assistant's output. With ``root`` (:data:`RESPONSE`)
    the output's top-level object is the structured answer, followed as a call's arguments."""

    def __init__(self, tools: ToolIndex, root: str | None = None, layouts: tuple[Layout, ...] = LAYOUTS):
        self.tools, self.root = tools, root
        self.layouts = layouts  # the target's layout family (``layouts_for``)
        self.text = ""
        self.stack: list[Frame] = []
        self.in_str: str | None = None  # None | "key" | "value"
        self.buf = ""  # current string (raw) or scalar
        self.esc = False
        self.in_scalar = False
        self.since = ""  # raw text since the last structural event
        self.line_indent = 0
        self.at_line_start = True
        self.layout: Layout | None = None  # layout of the current / last call
        self.calls: list[dict] = []  # finished calls: {"name", "keys"}
        self.name: str | None = None  # tool name of the current call
        self.pretty: bool | None = None
        self.indent_unit = 2
        self.kv_sep = ": "
        self.item_sep = ", "
        self.event = ""  # last structural character seen in JSON
        self.after_json = False  # a call (or list of calls) just closed; closer may follow
        self.text_since_json = ""
        self.objects = KeyIndex()  # finished objects of the output (keys of objects no schema describes follow them)

    def fork(self) -> "CallTracker":
        """A copy to feed text that is only drafted (a value copied from the context, closed) and
        ask what follows, leaving this tracker as it is. Frames and calls are copied; the index of
        finished objects is shared, so feed a fork nothing that closes an object."""
        t = copy.copy(self)
        t.stack = [replace(f, keys=list(f.keys)) for f in self.stack]
        t.calls = list(self.calls)
        return t

    # ---- feeding ----
    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)
        self.text += text

    def _char(self, ch: str) -> None:
        if ch == "\n":
            self.line_indent, self.at_line_start = 0, True
        elif ch == " " and self.at_line_start:
            self.line_indent += 1
        else:
            self.at_line_start = False
        if not self.stack:
            self._text_char(ch)
            return
        if self.in_str is not None:
            self._str_char(ch)
            return
        if self.in_scalar:
            if ch in ",}] \n\t\r":
                self._end_value()
            else:
                self.buf += ch
                return
        self._json_char(ch)

    def _text_char(self, ch: str) -> None:
        if ch in "{[" and self._json_may_start():
            self.layout = opened_by(self.text_since_json, self.layouts)
            self.after_json = False
            self._open(ch)
            return
        self.text_since_json += ch
        self.since += ch

    def _json_may_start(self) -> bool:
        before = self.text_since_json
        stripped = before.rstrip(" \t")
        return stripped == "" or stripped.endswith(("\n", "<tool_call>", PYTHON_TAG))

    def _str_char(self, ch: str) -> None:
        if self.esc:
            self.esc = False
            self.buf += ch
        elif ch == "\\":
            self.esc = True
            self.buf += ch
        elif ch == '"':
            kind, s = self.in_str, self.buf
            self.in_str, self.buf = None, ""
            top = self.stack[-1]
            if kind == "key":
                top.key = s
                top.keys.append(s)
                top.expect = "colon"
            else:
                if top.role == "call" and top.key == "name":
                    self.name = s
                self._end_value()
            self.since = ""
        else:
            self.buf += ch

    def _json_char(self, ch: str) -> None:
        top = self.stack[-1]
        if ch in " \n\t\r":
            self.since += ch
            return
        if ch == '"':
            self._learn_style(top)
            if top.kind == "obj" and top.expect == "key":
                self.in_str = "key"
            else:
                self.in_str = "value"
                self._note_value_start()
            self.buf, self.since = "", ""
        elif ch == ":":
            self.event = ":"
            top.expect = "value"
            self.since = ""
        elif ch == ",":
            self.event = ","
            top.expect = "key" if top.kind == "obj" else "value"
            top.key = None if top.kind == "obj" else top.key
            self.since = ""
        elif ch in "{[":
            self._note_value_start()
            self._open(ch)
        elif ch in "}]":
            self._close()
        else:
            self._note_value_start()
            self.in_scalar, self.buf = True, ch
            self.since = ""

    def _learn_style(self, top: Frame) -> None:
        """Whitespace after '{' / ',' tells pretty vs compact, the indent unit and separators."""
        if self.event in "{[" and top.role in ("call", "args"):
            if "\n" in self.since:
                self.pretty = True
                self.indent_unit = max(1, len(self.since.split("\n")[-1]) - top.indent)
            else:
                self.pretty = False
        elif self.event == "," and not self.pretty and top.role in ("call", "args"):
            self.item_sep = "," + self.since

    def _note_value_start(self) -> None:
        """The whitespace between a colon and its value is the output's key-value separator
        (none in compact JSON)."""
        if self.stack and self.stack[-1].expect == "value" and self.stack[-1].kind == "obj":
            self.kv_sep = ":" + self.since

    def _open(self, ch: str) -> None:
        parent = self.stack[-1] if self.stack else None
        kind = "obj" if ch == "{" else "arr"
        if parent is None and self.root is not None and kind == "obj":
            role, self.name = "args", self.root
        elif parent is None:
            role = "call" if kind == "obj" else "calls"
        elif parent.role == "calls" and kind == "obj":
            role = "call"
        elif parent.role == "call" and parent.key in ("arguments", "parameters") and kind == "obj":
            role = "args"
        else:
            role = "value"
        schema = None
        if role == "args":
            schema = self.tools.params_of(self.name)
        elif parent is not None and parent.role in ("args", "value") and parent.schema is not None:
            ps = parent.schema
            schema = schema_properties(ps).get(parent.key or "") if parent.kind == "obj" else schema_items(ps)
        if role == "call":
            self.name = None
        parent_key = (parent.key if parent.kind == "obj" else parent.parent_key) if parent is not None else None
        self.stack.append(
            Frame(kind, role, self.line_indent, schema, "key" if kind == "obj" else "value", parent_key=parent_key)
        )
        self.since, self.event = "", ch

    def _close(self) -> None:
        frame = self.stack.pop()
        if frame.kind == "obj":
            self.objects.add(frame.parent_key, frame.keys)
        if frame.role == "call":
            self.calls.append({"name": self.name, "keys": list(frame.keys)})
        if self.stack:
            self.stack[-1].expect = "next"
        else:
            self.after_json, self.text_since_json = True, ""
        self.since = ""
        if self.pretty is None and frame.role in ("call", "args"):
            self.pretty = False

    def _end_value(self) -> None:
        self.in_scalar, self.buf = False, ""
        if self.stack:
            self.stack[-1].expect = "next"
        self.since = ""

    # ---- derived state ----
    def frame(self, role: str) -> Frame | None:
        for f in reversed(self.stack):
            if f.role == role:
                return f
        return None

    @property
    def state(self) -> str:
        if not self.stack:
            return END if self.after_json else TEXT
        top = self.stack[-1]
        if top.role == "call":
            if self.in_str == "value" and top.key == "name":
                return TOOL_NAME
            return CALL_KEY
        if top.role == "args":
            if self.in_str == "key" or top.expect == "key":
                return ARG_NAME
            if top.expect == "next":
                return BETWEEN
            return VALUE if self.in_str or self.in_scalar else CALL_KEY
        return VALUE if top.role == "value" else CALL_KEY
