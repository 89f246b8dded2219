"""The dev splits of the tool-calling benchmarks, kept in the repository (README.md here: source,
split, licence, format), the one reader of JSONL files that every loader uses, and the
append-only JSONL store a resumable run keeps its finished records in.

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


class JsonlStore:
    """Append-only JSONL keyed records (error records stay on file only); a line cut short by a run
    killed while writing it is dropped from the file, so the next append starts clean."""

    def __init__(self, path: Path, key):
        self.path, self.key = Path(path), key
        self.records: dict = {}
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        good = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            good.append(line)
            if not rec.get("error"):
                self.records[key(rec)] = rec
        if len(good) != len(lines):
            self.path.write_text("".join(f"{line}\n" for line in good), encoding="utf-8")

    def append(self, rec: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
        if not rec.get("error"):
            self.records[self.key(rec)] = rec
