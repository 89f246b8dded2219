"""``toolspec bench --batch 1,2,4,8,16``: decode throughput of batched methods at each batch size.

For each benchmark, batch size B and method (``ar`` first): the items are cut into groups of B in
stream order; each group is decoded together on one step scheduler, every sequence with its own
drafter, under the batch-wide budget. Every prompt is prefilled once, untimed, into the run's
block pool and every decode starts from its cached blocks (:mod:`benchmarks.prompts`). Reported per
(benchmark, method, B): decode-phase output tokens/s, the ratio to batched plain greedy at the same
B, MAT, rows per forward, forward and host time per step, host time per live sequence by part
(``HOST_PARTS``), the drafters' prompt-side work per request (done before the first step, as a
server does it beside the prefill's forward; inside decode tokens/s, except, where a step model
prices the forward and host work runs beside it, the part its prefill would hide), and exact match per item
against single-stream plain greedy (``ar`` at B = 1; with ``--same-batch-reference`` against
``ar`` at the same B). One JSON line per group goes to
``<out>/batch.jsonl`` as it finishes, so an interrupted run resumes where it stopped.

    toolspec bench --batch 1,2,4,8,16 --data benchmarks/datasets/api_bank.dev.jsonl.gz --limit 48 \\
        --methods ar,suffix,toolspec --out benchmarks/runs/batch-cpu --name batch-3bench-cpu
"""

from __future__ import annotations

import collections
import gc
import json
import time
from pathlib import Path

from toolspec_core.drafters.methods import RequestInfo
from toolspec_core.engine.limits import check_prompt
from toolspec_core.engine.loop import DecodeConfig
from toolspec_core.engine.scheduler import BatchLimits, forward_overlaps_host
from toolspec_core.engine.sequence import Sequence
from toolspec_core.errors import ToolSpecError
from toolspec_core.spec.proposer import Proposer

from .cost import hardware_string
from .data import load_items, prompt_ids, select_items
from .datasets import JsonlStore
from .metrics import first_mismatch
from .plots import md_section, md_table, pyplot
from .prompts import BLOCK_TOKENS, PromptPool
from .runner import MethodPool, bench_target, log, resolve_cost

MAX_ROWS = 256  # the batch budget's curve is measured up to forwards of this many rows
HOST_PARTS = ("draft", "budget", "inputs", "commit")  # StepRecord's host time by part (+ "other": the rest)
OVERLAP = {"auto": None, "on": True, "off": False}  # --overlap: the scheduler's (None: the target's default)


def group_store(out: Path) -> JsonlStore:
    """``batch.jsonl``: the record of every decoded group, by (benchmark, method, B, group)."""
    return JsonlStore(out / "batch.jsonl", lambda r: (r["benchmark"], r["method"], r["batch"], r["group"]))


def _groups(items: list[dict], b: int, cycle: bool = False) -> list[list[dict]]:
    """``items`` cut into groups of ``b`` in stream order; with ``cycle``, a ``b`` larger than the
    items is one group of them repeated (copies ``id#k``): they decode together, so no copy's
    drafter sees another's output (the online library learns after the group)."""
    if cycle and b > len(items) and items:
        return [
            [
                items[i % len(items)] if i < len(items) else _copy(items[i % len(items)], i // len(items))
                for i in range(b)
            ]
        ]
    return [items[i : i + b] for i in range(0, len(items), b)]


def _copy(item: dict, k: int) -> dict:
    return {**item, "id": f"{item['id']}#{k}"}


def recorded_items(target, items: list[dict], args) -> list[dict]:
    """The selected items the replay target recorded (others are left out, counted in the log);
    a decode longer than the recording is refused."""
    if args.max_new_tokens > target.max_new_tokens:
        raise SystemExit(
            f"--target replay: the recording holds {target.max_new_tokens} tokens an item; --max-new-tokens "
            f"{args.max_new_tokens} needs a longer one"
        )
    have = target.recorded()
    out = [it for it in items if (it["benchmark"], it["id"]) in have]
    if len(out) < len(items):
        log(
            f"replay: {len(items) - len(out)} of {len(items)} selected {items[0]['benchmark']} items not recorded, left out"
        )
    return out


class BatchRun:
    def __init__(self, args, target=None):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        engine = (args.threads, None, getattr(args, "attention", None), getattr(args, "cuda_graphs", None))
        if target is None and getattr(args, "target", "model") == "replay":
            from .replay import RECORDING, replay_target
            from .step_model import StepModel

            model = StepModel.load(args.step_model) if getattr(args, "step_model", None) else None
            target = replay_target(getattr(args, "replay_file", None) or RECORDING, model)
        self.target = target = bench_target(args.model, args.dtype, args.device, *engine, target=target)
        self.benches = [
            select_items(load_items(p), args.limit, None if args.seed < 0 else args.seed) for p in args.data
        ]
        if hasattr(target, "recorded"):  # the replay serves only the items it recorded
            self.benches = [recorded_items(target, items, args) for items in self.benches]
        self.dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
        self.cost = resolve_cost(args.cost, target, self.out, MAX_ROWS)
        if self.cost is not None:
            self.cost.calibrate = bool(args.calibrate)  # learns from the batched steps it pays (budget.Calibration)
        self.store = group_store(self.out)
        self.done = self.store.records
        self.prompts: PromptPool | None = None  # the current benchmark's prompts, each prefilled once
        self._prompt_ids: dict[str, list[int]] = {}  # item id -> its rendered prompt's tokens
        (self.out / "config.json").write_text(json.dumps({**vars(args), "tool": "toolspec bench --batch"}, indent=2))

    def _ids(self, item: dict) -> list[int]:
        """The item's prompt tokens, rendered once per item (its cycled copies ``id#k`` share them)."""
        key = item["id"].split("#")[0]
        if key not in self._prompt_ids:
            self._prompt_ids[key] = prompt_ids(self.target.tokenizer, item)
        return self._prompt_ids[key]

    def prefilled(self, item: dict):
        """The item's prompt in the run's pool (prefilled there the first time, untimed)."""
        return self.prompts.warm(item["id"].split("#")[0], self._ids(item))

    def _prompt_pool(self, items: list[dict]) -> PromptPool:
        """A pool for a benchmark: every item's prompt, pinned, plus the largest group's sequences
        (prompt, ``max_new_tokens`` and one draft tree each)."""
        bt, tree = BLOCK_TOKENS, BatchLimits().tree_rows
        lens = [len(self._ids(it)) for it in items]
        prompts = sum(-(-n // bt) for n in lens)
        group = max(self.args.batch) * -(-(max(lens, default=0) + self.dcfg.max_new_tokens + tree) // bt)
        return PromptPool(
            self.target, (prompts + group) * bt, overlap=OVERLAP[getattr(self.args, "overlap", None) or "auto"]
        )

    def _prefill_s(self, prompts: list) -> float:
        """Seconds of prefill forward the prompt-side work hides behind, where the forward is
        modelled (a step model) and host work runs beside it (overlap): each prompt's prefill as
        the step model prices a step of one sequence with the prompt's rows (at least a one-row
        step's time: past its measured rows per sequence it extrapolates). Elsewhere 0: the
        prefill is not timed, so neither is anything hidden behind it."""
        model = getattr(self.target, "step_model", None)
        overlap = OVERLAP[getattr(self.args, "overlap", None) or "auto"]
        if model is None or not (overlap if overlap is not None else forward_overlaps_host(self.target)):
            return 0.0
        return sum(model.forward_ms(1, len(p)) for p in prompts) / 1000

    def run(self) -> None:
        from tqdm import tqdm

        a = self.args
        cycle = bool(getattr(a, "cycle", False))
        total = sum(len(_groups(items, b, cycle)) for items in self.benches for b in a.batch) * len(a.methods)
        with tqdm(total=total, initial=len(self.done), unit="group", dynamic_ncols=True) as bar:
            for items in self.benches:
                self.prompts = self._prompt_pool(items)
                items = [it for it in items if self._fits(it)]
                for b in a.batch:
                    for name in a.methods:
                        pool = MethodPool(self.target.tokenizer)  # a fresh online library per (B, method)
                        warm = False
                        for gi, group in enumerate(_groups(items, b, cycle)):
                            key = (group[0]["benchmark"], name, b, gi)
                            if key in self.done:
                                self._replay(pool, name, group, self.done[key])
                                continue
                            if not warm:
                                self._warm_up(group)
                                warm = True
                            bar.set_postfix_str(f"{key[0]} B={b} {name} group {gi}", refresh=False)
                            rec = self.run_group(pool, name, b, gi, group)
                            self.store.append(rec)
                            bar.update(1)
                self.prompts.clear()  # a benchmark's prompts are unpinned once all its runs are done

    def _fits(self, item: dict) -> bool:
        try:
            check_prompt(self.target, self._ids(item), self.dcfg.max_new_tokens)
            self.prefilled(item)
            return True
        except ToolSpecError as exc:
            log(f"skipping item {item['id']}: {exc}")
            return False

    def _warm_up(self, group: list[dict]) -> None:
        """An untimed 2-token batch first: the first decode after big prefills pays one-off costs.
        Then what exists is frozen out of the garbage collector's full passes, as Ray Serve does
        once a replica is initialised (``RAY_SERVE_FREEZE_GC_ON_STARTUP``; vLLM's engine core
        likewise): the modules and kernels loaded on first use would otherwise be walked by every
        full collection, 0.1-0.2 s each here, landing inside whichever step triggers one."""
        cfg = DecodeConfig(max_new_tokens=2)
        seqs = [Sequence(self.target, self._ids(it), None, cfg) for it in group]
        self.prompts.start(seqs, None, BatchLimits(max_running=len(group))).run()
        gc.collect()
        gc.freeze()

    def _request(self, item: dict) -> RequestInfo:
        pre = self.prefilled(item)
        return RequestInfo(prompt_ids=pre.prompt_ids, tools=item.get("tools") or [], embedding=pre.hidden)

    def _replay(self, pool: MethodPool, name: str, group: list[dict], rec: dict) -> None:
        """A resumed group: the online library observes the outputs it produced, as it did then."""
        for it in group:
            out = rec["outputs"].get(it["id"])
            if out is not None:
                pool.after_item(it["benchmark"], name, "online", self._request(it), out)

    def run_group(self, pool: MethodPool, name: str, b: int, gi: int, group: list[dict]) -> dict:
        bench = group[0]["benchmark"]
        method = pool.get(bench, name, "online")
        limits = BatchLimits(max_running=b)
        reqs = [self._request(it) for it in group]
        seqs = [Sequence(self.target, req.prompt_ids, None, self.dcfg) for req in reqs]
        started = self.prompts.start(seqs, self.cost, limits)  # untimed: the prompts' last rows, first tokens
        sched, first = started.sched, len(started.sched.steps)
        t0 = time.perf_counter()
        for seq, req in zip(seqs, reqs):
            seq.drafter = method.drafter(req)  # drafter setup (retrieval) is part of the decode phase
        # The drafters' prompt-side work (the prompt's text, values, objects, suffix index): a server
        # runs it beside the prefill's forward (Scheduler._side_job), here untimed like the prefill
        # it would hide behind, so it would otherwise land in the first decode step's host time.
        # Timed apart (``prompt_side_s``) and still inside ``decode_s``.
        todo, t1 = [s for s in seqs if s.drafter.prepares], time.perf_counter()
        if todo:
            Proposer.prepare([s.drafter for s in todo], [list(s.prompt_ids) for s in todo])
            for s in todo:
                s.prepared = True
        prompt_side_s = time.perf_counter() - t1 if todo else 0.0
        prompt_hidden_s = min(prompt_side_s, self._prefill_s([s.prompt_ids for s in todo]))
        started.run()
        decode_s = time.perf_counter() - t0
        outputs = {}
        for it, seq, req in zip(group, seqs, reqs):
            r = seq.result
            outputs[it["id"]] = {"tokens": r.tokens, "text": r.text, "forwards": r.stats.forwards, "mat": r.stats.mat}
            pool.after_item(bench, name, "online", req, outputs[it["id"]])
        steps = [s for s in sched.steps[first:] if s.sequences]
        sums = {f: sum(getattr(s, f) for s in steps) for f in ("rows", "forward_s", "host_s", "side_s", "hidden_s")}
        head = {"benchmark": bench, "method": name, "batch": b, "group": gi, "items": [it["id"] for it in group]}
        tool_sets = getattr(method, "tool_sets", None)  # the compiled tool-set cache (``ToolSetCache``)
        return {
            **head,
            "decode_s": decode_s,
            "generated": sum(len(s.result.tokens) for s in seqs),
            "steps": len(steps),
            **sums,
            "live": sum(s.sequences for s in steps),  # sequence-steps: host time per live sequence
            "prompt_side_s": prompt_side_s,
            "prompt_hidden_s": prompt_hidden_s,
            "host_parts_s": {p: sum(getattr(s, p + "_s") for s in steps) for p in HOST_PARTS},
            "tool_sets": tool_sets.stats() if tool_sets is not None else None,  # the method's so far
            "outputs": outputs,
        }


# --------------------------------------------------------------------------- report


POOLED = "pooled"
SUMS = (
    "decode_s",
    "generated",
    "steps",
    "rows",
    "forward_s",
    "host_s",
    "live",
    "hidden_s",
    "prompt_side_s",
    "prompt_hidden_s",
)  # a run's totals over its groups


def summarize(records: list[dict]) -> list[dict]:
    """One run per (benchmark, method, batch), plus ``pooled`` over the benchmarks that have every
    (method, batch) of the run, with exact match against single-stream plain greedy (``ar`` at
    B = 1), or against ``ar`` at the same B in a run without B = 1 (:func:`reference_batch`)."""
    refs: dict[int, dict] = {}  # batch -> item -> plain greedy's tokens at that B
    for r in records:
        if r["method"] == "ar":
            refs.setdefault(r["batch"], {}).update({i: o["tokens"] for i, o in r["outputs"].items()})
    single = reference_batch(records) == 1
    combos = {(r["method"], r["batch"]) for r in records}
    n_items: dict[str, set] = {}  # items of a benchmark: every one a run decoded
    groups = collections.Counter((r["benchmark"], r["method"], r["batch"]) for r in records)
    for r in records:  # a repeated item (``id#k``, ``--cycle``) counts as its original
        n_items.setdefault(r["benchmark"], set()).update(i.split("#")[0] for i in r["outputs"])

    def whole(bench: str, method: str, b: int) -> bool:
        return groups[(bench, method, b)] == -(-len(n_items.get(bench, ())) // b) > 0

    complete = {bench for bench in n_items if all(whole(bench, m, b) for m, b in combos)}
    keyed = [(r, (r["benchmark"], r["method"], r["batch"])) for r in records]
    if len(complete) > 1:
        keyed += [(r, (POOLED, r["method"], r["batch"])) for r in records if r["benchmark"] in complete]
    runs: dict[tuple, dict] = {}
    for r, k in keyed:
        ref = _Refs(refs.get(1 if single else r["batch"], {}))
        run = runs.setdefault(k, {**dict.fromkeys(SUMS, 0), "parts": collections.Counter(), "mats": [], "exact": []})
        for f in SUMS:
            run[f] += r.get(f, 0)
        run["parts"].update(r.get("host_parts_s", {}))
        run["mats"].extend(o["mat"] for o in r["outputs"].values())
        run["exact"].extend(
            ref.get(i) is not None and first_mismatch(o["tokens"], ref.get(i)) is None for i, o in r["outputs"].items()
        )
        run.setdefault("mismatched", []).extend(
            i for i, o in r["outputs"].items() if ref.get(i) is not None and o["tokens"] != ref.get(i)
        )
    out = []
    for (bench, method, b), run in sorted(
        runs.items(), key=lambda kv: (kv[0][0] == POOLED, kv[0][0], kv[0][2], _order(kv[0][1]))
    ):
        # the prompt-side work a server hides behind the prefill's forward is not decode time (``_prefill_s``)
        decode_s = run["decode_s"] - run["prompt_hidden_s"]
        tps = run["generated"] / decode_s if decode_s > 0 else None
        out.append(
            {
                "benchmark": bench,
                "method": method,
                "batch": b,
                "items": len(run["exact"]),
                "decode_tokens_per_s": tps,
                "speedup_vs_ar": None,
                "mat": sum(run["mats"]) / len(run["mats"]) if run["mats"] else None,
                "exact_match": sum(run["exact"]) / len(run["exact"]) if run["exact"] else None,
                "rows_per_step": run["rows"] / run["steps"] if run["steps"] else None,
                "forward_ms_per_step": 1000 * run["forward_s"] / run["steps"] if run["steps"] else None,
                "host_ms_per_step": 1000 * run["host_s"] / run["steps"] if run["steps"] else None,
                "host_ms_per_seq_step": 1000 * run["host_s"] / run["live"] if run["live"] else None,
                # host work that ran while the forward did (Scheduler.overlap), not in host_s
                "hidden_ms_per_step": 1000 * run["hidden_s"] / run["steps"] if run["steps"] else None,
                # the drafters' prompt-side work, done before the first step (a server: beside the prefill)
                "prompt_side_ms_per_request": 1000 * run["prompt_side_s"] / len(run["exact"]) if run["exact"] else None,
                "prompt_hidden_ms_per_request": 1000 * run["prompt_hidden_s"] / len(run["exact"])
                if run["exact"]
                else None,
                "hidden_share": run["hidden_s"] / (run["host_s"] + run["hidden_s"])
                if run["host_s"] + run["hidden_s"]
                else None,
                "host_ms_per_seq_step_by_part": (
                    {
                        **{p: 1000 * v / run["live"] for p, v in run["parts"].items()},
                        "other": 1000 * (run["host_s"] - sum(run["parts"].values())) / run["live"],
                    }
                    if run["live"] and run["parts"]
                    else None
                ),
                "steps": run["steps"],
                "complete": bench == POOLED or whole(bench, method, b),  # every group of the items decoded
                "mismatched_items": run["mismatched"],
            }
        )
    ar = {(r["benchmark"], r["batch"]): r["decode_tokens_per_s"] for r in out if r["method"] == "ar"}
    for r in out:
        base = ar.get((r["benchmark"], r["batch"]))
        if base and r["decode_tokens_per_s"]:
            r["speedup_vs_ar"] = r["decode_tokens_per_s"] / base
    return out


class _Refs(dict):
    """Plain greedy's tokens by item id; a repeated item (``id#k``, ``--cycle``) is its original's."""

    def get(self, key, default=None):
        return super().get(key, super().get(key.split("#")[0], default))


def reference_batch(records: list[dict]) -> int | None:
    """1: outputs are compared with single-stream plain greedy; None: with plain greedy at their
    own B (a run without B = 1, ``--same-batch-reference``)."""
    return 1 if any(r["method"] == "ar" and r["batch"] == 1 for r in records) else None


def _order(method: str) -> int:
    return {"ar": 0, "suffix": 1}.get(method, 2)


def build_report(out: Path, name: str, results: Path, hardware: str, model: str, plots: bool = True) -> dict:
    records = list(group_store(out).records.values())
    cost = json.loads((out / "cost.json").read_text()) if (out / "cost.json").exists() else None
    report = {
        "tool": "toolspec bench --batch",
        "name": name,
        "model": model,
        "hardware": hardware,
        "config": json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {},
        "cost_model": cost,
        "exact_reference": "ar at B = 1" if reference_batch(records) == 1 else "ar at the same B",
        "runs": summarize(records),
        "tool_sets": tool_set_rows(records),
    }
    step_model = report["config"].get("step_model")
    if step_model:  # the forward was modelled: every figure of the run is a projection
        sm = json.loads(Path(step_model).read_text()) if Path(step_model).exists() else {}
        report["projection"] = {
            "step_model": step_model,
            "gpu": sm.get("gpu"),
            "source": sm.get("source"),
            "overlap": report["config"].get("overlap") or "auto",
        }
        for r in report["runs"]:
            r["kind"] = "projection"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (results / f"{name}.md").write_text(markdown(report))
    if plots:
        plot(report, results / f"{name}.png")
    return report


def tool_set_rows(records: list[dict]) -> list[dict]:
    """Each (benchmark, method, B)'s compiled tool-set cache after its last group: the method
    sees that benchmark's stream (cycled copies included) once per B, so lookups are its
    requests; counts cover the groups decoded in one process (a resumed run's start afresh)."""
    last: dict[tuple, dict] = {}
    for r in records:
        if r.get("tool_sets"):
            k = (r["benchmark"], r["method"], r["batch"])
            if k not in last or r["group"] > last[k]["group"]:
                last[k] = r
    rows = []
    for (bench, method, b), r in sorted(last.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]), kv[0][2])):
        st = r["tool_sets"]
        rows.append({"benchmark": bench, "method": method, "batch": b, **st})
    return rows


def tool_set_markdown(report: dict) -> list[str]:
    """The compiled tool-set cache's table (``ToolSetCache.stats``), where a method keeps one."""
    rows = report.get("tool_sets") or []
    if not rows:
        return []
    intro = (
        "Each method's cache of compiled tool sets (`ToolSetCache`) after the benchmark's stream at that B: "
        "requests looked up, sets compiled (misses), hit rate, compile time per set, estimated bytes per "
        "set held (schema tables at compile plus the token table as drafting filled it) and the token "
        "tables' hit rate (a schema candidate's tokens at a boundary already tokenized)."
    )
    head = ["benchmark", "method", "B", "requests", "sets", "hit rate", "compile ms p50 / p99"]
    head += ["KiB per set mean / max", "token-table entries", "token-table hit rate"]
    cells = []
    for r in rows:
        cells.append(
            [r["benchmark"], r["method"], r["batch"], r["hits"] + r["misses"], r["misses"], _f(r["hit_rate"], ".3f")]
            + [f"{r['compile_ms_p50']:.2f} / {r['compile_ms_p99']:.2f}"]
            + [f"{r['bytes_per_entry_mean'] / 1024:.1f} / {r['bytes_per_entry_max'] / 1024:.1f}"]
            + [r.get("token_entries", "-"), _f(r.get("token_hit_rate"), ".3f")]
        )
    return md_section("Compiled tool sets", intro, md_table(head, cells, ["---"] * 2 + ["---:"] * 8))


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _parts(parts: dict | None) -> str:
    return "-" if not parts else " / ".join(_f(parts.get(p), ".3f") for p in HOST_PARTS + ("other",))


def _exact_against(report: dict) -> str:
    if report.get("exact_reference") == "ar at the same B":
        return "per item against plain greedy at the same B."
    return "per item against single-stream plain greedy."


def _run_cells(r: dict) -> tuple[list, list]:
    """A report row's leading cells (benchmark .. MAT) and its closing ones (host per sequence, parts, exact)."""
    exact = 100 * r["exact_match"] if r["exact_match"] is not None else None
    head = [r["benchmark"], r["method"], r["batch"], f"{r['items']}{'' if r['complete'] else ' (partial)'}"]
    head += [_f(r["decode_tokens_per_s"], ".1f"), f"{_f(r['speedup_vs_ar'])}x", _f(r["mat"])]
    tail = [_f(r.get("host_ms_per_seq_step"), ".3f"), _f(r.get("prompt_side_ms_per_request"), ".2f")]
    tail += [_parts(r.get("host_ms_per_seq_step_by_part"))]
    return head, tail + [f"{_f(exact, '.0f')}%"]


def markdown(report: dict) -> str:
    proj = report.get("projection")
    if proj:
        return projection_markdown(report)
    lines = [
        f"# {report['name']}: batched decoding",
        "",
        f"Model {report['model']} on {report['hardware']}. Decode-phase output tokens/s of B sequences decoded "
        "together (prefill not timed); speedup against batched plain greedy (`ar`) at the same B; prompt-side: "
        "the drafters' work on each prompt, done before the first step (a server does it beside the prefill), "
        "counted in tok/s, not in host ms; exact match " + _exact_against(report),
        "",
    ]
    head = ["benchmark", "method", "B", "items", "tok/s", "vs ar", "MAT", "rows/step", "forward ms/step"]
    head += ["host ms/step", "host ms/seq/step", "prompt-side ms/request"]
    head += ["draft / budget / inputs / commit / other", "exact"]
    rows = []
    for r in report["runs"]:
        head_cells, tail_cells = _run_cells(r)
        mid = [_f(r["rows_per_step"], ".1f"), _f(r["forward_ms_per_step"], ".0f"), _f(r["host_ms_per_step"], ".1f")]
        rows.append(head_cells + mid + tail_cells)
    table = md_table(head, rows, ["---"] * 2 + ["---:"] * 10 + ["---", "---:"])
    return "\n".join(lines + table + tool_set_markdown(report)) + "\n"


def projection_markdown(report: dict) -> str:
    """A step-model run's report: every heading and row says projection (the forward was slept, not run)."""
    proj = report["projection"]
    src = proj.get("source") or {}
    lines = [
        f"# {report['name']}: batched decoding, PROJECTION for {proj.get('gpu')}",
        "",
        f"**A projection, not a measurement.** The replay target (recorded outputs of {report['model']}) on "
        f"{report['hardware']}, each step lasting the forward of its batch and rows on {proj.get('gpu')} as "
        f"the step model `{Path(proj['step_model']).name}` gives it (from `{src.get('file')}`, "
        f"code {src.get('code')}, commit {src.get('commit')}, mode {src.get('mode')}; past its largest "
        "measured batch it extrapolates): the host work is this CPU's, the forward the GPU curve's. Host "
        f"work beside the forward (overlap): {proj.get('overlap')}. Projected decode-phase output tokens/s; "
        "speedup against batched plain greedy (`ar`) at the same B, projected alike; host ms/step is the "
        "host time not hidden behind the forward; hidden share: host work that ran while the forward did, "
        "of all host work; prompt-side: the drafters' work on each prompt, hidden behind its prefill's forward "
        "(with overlap; as the step model prices a step of one sequence with the prompt's rows, at least a one-row "
        "step) and counted in tok/s where it is not; exact match " + _exact_against(report),
        "",
    ]
    head = ["kind", "benchmark", "method", "B", "items", "projected tok/s", "projected vs ar", "MAT", "rows/step"]
    head += ["forward ms/step (modelled)", "host ms/step (exposed)", "hidden ms/step", "hidden share"]
    head += ["host ms/seq/step", "prompt-side ms/request (hidden)", "draft / budget / inputs / commit / other"]
    head += ["exact"]
    rows = []
    for r in report["runs"]:
        head_cells, tail_cells = _run_cells(r)
        if r.get("prompt_hidden_ms_per_request") is not None:
            tail_cells[1] += f" ({r['prompt_hidden_ms_per_request']:.2f})"
        share = 100 * r["hidden_share"] if r.get("hidden_share") is not None else None
        mid = [_f(r["rows_per_step"], ".1f"), _f(r["forward_ms_per_step"], ".1f"), _f(r["host_ms_per_step"], ".1f")]
        mid += [_f(r.get("hidden_ms_per_step"), ".2f"), _f(share, ".0f") + "%"]
        rows.append(["projection"] + head_cells + mid + tail_cells)
    align = ["---"] * 3 + ["---:"] * 13 + ["---", "---:"]
    # no "Compiled tool sets" table here: every row of a projection says so, and the cache's counts
    # are the CPU replay's (its report has them)
    return "\n".join(lines + md_table(head, rows, align)) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    benches = sorted({r["benchmark"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for method in sorted({r["method"] for r in report["runs"]}, key=_order):
            pts = sorted(
                (r["batch"], r["decode_tokens_per_s"])
                for r in report["runs"]
                if (r["benchmark"], r["method"]) == (bench, method)
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("projected decode output tokens/s" if report.get("projection") else "decode output tokens/s")
        ax.set_title(bench)
        ax.grid(alpha=0.3)
        ax.legend()
    proj = report.get("projection")
    title = f"{report['model']} on {report['hardware']}"
    fig.suptitle(f"PROJECTION for {proj.get('gpu')}: {title}" if proj else title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_main(args) -> int:
    if args.report_only:
        model = args.model or "embedded"
    else:
        run = BatchRun(args)
        run.run()
        model = run.target.name
    name = args.name or Path(args.out).name
    rep = build_report(
        Path(args.out), name, Path(args.results_dir), args.hardware or hardware_string(args.device), model
    )
    print((Path(args.results_dir) / f"{name}.md").read_text())
    bad = [r for r in rep["runs"] if r["exact_match"] is not None and r["exact_match"] < 1.0]
    if bad:
        log(f"!!! exact-match failures in {len(bad)} runs (see the report)")
    return 0
