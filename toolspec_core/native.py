"""The project's small C kernels (plain C against this Python's headers, no torch), built once per
machine: the drafters' (``drafters/tree_kernel.py``: the tree merge, the suffix walk, the BPE
encoder) and the budget's cut (``spec/tree.py``).

Built with the system C compiler into the project's cache (``~/.cache/toolspec/kernels``, or under
``TOOLSPEC_CACHE``), named by the source's hash, on first use (a second or two; ``scripts/setup.sh``
does it up front). Where that is impossible -- no compiler or headers, or the kernel's switch set to
``0`` -- :func:`load_module` returns None and the caller runs its Python reference.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

# IEEE doubles computed in the Python reference's order: no fused multiply-add, no fast-math
CFLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]


def cache_root() -> Path:
    """The project's cache: ``TOOLSPEC_CACHE``, else ``~/.cache/toolspec`` (kernels, the embedded model)."""
    return Path(os.environ.get("TOOLSPEC_CACHE", Path.home() / ".cache" / "toolspec"))


def build_dir() -> Path:
    return cache_root() / "kernels" / f"c-{sysconfig.get_config_var('SOABI')}"


def build(source: Path, directory: Path | None = None, name: str | None = None) -> Path:
    """Compile ``source`` into ``directory`` (default :func:`build_dir`) as module ``name`` (default
    the file's stem) unless a build of the same source, compiler and flags is there (the flags carry
    the bit-exactness); the shared object's path."""
    directory = directory or build_dir()
    name = name or source.stem
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


def load_module(source: Path, name: str, switch: str, fallback: str):
    """The compiled module ``name`` from ``source``, or None where the environment variable
    ``switch`` is ``0`` or it cannot be built (logged once with ``fallback``: what runs instead)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        path = build(source, name=name)
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except Exception as exc:  # no compiler / headers: the Python reference, never a failed step
        log.warning("%s unavailable (%s: %s); %s", name, type(exc).__name__, exc, fallback)
        return None
