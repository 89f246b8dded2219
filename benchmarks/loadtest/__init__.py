"""``toolspec loadtest``: load-test OpenAI-compatible endpoints the way ``vllm bench serve`` does.

Per endpoint and level it reports TTFT, TPOT, ITL and E2E latency (mean, p50, p90, p95, p99),
output / total tokens per second, requests per second, goodput under ``--slo``, errors by kind,
tool-call validity, MAT and acceptance from the server's ``toolspec`` statistics, and the share
of requests two endpoints answered identically (temperature 0). Endpoints are run one after the
other on the same seeded request sequence.

Load: closed loop (``--concurrency 1,2,4``: N clients, each sends its next request when its last
one finished) or open loop (``--request-rate 2,4,inf``: gamma/Poisson arrivals with
``--burstiness``, capped by ``--max-concurrency``); each level ends after ``--num-requests`` or
``--duration`` and never later than ``--max-seconds`` (requests still in flight then are errors
of kind ``deadline``). Workloads: ``single`` requests mixed from dataset JSONL files, or
``conversations``, agent conversations replayed step by step (workloads.py). ``--ray ADDRESS``
runs the clients as Ray actors spread over a cluster's nodes and merges their records.

Writes ``<name>.json``, ``.md`` and ``.png`` into ``--out``.

Example:
  toolspec loadtest --endpoint toolspec=http://127.0.0.1:8000/v1 --endpoint greedy=http://127.0.0.1:8001/v1 \\
      --concurrency 1,2,4,8 --num-requests 64 --warmup 4 --stream --slo ttft:500,tpot:60
"""

from .cli import main

__all__ = ["main"]
