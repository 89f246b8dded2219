"""The few-rows CPU linear kernel (``kernels/rows_linear.cpp``), built once per machine.

Why: a tree-verify step multiplies 1-64 rows by every weight; x86 BLAS and oneDNN GEMMs are built
for many rows and pay for it at few. This kernel streams each weight once at the machine's read
bandwidth (16 weight rows prefetched ahead into L2) whatever the row count, so plain decoding and
every small verify step cost little more than reading the weights (``docs/cpu-kernel.md`` has the
measurements). It computes a row the same way whatever the row count: a row's linear outputs are
bit for bit those of a one-row call (the attention around them is not batch-invariant, so whole
forwards still differ in the last bits), and the same in its AVX2 and AVX-512VL builds.

Compiled with torch's C++ extension tooling (a C++ compiler, AVX2 + FMA, AVX-512VL where present, OpenMP) into
the project's cache (``~/.cache/toolspec/kernels``, or under ``TOOLSPEC_CACHE``) on first use (``scripts/setup.sh`` does it up front, ~1 min); where
that is impossible -- no compiler, no AVX2, or ``TOOLSPEC_ROWS_KERNEL=0`` -- :func:`load` returns
None and the linears keep the oneDNN / ``F.linear`` dispatch.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "rows_linear.cpp"
# up to this many rows the kernel beats oneDNN on the dev CPU (whole-model forwards at 16-64 tokens take
# 0.70-0.94x oneDNN's time: measurements/rows-kernel-vs-onednn-cpu-avx512-afe9e69.json), so every
# verify step the budget allows (root + 63 nodes) goes through it
MAX_ROWS = 64


AVX2_FLAGS = ["-mavx2", "-mfma"]
AVX512_FLAGS = [*AVX2_FLAGS, "-mavx512f", "-mavx512vl"]


def wide_registers() -> bool:
    """Whether this CPU has AVX-512VL: 32 ymm registers, bigger tiles (the same per-output arithmetic,
    so both builds give the same bits)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def isa_flags() -> list[str]:
    return AVX512_FLAGS if wide_registers() else AVX2_FLAGS


def build_dir(flavour: str | None = None, source: Path = SOURCE) -> Path:
    """Where a build lives: per torch version, instruction-set flavour (``avx512`` / ``avx2``,
    default this CPU's) and source file (its path and text), so switching flags never reuses
    another build and two checkouts never rebuild over each other's (ninja rebuilds whenever the
    source's path differs from the one it last built). The folder's headers count as part of the source."""
    import hashlib

    from toolspec_core.model.embedded import cache_root

    flavour = flavour or ("avx512" if wide_registers() else "avx2")
    text = source.read_bytes() + b"".join(
        h.read_bytes() for h in sorted(source.parent.glob("*.h"))
    )  # headers it may include
    key = hashlib.sha256(str(source.resolve()).encode() + b"\0" + text).hexdigest()[:12]
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{flavour}-{key}"


STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a build that died


def clear_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove ``directory``'s build lock when it is older than :data:`STALE_LOCK_S`: torch's
    extension loader waits on that file forever, so a build killed mid-way would otherwise hang
    every later start of a replica. True when one was removed."""
    import time

    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("rows kernel: removing a build lock %.0f s old (%s), left by a build that did not finish", age, lock)
    lock.unlink(missing_ok=True)
    return True


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (``rows_linear(x, w, bias)``), or None where it cannot be used here."""
    return load_kernel(
        SOURCE,
        "toolspec_rows_linear",
        "TOOLSPEC_ROWS_KERNEL",
        "rows kernel",
        "linears keep the oneDNN / F.linear dispatch",
    )


def load_kernel(source: Path, name: str, switch: str, what: str, fallback: str):
    """A kernel of this folder built (once per machine) and loaded, or None -- with one log line
    saying ``fallback`` -- where the environment variable ``switch`` is 0, the CPU lacks AVX2 or
    the build fails (no compiler / headers): a slower path, never a failed load."""
    if os.environ.get(switch, "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("%s: this CPU lacks AVX2; %s", what, fallback)
        return None
    try:
        return build(source, name, build_dir(source=source))
    except Exception as exc:
        log.warning("%s unavailable (%s: %s); %s", what, type(exc).__name__, exc, fallback)
        return None


def build(source: Path, name: str, directory: Path, flags: list[str] | None = None):
    """Compile ``source`` as extension module ``name`` in ``directory`` (also how a benchmark builds an
    older revision's kernel beside this one, and a test the AVX2-only build on an AVX-512 machine);
    ``flags``: the instruction-set flags, default :func:`isa_flags`."""
    from torch.utils.cpp_extension import load as load_extension

    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)
    return load_extension(
        name=name,
        sources=[str(source)],
        build_directory=str(directory),
        extra_cflags=["-O3", "-ffp-contract=off", *(isa_flags() if flags is None else flags), "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
