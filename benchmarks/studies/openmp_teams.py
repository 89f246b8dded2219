"""Study: what a second OpenMP team costs a decode step. Result:
benchmarks/results/measurements/openmp-teams-cpu-*.json.

A replica loads and warms its model on one thread and decodes on the engine thread. GNU OpenMP
gives each of them a team of worker threads; with more managed threads than cores its workers stop
spin-waiting between parallel regions (``toolspec_core/model/openmp.py``). In one process, the
embedded model, plain greedy, ``--tokens`` new tokens of a short prompt, each round in this order:
on the loading thread (its team the only one), on a worker thread while the loading thread's team
lives (two teams, as a replica without the hand-back), and on that worker thread after
:func:`~toolspec_core.model.openmp.release_team` on the loading thread (one team again, what
``EngineHost.build`` does). Milliseconds per decoded token, median over rounds.

    python -m benchmarks.studies.openmp_teams --json benchmarks/results/measurements/openmp-teams-cpu-HW-<commit>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT = "Write the numbers from 1 to 300 separated by commas, nothing else."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import torch

    from toolspec_core import DecodeConfig, generate, load_target
    from toolspec_core.model.openmp import release_team

    target = load_target("embedded")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    cfg = DecodeConfig(max_new_tokens=a.tokens)

    def ms_per_token() -> float:
        r = generate(target, ids, None, cfg)
        return 1e3 * r.stats.decode_s / max(1, len(r.tokens) - 1)

    worker = ThreadPoolExecutor(1)
    worker.submit(ms_per_token).result()  # the worker's first parallel regions and allocations, untimed
    times = {"loading_thread": [], "second_thread_two_teams": [], "second_thread_after_release": []}
    for _ in range(a.rounds):
        worker.submit(release_team).result()  # the worker's team from the round before: one team below
        times["loading_thread"].append(ms_per_token())  # (re)makes the loading thread's team
        times["second_thread_two_teams"].append(worker.submit(ms_per_token).result())
        assert release_team(), "not GNU OpenMP: nothing to measure"
        times["second_thread_after_release"].append(worker.submit(ms_per_token).result())
    worker.shutdown()
    out = {
        "study": "openmp_teams",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "python -m benchmarks.studies.openmp_teams " + " ".join(sys.argv[1:] if argv is None else argv),
        "ms_per_token_median": {k: round(statistics.median(v), 1) for k, v in times.items()},
        "ms_per_token": {k: [round(x, 1) for x in v] for k, v in times.items()},
    }
    print(json.dumps(out["ms_per_token_median"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
