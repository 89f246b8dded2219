"""The side-by-side run: every method in the same decode loop, KV cache and process.

Per item: prefill ONCE (untimed, into the run's block pool), then decode with each method from
the prompt's cached blocks (:mod:`benchmarks.prompts`), plain greedy first as the reference. One JSON line per (item, method, library) goes to
``<out>/items.jsonl`` as soon as it is done, so a rerun continues where a run stopped.

Library protocol of history methods: ``cold`` a fresh method per item; ``online`` one method per
benchmark that observes its OWN outputs in stream order; ``warm`` one method per benchmark that
first observes the gold calls of a separate warm file, never evaluated items. Other methods keep
one instance per benchmark (online acceptance rates carry over, as in a server), library null.
Retrieval keys (``--retrieval-key``): benchmarks/README.md.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from toolspec_core.drafters.methods import RequestInfo, make_method, method_class
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.cost_probe import cost_model_for
from toolspec_core.engine.limits import check_prompt
from toolspec_core.engine.loop import DecodeConfig, prefill
from toolspec_core.engine.scheduler import BatchLimits
from toolspec_core.engine.sequence import Sequence
from toolspec_core.errors import ToolSpecError

from .data import load_items, load_stream, prompt_ids, response_schema, select_items, warm_documents
from .datasets import JsonlStore
from .metrics import answer_metrics, call_metrics, first_mismatch
from .prompts import BLOCK_TOKENS, PromptPool

ALL_METHODS = ("ar", "pld", "suffix", "token_recycling", "toolspec_schema", "toolspec_retrieval", "toolspec")
LIBRARIES = ("cold", "online", "warm")
RETRIEVAL_KEYS = ("qwen", "hybrid", "lexical", "hidden")


@dataclass
class RunConfig:
    data: list[str]
    out: str
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    libraries: list[str] = field(default_factory=lambda: ["online"])
    limit: int | None = None
    seed: int | None = 0
    warm_files: list[str] = field(default_factory=list)
    warm_layout: str = "fence"
    warm_embed: bool = True
    warm_limit: int | None = None  # warm items per benchmark (seeded sample), each costs a prefill
    max_new_tokens: int = 256
    cost: str = "measured"  # measured | reference | flat | path to a cost JSON
    model: str | None = None  # None/"embedded" or an HF directory
    threads: int | None = None
    retime_reference: bool = True  # resumed items: time plain greedy again in this run
    packed_rows: int | None = None  # CPU fp32 opt-in: MKL packed GEMM for 4..N-row forwards (None/0: off)
    calibrate: bool = False  # the shared cost curve learns from the steps really paid (budget.Calibration)
    device: str = "cpu"  # where the target runs (cuda: float32 unless dtype says otherwise)
    dtype: str = "float32"
    structured: bool = False  # the structured-output tasks made from the items (data.structured_item)
    # how library methods key the call library: a text key as the Retrieval deployment computes it
    # (qwen | hybrid | lexical) or the target's last prompt state (hidden)
    retrieval_key: str = "qwen"
    attention: str | None = None  # the target's attention over a step's rows (None: its default)
    cuda_graphs: bool | None = None  # replay the step from CUDA graphs (None: the target's default)


def bench_target(
    model, dtype: str, device: str, threads=None, packed_rows=None, attention=None, cuda_graphs=None, *, target=None
):
    """The target of a bench run (``target``, when given, as it is). Only the engine flags given are
    passed to ``load_target``, so the target's defaults hold (and a build without them still loads)."""
    from toolspec_core.model.target import load_target, resolve_dtype

    if threads:
        torch.set_num_threads(threads)
    if target is not None:
        return target
    given = (("packed_rows", packed_rows), ("attention", attention), ("cuda_graphs", cuda_graphs))
    dtype = resolve_dtype(dtype, device)
    return load_target(model, dtype=dtype, device=device, **{k: v for k, v in given if v is not None})


def run_pairs(cfg: RunConfig) -> list[tuple[str, str | None]]:
    """(method, library) pairs in decode order; plain greedy first (it is the reference)."""
    out: list[tuple[str, str | None]] = [("ar", None)]
    for m in cfg.methods:
        if m == "ar":
            continue
        out.extend((m, lib) for lib in cfg.libraries) if _method_flag(m, "uses_history") else out.append((m, None))
    return out


def _method_flag(name: str, flag: str) -> bool:
    """``uses_library`` (drafts from a call library) or ``uses_history`` of a method; False for a
    method whose module cannot be imported (it is planned once and skipped by the pool)."""
    try:
        return getattr(method_class(name), flag)
    except ImportError:
        return False


def text_keyer(kind: str, threads: int | None = None):
    """The Retrieval deployment's keyer for ``kind`` (``deployments.retrieval.make_keyer`` on a
    ``RetrievalConfig`` with that key and the default encoder), its keys cached per text."""
    from deployments.config import EncoderConfig, RetrievalConfig
    from deployments.retrieval import make_keyer
    from retrieval_service.library import CachedKeyer

    return CachedKeyer(make_keyer(RetrievalConfig(key=kind, encoder=EncoderConfig(threads=threads))))


def pair_key(item_id: str, method: str, library: str | None) -> str:
    return f"{item_id}\t{method}\t{library or '-'}"


# --------------------------------------------------------------------------- stores


def item_store(out: Path) -> JsonlStore:
    return JsonlStore(out / "items.jsonl", lambda r: pair_key(r["item"], r["method"], r["library"]))


def encode_hidden(h: torch.Tensor) -> str:
    return base64.b64encode(h.detach().float().contiguous().numpy().tobytes()).decode()


def decode_hidden(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.float32).clone()  # [H]


class PrefillCache:
    """Prefill time and retrieval key (last prompt hidden state) per item, so a resumed online
    run can replay ``observe`` without prefilling finished items again."""

    def __init__(self, path: Path):
        self.store = JsonlStore(path, lambda r: r["item"])

    def get(self, item_id: str) -> dict | None:
        return self.store.records.get(item_id)

    def put(self, item_id: str, pre) -> dict:
        rec = {"item": item_id, "prompt_tokens": len(pre.prompt_ids), "prefill_s": pre.seconds}
        self.store.append({**rec, "hidden": encode_hidden(pre.hidden)})
        return self.store.records[item_id]


# --------------------------------------------------------------------------- cost model


def resolve_cost(spec: str, target, out: Path, max_rows: int = 0) -> CostModel | None:
    """The one CostModel every tree method uses (``max_rows``: measured up to forwards of that many
    rows, for batches); saved in the run directory and reused on resume."""
    saved = out / "cost.json"
    if saved.exists():
        d = json.loads(saved.read_text())
        if spec not in (d.get("spec"), None):
            log(f"note: reusing this run's saved cost model ({d.get('spec')}), not --cost {spec}")
        return CostModel.from_dict(d)
    if spec in ("measure", "measured"):
        log("measuring the verify-cost curve of this target ...")
    cm = cost_model_for(spec, target, max_rows=max_rows)
    if cm is not None:
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({**cm.to_dict(), "spec": spec}, indent=2) + "\n")
        log("cost curve c(k): " + ", ".join(f"{k}:{v:.2f}" for k, v in sorted(cm.points.items())))
    return cm


# --------------------------------------------------------------------------- methods


def log(msg: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)


class MethodPool:
    """Method instances per (benchmark, method, library), following the library protocol."""

    def __init__(self, tokenizer, warm_docs=None, library=None):
        self.tok = tokenizer
        self.warm_docs = warm_docs  # benchmark -> [(RequestInfo, ids, text)] (lazy)
        self.library = library  # () -> a fresh CallLibrary for a library method (None: its own MemoryLibrary)
        self.instances: dict[tuple, object] = {}
        self.unavailable: dict[str, str] = {}

    def _make(self, name: str):
        try:
            if self.library is not None and _method_flag(name, "uses_library"):
                return make_method(name, self.tok, library=self.library())
            return make_method(name, self.tok)
        except (ImportError, AttributeError) as exc:
            self.unavailable[name] = f"{type(exc).__name__}: {exc}"
            log(f"skipping method {name!r}: {self.unavailable[name]}")
            return None

    def get(self, bench: str, name: str, library: str | None):
        if name in self.unavailable:
            return None
        if library == "cold":
            return self._make(name)
        key = (bench, name, library)
        if key not in self.instances:
            method = self._make(name)
            if method is not None and library == "warm":
                for req, ids, text in self.warm_docs(bench):
                    method.observe(req, ids, text)
            self.instances[key] = method
        return self.instances[key]

    def after_item(self, bench: str, name: str, library: str | None, req: RequestInfo, rec: dict) -> None:
        """Online library: the method learns from its own finished output (never before)."""
        if library == "online" and name not in self.unavailable:
            method = self.get(bench, name, library)
            if method is not None:
                method.observe(req, rec["tokens"], rec["text"])


# --------------------------------------------------------------------------- one decode


def decode_record(
    target, prompts: PromptPool, method, req: RequestInfo, dcfg: DecodeConfig, cost: CostModel | None
) -> dict:
    """Decode ``req``'s prompt (in ``prompts``' pool) with ``method`` and return the timing /
    acceptance part of a record.

    decode_s = drafter setup (e.g. retrieval) + the loop's draft/verify/commit time; the prompt's
    prefill (its last rows past the cached blocks included: :meth:`PromptPool.start`) and a
    structured answer's grammar (the same for every method) are excluded.
    """
    check_prompt(target, req.prompt_ids, dcfg.max_new_tokens)
    constraint = None
    if req.response_schema is not None:  # every method decodes under the answer's grammar
        from toolspec_core.engine.grammar import make_tool_constraint

        vocab = getattr(target.model.config, "vocab_size", None)
        constraint = make_tool_constraint(target.tokenizer, [], "none", vocab, response=req.response_schema)
    seq = Sequence(target, list(req.prompt_ids), None, dcfg, constraint)
    started = prompts.start([seq], cost, BatchLimits(max_running=1))
    t0 = time.perf_counter()
    seq.drafter = method.drafter(req)
    setup = time.perf_counter() - t0
    started.run()
    res = seq.result
    stats = res.stats.to_dict()
    stats["decode_s"] += setup
    return {"tokens": res.tokens, "text": res.text, "finish_reason": res.finish_reason, "setup_s": setup, **stats}


def finish_record(rec: dict, item: dict, ar: dict | None, ref: dict | None = None) -> dict:
    """Add exact match vs plain greedy, per-item speedup and tool-call metrics.

    ``ref``: plain greedy decoded again in this run (a resumed item whose ``ar`` record is
    from an earlier run); the speedup is against its time, not the stored one, because a
    shared machine's speed drifts between runs.
    """
    rec.update(call_metrics(rec["text"], item) if response_schema(item) is None else answer_metrics(rec["text"], item))
    if ar is None:  # this is plain greedy itself
        rec.update(
            exact_match=True, first_mismatch=None, ar_decode_s=rec["decode_s"], speedup=1.0, ar_step_s=_median_step(rec)
        )
        return rec
    diff = first_mismatch(rec["tokens"], ar["tokens"])
    base = ar if ref is None else ref
    rec.update(
        exact_match=diff is None,
        first_mismatch=diff,
        ar_decode_s=base["decode_s"],
        ar_step_s=_median_step(base),
        reference_retimed=ref is not None,
        speedup=base["decode_s"] / rec["decode_s"] if rec["decode_s"] > 0 else None,
    )
    if diff is not None:
        log(
            f"!!! EXACT-MATCH FAILURE: item {item['id']} method {rec['method']}/{rec['library']}: output differs "
            f"from plain greedy at token {diff} (got {rec['tokens'][diff : diff + 5]}, greedy {ar['tokens'][diff : diff + 5]})"
        )
    return rec


def _median_step(rec: dict) -> float | None:
    """Median seconds of one plain-greedy step (the unit of the observed cost curve)."""
    steps = sorted(rec.get("verify_per_step") or [])
    return steps[len(steps) // 2] if steps else None


# --------------------------------------------------------------------------- the run


class Runner:
    def __init__(self, cfg: RunConfig, target=None):
        self.cfg, self.out = cfg, Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        engine = (cfg.threads, cfg.packed_rows, cfg.attention, cfg.cuda_graphs)
        self.target = target = bench_target(cfg.model, cfg.dtype, cfg.device, *engine, target=target)
        self.stream = load_stream(cfg.data, cfg.limit, cfg.seed, cfg.structured)
        self.pairs = run_pairs(cfg)
        self.store = item_store(self.out)
        self.prefills = PrefillCache(self.out / "prefill.jsonl")
        # one item's prompt pinned at a time, and its decode (pages of the pool are touched as used)
        room = target.max_context + cfg.max_new_tokens + BatchLimits().tree_rows + 2 * BLOCK_TOKENS
        self.prompts = PromptPool(target, room)
        self.warm_prefills = PrefillCache(self.out / "warm_prefill.jsonl")
        if cfg.retrieval_key not in RETRIEVAL_KEYS:
            raise ValueError(f"unknown retrieval key {cfg.retrieval_key!r}; known: {', '.join(RETRIEVAL_KEYS)}")
        self.text_key = cfg.retrieval_key != "hidden"
        self._keyer = None  # the text keyer, loaded when a library method first needs it
        self._key_s: float | None = None  # encoder seconds of the current item's text key
        self.pool = MethodPool(target.tokenizer, self.warm_docs, self._service_library if self.text_key else None)
        self.dcfg = DecodeConfig(max_new_tokens=cfg.max_new_tokens)
        self._warm: dict[str, list] = {}
        self._write_config()
        self.cost = resolve_cost(cfg.cost, target, self.out)
        self.cost.calibrate = cfg.calibrate

    @property
    def keyer(self):
        if self._keyer is None:
            log(f"loading the {self.cfg.retrieval_key} retrieval keyer ...")
            self._keyer = text_keyer(self.cfg.retrieval_key, self.cfg.threads)
        return self._keyer

    def _service_library(self):
        from retrieval_service.library import ServiceLibrary

        return ServiceLibrary(self.keyer)

    def request_key(self, item: dict, pre=None, pinfo=None):
        """The library key of an item's request: its text (text keys) or the last prompt state."""
        if self.text_key:
            from retrieval_service.embedding import query_text

            return query_text(item.get("messages") or [], item.get("tools"))
        return pre.hidden if pre is not None else (decode_hidden(pinfo["hidden"]) if pinfo else None)

    def _write_config(self) -> None:
        path = self.out / "config.json"
        now = {**asdict(self.cfg), "target": self.target.name}
        if path.exists():
            old = json.loads(path.read_text())
            same = ("data", "limit", "seed", "max_new_tokens", "target", "warm_files")
            changed = [k for k in same if old.get(k) != now.get(k)]
            if old.get("retrieval_key", "hidden") != now["retrieval_key"]:
                changed.append("retrieval_key")
            if changed:
                log(f"WARNING: resuming {self.out} with different {', '.join(changed)} than the original run")
        from .cost import hardware_string

        path.write_text(json.dumps({**now, "hardware": hardware_string(self.cfg.device)}, indent=2) + "\n")

    def warm_docs(self, bench: str) -> list:
        """Warm-file items of this benchmark, minus every item being evaluated."""
        if bench not in self._warm:
            evaluated = {it["id"] for it in self.stream}
            items = [it for p in self.cfg.warm_files for it in load_items(p)]
            items = [it for it in items if it["benchmark"] == bench and it["id"] not in evaluated]
            items = select_items(items, self.cfg.warm_limit, self.cfg.seed)
            embed = self._warm_embedding if self.cfg.warm_embed else None
            self._warm[bench] = warm_documents(
                self.target.tokenizer, items, self.target.eos_ids, self.cfg.warm_layout, embed
            )
            log(f"warm library for {bench}: {len(self._warm[bench])} documents")
        return self._warm[bench]

    def _warm_embedding(self, item: dict, ids: list[int]):
        if self.text_key:
            return self.request_key(item)
        rec = self.warm_prefills.get(item["id"])
        if rec is None:
            rec = self.warm_prefills.put(item["id"], prefill(self.target, ids, self.prompts.pool))
        return decode_hidden(rec["hidden"])

    def todo(self, item: dict) -> list[tuple[str, str | None]]:
        return [(m, lib) for m, lib in self.pairs if pair_key(item["id"], m, lib) not in self.store.records]

    def run(self, max_items: int | None = None) -> None:
        """Decode every pending pair; ``max_items`` stops early (tests simulate interruption)."""
        from tqdm import tqdm

        total = len(self.stream) * len(self.pairs)
        done = sum(1 for it in self.stream for m, lib in self.pairs if pair_key(it["id"], m, lib) in self.store.records)
        index: dict[str, int] = {}
        with tqdm(total=total, initial=done, unit="decode", dynamic_ncols=True, file=sys.stderr) as bar:
            for n, item in enumerate(self.stream):
                if max_items is not None and n >= max_items:
                    break
                pos = index[item["benchmark"]] = index.get(item["benchmark"], -1) + 1
                self.run_item(item, pos, bar)

    def run_item(self, item: dict, pos: int, bar) -> None:
        bench, pending = item["benchmark"], self.todo(item)
        ids = prompt_ids(self.target.tokenizer, item)
        pre, pinfo = None, self.prefills.get(item["id"])
        self.prompts.clear()  # the previous item's prompt: its blocks evictable
        if pending:
            try:
                pre = self.prompts.warm(item["id"], ids)
            except ToolSpecError as exc:
                log(f"skipping item {item['id']}: {exc}")
                bar.update(len(pending))
                return
            pinfo = pinfo or self.prefills.put(item["id"], pre)
            # untimed 2-token decode so plain greedy (always first) does not pay the first
            # decode's one-off costs after a large prefill (allocator, caches)
            self.prompts.start(
                [Sequence(self.target, ids, None, DecodeConfig(max_new_tokens=2))], None, BatchLimits()
            ).run()
        emb = self.request_key(item, pre, pinfo)
        self._key_s = None
        if self.text_key and any(_method_flag(m, "uses_library") for m, _ in self.pairs):
            # keyed before any decode is timed: serving keys the text while the prompt is prefilled
            t0 = self.keyer.seconds
            if emb.strip():
                self.keyer.key(emb)
            self._key_s = self.keyer.seconds - t0
        req = RequestInfo(
            prompt_ids=ids, tools=item.get("tools") or [], embedding=emb, response_schema=response_schema(item)
        )
        ar = self.store.records.get(pair_key(item["id"], "ar", None))
        stored_ar, ref = ar is not None, None
        for name, lib in self.pairs:
            rec = self.store.records.get(pair_key(item["id"], name, lib))
            if rec is None and ar is None and name != "ar":
                log(f"skipping {name}/{lib or '-'} on item {item['id']}: no plain-greedy reference")
                bar.update(1)
                continue
            if rec is None:
                bar.set_postfix_str(f"{item['id'][:40]} {name}/{lib or '-'}", refresh=False)
                if stored_ar and ref is None and self.pool.get(bench, name, lib) is not None:
                    ref = self.retime_reference(item, pre, req, ar)
                rec = self.decode_pair(item, pos, pre, req, name, lib, ar, ref)
                bar.update(1)
            if rec is None:
                continue
            if name == "ar":
                ar = rec
            self.pool.after_item(bench, name, lib, req, rec)

    def retime_reference(self, item, pre, req, ar: dict) -> dict | None:
        """Plain greedy's decode time in this run for an item resumed with new methods.

        Also a determinism check: the tokens must be the stored ones.
        """
        if not self.cfg.retime_reference:
            return None
        rec = decode_record(
            self.target, self.prompts, self.pool.get(item["benchmark"], "ar", None), req, self.dcfg, self.cost
        )
        if rec["tokens"] != ar["tokens"]:
            log(
                f"!!! plain greedy on item {item['id']} differs from its stored output at token "
                f"{first_mismatch(rec['tokens'], ar['tokens'])}: the stored reference is not reproducible"
            )
        return rec

    def decode_pair(self, item, pos, pre, req, name, lib, ar, ref=None) -> dict | None:
        method = self.pool.get(item["benchmark"], name, lib)
        if method is None:
            return None
        head = {"item": item["id"], "benchmark": item["benchmark"], "index": pos, "method": name, "library": lib}
        try:
            rec = {**head, **decode_record(self.target, self.prompts, method, req, self.dcfg, self.cost)}
        except Exception as exc:  # a broken method must not stop the other methods' run
            log(f"!!! method {name}/{lib} failed on item {item['id']}: {type(exc).__name__}: {exc}")
            self.store.append({**head, "error": f"{type(exc).__name__}: {exc}"})
            return None
        rec["prefill_s"] = pre.seconds
        if self._key_s is not None and _method_flag(name, "uses_library"):
            rec["retrieval_key"], rec["key_s"] = self.cfg.retrieval_key, self._key_s
        rec["e2e_s"] = pre.seconds + rec["decode_s"]  # one prefill + this method's decode phase
        rec = finish_record(rec, item, None if name == "ar" else ar, ref)
        self.store.append(rec)
        return rec


def run(cfg: RunConfig, target=None, max_items: int | None = None) -> Runner:
    runner = Runner(cfg, target)
    runner.run(max_items)
    return runner
