"""Schema-aware continuations: from an FSM position, every text the tool schemas allow next.

``continuations`` returns candidate continuations, each a list of segments (text or raw token
ids, with the FSM state as label) and a probability. Shared prefixes are merged later, when the
candidates are tokenized into one draft tree. Fixed text (braces, keys, separators, closers)
has probability 1 inside a candidate; branch points (which tool, which argument, which enum
value, close or continue) split the probability. The expansion is a graph (``Graph``) a request
builds as its steps reach it (``_Builder``) and each step walks from its FSM position (``_Walk``;
``drafters/kernels/cand_walk.c`` is its compiled twin).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

from toolspec_core.drafters.base import LabelRates
from toolspec_core.drafters.toolcall.compiled import CompiledTools
from toolspec_core.drafters.toolcall.fsm import CallTracker, Frame, ToolIndex
from toolspec_core.drafters.toolcall.objkeys import CLOSE, KeyIndex, key_candidates
from toolspec_core.drafters.toolcall.schema import enum_values, variants
from toolspec_core.drafters.toolcall.schema import properties as schema_properties
from toolspec_core.drafters.toolcall.values import date_values, numbers_for, wants_date
from toolspec_core.drafters.tree_kernel import load_walk
from toolspec_core.spec.labels import (
    ARG_NAME,
    CALL_KEY,
    DERIVED,
    END,
    NEXT_CALL,
    OBJ_KEY,
    OPENER,
    OWN_CALL,
    RETRIEVAL,
    TOOL_NAME,
    VALUE,
)
from toolspec_core.spec.layouts import BARE, BARE_PRETTY, Layout

Seg = tuple  # (text: str | tuple[int, ...], label: str): hashable, so a candidate is a cache key

# Branch probabilities of schema drafting. They are hand-set, not fitted: a node's conf is its
# share of its parent's mass times its label's learned acceptance rate (``candidates_to_tree``),
# so these decide how the mass splits where the schema allows several continuations, and the
# learned rates correct their overall level.
CALL_START_PRIOR = 0.5  # P(an output opens with a call) before any is served: no lean (tools offered, prose common)
PROSE_AFTER_PRIOR = 0.3  # P(prose follows a call's text closer) before any is served: most turns end at the call
COUNT_PRIOR = 1.0  # pseudo-count of every offered tool and layout (add-one): one never seen yet is still drafted
NEW_VALUE_CALLS = 1  # pseudo-call with a value no past call passed: values seen in every call still leave room
OUTPUT_KEYS_WEIGHT = 3.0  # the output's own objects repeat more often than the conversation's
FREE_MORE = 0.5  # a call of an unknown tool (``ToolIndex.free``): chance of another argument
FREE_KEY_END = 0.5  # an unknown tool's key being typed ends here: no schema to say, so even odds
OWN_SHARE = 0.5  # of a next call's tool-name mass: the tools this output already called (repeats, parallel calls)
SEEN_SHARE = 0.9  # at most this much of a value's mass goes to values seen in past / earlier calls
DATE_SHARE = 0.5  # of a value's mass left after seen values: the conversation's dates (half; typed openings the rest)
REQUIRED_WEIGHT = 3.0  # a required argument not yet written, against an optional one: calls rarely leave one out
SCHEMA_ORDER_WEIGHT = 2.0  # an argument after the last one written in the schema's order: models tend to keep it
PAST_ORDER_WEIGHT = 8.0  # times the share of past calls of the tool that wrote it next: a seen order beats the schema's
NUMBER_SHARE = 0.6  # of a number's mass: the conversation's numbers by rank; the rest for one it does not mention
DATE_TEXT_SHARE = 0.6  # inside a string: the dates whose rendering continues it, by rank; the rest for other text
BRACKET_OPENS = 0.9  # an array / object value opens with its bracket: near certain, hedged a little below a quote's 1
MORE_REQUIRED = 0.9  # after a value, P(another argument) while a required one is missing: calls rarely stop short
MORE_OPTIONAL = 0.35  # ... when only optional ones are left: calls more often stop at the required ones
STRING_ENDS = 0.15  # a string value ends at this token: strings usually go on (low prior; the budget decides)
NUMBER_ENDS = 0.3  # a number being written ends at this token: digits come a token each (Qwen), so most go on
CLOSER_GOES_ON = 0.9  # a layout closer the output has begun (or is due) is written out, then what follows it
NEXT_OBJECT = 0.15  # after a bare call's '}': P(a new line and another object) -- the rest: end of turn
NEXT_OBJECT_AFTER_NEWLINE = 0.7  # the same once the new line is written
AFTER_PROSE = 0.15  # P(a call opens | a new line of prose)
ANNOUNCED = 0.5  # ... when the prose ended with a colon ("Here's the call:\n\n")
SEEN_KEY = 0.7  # a key of an undescribed object being typed continues as a key seen before (by their shares)
KEY_ENDS = 0.3  # ... or ends here (keys end at token boundaries more often than not)
KEY_ENDS_UNSEEN = 0.5  # ... ends here when no seen key continues it: even odds
NEXT_RECORD = 0.5  # after an array's object element: another record like it or the array's end, even odds


@dataclass
class Cand:
    segs: list[Seg]
    prob: float


@dataclass
class Priors:
    """Branch probabilities learned across requests (tool and layout frequencies, how outputs
    begin and what follows a call's closer)."""

    tool_counts: dict[str, float] = field(default_factory=dict)
    layout_counts: dict[str, float] = field(default_factory=dict)
    version: int = 0  # counts the changes (``SchemaMethod.observe``): expansion graphs are per version
    # P(an output opens with a call), P(text follows a call's closer that is text): learned from the
    # outputs served (``SchemaMethod.observe``), starting from these priors
    events: LabelRates = field(
        default_factory=lambda: LabelRates({"call_start": CALL_START_PRIOR, "prose_after": PROSE_AFTER_PRIOR})
    )

    @property
    def call_start(self) -> float:
        return self.events.rate("call_start")

    @property
    def prose_after(self) -> float:
        return self.events.rate("prose_after")

    def tool_weights(self, names: list[str]) -> list[float]:
        w = [COUNT_PRIOR + self.tool_counts.get(n, 0.0) for n in names]
        s = sum(w)
        return [x / s for x in w]

    def layout_weights(self, layouts: list[Layout]) -> list[float]:
        w = [COUNT_PRIOR + self.layout_counts.get(lay.name, 0.0) for lay in layouts]
        s = sum(w)
        return [x / s for x in w]


def _past_values(past: list[tuple[str, dict]], name: str, key: str) -> list[tuple[object, float]]:
    """Distinct scalar values past calls of ``name`` passed as ``key``, with their share of those calls."""
    vals = [
        a[key] for n, a in past if n == name and isinstance(a, dict) and isinstance(a.get(key), (str, int, float, bool))
    ]
    n_calls = sum(1 for n, _ in past if n == name)
    out: dict[str, tuple[object, int]] = {}
    for v in vals:
        k = _json_scalar(v)
        out[k] = (v, out.get(k, (v, 0))[1] + 1)
    return sorted(((v, c / (n_calls + NEW_VALUE_CALLS)) for v, c in out.values()), key=lambda x: -x[1])


class _Cut(list):
    """No continuations because all were left out as below the floor (``_Walk.under``): unlike
    an empty list, not "nothing follows"."""


_NO_SCHEMA: dict = {}  # an argument without a schema: one object, so its nodes are shared

SLACK = 1e-9  # relative margin on the floor: a bound multiplies in another order than the candidate's prob

# The expansion as a graph (``Graph``): a node is a flat tuple of instructions (``flat``), each
# (kind, prob, child, op, slot, segs, nonempty) -- ``segs`` the segments it writes (a tuple of
# Seg), ``nonempty`` whether any of them writes something, ``child`` the node it expands (a node
# id) at the level ``op`` says. The walk carries the levels left (``levels`` at the root): what a
# node drafts does not depend on them, only how far down the walk goes, so a node serves every
# depth it is reached at.
SEQ = 0  # segs, then each candidate of ``child`` expanded under factor prob; segs alone (a leaf) if none
SEQ_LEAF = 1  # segs alone, a leaf with prob (nothing follows)
SHARED = 2  # ``child`` expanded under prob once, kept in ``slot`` for the SEQ_SHAREDs after it
SEQ_SHARED = 3  # as SEQ, with the candidates kept in ``slot``
LEAF = 4  # a leaf: one of the floor's probabilities
CAND = 5  # a candidate that is not one of the floor's (keys of undescribed objects)
MUL = 6  # ``child`` expanded under prob, each candidate's probability times prob
DIV = 7  # ``child`` expanded under 1 / prob, each candidate's probability divided by prob (a count)
INLINE = 8  # ``child``'s candidates as they are
GUARD = 9  # at level -1 the rest of the node is nothing (the levels are spent)
WIDTH = 7  # fields an instruction

# the level a child is walked at (``op``)
SAME = 0  # the parent's
DOWN = 1  # one less
DOWN_IF = 2  # one less where the parent's is above 0; at 0 the branch ends there (SEQ: a leaf; SHARED: no tails)
ZERO = 3  # 0


class _Ref(NamedTuple):
    """A child of an instruction: its node id and the level it is walked at (``SAME`` ... ``ZERO``)."""

    node: int
    op: int


_REF = "\x00ref"  # (_REF, k): an object of a node's arguments, ``Graph.refs[k]`` (a plain tuple: see ``Graph``)


class _Shared:
    """An expansion several branches follow with (``_Builder.shared``): emitted once, before the
    first of them."""

    __slots__ = ("prob", "child", "slot", "emitted")

    def __init__(self, prob: float, child: _Ref, slot: int):
        self.prob, self.child, self.slot, self.emitted = prob, child, slot, False


STYLE = ("pretty", "indent_unit", "kv_sep", "item_sep", "root", "call_indent", "in_calls", "calls", "own", "priors")


def style(tr: CallTracker, priors: Priors, own) -> tuple:
    """What the builder's nodes read of the tracker and the request beyond their arguments, the
    fields ``STYLE`` names: the output's JSON style, the call being written (its indent, whether
    inside a calls array, whether a call has finished), this output's finished calls (``own``)
    and the priors' version. A node records what it read (``Graph.sync``). The step's own
    position (the text being typed, the separator just written) is read by the step's
    instructions only, never a node's."""
    call = tr.frame("call")
    return (
        tr.pretty,
        tr.indent_unit,
        tr.kv_sep,
        tr.item_sep,
        tr.root,
        call.indent if call is not None else None,
        tr.frame("calls") is not None,
        bool(tr.calls),
        own,
        priors.version,
    )


_FIELD = {f: k for k, f in enumerate(STYLE)}


def _same(a, b) -> bool:
    return a is b or a == b


_PLAIN = (str, int, float, bool, tuple)  # node arguments kept as they are (``used``: a tuple of names)


def _base(key) -> str:
    """The ``style`` field a read (``_Builder.read``) depends on."""
    return key if key.__class__ is str else "pretty" if key[0] == "pretty" else "own"


def style_value(style: tuple, key):
    """What a node read (``_Builder.read``): a ``style`` field, or a value derived from one --
    ("pretty", default): whether a layout is written pretty-printed (the output's own style once
    it shows, else the layout's ``default``); ("own_tools", names): how often this output called each of
    ``names``; ("own_values", tool, key): the values its calls of ``tool`` passed as ``key``;
    ("own_next", tool): the argument orders of its calls of ``tool``. A node depends on no more
    than it used, so an output that turns out compact, or a finished call of another tool, does
    not build it again."""
    if key.__class__ is str:
        return style[_FIELD[key]]
    kind = key[0]
    if kind == "pretty":
        pretty = style[0]
        return pretty if pretty is not None else key[1]
    own = style[8]
    if kind == "own_tools":
        return tuple(sum(1 for n, _ in own if n == x) for x in key[1])
    if kind == "own_values":
        return tuple((_json_scalar(v), share) for v, share in _past_values(own, key[1], key[2]))
    return tuple(tuple(a) for n, a in own if n == key[1] and isinstance(a, dict))  # own_next


class Graph:
    """The expansion graph of one request's candidate builder, built as walks reach its nodes.

    Node ``i`` is ``nodes[i]`` (a tuple of instructions), or None until a walk reaches it:
    ``build(i)`` then runs the builder method it stands for (``thunks[i]``) with the step's
    builder. A node is named by its method and arguments (``index``), so every branch that leads
    to the same structure (the arguments after a value, whichever value it was; the same
    structure at another depth) shares it, and later steps find it built: the schemas, the
    request's past calls, values and the priors are expanded once, each step only walks. A node
    also records the ``style`` fields it read; when one of them changes (``sync``: the call
    closes, the priors move), only the nodes that read it are built again.

    Its tables hold plain tuples, strings and numbers only (the objects nodes' arguments name
    sit in ``refs``), which the garbage collector stops following once it has seen them, so a
    request's graph adds little to a full collection however long the request lives.
    """

    __slots__ = (
        "nodes",
        "thunks",
        "index",
        "refs",
        "ref_index",
        "slots",
        "builder",
        "style",
        "reads",
        "deps",
        "readers",
    )

    def __init__(self):
        self.nodes: list[tuple | None] = []
        self.thunks: list[tuple] = []  # (builder method's name, *its arguments) per node
        self.index: dict[tuple, int] = {}
        self.refs: list = []  # the objects nodes' arguments name (schemas, layouts), each once
        self.ref_index: dict[int, int] = {}  # id(object) -> its index in ``refs`` (which holds it)
        self.slots = 0  # SHARED slots handed out
        self.builder: _Builder | None = None  # the step's: nodes are built with it
        self.style: tuple | None = None  # the step's ``style``
        self.reads: dict | None = None  # what the node being built has read (``style_value``'s keys), with the values
        self.deps: list[dict] = []  # per node: what it read, with the values then
        self.readers: dict[str, set[int]] = {}  # per ``style`` field: the nodes that read it or a value derived from it

    def node(self, name: str, args: tuple) -> int:
        key = [name]
        for a in args:
            if a.__class__ not in _PLAIN and a is not None:
                a = self._ref(a)
            key.append(a)
        key = tuple(key)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.nodes)
            self.nodes.append(None)
            self.thunks.append(key)
            self.deps.append({})
        return i

    def _ref(self, obj) -> tuple:
        k = self.ref_index.get(id(obj))
        if k is None:
            k = self.ref_index[id(obj)] = len(self.refs)
            self.refs.append(obj)
        return (_REF, k)

    def build(self, i: int) -> tuple:
        instrs = self.nodes[i]
        if instrs is None:
            name, *args = self.thunks[i]
            for k, a in enumerate(args):
                if a.__class__ is tuple and a and a[0] is _REF:
                    args[k] = self.refs[a[1]]
            self.reads = reads = {}
            try:
                instrs = flat(getattr(self.builder, name)(*args))
            finally:
                self.reads = None
            self.deps[i] = reads
            for key in reads:
                self.readers.setdefault(_base(key), set()).add(i)
            self.nodes[i] = instrs
        return instrs

    def sync(self, style: tuple) -> None:
        """The step's ``style``: nodes built under another value of what they read are built
        again when next reached."""
        old, self.style = self.style, style
        if old is None or old == style:
            return
        for f, before, v in zip(STYLE, old, style):
            if _same(before, v):
                continue
            for i in self.readers.get(f, ()):
                if self.nodes[i] is not None and any(
                    _base(key) == f and not _same(style_value(style, key), was) for key, was in self.deps[i].items()
                ):
                    self.nodes[i] = None


class _Walk:
    """Walks a graph from a root: the candidates, expanded under the floors and the levels (the
    Python reference of ``cand_walk.c``'s ``walk``, bit for bit).

    Bounded expansion (``keep``): only the ``keep`` most probable candidates are returned, so a
    branch whose candidates are all less probable than ``keep`` candidates already expanded is
    not expanded. Every factor of a candidate's probability is at most 1, so a branch's bound is
    the product of the factors above it (``mult``); the floor is the ``keep``-th largest
    probability of the leaves expanded so far (``best``). A cut branch still counts as
    non-empty (``cuts``): its parent must not become a candidate of its own. The result after
    the cut (``continuations``) is the full expansion's, candidate for candidate and in order.

    The budget's floor (``min_prob``) is another matter: a branch whose bound is below it is not
    expanded at all, and its parent's segments end a candidate with the branch's probability, as
    where the levels run out -- its nodes could not be kept, but the mass it adds to the nodes
    above it counts. The expansion is then that of a shallower tree, bounded or not alike.
    """

    def __init__(self, graph: Graph, keep: int, min_prob: float, levels: int):
        self.graph, self.keep, self.min_prob = graph, keep, min_prob
        self.lv = levels  # levels left below the node being walked
        self.mult = 1.0  # product of the probability factors above the branch being expanded
        self.best: list[float] = []  # min-heap: the ``keep`` largest leaf probabilities so far
        self.cuts = 0  # branches left out as below the floor

    def below(self, prob: float) -> bool:
        """Whether every candidate of a branch with factor ``prob`` here is below the floor."""
        if not self.keep:
            return False
        floor = self.best[0] if len(self.best) >= self.keep else 0.0
        if self.mult * prob * (1.0 + SLACK) < floor:
            self.cuts += 1
            return True
        return False

    def leaf(self, segs: tuple, nonempty: bool, prob: float) -> Cand:
        """A candidate nothing follows; its probability (times ``mult``, the factors above it) is
        one of the floor's, so every factor a caller multiplies in later is in ``mult`` already."""
        if self.keep and nonempty:
            p = self.mult * prob
            if p > 0:
                (heapq.heappush if len(self.best) < self.keep else heapq.heappushpop)(self.best, p)
        return Cand(list(segs), prob)

    def under(self, prob: float, child: int, op: int) -> list:
        """``child`` expanded with factor ``prob`` above it (for a list several branches share, the
        largest of their factors); a ``_Cut`` where all of it was below the floor."""
        if self.below(prob):
            return _Cut()
        if self.mult * prob < self.min_prob:
            return []  # below the budget's floor: nothing follows, the caller's segments carry the mass
        outer, cuts, lv = self.mult, self.cuts, self.lv
        self.mult = outer * prob
        self.lv = lv if op == SAME else 0 if op == ZERO else lv - 1
        out = self.run(self.graph.build(child))
        self.mult, self.lv = outer, lv
        return out if out or self.cuts == cuts else _Cut()

    def then(self, segs: tuple, nonempty: bool, prob: float, tails: list) -> list[Cand]:
        if not tails:
            if tails.__class__ is _Cut:
                return []  # what follows was cut: every candidate here is below the floor
            return [self.leaf(segs, nonempty, prob)]
        return [Cand(list(segs) + t.segs, prob * t.prob) for t in tails]

    def run(self, instrs) -> list[Cand]:
        out: list[Cand] = []
        shared: dict[int, list] = {}
        for j in range(0, len(instrs), WIDTH):
            kind, prob, child, op, slot, segs, nonempty = instrs[j : j + WIDTH]
            spent = op == DOWN_IF and self.lv <= 0  # the branch ends here: no levels left below
            if kind == SEQ:
                if spent:
                    if not self.below(prob):
                        out.append(self.leaf(segs, nonempty, prob))
                else:
                    out += self.then(segs, nonempty, prob, self.under(prob, child, op))
            elif kind == SEQ_LEAF:
                if not self.below(prob):
                    out.append(self.leaf(segs, nonempty, prob))
            elif kind == SHARED:
                shared[slot] = [] if spent else self.under(prob, child, op)
            elif kind == SEQ_SHARED:
                if not self.below(prob):
                    out += self.then(segs, nonempty, prob, shared[slot])
            elif kind == LEAF:
                out.append(self.leaf(segs, nonempty, prob))
            elif kind == CAND:
                out.append(Cand(list(segs), prob))
            elif kind == MUL:
                out += [Cand(c.segs, c.prob * prob) for c in self.under(prob, child, op)]
            elif kind == DIV:
                out += [Cand(c.segs, c.prob / prob) for c in self.under(1.0 / prob, child, op)]
            elif kind == INLINE:
                out += self.run(self.graph.build(child))
            elif self.lv < 0:  # GUARD
                break
        return out


def walk(graph: Graph, root, keep: int, min_prob: float, max_cands: int, levels: int) -> list[Cand]:
    """The candidates of ``root`` (instructions) over ``graph``: non-empty, most probable first,
    at most ``max_cands`` (``_Walk``; ``cand_walk.c`` is its compiled twin)."""
    cands = _Walk(graph, keep, min_prob, levels).run(root)
    cands = [c for c in cands if c.prob > 0 and any(s[0] for s in c.segs)]
    cands.sort(key=lambda c: -c.prob)
    return cands[:max_cands]


def flat(instrs: list[tuple]) -> tuple:
    """A node's instructions as one tuple, ``WIDTH`` fields each: one object a node, not one an
    instruction, for the garbage collector to count and walk."""
    return tuple(chain.from_iterable(instrs))


def _listed(xs) -> list:
    return xs if xs.__class__ is list else list(xs)


def _instr(kind: int, prob: float = 1.0, segs=(), child: tuple = (-1, SAME), slot: int = -1) -> tuple:
    segs = tuple(segs)
    nonempty = False
    for s in segs:
        if s[0]:
            nonempty = True
            break
    return (kind, prob, child[0], child[1], slot, segs, nonempty)


class _Builder:
    """Emits the expansion graph for one tracker position; small helpers, one per structure, each
    returning its node's instructions. What follows a structure is a node of its own
    (``node``: built when a walk first reaches it, shared by every branch that leads to it), so
    a step builds only the instructions of its own position (``build``) and walks the rest.
    Every read of the tracker's style, this output's calls or the priors goes through ``read``
    (the node's dependencies); the request's fixed inputs (tools, past calls, dates, numbers,
    tables, ``eos``) are the same every step.
    """

    def __init__(
        self,
        tr: CallTracker,
        tools: ToolIndex,
        priors: Priors,
        eos: list[int],
        past=(),
        dates=(),
        context_keys: KeyIndex | None = None,
        own=(),
        numbers=(),
        tables: CompiledTools | None = None,
        past_memo: dict | None = None,
        graph: Graph | None = None,
        layouts: tuple | None = None,
    ):
        self.tr, self.tools, self.priors, self.eos = tr, tools, priors, eos
        # the tool set's compiled schema answers (None: the schema functions, every step)
        self.tables = tables
        # ``_past_values`` of ``past`` by (tool, key): the past calls are the request's, fixed for
        # its whole decode, so the drafter keeps this across steps (None: computed every time)
        self.past_memo = past_memo
        self.numbers = _listed(numbers)  # numbers the conversation mentions (values.context_numbers)
        self.past = _listed(past)  # (tool name, arguments) of retrieved past calls
        self.own = _listed(own)  # (tool name, arguments) of the calls this output has finished
        self.dates = _listed(dates)  # dates the conversation mentions (values.context_dates)
        self.objects = ([(context_keys, 1.0)] if context_keys is not None else []) + [(tr.objects, OUTPUT_KEYS_WEIGHT)]
        self.layouts = layouts  # the layouts an output may open with (None: the tracker's family)
        self.graph = graph if graph is not None else Graph()
        self.graph.builder = self
        self.graph.sync(style(tr, priors, own))

    # ---- instructions ----
    def node(self, fn, *args, op: int = SAME) -> _Ref:
        """The node of ``fn(*args)`` (a method of this builder), built when a walk reaches it, and
        the level it is walked at (``op``: the walk's levels, ``SAME`` ... ``ZERO``)."""
        return _Ref(self.graph.node(fn.__name__, args), op)

    def down(self, fn, *args) -> _Ref:
        """``node`` one level down (unconditionally: the node itself ends at level -1, ``guard``)."""
        return self.node(fn, *args, op=DOWN)

    def deeper(self, fn, *args) -> _Ref:
        """``node`` one level down where levels are left; where not, the branch ends (a leaf)."""
        return self.node(fn, *args, op=DOWN_IF)

    @staticmethod
    def guard() -> list[tuple]:
        """Nothing of this node at level -1 (the levels are spent)."""
        return [_instr(GUARD)]

    def leaf(self, segs: list[Seg], prob: float) -> tuple:
        return _instr(LEAF, prob, segs)

    def cand(self, segs: list[Seg], prob: float) -> tuple:
        return _instr(CAND, prob, segs)

    def shared(self, prob: float, child: _Ref) -> _Shared:
        """``child`` expanded once under ``prob`` (the largest factor of the branches that follow
        with it: ``seq`` with this as ``tails``)."""
        self.graph.slots += 1
        return _Shared(prob, child, self.graph.slots)

    def scaled(self, prob: float, child: _Ref) -> list[tuple]:
        """``child``'s candidates, expanded under ``prob`` and their probabilities times it."""
        return [_instr(MUL, prob, child=child)]

    def inline(self, child: _Ref) -> list[tuple]:
        return [_instr(INLINE, child=child)]

    def read(self, key):
        """A field of the step's ``style`` or a value derived from one (``style_value``), recorded
        as read by the node being built (``Graph.sync``)."""
        graph = self.graph
        value = graph.style[_FIELD[key]] if key.__class__ is str else style_value(graph.style, key)
        reads = graph.reads
        if reads is not None:
            reads[key] = value
        return value

    def tool_weights(self, names: list[str]) -> list[float]:
        """Learned tool frequencies, half the mass moved to the tools this output already called."""
        self.read("priors")
        w = self.priors.tool_weights(names)
        self.read(("own_tools", tuple(names)))
        own = [n for n, _ in self.own if n in names]
        if not own:
            return w
        return [(1 - OWN_SHARE) * x + OWN_SHARE * own.count(n) / len(own) for n, x in zip(names, w)]

    def seen_values(self, name: str, key: str) -> list[tuple[object, float, str]]:
        """(value, share, label) of the values retrieved past calls and this output's earlier calls
        of ``name`` passed as ``key``; shares scaled to at most ``SEEN_SHARE`` together."""
        memo = self.past_memo
        if memo is None:
            past = _past_values(self.past, name, key)
        else:
            past = memo.get((name, key))
            if past is None:
                past = memo[(name, key)] = _past_values(self.past, name, key)
        seen = [(v, s, RETRIEVAL) for v, s in past]
        self.read(("own_values", name, key))
        seen += [(v, s, OWN_CALL) for v, s in _past_values(self.own, name, key)]
        total = sum(s for _, s, _ in seen)
        scale = SEEN_SHARE / total if total > SEEN_SHARE else 1.0
        return [(v, s * scale, lab) for v, s, lab in seen]

    def derived(self, key: str, schema: dict) -> list[str]:
        """Context dates rendered for a string argument that may hold one (most likely first)."""
        if not self.dates:
            return []
        if self.tables is not None:
            string = self.tables.date_string(key, schema)
            return date_values(self.dates, string) if string is not None else []
        strings = [v for v in variants(schema) if v.get("type", "string") == "string" and "enum" not in v]
        if not strings or not wants_date(key, strings[0]):
            return []
        return date_values(self.dates, strings[0])

    # ---- style ----
    def pretty(self, layout: Layout | None) -> bool:
        return self.read(("pretty", bool(layout and layout.pretty)))

    @property
    def indent_unit(self) -> int:
        return self.read("indent_unit")

    @property
    def kv_sep(self) -> str:
        return self.read("kv_sep")

    def ws_in(self, indent: int, layout=None) -> str:
        return "\n" + " " * (indent + self.indent_unit) if self.pretty(layout) else ""

    def ws_key(self, indent: int, layout=None) -> str:
        """Whitespace before a key: after '{' (ws_in) or after ',' (the item separator's). Reads
        the separator just written: the step's own instructions only, never a node's (``style``)."""
        assert self.graph.reads is None, "ws_key: the step's position, not a node's"
        return self.sep(indent, layout)[1:] if self.tr.event == "," else self.ws_in(indent, layout)

    def ws_close(self, indent: int, layout=None) -> str:
        return "\n" + " " * indent if self.pretty(layout) else ""

    def sep(self, indent: int, layout=None) -> str:
        return "," + ("\n" + " " * (indent + self.indent_unit) if self.pretty(layout) else self.read("item_sep")[1:])

    @staticmethod
    def rest(expected_ws: str, since: str) -> str:
        return expected_ws[len(since) :] if expected_ws.startswith(since) else ""

    # ---- structures (each returns its instructions) ----
    def seq(self, segs: list[Seg], tails, prob: float = 1.0) -> list[tuple]:
        """``segs`` then each candidate of ``tails`` (a node, expanded with ``prob`` above it, or a
        ``shared`` expansion), or ``segs`` alone when nothing follows (``tails`` None)."""
        if tails is None:
            return [_instr(SEQ_LEAF, prob, segs)]
        if tails.__class__ is _Shared:
            out = [] if tails.emitted else [_instr(SHARED, tails.prob, child=tails.child, slot=tails.slot)]
            tails.emitted = True
            return out + [_instr(SEQ_SHARED, prob, segs, slot=tails.slot)]
        return [_instr(SEQ, prob, segs, child=tails)]

    def call_body(
        self, layout: Layout, call_indent: int, label: str | None = None, key: str | None = None
    ) -> list[tuple]:
        """From just after the call's '{': "name": "<tool>", "arguments": {...}. ``key``: the text
        still to write up to the end of the "name" key (default: all of it, after the opening
        whitespace). The head is labelled as the tracker's position says (``head_label``) unless
        ``label`` is given."""
        key = self.ws_in(call_indent, layout) + '"name"' if key is None else key
        head = [(key + self.kv_sep + '"', label or self.head_label())]
        return self.seq(head, self.node(self.tool_names, "", layout, call_indent))

    def tool_names(self, prefix: str, layout: Layout, call_indent: int) -> list[tuple]:
        names = [n for n in self.tools.names if n.startswith(prefix)]
        if not names:
            return []
        out = []
        for name, w in zip(names, self.tool_weights(names)):
            segs = [(name[len(prefix) :] + '"', TOOL_NAME)]
            tail = self.deeper(self.after_name, name, layout, call_indent)
            out += self.seq(segs, tail, w)
        return out

    def after_name(
        self, name: str, layout: Layout, call_indent: int, since: str = "", after_comma: bool = False
    ) -> list[tuple]:
        """From after the tool name's closing quote (or, ``after_comma``, the comma that follows it)."""
        key = layout.args_key if layout else "arguments"
        text = (
            self.rest(self.sep(call_indent, layout)[1:], since)
            if since or after_comma
            else self.sep(call_indent, layout)
        )
        segs = [(text + '"' + key + '"' + self.kv_sep + "{", CALL_KEY)]
        indent = call_indent + self.indent_unit if self.pretty(layout) else 0
        return self.seq(segs, self.node(self.args_open, name, layout, indent))

    def args_open(self, name: str, layout: Layout, args_indent: int, since: str = "") -> list[tuple]:
        free = self.tools.free(name)  # a tool the request does not offer: a key of unknown name, most likely
        if not free and not self.tools.properties(name):
            return self.guard() + self.seq([("}", CALL_KEY)], self.node(self.close_call, layout))
        ws = self.rest(self.ws_in(args_indent, layout), since)
        if free:
            return [self.leaf([(ws + '"', CALL_KEY)], FREE_MORE)]
        return self.seq([(ws + '"', CALL_KEY)], self.node(self.arg_names, name, (), "", layout, args_indent))

    def arg_weights(self, name: str, used: tuple[str, ...], cands: list[str]) -> list[float]:
        props = list(self.tools.properties(name))
        req = set(self.tools.required(name))
        last = props.index(used[-1]) if used and used[-1] in props else -1
        w = []
        follows = self._past_next_args(name, used)
        for a in cands:
            x = REQUIRED_WEIGHT if a in req else 1.0
            if a in props and props.index(a) > last:
                x *= SCHEMA_ORDER_WEIGHT  # models tend to keep the schema's order
            x *= 1.0 + PAST_ORDER_WEIGHT * follows.get(a, 0.0)  # ... and the order earlier calls of this tool used
            w.append(x)
        s = sum(w)
        return [x / s for x in w]

    def _past_next_args(self, name: str, used: tuple[str, ...]) -> dict[str, float]:
        """Share of past calls of ``name`` whose next argument after ``used`` was each name."""
        nxt: dict[str, float] = {}
        self.read(("own_next", name))
        calls = [list(a) for n, a in self.past + self.own if n == name and isinstance(a, dict)]
        for keys in calls:
            rest = [k for k in keys if k not in used]
            if rest:
                nxt[rest[0]] = nxt.get(rest[0], 0.0) + 1.0 / len(calls)
        return nxt

    def arg_names(self, name: str, used: tuple, prefix: str, layout, args_indent: int) -> list[tuple]:
        if self.tools.free(name):  # unknown names: the one being typed may end here (as in ``in_object``)
            return [self.leaf([('"' + self.kv_sep, ARG_NAME)], FREE_KEY_END)] if prefix else []
        props = self.tools.properties(name)
        cands = [a for a in props if a not in used and a.startswith(prefix)]
        out = []
        for a, w in zip(cands, self.arg_weights(name, used, cands)):
            segs = [(a[len(prefix) :] + '"' + self.kv_sep, ARG_NAME)]
            tail = self.deeper(self.value_start, name, used + (a,), props.get(a) or _NO_SCHEMA, layout, args_indent)
            out += self.seq(segs, tail, w)
        return out

    def value_start(self, name, used, schema: dict, layout, args_indent: int) -> list[tuple]:
        """Values earlier calls of this tool passed here, then the typed openings."""
        seen = self.seen_values(name, used[-1]) if used else []
        out = []
        for v, share, label in seen:
            out += self.seq(
                [(_json_scalar(v), label)], self.down(self.after_value, name, used, layout, args_indent), share
            )
        rest = 1.0 - sum(sh for _, sh, _ in seen)
        derived = self.derived(used[-1], schema) if used else []
        if derived:
            shares = _rank_shares(len(derived), DATE_SHARE * rest)
            after = self.shared(shares[0], self.down(self.after_value, name, used, layout, args_indent))
            for v, share in zip(derived, shares):
                out += self.seq([('"', VALUE), (v, DERIVED), ('"', VALUE)], after, share)
            rest *= 1.0 - DATE_SHARE
        alts = self.tables.variants(schema) if self.tables is not None else variants(schema)
        if len(alts) == 1:  # its openings as they are: a 1/1 share (``typed_start``) changes no float and no cut
            return out + self.scaled(rest, self.node(self._typed_start, name, used, alts[0], layout, args_indent))
        return out + self.scaled(rest, self.node(self.typed_start, name, used, schema, layout, args_indent))

    def typed_start(self, name, used, schema: dict, layout, args_indent: int) -> list[tuple]:
        """Typed value openings, the schema's alternatives (``anyOf`` / ``oneOf`` branches, type
        lists) sharing the mass: enum values, booleans, null, numbers from the context, the quote of
        a string, an array's or object's opening."""
        alts = self.tables.variants(schema) if self.tables is not None else variants(schema)
        n = float(len(alts))
        return [_instr(DIV, n, child=self.node(self._typed_start, name, used, v, layout, args_indent)) for v in alts]

    def _typed_start(self, name, used, schema: dict, layout, args_indent: int) -> list[tuple]:
        typ = schema.get("type")
        enum = schema.get("enum")

        def after(top: float):  # what follows the value, shared by its branches (top: their largest factor)
            return self.shared(top, self.deeper(self.after_value, name, used, layout, args_indent))

        if self.tables is not None:  # the opening kind and the enum's JSON, compiled once per tool set
            start = self.tables.start(schema)
            typ, enum = start.kind, start.enum_json
            if typ == "enum":
                vals = list(enum)
                tails = after(1.0 / len(vals))
                return [c for v in vals for c in self.seq([(v, VALUE)], tails, 1.0 / len(vals))]
            typ = "integer" if typ == "number" else typ
        elif isinstance(enum, list) and enum and all(isinstance(e, (str, int, float, bool)) for e in enum):
            vals = [_json_scalar(e) for e in enum]
            tails = after(1.0 / len(vals))
            return [c for v in vals for c in self.seq([(v, VALUE)], tails, 1.0 / len(vals))]
        if typ == "boolean":
            tails = after(0.5)
            return [c for v in ("true", "false") for c in self.seq([(v, VALUE)], tails, 0.5)]
        if typ == "null":
            return self.seq([("null", VALUE)], after(1.0))
        if typ in ("integer", "number"):
            nums = numbers_for(self.numbers, schema)
            shares = _rank_shares(len(nums), NUMBER_SHARE)
            tails = after(shares[0]) if nums else None
            return [c for v, share in zip(nums, shares) for c in self.seq([(v, VALUE)], tails, share)]
        if typ == "string":
            return [self.leaf([('"', VALUE)], 1.0)]
        if typ == "array":
            return [self.leaf([("[", VALUE)], BRACKET_OPENS)]
        if typ == "object":
            return [self.leaf([("{", VALUE)], BRACKET_OPENS)]
        return []

    def after_value(self, name, used, layout, args_indent: int, since: str = "") -> list[tuple]:
        """After an argument value: the next argument, or close arguments + call + layout."""
        props = self.tools.properties(name)
        req = set(self.tools.required(name))
        left = [a for a in props if a not in used]
        missing_req = any(a in req for a in left)
        if self.tools.free(name):
            p_more = FREE_MORE
        elif not left:
            p_more = 0.0
        else:
            p_more = MORE_REQUIRED if missing_req else MORE_OPTIONAL
        out = self.guard()
        if p_more > 0:
            sep = self.sep(args_indent, layout)
            sep = "," + self.rest(sep[1:], since) if since else sep
            out += self.seq(
                [(sep + '"', CALL_KEY)], self.node(self.arg_names, name, used, "", layout, args_indent), p_more
            )
        if p_more < 1:
            ws = self.rest(self.ws_close(args_indent, layout), since)
            out += self.seq([(ws + "}", END)], self.node(self.close_call, layout), 1 - p_more)
        return out

    def close_call(self, layout: Layout | None, since: str = "") -> list[tuple]:
        """From after the arguments' '}' (and ``since``, whitespace already written after it): the
        call's '}', the layout closer, then end of turn (a structured answer: the end of turn)."""
        if self.read("root") is not None:
            return self.end_turn()
        call_indent = self.read("call_indent") or 0
        text = self.rest(self.ws_close(call_indent, layout), since) + "}"
        if not self.read("in_calls") and layout is not None:
            after = (
                self.node(self.after_closer, layout.closer)
                if layout.closer
                else self.node(self.after_bare_call, layout, "")
            )
            return self.seq([(text, END)], after)
        return [self.leaf([(text, END)], 1.0)]

    def after_closer(self, rest: str) -> list[tuple]:
        """The rest of the layout's closer, then the end of the turn -- or, for a closer that is
        text, a paragraph of prose: its first token differs ("``" + "`\\n\\n", not "```"), so
        both are drafted."""
        if not rest:
            return [self.leaf([(tuple(self.eos[:1]), END)], 1.0)]
        self.read("priors")
        p = self.priors.prose_after
        return [self.leaf([(rest, END), (tuple(self.eos[:1]), END)], 1.0 - p), self.leaf([(rest + "\n\n", END)], p)]

    def end_turn(self) -> list[tuple]:
        return [self.leaf([(tuple(self.eos[:1]), END)], 1.0)]

    def answer_open(self) -> list[tuple]:
        """A structured answer from its start: '{' and its keys, compact or pretty-printed."""
        if self.tr.text_since_json.strip():
            return []
        out = []
        for lay in (BARE, BARE_PRETTY):
            out += self.seq([("{", OPENER)], self.node(self.args_open, self.tr.root, lay, 0), 0.5)
        return out

    # ---- entry: from the tracker's current position ----
    def build(self) -> list[tuple]:
        tr = self.tr
        if not tr.stack and tr.root is not None:
            return self.end_turn() if tr.after_json else self.answer_open()
        if not tr.stack:
            return self.closer() if tr.after_json else self.opener()
        top = tr.stack[-1]
        if top.role == "call":
            return self.in_object(top) if self.free_object(top) else self.in_call(top)
        if top.role == "args":
            return self.in_args(top)
        return self.in_object(top) if top.kind == "obj" else self.in_array(top)

    def opener(self) -> list[tuple]:
        text = self.tr.text_since_json
        at_line_start = text == "" or text.endswith("\n")
        # after prose a call starts on a new line, most often once the prose has announced it ("...:\n\n")
        p_line = ANNOUNCED if text.rstrip().endswith(":") else AFTER_PROSE
        out = []
        family = self.tr.layouts
        for lay, w in zip(family, self.priors.layout_weights(family)):
            if self.layouts is not None and lay not in self.layouts:
                continue
            full = lay.opener + "{"
            j = _overlap(text, full) if lay.opener else 0
            if j and not (text[:-j] == "" or text[:-j].endswith("\n")):
                j = 0  # an opener begins a line ("use the `tool`" is inline code, not a fence)
            # an opener is drafted at the very start, to complete one the model has begun, or on a new line after prose
            if j == 0 and not at_line_start:
                continue
            segs = [(full[j:], OPENER)]
            p = w * (self.priors.call_start if text == "" else (1.0 if j > 0 else p_line))
            out += self.seq(segs, self.node(self.call_body, lay, 0), p)
        return out

    def closer(self) -> list[tuple]:
        lay = self.tr.layout
        if lay is None:
            return []
        written = self.tr.text_since_json
        if not lay.closer:
            return self.after_bare_call(lay, written)
        if lay.closer.startswith(written):
            return self.scaled(CLOSER_GOES_ON, self.node(self.after_closer, lay.closer[len(written) :]))
        return []

    def after_bare_call(self, layout: Layout, written: str) -> list[tuple]:
        """After a bare call's '}' and the ``written`` whitespace: the end of the turn, or a new line
        and another object -- a next call (its head learned apart: ``next_call``) or, small models, a
        made-up tool result; both begin with '{"'. Qwen writes "}}\n" as one token, so the new line
        is drafted together with the closing brace."""
        line = written.strip(" \t")
        if line not in ("", "\n"):
            return []
        p = NEXT_OBJECT_AFTER_NEWLINE if line else NEXT_OBJECT
        nxt = self.seq(
            [(self.rest("\n", line) + "{", END)], self.node(self.call_body, layout, 0, NEXT_CALL, op=ZERO), p
        )
        return [self.leaf([(tuple(self.eos[:1]), END)], 1.0 - p)] + nxt

    def in_call(self, f: Frame) -> list[tuple]:
        tr, lay = self.tr, self.tr.layout
        if tr.in_str == "key":
            need = "name" if "name" not in f.keys else (lay.args_key if lay else "arguments")
            if not need.startswith(tr.buf):
                return []
            if need == "name":
                return self.call_body(lay, f.indent, key=need[len(tr.buf) :] + '"')
            return self.seq(
                [(need[len(tr.buf) :] + '"' + self.kv_sep + "{", CALL_KEY)],
                self.node(self.args_open, tr.name, lay, self._args_indent(f, lay)),
            )
        if tr.in_str == "value" and f.key == "name":
            return self.tool_names(tr.buf, lay, f.indent)
        if f.expect == "key" and "name" not in f.keys:
            return self.call_body(lay, f.indent, key=self.rest(self.ws_key(f.indent, lay), tr.since) + '"name"')
        if f.expect == "key" and not any(k in f.keys for k in ("arguments", "parameters")):
            return self.after_name(
                tr.name or "", lay, f.indent, since=tr.since, after_comma=True
            )  # a step may end on the comma
        if f.expect in ("colon", "value") and f.key == "name":
            return self.seq([(self.after_colon(f) + '"', CALL_KEY)], self.node(self.tool_names, "", lay, f.indent))
        if f.expect == "next" and f.key == "name":
            return self.after_name(tr.name or "", lay, f.indent, since=tr.since)
        if f.expect in ("colon", "value") and f.key in ("arguments", "parameters"):
            return self.seq(
                [(self.after_colon(f) + "{", CALL_KEY)],
                self.node(self.args_open, tr.name, lay, self._args_indent(f, lay)),
            )
        if f.expect == "next":
            return self.close_call(lay, since=tr.since) if self.tr.frame("args") is None else []
        return []

    def free_object(self, f: Frame) -> bool:
        """A top-level object that is not a call (its first key is not "name"): a made-up result."""
        if f.keys:
            return f.keys[0] != "name"
        return self.tr.in_str == "key" and not "name".startswith(self.tr.buf)

    def object_keys(self, f: Frame, prefix: str = "") -> list[tuple[str, float]]:
        props = schema_properties(f.schema) if isinstance(f.schema, dict) else {}
        return key_candidates(self.objects, f.parent_key, list(f.keys), prefix, list(props))

    def in_object(self, f: Frame) -> list[tuple]:
        """An object no tool schema describes: its next key (or its end), as the objects seen so far
        suggest. The value is left to value drafting."""
        tr, lay = self.tr, self.tr.layout
        if tr.in_str == "key":
            # a key seen before, or (keys end at token boundaries more often than not) this one ends here
            out = [
                self.cand([(k[len(tr.buf) :] + '"' + self.kv_sep, OBJ_KEY)], SEEN_KEY * p)
                for k, p in self.object_keys(f, tr.buf)
            ]
            return out + (
                [self.cand([('"' + self.kv_sep, OBJ_KEY)], KEY_ENDS if out else KEY_ENDS_UNSEEN)] if tr.buf else []
            )
        if f.expect == "key":
            ws = self.rest(self.ws_key(f.indent, lay), tr.since)
            return [
                self.cand([(ws + '"' + k + '"' + self.kv_sep, OBJ_KEY)], p)
                for k, p in self.object_keys(f)
                if k != CLOSE
            ]
        return self.object_next(f, tr.since) if f.expect == "next" else []

    def object_next(self, f: Frame, since: str) -> list[tuple]:
        """After a value: the separator and the next key, or the object's end."""
        out = []
        for k, p in self.object_keys(f):
            if k == CLOSE:
                out.append(self.cand([(self.rest(self.ws_close(f.indent, self.tr.layout), since) + "}", OBJ_KEY)], p))
            elif not since:
                out.append(self.cand([(self.sep(f.indent, self.tr.layout) + '"' + k + '"' + self.kv_sep, OBJ_KEY)], p))
        return out

    def in_array(self, f: Frame) -> list[tuple]:
        """After an array's object element: the next record with the same first key, or the end."""
        tr, lay = self.tr, self.tr.layout
        if f.expect != "next" or tr.since or f.parent_key not in tr.objects.first:
            return []
        firsts = [(k, p) for k, p in key_candidates([(tr.objects, 1.0)], f.parent_key, []) if k != CLOSE]
        out = [
            self.cand(
                [
                    (
                        self.sep(f.indent, lay)
                        + "{"
                        + self.ws_in(f.indent + self.indent_unit, lay)
                        + '"'
                        + k
                        + '"'
                        + self.kv_sep,
                        OBJ_KEY,
                    )
                ],
                NEXT_RECORD * p,
            )
            for k, p in firsts
        ]
        return out + [self.cand([(self.ws_close(f.indent, lay) + "]", OBJ_KEY)], 1.0 - NEXT_RECORD)]

    def head_label(self) -> str:
        """Label of a call's opening key: a second object after a finished call is learned apart
        (a parallel call for some models, an invented tool result for others)."""
        return NEXT_CALL if self.read("calls") and not self.read("in_calls") else CALL_KEY

    def after_colon(self, f: Frame) -> str:
        """What of the key-value separator (``": "``) is still to come: all of it before the colon,
        the whitespace not yet written after it (a step often ends on a ``":`` token)."""
        if f.expect == "colon":
            return self.kv_sep
        return self.rest(self.kv_sep[1:], self.tr.since)

    def _args_indent(self, call: Frame, lay) -> int:
        return call.indent + self.indent_unit if self.pretty(lay) else 0

    def in_args(self, f: Frame) -> list[tuple]:
        tr, lay = self.tr, self.tr.layout
        name = tr.name or ""
        used = tuple(k for k in f.keys if k is not None)
        if tr.in_str == "key":
            return self.arg_names(name, used, tr.buf, lay, f.indent)  # the key being typed is not in f.keys yet
        if f.expect == "key":
            ws = self.rest(self.ws_key(f.indent, lay), tr.since)
            return self.seq([(ws + '"', CALL_KEY)], self.node(self.arg_names, name, used, "", lay, f.indent))
        schema = self.tools.properties(name).get(f.key or "") or _NO_SCHEMA
        if f.expect == "colon" or (f.expect == "value" and not tr.in_str and not tr.in_scalar):
            ws = self.after_colon(f)  # the separator, or (a step may end on the colon) its space still to come
            starts = self.node(self.value_start, name, used, schema, lay, f.indent)
            return self.seq([(ws, CALL_KEY)], starts) if ws else self.inline(starts)
        if tr.in_str == "value":
            return self.string_value(name, used, schema, lay, f.indent)
        if tr.in_scalar:
            return self.scalar_value(name, used, schema, lay, f.indent)
        if f.expect == "next":
            return self.after_value(name, used, lay, f.indent, since=tr.since)
        return []

    def string_value(self, name, used, schema, lay, indent) -> list[tuple]:
        buf = self.tr.buf
        enum = self.tables.enum_values(schema) if self.tables is not None else enum_values(schema)
        if isinstance(enum, list):
            vals = [e for e in enum if isinstance(e, str) and e.startswith(buf)]
            out = []
            for v in vals:
                out += self.seq(
                    [(v[len(buf) :] + '"', VALUE)],
                    self.down(self.after_value, name, used, lay, indent),
                    1.0 / len(vals),
                )
            return out
        # the string may end here: closing quote + what follows (low prior; the budget decides)
        seen = []
        for v, share, label in self.seen_values(name, used[-1]) if used else []:
            text = _json_scalar(v)[1:] if isinstance(v, str) else ""
            if text.startswith(buf) and len(text) > len(buf) + 1:
                seen.append((text[len(buf) :], label, share))
        derived = [v for v in self.derived(used[-1], schema) if v.startswith(buf) and len(v) > len(buf)] if used else []
        shares = _rank_shares(len(derived), DATE_TEXT_SHARE)
        top = max([STRING_ENDS] + [sh for _, _, sh in seen] + shares)
        after = self.shared(top, self.down(self.after_value, name, used, lay, indent))
        out = self.seq([('"', VALUE)], after, STRING_ENDS)
        for text, label, share in seen:
            out += self.seq([(text, label)], after, share)
        for v, share in zip(derived, shares):
            out += self.seq([(v[len(buf) :], DERIVED), ('"', VALUE)], after, share)
        return out

    def scalar_value(self, name, used, schema, lay, indent) -> list[tuple]:
        buf = self.tr.buf
        for word in ("true", "false", "null"):
            if word.startswith(buf) and word != buf:
                return self.seq([(word[len(buf) :], VALUE)], self.down(self.after_value, name, used, lay, indent))
        return self.scaled(NUMBER_ENDS, self.down(self.after_value, name, used, lay, indent))


def _rank_shares(n: int, total: float) -> list[float]:
    """``total`` split over ``n`` ranked candidates in proportion to 1 / rank."""
    w = [1.0 / (i + 1) for i in range(n)]
    return [total * x / sum(w) for x in w]


def _json_scalar(v) -> str:
    import json

    return json.dumps(v, ensure_ascii=False)


def _overlap(text: str, full: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``full``."""
    for j in range(min(len(text), len(full) - 1), 0, -1):
        if text.endswith(full[:j]):
            return j
    return 0


def continuations(
    tr: CallTracker,
    tools: ToolIndex,
    priors: Priors,
    eos: list[int],
    levels: int = 3,
    max_cands: int = 64,
    past=(),
    dates=(),
    context_keys: KeyIndex | None = None,
    own=(),
    numbers=(),
    bounded: bool = True,
    tables: CompiledTools | None = None,
    past_memo: dict | None = None,
    min_prob: float = 0.0,
    graph: Graph | None = None,
    compiled: bool = True,
    layouts: tuple | None = None,
) -> list[Cand]:
    """Candidate continuations from the tracker's position, most probable first.

    ``past``: (tool name, arguments) of retrieved past calls -- their argument order and values
    become branches, written in the style this output uses (not the style they were stored in).
    ``own``: (tool name, arguments) of the calls this output has finished -- a next call often
    repeats one (small models) or calls the same tool again with other values (parallel calls).
    ``dates``: dates the conversation mentions (``values.context_dates``) -- rendered as date
    arguments are written, they become value branches.
    ``numbers``: numbers the conversation mentions (``values.context_numbers``) -- number arguments
    drafted whole, within the schema's type and bounds.
    ``context_keys``: the conversation's JSON objects (``objkeys.KeyScanner``) -- with the output's
    own (``tr.objects``), the keys of objects no schema describes (made-up results, records) follow them.
    ``bounded``: expand only branches that can reach the ``max_cands`` kept (the same result;
    ``False`` expands every branch, the reference the tests compare against).
    ``min_prob``: the budget's floor (``DraftContext.min_prob``): a branch less probable is not
    expanded; what leads to it ends a candidate there (``_Walk``).
    ``graph``: the request's expansion graph, kept across its steps (None: one for this call; the
    caller passes the same ``past``, ``dates``, ``numbers``, ``tables`` and ``eos`` every step).
    ``compiled``: walk the graph in ``cand_walk.c`` where it is built (else, and as the reference,
    ``walk``). ``layouts``: at an output's start, draft the openers of these only (None: every
    layout of the tracker's family; each keeps its share of the family's).
    """
    graph = graph if graph is not None else Graph()
    b = _Builder(tr, tools, priors, eos, past, dates, context_keys, own, numbers, tables, past_memo, graph, layouts)
    root = flat(b.build())
    keep = max_cands if bounded else 0
    kernel = load_walk() if compiled else None
    if kernel is None:
        return walk(graph, root, keep, min_prob, max_cands, levels)
    found = kernel.walk(root, graph.nodes, graph.build, keep, min_prob, max_cands, levels)
    return [Cand(segs, prob) for prob, segs in found]
