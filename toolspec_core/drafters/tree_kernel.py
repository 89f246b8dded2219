"""The drafting kernels compiled (``kernels/*.c``), built once per machine: the schema tree's
merge loop (``tree_merge.c``, :func:`load`), suffix drafting's per-step walk for a batch
(``suffix_walk.c``, :func:`load_suffix`; ``suffix.walk_batch`` says what it does) and the
boundary tokenizer's ASCII encoder and whole-candidate tokenization (``bpe.c``, :func:`load_bpe`;
``boundary.native_encoder``, ``BoundaryTokenizer.tokenize``).

Why: merging a step's candidates into one trie -- a child lookup and a node append per token,
a rate per new node, the mass of every node on each chain, the stop test over all nodes, each
node's confidence -- is per-token Python work that the profile of drafting puts at about a
quarter of it (docs/design.md, "Where drafting's time goes"); it is plain integers and floats,
so C does it without the interpreter. Each candidate's tokens come from a callback (the tool
set's token table, on a miss the boundary tokenizer, whose whole-candidate ``tokenize`` is
``bpe.c``'s), as do the learned rates (called back once per distinct (label, parent label)).

Built with the system C compiler against this Python's headers (no torch) into the project's
cache (``~/.cache/toolspec/kernels``, or under ``TOOLSPEC_CACHE``), named by the source's hash,
on first use (a second or two). Where that is impossible -- no compiler or headers, or
``TOOLSPEC_TREE_KERNEL=0`` (``TOOLSPEC_SUFFIX_KERNEL=0``, ``TOOLSPEC_BPE_KERNEL=0`` for the others) -- the loader
returns None and the drafter runs its Python loop, which is also the reference the tests compare
the compiled one against.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "tree_merge.c"
NAME = "toolspec_tree_merge"
SUFFIX_SOURCE = Path(__file__).parent / "kernels" / "suffix_walk.c"
SUFFIX_NAME = "toolspec_suffix_walk"
BPE_SOURCE = Path(__file__).parent / "kernels" / "bpe.c"
BPE_NAME = "toolspec_bpe"
# IEEE doubles computed in the Python loop's order: no fused multiply-add, no fast-math
CFLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]


def build_dir() -> Path:
    from toolspec_core.model.embedded import cache_root

    return cache_root() / "kernels" / f"tree-merge-{sysconfig.get_config_var('SOABI')}"


def build(source: Path = SOURCE, directory: Path | None = None, name: str = NAME) -> Path:
    """Compile ``source`` into ``directory`` (default :func:`build_dir`) unless a build of the same
    source, compiler and flags is there (the flags carry the bit-exactness); the shared object's path."""
    directory = directory or build_dir()
    cc = os.environ.get("CC", "cc")
    digest = hashlib.sha256(source.read_bytes() + repr((cc, CFLAGS)).encode()).hexdigest()[:16]
    out = directory / f"{name}-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if out.exists():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [cc, *CFLAGS, f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same file
    return out


@functools.lru_cache(maxsize=1)
def load():
    """The compiled tree merge (``merge``), or None where it cannot be built or is switched off."""
    return _load(SOURCE, NAME, "TOOLSPEC_TREE_KERNEL", "drafting merges trees in Python")


@functools.lru_cache(maxsize=1)
def load_suffix():
    """The compiled suffix walk (``walk``), or None where it cannot be built or is switched off."""
    return _load(SUFFIX_SOURCE, SUFFIX_NAME, "TOOLSPEC_SUFFIX_KERNEL", "suffix drafting walks in Python")


@functools.lru_cache(maxsize=1)
def load_bpe():
    """The compiled ASCII byte-level BPE encoder (``make``, ``encode``), or None."""
    return _load(BPE_SOURCE, BPE_NAME, "TOOLSPEC_BPE_KERNEL", "the boundary tokenizer encodes with the tokenizer")


def _load(source: Path, name: str, switch: str, fallback: str):
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        path = build(source, name=name)
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except Exception as exc:  # no compiler / headers: the Python loop, never a failed draft
        log.warning("%s unavailable (%s: %s); %s", name, type(exc).__name__, exc, fallback)
        return None
