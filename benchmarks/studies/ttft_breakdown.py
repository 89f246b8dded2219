"""Study: where a request's first token waits under load. Result: benchmarks/results/measurements/ttft-breakdown-*.

Reads the records of a streamed ToolSpec load test (``--save-records``; each request's
``server_timeline``: wall-clock marks of the ingress, the replica and the scheduler, and what the
first steps that held it carried) and splits every request's client-side TTFT into what it
waited on, in order:

- ``to_ingress``: the client's send to the HTTP ingress reading it (loopback, body parse);
- ``to_replica``: ingress to the replica (Ray's hop, the router's queue);
- ``prepare``: tokenization, chat template, schema / grammar set-up in the replica's workers;
- ``search``: the retrieval search's wait on the request path (0 when it runs beside prefill);
- ``drafter``: the request's drafter built in a worker thread;
- ``step_end``: its sequence handed to the engine thread, which takes new sequences between
  steps (the rest of the step running when it arrived);
- ``queue``: waiting in the scheduler before admission (``max_running``, the KV pool);
- ``chunk_wait``: admitted, waiting for its first prefill chunk (other prompts' chunks first);
- ``prefill``: its first chunk to its first token (``prefill_steps`` steps; what they carried);
- ``to_text``: the first token to the replica's first text event (detokenizer, event loop);
- ``hold``: the replica's first text to the ingress's first chunk with content or a tool-call
  delta (Ray's hop back, and the stream shaper holding text that may start a call until the
  call's name is known -- ``hold_steps`` engine steps, ``hold_tokens`` output tokens);
- ``to_client``: the ingress's first chunk to the client reading it.

    python -m benchmarks.studies.ttft_breakdown RUN.records.jsonl [--endpoint ts] --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# the timeline's marks in order; each part of a TTFT runs from one mark to the next
MARKS = ("started", "http_in", "replica_in", "prepared", "searched", "submitted", "queued", "admitted",
         "prefill_start", "first_token", "first_text", "first_chunk", "client_first_chunk")  # fmt: skip
NAMES = ("to_ingress", "to_replica", "prepare", "search", "drafter", "step_end", "queue", "chunk_wait",
         "prefill", "to_text", "hold", "to_client")  # fmt: skip
PARTS = tuple(zip(NAMES, MARKS, MARKS[1:]))


def breakdown(rec: dict) -> dict | None:
    """One request's TTFT split (seconds) and what its steps carried (without a timeline, its
    TTFT and E2E alone); None for a failed request."""
    tl = rec.get("server_timeline")
    if not rec.get("ok") or rec.get("ttft_ms") is None:
        return None
    if not isinstance(tl, dict):  # another server (vLLM): its TTFT alone
        keys = ("index", "item_id", "prompt_tokens")
        return {**{k: rec[k] for k in keys}, "ttft_s": rec["ttft_ms"] / 1e3, "e2e_s": rec["e2e_ms"] / 1e3}
    marks = {k: v for k, v in tl.items() if isinstance(v, (int, float))}
    marks["started"] = rec["started"]
    marks["client_first_chunk"] = rec["started"] + rec["ttft_ms"] / 1e3
    out = {"index": rec["index"], "item_id": rec["item_id"], "prompt_tokens": rec["prompt_tokens"]}
    out["ttft_s"], out["e2e_s"] = rec["ttft_ms"] / 1e3, rec["e2e_ms"] / 1e3
    for name, a, b in PARTS:
        out[name] = marks[b] - marks[a] if a in marks and b in marks else None
    steps = tl.get("early_steps") or []
    pre = [s for s in steps if s["kind"] == "prefill"]
    out["prefill_steps"] = len(pre)
    out["prefill_own_rows"] = sum(s["own_rows"] for s in pre)
    out["prefill_step_rows"] = sum(s["rows"] for s in pre)  # all rows of those forwards
    out["prefill_step_prefill_rows"] = sum(s["prefill_rows"] for s in pre)
    out["prefill_step_decode_rows"] = sum(s["decode_rows"] for s in pre)  # decoding sequences' roots + drafts there
    out["prefill_forward_s"] = sum(s["forward_s"] for s in pre)
    first_chunk = marks.get("first_chunk")
    if first_chunk is not None:
        dec = [s for s in steps if s["kind"] == "decode" and s["end"] <= first_chunk + 1e-3]
        out["hold_steps"] = len(dec)
        out["hold_steps_with_prefill"] = sum(1 for s in dec if s["prefill_rows"] > 0)
        out["hold_tokens"] = dec[-1]["generated"] if dec else 1
        out["hold_own_rows"] = sum(s["own_rows"] for s in dec)
        out["hold_forward_s"] = sum(s["forward_s"] for s in dec)
    out["first_token_s"] = marks["first_token"] - marks["started"] if "first_token" in marks else None
    out["retrieval"] = tl.get("retrieval")
    return out


def prompt_phase(recs: list[dict]) -> float | None:
    """Seconds from the level's first request to the end of its last step that carried prompt
    rows (the steps every request saw, from their ``early_steps``); None without timelines. At a
    burst of fresh prompts it is the time the replica took to prefill all of them, so a TTFT
    over it compares runs the machine ran at different speeds."""
    ends = [
        s["end"] for r in recs for s in ((r.get("server_timeline") or {}).get("early_steps") or []) if s["prefill_rows"]
    ]
    if not ends:
        return None
    return max(ends) - min(r["started"] for r in recs)


def summarize(rows: list[dict]) -> dict:
    keys = list(NAMES) + ["ttft_s", "e2e_s", "first_token_s", "prefill_steps", "prefill_forward_s"]
    keys += ["hold_steps", "hold_steps_with_prefill", "hold_tokens", "hold_forward_s"]
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = {"median": statistics.median(vals), "mean": statistics.fmean(vals), "max": max(vals)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("records", nargs="+", help="load-test records (.records.jsonl[.gz])")
    p.add_argument("--endpoint", action="append", help="only these endpoints (default: every one with timelines)")
    p.add_argument("--out", help="write the breakdown here (JSON)")
    ns = p.parse_args(argv)
    from benchmarks.datasets import read_jsonl

    by_ep: dict[str, list[dict]] = {}
    raw: dict[str, list[dict]] = {}
    for path in ns.records:
        for rec in read_jsonl(path):
            ep = f"{rec.get('endpoint')}@c{rec.get('concurrency')}"
            if len(ns.records) > 1:  # several runs: each endpoint apart per run
                ep = f"{os.path.basename(path).split('.')[0]}:{ep}"
            if ns.endpoint and rec.get("endpoint") not in ns.endpoint:
                continue
            row = breakdown(rec)
            if row is not None:
                by_ep.setdefault(ep, []).append(row)
                raw.setdefault(ep, []).append(rec)
    result = {"sources": ns.records, "parts": list(NAMES), "endpoints": {}}
    for ep, rows in by_ep.items():
        rows.sort(key=lambda r: r["ttft_s"])
        result["endpoints"][ep] = {"summary": summarize(rows), "requests": rows}
        phase = prompt_phase(raw[ep])
        if phase is not None:  # TTFTs against the time the run took to prefill every prompt (machine speed cancels)
            result["endpoints"][ep]["prompt_phase_s"] = phase
            result["endpoints"][ep]["ttft_over_prompt_phase"] = [round(r["ttft_s"] / phase, 3) for r in rows]
        print(f"== {ep}: {len(rows)} requests (sorted by TTFT); seconds")
        cols = ["ttft_s"] + list(NAMES) + ["prefill_steps", "hold_steps", "hold_tokens"]
        print(" ".join(f"{c[:10]:>10}" for c in cols))
        for r in rows:
            print(" ".join(f"{'-' if r.get(c) is None else round(r[c], 2):>10}" for c in cols))
        med = result["endpoints"][ep]["summary"]
        print(" ".join(f"{'-' if c not in med else round(med[c]['median'], 2):>10}" for c in cols), "(median)")
        if "prompt_phase_s" in result["endpoints"][ep]:
            over = result["endpoints"][ep]["ttft_over_prompt_phase"]
            print(f"prompt phase {result['endpoints'][ep]['prompt_phase_s']:.1f} s; TTFT / phase: {over}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
