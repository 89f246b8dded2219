"""A clone runs on its own: nothing in the repository reads a path outside its checkout, and the
default data paths (the dev splits, the RayService CRD) resolve inside it and exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# recorded outputs name the machine they ran on; the rest is scratch or tooling state (a worktree's
# .git file names where its repository lives)
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", "runs", "results", ".gpu", "tmp"}
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".cpp", ""}
# a folder beside the checkout, or this machine's work folder (pieced together so this file does not match)
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", r"\b" + "shared/(data|k8s)", r'"shared"\s*/', "/" + "work/"]))
PARENTS = re.compile(r"__file__\)\.resolve\(\)\.parents\[(\d+)\]")


def candidate_paths() -> list[Path]:
    """What the repository holds: git's tracked and not-ignored files in a checkout (tool state such
    as .hypothesis/ or a venv is ignored), every file under the root elsewhere (an unpacked sdist)."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        res = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        return [ROOT / f for f in res.stdout.decode().split("\0") if f]
    return list(ROOT.rglob("*"))


def repo_text_files() -> list[Path]:
    out = []
    for path in candidate_paths():
        rel = path.relative_to(ROOT)
        if any(p in SKIP_DIRS or p.endswith(".egg-info") or p.endswith("_cache") for p in rel.parts[:-1]):
            continue
        if (
            path.is_file()
            and path.name != ".git"
            and (path.suffix in TEXT_SUFFIXES or path.name.startswith("Dockerfile"))
        ):
            out.append(path)
    return out


def test_the_scan_sees_the_repository():
    files = {p.relative_to(ROOT).as_posix() for p in repo_text_files()}
    assert {"README.md", "pyproject.toml", ".ci/run", "k8s/k8s_validate.py", "benchmarks/README.md"} <= files
    assert "tests/test_repo_paths.py" in files and not any(f.startswith("benchmarks/results/") for f in files)


def test_nothing_reads_outside_the_checkout():
    bad = []
    for path in repo_text_files():
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        bad += [f"{rel}: {m.group(0)!r}" for m in OUTSIDE.finditer(text)]
        # Path(__file__).resolve().parents[i] of a file k folders below the root is the root for i = k
        bad += [f"{rel}: parents[{i}]" for i in map(int, PARENTS.findall(text)) if i >= len(rel.parts)]
    assert not bad


def test_the_outside_patterns_match_what_they_guard_against():
    for line in ('ROOT.parent / "' + 'shared" / "data"', "--data ../" + "shared/" + "data/x.jsonl", "/" + "work/x"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("benchmarks/datasets/api_bank.dev.jsonl.gz, a shared library")


def test_default_data_paths_are_in_the_repository(monkeypatch):
    from benchmarks.cli import _check, _parser
    from benchmarks.datasets import CONVERSATIONS, DATASETS, SINGLE_TURN, dev_set, read_jsonl
    from benchmarks.loadtest.workloads import default_datasets

    names = (*SINGLE_TURN, CONVERSATIONS, "toolbench_examples")
    paths = [dev_set(n) for n in names] + [Path(p) for k in ("single", "conversations") for p in default_datasets(k)]
    ap = _parser()
    args = ap.parse_args([])
    _check(args, ap)  # no --data: the three single-turn dev sets
    paths += [Path(p) for p in args.data]
    assert args.data == [str(dev_set(n)) for n in SINGLE_TURN]

    sys.path.insert(0, str(ROOT / "k8s"))
    import k8s_validate

    monkeypatch.delenv("TOOLSPEC_RAYSERVICE_CRD", raising=False)
    paths.append(k8s_validate.find_crd())
    for path in paths:
        assert path.resolve().is_relative_to(ROOT) and path.is_file(), path
    assert DATASETS.resolve().is_relative_to(ROOT)
    assert len(read_jsonl(dev_set("toolalpaca"))) == 100  # gzip read transparently


def test_a_plain_jsonl_reads_like_the_gzipped_one(tmp_path):
    from benchmarks.data import load_items
    from benchmarks.datasets import dev_set, open_text

    plain = tmp_path / "toolalpaca.dev.jsonl"
    with open_text(dev_set("toolalpaca")) as f:
        plain.write_text(f.read())
    assert load_items(plain) == load_items(dev_set("toolalpaca"))


def test_the_package_ships_the_data_and_not_the_studies():
    from setuptools import find_packages

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(str(ROOT), **cfg["packages"]["find"])
    assert "benchmarks.datasets" in found and "benchmarks.loadtest" in found
    assert not [p for p in found if p.startswith("benchmarks.studies")]
    data = cfg["package-data"]["benchmarks.datasets"]
    assert all(any(Path(p.name).match(g) for g in data) for p in (ROOT / "benchmarks" / "datasets").glob("*.gz"))


@pytest.mark.parametrize("name", ["api_bank", "bfcl_v3", "toolalpaca", "bfcl_v3_multi_turn", "toolbench_examples"])
def test_every_dev_split_has_its_provenance(name):
    readme = (ROOT / "benchmarks" / "datasets" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}.dev.jsonl.gz`"))
    assert "Apache-2.0" in row  # its licence
