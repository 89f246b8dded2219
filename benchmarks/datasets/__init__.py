"""The dev splits of the tool-calling benchmarks, kept in the repository (README.md here: source,
split, licence, format), and the one reader of JSONL files that every loader uses.

The splits are stored gzip-compressed (``<name>.dev.jsonl.gz``); a plain ``.jsonl`` a user passes
(``--data``, ``--dataset``) reads the same way.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import IO

DATASETS = Path(__file__).resolve().parent
# the single-request benchmarks every default run and load test mixes
SINGLE_TURN = ("api_bank", "bfcl_v3", "toolalpaca")
CONVERSATIONS = "bfcl_v3_multi_turn"  # one row per (conversation, turn): the agent-conversation workload


def dev_set(name: str) -> Path:
    """The in-repository file of dev split ``name`` (``api_bank``, ``bfcl_v3``, ...)."""
    return DATASETS / f"{name}.dev.jsonl.gz"


def open_text(path: str | Path) -> IO[str]:
    """A JSONL file opened for reading text, gunzipped on the fly when it ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first ``limit`` (None: all) JSON objects of a JSONL file, blank lines skipped."""
    rows = []
    with open_text(path) as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows
