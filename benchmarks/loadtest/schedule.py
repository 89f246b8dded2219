"""When requests are sent: closed loop (N clients) or open loop (Poisson / gamma arrivals).

A *plan* says how one slice of clients runs a level:
``{"concurrency": int | None, "offsets": [s, ...] | None, "max_concurrency": int | None,
"max_seconds": float, "duration": float | None}``. Closed loop (``concurrency``): that many clients,
each takes the next session and sends its requests one after the other, a request only once
the previous one finished. Open loop (``offsets``): session k starts ``offsets[k]`` seconds after
the slice started, whatever is in flight; ``max_concurrency`` caps requests in flight (the rest
wait, as with vLLM's ``--max-concurrency``). No new request is sent after ``duration`` seconds;
at ``max_seconds`` requests still in flight are cancelled and recorded as errors of kind
``deadline``, so a level always ends by itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
import socket

from .client import ERROR_BODY_CHARS, build_payload, error_kind, fill_success, new_record, send_one


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start times (s, first at 0) of *n* arrivals at *rate* per second.

    Inter-arrival times are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``, as
    in ``vllm bench serve``: burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular.
    An infinite rate sends everything at once.
    """
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run_slice(url: str, sessions: list[list[tuple[int, dict]]], plan: dict, opts: dict, on_done=None) -> dict:
    """Run one slice of clients over *sessions* (lists of (index, item)) by *plan*.

    Returns the raw records, the slice's duration on this client's clock, the peak number of
    requests in flight, and whether the time limit stopped it.
    """
    import httpx

    node = opts.get("node") or socket.gethostname()
    headers = {"Authorization": f"Bearer {opts['api_key']}"} if opts.get("api_key") else {}
    if opts.get("timeline"):  # ToolSpec servers add the request's timeline to the response (others ignore it)
        headers["X-ToolSpec-Timeline"] = "1"
    records: list[dict] = []
    loop = asyncio.get_running_loop()
    closed = plan.get("offsets") is None
    cap = plan["concurrency"] if closed else plan.get("max_concurrency")
    gate = asyncio.Semaphore(cap) if cap and not closed else None
    in_flight = {"now": 0, "peak": 0}

    async def send(client, session_no: int, turn: int, index: int, item: dict) -> None:
        payload = build_payload(item, opts)
        rec = new_record(index, item, node, session_no, turn)
        records.append(rec)
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        try:
            fill_success(rec, item, await send_one(client, url, payload, headers))
        except asyncio.CancelledError:
            rec["error"] = "deadline"
            raise
        except Exception as exc:  # every failure is data: count it, keep going
            rec["error"], rec["detail"] = error_kind(exc), str(exc)[:ERROR_BODY_CHARS]
        finally:
            in_flight["now"] -= 1
            if on_done:
                on_done()

    async def play(client, session_no: int, session: list, first: bool = False) -> None:
        for turn, (index, item) in enumerate(session):
            if loop.time() >= stop_new and not (first and turn == 0):
                return
            async with gate or contextlib.nullcontext():
                await send(client, session_no, turn, index, item)

    async def closed_client(client, pending) -> None:
        first = True  # the first wave goes out at the start whatever the clock says (a level sends something)
        while pending and (first or loop.time() < stop_new):
            session_no, session = pending.popleft()
            await play(client, session_no, session, first)
            first = False

    async def dispatcher(client) -> None:
        started = []
        try:
            for (session_no, session), offset in zip(enumerate(sessions), plan["offsets"], strict=True):
                delay = t0 + offset - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if loop.time() >= stop_new:
                    break
                started.append(asyncio.create_task(play(client, session_no, session)))
            await asyncio.gather(*started)
        finally:
            for task in started:
                task.cancel()
            await asyncio.gather(*started, return_exceptions=True)

    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(opts.get("timeout", 600.0), connect=min(10.0, opts.get("timeout", 600.0)))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        # the level's clock starts once the client exists (building it can take a while on a busy
        # machine, and a short --duration must still send its first requests)
        t0 = loop.time()
        deadline = t0 + plan["max_seconds"]
        stop_new = min(deadline, t0 + plan["duration"]) if plan.get("duration") else deadline
        if closed:
            pending = collections.deque(enumerate(sessions))
            tasks = [asyncio.create_task(closed_client(client, pending)) for _ in range(max(1, cap))]
        else:
            tasks = [asyncio.create_task(dispatcher(client))]
        _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()
    return {
        "records": records,
        "duration_s": loop.time() - t0,
        "node": node,
        "timed_out": bool(late),
        "unsent": sum(len(s) for s in sessions) - len(records),
        "peak_in_flight": in_flight["peak"],
    }


def split_jobs(jobs: list, concurrency: int, tasks: int) -> list[tuple[list, int]]:
    """Split a closed-loop level over up to *tasks* client slices, jobs in proportion to their clients."""
    k = max(1, min(tasks, concurrency, len(jobs) or 1))
    shares = [concurrency // k + (1 if i < concurrency % k else 0) for i in range(k)]
    # Client slots dealt round-robin over slices, jobs dealt over slots.
    owner = [s for r in range(max(shares)) for s, share in enumerate(shares) if share > r]
    parts: list[list] = [[] for _ in range(k)]
    for j, job in enumerate(jobs):
        parts[owner[j % concurrency]].append(job)
    return [(part, share) for part, share in zip(parts, shares, strict=True) if part]


def split_plan(sessions: list, plan: dict, slices: int) -> list[tuple[list, dict]]:
    """One level's sessions and plan divided over *slices* client slices (e.g. Ray actors).

    Closed loop: clients and sessions in proportion (split_jobs). Open loop: sessions dealt
    round-robin with their own arrival offsets, so the slices together keep the asked-for
    arrival process; ``max_concurrency`` is shared out like clients.
    """
    if plan.get("offsets") is None:
        return [
            (part, dict(plan, concurrency=share)) for part, share in split_jobs(sessions, plan["concurrency"], slices)
        ]
    k = max(1, min(slices, len(sessions) or 1))
    cap = plan.get("max_concurrency")
    out = []
    for s in range(k):
        part_plan = dict(plan, offsets=plan["offsets"][s::k])
        if cap:
            part_plan["max_concurrency"] = max(1, cap // k + (1 if s < cap % k else 0))
        out.append((sessions[s::k], part_plan))
    return [(part, p) for part, p in out if part]


def merge_slices(outs: list[dict]) -> dict:
    """Aggregate slice results; the slices started together, so the level lasted as long as the
    longest slice (each duration measured on its own client's clock: no clock agreement needed)."""
    records = sorted((r for o in outs for r in o["records"]), key=lambda r: r["index"])
    return {
        "records": records,
        "duration_s": max((o["duration_s"] for o in outs), default=0.0),
        "nodes": sorted({o["node"] for o in outs}),
        "timed_out": any(o["timed_out"] for o in outs),
        "unsent": sum(o["unsent"] for o in outs),
        "peak_in_flight": sum(o.get("peak_in_flight") or 0 for o in outs),
    }


def run_level_local(url: str, sessions: list, plan: dict, opts: dict, on_done=None) -> dict:
    return merge_slices([asyncio.run(run_slice(url, sessions, plan, opts, on_done))])
