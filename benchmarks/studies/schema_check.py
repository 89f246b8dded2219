"""Study: what checking a request's tool schemas costs on its way to the first token.

Every tool schema of the dev sets (API-Bank, BFCL v3, ToolAlpaca), each checked three ways, median
of ``--rounds`` passes: jsonschema's ``Draft202012Validator.check_schema`` (what
``protocol._schema_problem`` calls on a schema not seen before), one metaschema validator built
once and reused (``iter_errors``), and ``protocol.plainly_valid`` (the one-walk rules); with how
many schemas the walk accepts. Result: benchmarks/results/measurements/schema-check-*.json.

    python -m benchmarks.studies.schema_check --out benchmarks/results/measurements/schema-check-cpu-epyc-COMMIT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.datasets import SINGLE_TURN, dev_set, read_jsonl
from deployments.protocol import plainly_valid


def schemas() -> list[dict]:
    out = []
    for name in SINGLE_TURN:
        for it in read_jsonl(dev_set(name)):
            for tool in it.get("tools") or []:
                params = (tool.get("function") or tool).get("parameters")
                if isinstance(params, dict):
                    out.append(params)
    return out


def per_schema_us(fn, items: list[dict], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for s in items:
            fn(s)
        times.append((time.perf_counter() - t) / len(items) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from jsonschema import Draft202012Validator

    items = schemas()
    meta = Draft202012Validator(Draft202012Validator.META_SCHEMA)
    out = {
        "what": "microseconds per tool schema of the dev sets, median of rounds",
        "schemas": len(items),
        "plainly_valid_accepts": sum(plainly_valid(s) for s in items),
        "check_schema_us": per_schema_us(Draft202012Validator.check_schema, items, a.rounds),
        "reused_validator_us": per_schema_us(lambda s: next(meta.iter_errors(s), None), items, a.rounds),
        "plainly_valid_us": per_schema_us(plainly_valid, items, a.rounds),
    }
    print(json.dumps(out, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
