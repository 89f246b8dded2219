"""The images' Dockerfiles (docker/) against the repository, without building them: every file a
``COPY``/``ADD`` takes from the build context (the repository root) exists and survives
.dockerignore, every repository file a ``RUN`` names was copied in before it, and the overlays run
the images these files build."""

from __future__ import annotations

import fnmatch
import posixpath
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
sys.path.insert(0, str(K8S))

import k8s_render  # noqa: E402

# overlay -> the Dockerfile of the image it runs
IMAGES = {"cpu-dev": "docker/Dockerfile.cpu", "gpu-prod": "docker/Dockerfile.gpu"}
# a file-like word in a RUN line: relative, with a directory part, not a URL, an option or a variable
REPO_PATH = re.compile(r"^(\./)?[\w.-]+(/[\w.*-]+)+/?$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comment lines dropped (also inside a continued
    instruction, as Docker does), backslash continuations joined."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    assert not current.strip(), f"{path}: a continuation runs off the end"
    return out


def copy_sources(args: str) -> tuple[list[str], str] | None:
    """(sources, destination) of a COPY / ADD from the build context; None for a copy from a stage."""
    words = shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"COPY {args}: needs a source and a destination"
    return paths[:-1], paths[-1]


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Docker's matching of one path: ``*`` and ``?`` stay within a component, ``**`` spans any."""
    if pattern and pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return len(parts) == len(pattern) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pattern))


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``rel`` (or a directory above it) out of the context (the
    patterns here use no ``!`` exceptions)."""
    assert not any(p.startswith("!") for p in patterns), "exceptions are not handled here"
    parts = rel.strip("/").split("/")
    return any(_matches(parts[:n], p.split("/")) for n in range(1, len(parts) + 1) for p in patterns)


def context_files(source: str) -> list[Path]:
    """What a COPY source names in the build context (globs allowed)."""
    if source in (".", "./"):
        return [ROOT]
    return sorted(ROOT.glob(source.rstrip("/"))) if any(c in source for c in "*?[") else [ROOT / source]


def check_dockerfile(rel: str) -> list[str]:
    """Every problem of one Dockerfile against the repository."""
    path = ROOT / rel
    patterns = dockerignore()
    problems: list[str] = []
    workdir = "/"
    copied: list[tuple[str, str]] = []  # (absolute path in the image, repository path; "." the root)
    for word, args in instructions(path):
        if word == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, args))
        elif word in ("COPY", "ADD"):
            parsed = copy_sources(args)
            if parsed is None:
                continue
            sources, dest = parsed
            dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
            for src in sources:
                files = context_files(src)
                if not files or not all(f.exists() for f in files):
                    problems.append(f"{rel}: {word} {src}: not in the repository")
                    continue
                if src not in (".", "./") and ignored(src, patterns):
                    problems.append(f"{rel}: {word} {src}: left out of the context by .dockerignore")
                for f in files:
                    # a directory's contents land in the destination; a file in it when it ends in "/"
                    into = f.is_file() and (dest.endswith("/") or len(files) > 1 or dest in (".", "./"))
                    copied.append((posixpath.join(dest_abs, f.name) if into else dest_abs, str(f.relative_to(ROOT))))
        elif word == "RUN":
            for token in shlex.split(args):
                if ":" in token or token.startswith(("-", "$", "/")) or not REPO_PATH.match(token):
                    continue
                absolute = posixpath.normpath(posixpath.join(workdir, token))
                owners = [(d, r) for d, r in copied if absolute == d or absolute.startswith(d.rstrip("/") + "/")]
                if not owners:
                    problems.append(f"{rel}: RUN names {token}, which no earlier COPY put at {absolute}")
                    continue
                base, repo = max(owners, key=lambda o: len(o[0]))
                repo_path = posixpath.normpath(posixpath.join(repo, posixpath.relpath(absolute, base)))
                if not (ROOT / repo_path).exists():
                    problems.append(f"{rel}: RUN names {token} ({repo_path}), not in the repository")
                elif ignored(repo_path, patterns):
                    problems.append(f"{rel}: RUN names {token}, left out of the context by .dockerignore")
    return problems


@pytest.mark.parametrize("rel", sorted(set(IMAGES.values())))
def test_dockerfile_refers_to_files_that_exist(rel):
    assert check_dockerfile(rel) == []


@pytest.mark.parametrize("rel", sorted(set(IMAGES.values())))
def test_dockerfile_installs_the_project(rel):
    """The package's own files reach the image, and it installs with the pinned torch."""
    patterns = dockerignore()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], "requirements"]
    needed += [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert [n for n in needed if ignored(n, patterns)] == []
    runs = " ".join(args for word, args in instructions(ROOT / rel) if word == "RUN")
    assert "-c requirements/gpu-constraints.txt" in runs  # torch's pin, the same as pyproject.toml's
    pins = [d for d in project["project"]["dependencies"] if d.startswith("torch==")]
    assert pins and pins[0] in (ROOT / "requirements" / "gpu-constraints.txt").read_text()


def test_cpu_image_builds_the_kernel_and_gpu_image_deepspeed():
    cpu = " ".join(args for word, args in instructions(ROOT / IMAGES["cpu-dev"]) if word == "RUN")
    assert "rows_kernel" in cpu and "download.pytorch.org/whl/cpu" in cpu and "embedded_model_dir" in cpu
    gpu = instructions(ROOT / IMAGES["gpu-prod"])
    assert any(w == "FROM" and "CUDA_IMAGE" in a for w, a in gpu)
    runs = " ".join(a for w, a in gpu if w == "RUN")
    assert "[serve,tp,k8s]" in runs and "--no-build-isolation" in runs and "DS_BUILD_OPS" in runs


def test_planted_problems_are_found(tmp_path):
    broken = tmp_path / "Dockerfile"
    broken.write_text(
        "FROM python:3.11-slim\nWORKDIR /src\nRUN pip install -r requirements/model.txt\n"
        "COPY requirements/ requirements/\nCOPY no-such-dir/ x/\n"
        "RUN pip install -r \\\n    requirements/missing.txt\nCOPY tests/ tests/\n"
    )
    problems = check_dockerfile(str(broken))  # ROOT / an absolute path is that path
    text = "\n".join(problems)
    assert "RUN names requirements/model.txt, which no earlier COPY" in text
    assert "COPY no-such-dir/: not in the repository" in text
    assert "requirements/missing.txt (requirements/missing.txt), not in the repository" in text
    assert "COPY tests/: left out of the context by .dockerignore" in text


def test_overlays_run_the_images():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay, rel in IMAGES.items():
        docs = k8s_render.render(K8S / "overlays" / overlay)
        rc = next(d for d in docs if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
        pods = [rc["headGroupSpec"]] + rc["workerGroupSpecs"]
        images = {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}
        assert len(images) == 1, images
        (image,) = images
        assert image.endswith(f":{version}"), image  # the tag is the package's version
        # the Dockerfile documents the build of exactly this image
        assert f"-t {image} ." in (ROOT / rel).read_text(), (overlay, image)
        suffix = {"docker/Dockerfile.cpu": "toolspec-cpu", "docker/Dockerfile.gpu": "toolspec-gpu"}[rel]
        assert image.split(":")[0].endswith("/" + suffix)
