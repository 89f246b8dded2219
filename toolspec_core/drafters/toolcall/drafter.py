"""ToolSpec drafters: schema tree (FSM) + generic value drafting + retrieved past calls, one tree.

Per step: the FSM follows the committed text, ``continuations`` lists what the schemas allow
next, each candidate is tokenized at the boundary into the tree (probability mass per node ->
conditional confidence), generic drafts (suffix matches over the context and the history of
earlier outputs, argument values copied from the context) and retrieved past calls are
trie-merged into the same tree, and the engine's cost-aware budget keeps what pays.
"""

from __future__ import annotations

import threading

from toolspec_core.drafters import tree_kernel
from toolspec_core.drafters.base import LabelRates, add_copies, label_rate_key, rate_key
from toolspec_core.drafters.history import TenantHistories
from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.drafters.suffix import SUFFIX_PRIOR, SuffixDrafter, walk_batch
from toolspec_core.drafters.suffix_trie import SuffixTrie
from toolspec_core.drafters.toolcall.boundary import TAIL_TOKENS, BoundaryTokenizer
from toolspec_core.drafters.toolcall.candidates import Cand, Graph, Priors, continuations
from toolspec_core.drafters.toolcall.compiled import CompiledTools, ToolSetCache
from toolspec_core.drafters.toolcall.fsm import RESPONSE, CallTracker, ToolIndex
from toolspec_core.drafters.toolcall.library import CallLibrary, MemoryLibrary, PastCall, as_past_call
from toolspec_core.drafters.toolcall.objkeys import KeyIndex, KeyScanner
from toolspec_core.drafters.toolcall.parse import parse_tool_calls
from toolspec_core.drafters.toolcall.values import context_dates, context_numbers, digit_run, value_spans
from toolspec_core.engine.detokenize import Detokenizer
from toolspec_core.model.prompting import turn_end_ids
from toolspec_core.spec import labels as lbl
from toolspec_core.spec.layouts import LAYOUTS, LLAMA_LAYOUTS, layout_of, layouts_for
from toolspec_core.spec.proposer import DraftContext, DrafterBase
from toolspec_core.spec.tree import ROOT, DraftTree, VerifyResult

DEFAULT_RATES = {
    lbl.CALL_KEY: 0.97,
    lbl.TOOL_NAME: 0.97,
    lbl.ARG_NAME: 0.97,
    lbl.VALUE: 0.9,
    lbl.END: 0.95,
    lbl.OPENER: 0.9,
    lbl.RETRIEVAL: 0.6,
    lbl.RETRIEVAL + "+": 0.85,
    lbl.OWN_CALL: 0.5,
    lbl.OWN_CALL + "+": 0.85,
    lbl.SPAN: 0.6,
    lbl.SPAN + "+": 0.85,
    lbl.DERIVED: 0.5,
    lbl.DERIVED + "+": 0.85,
    lbl.PATTERN: 0.5,
    lbl.PATTERN + "+": 0.85,
    lbl.NEXT_CALL: 0.5,
    lbl.OBJ_KEY: 0.6,
}


DET = 0.99  # a node whose share of its parent's mass is at least this is "deterministic"


def candidates_to_tree(
    bt: BoundaryTokenizer,
    committed: list[int],
    cands: list[Cand],
    rates: LabelRates,
    max_tokens: int = 96,
    max_nodes: int | None = None,
    compiled: bool = True,
    tokenize=None,
) -> DraftTree:
    """Tokenize each candidate after ``committed`` and merge them into one tree.

    Node mass = sum of the probabilities of the candidates through it; conf = mass share of the
    parent times the learned rate of the node's label (how often the model keeps to the schema).
    ``max_nodes``: the budget keeps at most this many nodes of a tree, those of highest path
    probability (``tree.allocate``). A node's path probability is its mass times the rates along
    its path (the shares telescope), and only grows as candidates are added; a node that
    candidates not yet added would create has at most their summed mass. So once ``max_nodes``
    nodes are above that sum, the rest of the candidates (most probable first) could only add
    nodes the budget drops unverified, and are not tokenized -- the long tail is most of the cost.
    ``compiled``: the merge loop in C where it is built (``tree_kernel``), the same tree bit for
    bit; this Python loop is the reference. ``tokenize(tail, segs) -> (ids, labels)``: where a
    candidate's tokens come from (a tool set's token table, ``CompiledTools.candidate``; default
    ``bt.candidate``).
    """
    tokenize = tokenize or bt.candidate
    kernel = tree_kernel.load() if compiled else None
    if kernel is not None:
        return _merged(kernel, tokenize, committed, cands, rates, max_tokens, max_nodes)
    tree = DraftTree()
    mass: list[float] = []
    path_rate: list[float] = []  # product of the label rates from the root down to each node
    node_rate: list[float] = []  # each node's own label rate
    # a node's rate by (its label, its parent's label): the rates do not change while one tree is built
    rate: dict[tuple[str, str | None], float] = {}
    tail = tuple(committed[-TAIL_TOKENS:])  # all the boundary tokenizer reads of the context
    left = sum(c.prob for c in cands)  # mass of the candidates not yet added
    scale = max(1.0, left)  # root shares are capped at 1: path probability >= mass x rates / scale
    top = 0.0  # the largest node mass (masses only grow)
    parents, labels_of = tree.parents, tree.labels
    for cand in cands:
        bound = left * scale
        if max_nodes is not None and len(tree) >= max_nodes and bound < top:
            if _kept_above(mass, path_rate, max_nodes, bound):
                break
        left -= cand.prob
        ids, labels = tokenize(tail, tuple(cand.segs))
        nodes = tree.add_chain(ids[:max_tokens], labels)
        for i in range(len(mass), len(tree)):
            p = parents[i]
            pair = (labels_of[i], labels_of[p] if p != ROOT else None)
            r = rate.get(pair)
            if r is None:
                r = rate[pair] = rates.rate(rate_key(tree, i))
            mass.append(0.0)
            node_rate.append(r)
            path_rate.append(r * (1.0 if p == ROOT else path_rate[p]))
        prob = cand.prob
        for i in nodes:
            mass[i] += prob
            if mass[i] > top:
                top = mass[i]
    for i, p in enumerate(tree.parents):
        share = mass[i] / (1.0 if p == ROOT else max(mass[p], 1e-12))
        tree.conf[i] = min(1.0, share) * node_rate[i]
    return tree


def _merged(kernel, tokenize, committed, cands, rates, max_tokens, max_nodes) -> DraftTree:
    """``candidates_to_tree`` by the compiled loop: the same inputs, rates by (label, parent label)."""

    def rate(label: str, parent: str | None) -> float:
        return rates.rate(label_rate_key(label, parent))

    tokens, parents, conf, labels, kids = kernel.merge(
        tuple(committed[-TAIL_TOKENS:]),
        [c.segs for c in cands],
        [c.prob for c in cands],
        tokenize,
        rate,
        sum(c.prob for c in cands),
        max_tokens,
        -1 if max_nodes is None else max_nodes,
    )
    return DraftTree(tokens, parents, conf, labels, kids)


def _kept_above(mass: list[float], path_rate: list[float], n: int, bound: float) -> bool:
    """Whether ``n`` nodes have mass times the rates down to them above ``bound``."""
    above = 0
    for m, r in zip(mass, path_rate):
        if m * r > bound:
            above += 1
            if above >= n:
                return True
    return False


class RetrievalDrafter:
    """Suffix match of the tokens written so far against retrieved past calls (a small trie).

    Once the FSM knows the tool, only that tool's calls are used. The longest suffix of the
    output that occurs in a past call decides; its continuation is drafted whole.
    """

    def __init__(
        self,
        calls: list[PastCall],
        rates: LabelRates,
        max_ngram: int = 8,
        length: int = 48,
        branches: int = 3,
        min_ngram: int = 2,
        long_at: int = 4,
    ):
        self.calls, self.rates = calls, rates
        self.max_ngram, self.length, self.branches = max_ngram, length, branches
        self.min_ngram = min_ngram  # a one-token match ('"', ':') says nothing about what follows
        self.long_at = long_at  # matches of at least this many tokens learn their own rate

    def tree(self, ctx: DraftContext, tool: str | None) -> DraftTree:
        tree = DraftTree()
        gen = ctx.generated
        calls = [c for c in self.calls if tool is None or c.tool_name == tool] or ([] if tool else self.calls)
        if not calls or not gen:
            return tree
        best: list[tuple[int, float, list[int]]] = []
        for c in calls:
            n, cont = _longest_suffix_match(gen, c.token_ids, self.max_ngram, min(self.length, ctx.max_depth))
            if n >= self.min_ngram and cont:
                best.append((n, c.score, cont))
        if not best:
            return tree
        best.sort(key=lambda x: (-x[0], -x[1]))
        top_n = best[0][0]
        seen = set()
        conts = []
        for n, _, cont in best:
            if n < top_n or tuple(cont[:3]) in seen:
                continue
            seen.add(tuple(cont[:3]))
            conts.append(cont)
            if len(conts) >= self.branches:
                break
        # branch mass: votes of the past calls agreeing on the first tokens
        top = [c for n, _, c in best if n == top_n]
        shares = [sum(1 for c in top if c[:1] == cont[:1]) / len(top) for cont in conts]
        return add_copies(tree, conts, lbl.match_label(lbl.RETRIEVAL, top_n, self.long_at), self.rates, shares)


def _longest_suffix_match(gen: list[int], seq: list[int], max_n: int, length: int) -> tuple[int, list[int]]:
    """(n, continuation) for the longest n <= max_n with gen[-n:] occurring in seq (last occurrence)."""
    last = gen[-1]
    best_n, best_pos = 0, -1
    for pos in range(len(seq) - 1, -1, -1):
        if seq[pos] != last:
            continue
        n = 1
        while n < max_n and n < len(gen) and pos - n >= 0 and seq[pos - n] == gen[-1 - n]:
            n += 1
        if n > best_n:
            best_n, best_pos = n, pos
            if n == max_n:
                break
    if best_pos < 0:
        return 0, []
    return best_n, seq[best_pos + 1 : best_pos + 1 + length]


class SchemaDrafter(DrafterBase):
    """The ToolSpec drafter for one request: schema tree + generic drafting (suffix matches over the
    context and, with retrieval, the tenant's history; argument values copied from the context) +
    retrieved past calls, one tree."""

    prepares = True  # ``prepare``: the prompt's text, values, suffix index and first graph nodes, beside a forward
    TAILS = 8  # most probable continuations drafted after a copied value (each is tokenized with the span)
    WORD_END = 0.3  # share of a prose span's mass on the value ending where the source's word ends
    AHEAD_SHARE = 0.1  # a layout's least share of the outputs for ``prepare`` to build its part of the graph

    def __init__(
        self,
        bt: BoundaryTokenizer,
        tools: ToolIndex,
        priors: Priors,
        rates: LabelRates,
        eos: list[int],
        suffix: SuffixDrafter,
        retrieval: RetrievalDrafter | None = None,
        schema: bool = True,
        answer: bool = False,
        layouts: tuple = LAYOUTS,
        reference: bool = False,
        tables: CompiledTools | None = None,
    ):
        """``answer``: the output is a structured answer (response_format) whose schema ``tools``
        holds under ``RESPONSE``; ``layouts``: the target's call layouts (``layouts_for``);
        ``reference``: every step in Python with the full candidate expansion, the Python tree
        merge and suffix walk and the tokenizer's own encode -- the drafter the tests hold this one
        to (the same trees); ``tables``: the tool
        set's compiled schema answers and token table (``compiled``; None: none, every step asks
        the schema functions and the method's tokenizer cache)."""
        self.reference = reference
        self.tables = tables
        # the retrieved past calls as the candidate builder reads them, and its per-(tool, key)
        # values of them: fixed for the request, so built once, not every step
        self._past = [(c.tool_name, c.arguments) for c in retrieval.calls] if retrieval is not None else []
        self._past_memo: dict | None = None if reference else {}
        # the schema candidates' expansion graph, kept across steps (None: expanded afresh every step)
        self._graph: Graph | None = None if reference else Graph()
        self._tokenize = (lambda tail, segs: tables.candidate(bt.tokenize, tail, segs)) if tables else None
        self.bt, self.tools, self.priors, self.rates, self.eos = bt, tools, priors, rates, eos
        self.suffix, self.retrieval, self.schema = suffix, retrieval, schema
        self.tracker = CallTracker(tools, RESPONSE if answer else None, layouts)
        self._n_fed = 0  # committed tokens whose text the tracker has seen
        self._n_chars = 0  # characters of the output text the tracker has seen
        self._detok: Detokenizer | None = None  # spells the output of contexts built by hand
        self._prompt_text: str | None = None
        self._dates: list | None = None
        self._numbers: list[str] | None = None
        self._prompt_keys: KeyIndex | None = None  # objects of the conversation (objkeys)
        self._own: tuple[int, list] = (0, [])  # (tracker.calls seen, (name, arguments) of this output's finished calls)

    def _sync(self, ctx: DraftContext) -> None:
        """Feed the tracker the output text committed since the last step.

        The text is the engine's (``ctx.text``: decoded once per request, shared with stop strings
        and streaming); it only grows, so only the new characters are fed. A context built by
        hand carries no text: the drafter's own ``Detokenizer`` spells its tokens.
        """
        text, n = ctx.text, ctx.text_tokens
        if text is None:
            if self._detok is None:
                self._detok = Detokenizer(self.bt.tok)
            self._detok.feed(ctx.generated[len(self._detok.ids) :])
            text, n = self._detok.text, self._detok.read
        self.tracker.feed(text[self._n_chars :])
        self._n_chars, self._n_fed = len(text), n

    def prepare(self, prompt_ids: list[int]) -> None:
        """The prompt's side of drafting, before the first step: its text, numbers, dates and
        objects, the suffix index over it, and the schema candidates' expansion graph's first nodes
        (``_expand_ahead``). Depends on nothing a forward computes, so the scheduler runs it beside
        one -- the prefill's, whose first token the first step drafts after (``propose`` does
        whatever is left undone)."""
        ctx = DraftContext(list(prompt_ids), len(prompt_ids), 0)
        self._prompt(ctx)
        if self.schema:
            self._context_numbers(ctx)
            self._context_dates(ctx)
            self._context_keys(ctx)
            if self._graph is not None and not self._graph.nodes:
                self._expand_ahead(ctx)
        if self.suffix.context.length == 0:
            self.suffix.context.extend(prompt_ids)

    def _expand_ahead(self, ctx: DraftContext) -> None:
        """The expansion graph's first nodes: the walk from an empty output, as the first step
        would make it -- the layouts' openers, the tool names, each tool's arguments and their
        first values -- for the layouts the priors give at least ``AHEAD_SHARE`` of the outputs
        (every one until they have learned). The first token (the prefill's) picks one of them."""
        tr = self.tracker
        if not self.tools.names and tr.root is None:
            return
        family = list(tr.layouts)
        layouts = tuple(lay for lay, w in zip(family, self.priors.layout_weights(family)) if w >= self.AHEAD_SHARE)
        self._expand(ctx, tr, layouts=layouts)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree, job, into = self._draft(ctx)
        if job is not None:
            walk_batch([job])
        return _finish(tree, into)

    @classmethod
    def propose_batch(cls, drafters: list, ctxs: list[DraftContext]) -> list[DraftTree] | None:
        """Every sequence's tree of a step, the suffix walks of all of them in one compiled call
        (``suffix.walk_batch``); None where the walk is not compiled (each drafts alone)."""
        if not all(d.suffix.compiled for d in drafters):
            return None
        drafted = [d._draft(c) for d, c in zip(drafters, ctxs)]
        walk_batch([job for _, job, _ in drafted if job is not None])
        return [_finish(tree, into) for tree, _, into in drafted]

    def _draft(self, ctx: DraftContext) -> tuple[DraftTree, tuple | None, DraftTree | None]:
        """The step's tree up to the suffix walk: (tree, the walk's job or None, the tree the
        walked one merges into or None) -- ``_finish`` completes it once the walk is done."""
        self._sync(ctx)
        tree = DraftTree()
        if self.schema and (self.tools.names or self.tracker.root is not None):
            tree = candidates_to_tree(
                self.bt,
                ctx.tokens,
                self._continuations(ctx, self.tracker, min_prob=ctx.min_prob),
                self.rates,
                max_nodes=ctx.max_nodes,
                compiled=not self.reference,
                tokenize=self._tokenize,
            )
        if self.retrieval is not None:
            tree.merge(self.retrieval.tree(ctx, self.tracker.name))
        tree.merge(self._value_tree(ctx))
        return self._generic(ctx, tree)

    def _generic(self, ctx: DraftContext, tree: DraftTree) -> tuple[DraftTree, tuple | None, DraftTree | None]:
        """Suffix drafts where the schema does not know the text (free text, values, the end of a
        call): a tree of their own, merged into ``tree``; elsewhere only after the schema's most
        probable chain, where it stops knowing, grown into ``tree`` itself. Returns what
        ``_draft`` returns."""
        if not self.schema or self.tracker.state in lbl.SUFFIX_STATES or not len(tree):
            own = DraftTree()
            return own, self.suffix.walk_job(ctx, own, ROOT, 1.0), tree
        leaf, prob = _chain_end(tree)
        if leaf != ROOT:
            return tree, self.suffix.walk_job(ctx, tree, leaf, prob), None
        return tree, None, None

    def _continuations(
        self, ctx: DraftContext, tracker: CallTracker, max_cands: int = 64, min_prob: float = 0.0
    ) -> list[Cand]:
        """What the schemas allow after ``tracker``'s text (this output's tracker, or a fork of it).
        ``min_prob``: the budget's floor, for the step's own tree only (``_after_value``'s tails
        are shares of a copied span's probability, normalised there: a floor does not apply)."""
        return self._expand(ctx, tracker, max_cands=max_cands, min_prob=min_prob)

    def _expand(
        self, ctx: DraftContext, tracker: CallTracker, max_cands: int = 64, min_prob: float = 0.0, layouts=None
    ) -> list[Cand]:
        """``continuations`` with this request's inputs and its expansion graph."""
        return continuations(
            tracker,
            self.tools,
            self.priors,
            self.eos,
            max_cands=max_cands,
            past=self._past,
            dates=self._context_dates(ctx),
            context_keys=self._context_keys(ctx),
            own=self._own_calls(),
            numbers=self._context_numbers(ctx),
            bounded=not self.reference,
            tables=self.tables,
            past_memo=self._past_memo,
            min_prob=min_prob,
            graph=self._graph,
            compiled=not self.reference,
            layouts=layouts,
        )

    def _own_calls(self) -> list[tuple[str, dict]]:
        """This output's finished calls with their arguments, parsed again only when one more has closed."""
        n = len(self.tracker.calls)
        if n != self._own[0]:
            self._own = (n, [(c.name, c.arguments) for c in parse_tool_calls(self.tracker.text).calls])
        return self._own[1]

    def _prompt(self, ctx: DraftContext) -> str:
        if self._prompt_text is None:
            self._prompt_text = self.bt.tok.decode(ctx.tokens[: ctx.prompt_len], skip_special_tokens=True)
        return self._prompt_text

    def _context_numbers(self, ctx: DraftContext) -> list[str]:
        """Numbers the conversation writes, found once per request (values.context_numbers)."""
        if self._numbers is None:
            self._numbers = context_numbers(self._prompt(ctx))
        return self._numbers

    def _context_dates(self, ctx: DraftContext) -> list:
        """Dates the conversation mentions, found once per request (values.context_dates)."""
        if self._dates is None:
            self._dates = context_dates(self._prompt(ctx))
        return self._dates

    def _context_keys(self, ctx: DraftContext) -> KeyIndex:
        """The conversation's JSON objects, scanned once per request (the output's are the tracker's)."""
        if self._prompt_keys is None:
            self._prompt_keys = KeyScanner().feed(self._prompt(ctx)).index
        return self._prompt_keys

    def _value_tree(self, ctx: DraftContext) -> DraftTree:
        """The current argument value continued as in the context (see ``values``)."""
        tr, tree = self.tracker, DraftTree()
        if (
            self._n_fed != len(ctx.generated)
            or tr.state != lbl.VALUE
            or not (tr.in_str == "value" or tr.in_scalar)
            or not tr.buf
        ):
            return tree
        source = self._prompt(ctx) + tr.text[: len(tr.text) - len(tr.buf)]
        schema = self.schema and bool(self.tools.names)  # the schema says what follows a value
        cands, memo = [], {}
        for rank, span in enumerate(value_spans(source, tr.buf, tr.in_scalar)):
            share = 1.0 / (rank + 1)  # the first token at rate x share, as add_copies
            ends = [(span, share)]
            cut = _word_end(span)
            if schema and tr.in_str and not span.endswith('"') and cut < len(span):
                # a span from prose runs on past the value: it may end where the source's word does
                ends = [(span, share * (1 - self.WORD_END)), (span[:cut] + '"', share * self.WORD_END)]
            for text, p in ends:
                closes = tr.in_scalar or text.endswith('"')
                tails = self._after_value(ctx, text, memo) if schema and closes else []
                total = sum(t.prob for t in tails)
                cands += (
                    [Cand([(text, lbl.SPAN)] + t.segs, p * t.prob / total) for t in tails]
                    if total > 0
                    else [Cand([(text, lbl.SPAN)], p)]
                )
        if cands:
            tree = candidates_to_tree(self.bt, ctx.tokens, cands, self.rates, compiled=not self.reference)
        run = digit_run(tr.buf)
        if run:
            tree.merge(
                add_copies(
                    DraftTree(), [self.bt.continuation(ctx.tokens, run)[: ctx.max_depth]], lbl.PATTERN, self.rates
                )
            )
        return tree

    def _after_value(self, ctx: DraftContext, span: str, memo: dict) -> list[Cand]:
        """What the schema drafts after a copied span that closes the value (a string span with its
        closing quote, a number): the next argument or the end of the call, tokenized together with
        the span -- the quote merges with what follows (``"\n``, ``",``), so a span drafted alone
        ends on a token the target does not write. What follows a closed string does not depend on
        its text, so ``memo`` (one step's) computes it once."""
        key = span if self.tracker.in_scalar else '"'
        if key not in memo:
            fork = self.tracker.fork()
            fork.feed(key)
            memo[key] = self._continuations(ctx, fork, max_cands=self.TAILS)
        return memo[key]

    def feedback(self, tree: DraftTree, result: VerifyResult) -> None:
        """Learn label rates from deterministic nodes only (branch losers are expected); suffix
        drafts learn their own keyed rates (by the path they proposed) from the nodes they own."""
        self.suffix.feedback(tree, result, owned=True)
        self.rates.update(
            tree,
            result,
            skip=lambda i, key: (
                lbl.base_label(key) == lbl.SUFFIX
                or (not lbl.is_chain(key) and tree.conf[i] < DET * self.rates.rate(key))
            ),
        )


def _finish(walked: DraftTree, into: DraftTree | None) -> DraftTree:
    """The step's tree once the suffix walk is done: ``walked`` merged into ``into`` where the
    suffix drafts had a tree of their own (``_generic``), else ``walked`` itself."""
    if into is None or not into.tokens:  # nothing to merge into: the walked tree is the step's
        return walked
    into.merge(walked)
    return into


def _word_end(text: str) -> int:
    """Index of the first character of ``text`` that cannot continue a word (an id, a code)."""
    return next((i for i, ch in enumerate(text) if not (ch.isalnum() or ch in "_-")), len(text))


def _chain_end(tree: DraftTree) -> tuple[int, float]:
    """The end of the most probable chain from the root (following the highest-conf child) and its
    path probability: where a schema draft stops knowing what comes next. One pass (parents
    precede children)."""
    best: dict[int, int] = {}  # parent -> its highest-conf child
    for i, p in enumerate(tree.parents):
        if p not in best or tree.conf[i] > tree.conf[best[p]]:
            best[p] = i
    node, prob = ROOT, 1.0
    while node in best:
        node = best[node]
        prob *= tree.conf[node]
    return node, prob


class SchemaMethod:
    """``toolspec_schema``: schema drafting + generic drafting over the request's own context
    (suffix matches, argument values copied from the context); no history."""

    name = "toolspec_schema"
    uses_schema = True  # drafts the tool calls the schemas allow (the FSM)
    uses_history = uses_library = False

    def __init__(
        self,
        tokenizer,
        library: CallLibrary | None = None,
        retrieve_k: int = 8,
        eos_ids: list[int] | None = None,
        suffix_depth: int = 32,
        suffix_nodes: int = 64,
        max_match: int = 8,
        prompt_tail: int = 8,
        history_tokens: int = 32768,
        reference: bool = False,
        tool_set_bytes: int = 64 << 20,
    ):
        """``reference``: every schema candidate expanded, tokenized and merged afresh at every step
        in Python (no bounded expansion, no per-candidate token cache, no compiled tool sets, no
        compiled merge, suffix walk or ASCII encoder): the drafter the tests hold the fast one to. ``tool_set_bytes``: the bound
        on the compiled tool sets kept (``ToolSetCache``, estimated bytes)."""
        self.tok = tokenizer
        self.reference = reference
        self.bt = BoundaryTokenizer(tokenizer, cache_candidates=not reference)
        if not reference:
            tree_kernel.load()  # built (once per machine) now, not inside a step's drafting
            tree_kernel.load_suffix()
        # acceptance rates are learned per tenant (one tenant's model habits or poisoned library
        # never shape another's trees): (schema rates, suffix rates), least recently used dropped
        self._tenant_rates: dict[str, tuple[LabelRates, LabelRates]] = {}
        self.priors = Priors()
        # the shared library of past calls (an in-memory one unless given); none for schema-only drafting
        self.library = (library if library is not None else MemoryLibrary()) if self.uses_library else None
        self.retrieve_k = retrieve_k
        self.suffix_depth, self.suffix_nodes, self.max_match, self.prompt_tail = (
            suffix_depth,
            suffix_nodes,
            max_match,
            prompt_tail,
        )
        # history of earlier outputs (retrieval methods): one suffix trie per tenant, so a tenant's
        # outputs are never drafted for another. It lives in this process (per replica) and takes in
        # this replica's outputs plus the past calls retrieval brings from the shared library
        # (other replicas' outputs, outputs from before a restart), each output once.
        self.history = TenantHistories(suffix_depth, history_tokens)
        self.eos = list(eos_ids) if eos_ids else turn_end_ids(tokenizer)
        self.layouts = layouts_for(tokenizer)
        # compiled tool sets, shared by every request with the same tools (the reference compiles none)
        self.tool_sets = ToolSetCache(tool_set_bytes)
        # a server's worker threads build drafters and observe outputs while its engine thread
        # drafts: the caches above and the learned counts change under this lock
        self._lock = threading.Lock()

    def _tools(self, tools: list[dict], response: dict | None = None) -> tuple[ToolIndex, CompiledTools | None]:
        """The request's tool index and its compiled tables (the reference: a fresh index, no tables)."""
        if self.reference:
            return ToolIndex.from_tools(tools, response), None
        compiled = self.tool_sets.get(tools, response, self.tok)
        return compiled.index, compiled

    MAX_TENANTS = 256  # tenants whose acceptance rates are kept

    def rates_for(self, tenant: str) -> tuple[LabelRates, LabelRates]:
        """The tenant's (schema, suffix) acceptance rates, from the priors on first use."""
        with self._lock:
            pair = self._tenant_rates.pop(tenant, None) or (LabelRates(DEFAULT_RATES), LabelRates(SUFFIX_PRIOR))
            self._tenant_rates[tenant] = pair  # most recent last
            while len(self._tenant_rates) > self.MAX_TENANTS:
                del self._tenant_rates[next(iter(self._tenant_rates))]
            return pair

    @property
    def rates(self) -> LabelRates:
        """The default tenant's schema rates (single-tenant use: benchmarks, tests)."""
        return self.rates_for("default")[0]

    def drafter(self, req: RequestInfo) -> SchemaDrafter:
        rates, suffix_rates = self.rates_for(req.tenant)
        retrieval, history = None, SuffixTrie(self.suffix_depth)  # no history: an empty trie
        if self.uses_library:
            calls = req.retrieved
            if calls is None and self.library is not None:
                names = [t["function"]["name"] for t in req.tools or [] if "function" in t]
                calls = self.library.search(req.tenant, req.embedding, names or None, self.retrieve_k)
            past = [as_past_call(c) for c in calls or []]
            retrieval = RetrievalDrafter(past, rates)
            for c in past:
                self.history.add(req.tenant, c.token_ids)
            history = self.history.trie(req.tenant)
        suffix = SuffixDrafter(
            history, suffix_rates, self.suffix_depth, self.max_match, self.suffix_nodes, compiled=not self.reference
        )
        index, tables = self._tools(req.tools, req.response_schema)
        return SchemaDrafter(
            self.bt,
            index,
            self.priors,
            rates,
            self.eos,
            suffix,
            retrieval,
            self.uses_schema,
            answer=req.response_schema is not None and not req.tools,
            layouts=self.layouts,
            reference=self.reference,
            tables=tables,
        )

    def observe(self, req: RequestInfo, output_ids: list[int], text: str) -> None:
        """Learn tool/layout frequencies; remember the output (suffix history) and its calls (library)
        unless told not to."""
        if self.uses_library and req.remember:
            self.history.add(req.tenant, output_ids, req.prompt_ids[-self.prompt_tail :])
        if req.response_schema is not None and not req.tools:  # a structured answer holds no calls
            return
        parsed = parse_tool_calls(text)
        spans = parsed.spans
        # drafters only read the counts (.get): each change is one dict store; the version moves
        # after them, so the nodes of a drafter's expansion graph that read them are built again
        # (``candidates.Graph.sync``)
        with self._lock:
            self.priors.events.count("call_start", bool(spans) and not text[: spans[0][0]].strip())
            if parsed.calls:
                for _, end in spans:  # after a closer that is text (a fence, a tag): does the output go on?
                    if text[:end].rstrip().endswith(TEXT_CLOSERS):
                        self.priors.events.count("prose_after", bool(text[end:].strip()))
                for c in parsed.calls:
                    self.priors.tool_counts[c.name] = self.priors.tool_counts.get(c.name, 0.0) + 1.0
                lay = layout_of(text).name
                self.priors.layout_counts[lay] = self.priors.layout_counts.get(lay, 0.0) + 1.0
            self.priors.version += 1
        if not parsed.calls:
            return
        if self.library is not None and req.remember:
            for c in parsed.calls:
                self.library.add(
                    req.tenant, PastCall(c.name, list(output_ids), text, c.arguments), req.embedding, req.remember
                )


class RetrievalMethod(SchemaMethod):
    """``toolspec_retrieval``: drafts from retrieved past calls and the history of earlier outputs
    (+ generic drafting over the context), no schema FSM."""

    name = "toolspec_retrieval"
    uses_schema = False
    uses_history = uses_library = True


class ToolSpecMethod(SchemaMethod):
    """``toolspec``: schema + retrieval (past calls from the library, suffix matches over the
    tenant's earlier outputs) + generic drafting over the context, merged into one tree."""

    name = "toolspec"
    uses_schema = True
    uses_history = uses_library = True


TEXT_CLOSERS = tuple(
    sorted({lay.closer.strip() for lay in LAYOUTS + LLAMA_LAYOUTS if lay.closer})
)  # "</tool_call>", "```"
