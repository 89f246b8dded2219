"""The drafting kernels compiled (``kernels/*.c``), built once per machine: the schema tree's
merge loop (``tree_merge.c``, :func:`load`), suffix drafting's per-step walk for a batch
(``suffix_walk.c``, :func:`load_suffix`; ``suffix.walk_batch`` says what it does) and the
boundary tokenizer's ASCII encoder and whole-candidate tokenization (``bpe.c``, :func:`load_bpe`;
``boundary.native_encoder``, ``BoundaryTokenizer.tokenize``), and the walk of the schema
candidates' expansion graph (``cand_walk.c``, :func:`load_walk`; ``candidates.walk`` is its
Python reference).

Why: merging a step's candidates into one trie -- a child lookup and a node append per token,
a rate per new node, the mass of every node on each chain, the stop test over all nodes, each
node's confidence -- is per-token Python work that the profile of drafting puts at about a
quarter of it (docs/design.md, "Where drafting's time goes"); it is plain integers and floats,
so C does it without the interpreter. Each candidate's tokens come from a callback (the tool
set's token table, on a miss the boundary tokenizer, whose whole-candidate ``tokenize`` is
``bpe.c``'s), as do the learned rates (called back once per distinct (label, parent label)).

Built with the system C compiler against this Python's headers (no torch) into the project's
cache (``~/.cache/toolspec/kernels``, or under ``TOOLSPEC_CACHE``), named by the source's hash,
on first use (a second or two; ``toolspec_core.native``). Where that is impossible -- no compiler or headers, or
``TOOLSPEC_TREE_KERNEL=0`` (``TOOLSPEC_SUFFIX_KERNEL=0``, ``TOOLSPEC_BPE_KERNEL=0``, ``TOOLSPEC_WALK_KERNEL=0`` for the others) -- the loader
returns None and the drafter runs its Python loop, which is also the reference the tests compare
the compiled one against.
"""

from __future__ import annotations

import functools
from pathlib import Path

from toolspec_core.native import load_module

SOURCE = Path(__file__).parent / "kernels" / "tree_merge.c"
NAME = "toolspec_tree_merge"
SUFFIX_SOURCE = Path(__file__).parent / "kernels" / "suffix_walk.c"
SUFFIX_NAME = "toolspec_suffix_walk"
BPE_SOURCE = Path(__file__).parent / "kernels" / "bpe.c"
BPE_NAME = "toolspec_bpe"
WALK_SOURCE = Path(__file__).parent / "kernels" / "cand_walk.c"
WALK_NAME = "toolspec_cand_walk"


@functools.lru_cache(maxsize=1)
def load():
    """The compiled tree merge (``merge``), or None where it cannot be built or is switched off."""
    return load_module(SOURCE, NAME, "TOOLSPEC_TREE_KERNEL", "drafting merges trees in Python")


@functools.lru_cache(maxsize=1)
def load_suffix():
    """The compiled suffix walk (``walk``), or None where it cannot be built or is switched off."""
    return load_module(SUFFIX_SOURCE, SUFFIX_NAME, "TOOLSPEC_SUFFIX_KERNEL", "suffix drafting walks in Python")


@functools.lru_cache(maxsize=1)
def load_bpe():
    """The compiled ASCII byte-level BPE encoder (``make``, ``encode``), or None."""
    return load_module(BPE_SOURCE, BPE_NAME, "TOOLSPEC_BPE_KERNEL", "the boundary tokenizer encodes with the tokenizer")


@functools.lru_cache(maxsize=1)
def load_walk():
    """The compiled walk of the schema candidates' expansion graph (``walk``), or None."""
    return load_module(WALK_SOURCE, WALK_NAME, "TOOLSPEC_WALK_KERNEL", "schema candidates are walked in Python")
