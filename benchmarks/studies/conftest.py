"""The studies' tests use the suite's helpers: ``tests/`` folders on the path, as its conftest puts them."""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
for folder in (TESTS, TESTS / "benchmarks", TESTS / "drafters" / "toolcall"):
    sys.path.insert(0, str(folder))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
