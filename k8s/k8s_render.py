"""Render a kustomization offline, for machines without `kubectl kustomize`.

Implements only the kustomize subset these manifests use, and fails loudly on anything
else so a rendering can never silently differ from `kubectl kustomize`:
``resources`` (files and directories), ``namespace``, ``images`` (newName/newTag/digest)
and ``patches`` (strategic-merge, including ``$patch: delete`` of a whole resource, and
JSON 6902). Transformers run in kustomize's order: patches, namespace, images.
tests/k8s/test_k8s.py compares its output with `kubectl kustomize` wherever that exists.

Usage: python k8s/k8s_render.py k8s/overlays/cpu-dev
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}

# kustomize's "legacy" output order; kinds not listed go between FIRST and LAST.
ORDER_FIRST = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]

CLUSTER_SCOPED = {
    "Namespace",
    "Node",
    "PersistentVolume",
    "StorageClass",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "IngressClass",
    "RuntimeClass",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "APIService",
    "CSIDriver",
    "CSINode",
    "VolumeAttachment",
}

# API groups whose kinds kustomize patches with their OpenAPI merge keys; custom resources
# have none, so kustomize replaces their lists wholesale (verified against kubectl 1.32).
BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "scheduling.k8s.io",
}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "volumeDevices": "devicePath",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render exactly (or that kustomize would reject)."""


def render(directory: str | Path) -> list[dict]:
    """Build the kustomization in *directory* and return its resources in kustomize's order."""
    return sort_resources(_build(Path(directory).resolve(), stack=()))


def dump(docs: list[dict]) -> str:
    """YAML stream as kustomize prints it (sorted keys, block style, `---` between docs)."""
    return "---\n".join(yaml.dump(d, Dumper=_BlockDumper, sort_keys=True, default_flow_style=False) for d in docs)


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as `|` blocks and quotes with `"` (`'` around a
    string holding `"`), like kustomize."""

    def choose_scalar_style(self):
        style = super().choose_scalar_style()
        value = self.event.value
        if style in ("'", '"') and '"' in value and "'" not in value and "\n" not in value:
            return "'"  # a string holding double quotes (JSON in a rayStartParams value): kustomize single-quotes it
        return '"' if style == "'" else style


def _str_representer(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


def _kustomization_path(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise KustomizeError(f"no kustomization file in {directory}")


def _build(directory: Path, stack: tuple) -> list[dict]:
    if directory in stack:
        raise KustomizeError(f"cycle in kustomization resources at {directory}")
    path = _kustomization_path(directory)
    kust = yaml.safe_load(path.read_text()) or {}
    unknown = set(kust) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported kustomization fields {sorted(unknown)}")
    docs: list[dict] = []
    for entry in kust.get("resources") or []:
        docs.extend(_load_resource(directory, entry, stack + (directory,)))
    _check_unique(docs, path)
    for patch in kust.get("patches") or []:
        docs = _apply_patch_entry(docs, patch, directory)
    if kust.get("namespace"):
        docs = [_set_namespace(d, kust["namespace"]) for d in docs]
    for image in kust.get("images") or []:
        docs = [_set_image(d, image) for d in docs]
    return docs


def _load_resource(base: Path, entry: str, stack: tuple) -> list[dict]:
    if "://" in entry or entry.startswith("git@"):
        raise KustomizeError(f"remote resource {entry!r} not supported offline")
    target = (base / entry).resolve()
    if target.is_dir():
        return _build(target, stack)
    if not target.is_file():
        raise KustomizeError(f"resource {entry!r} not found under {base}")
    return _load_yaml_docs(target)


def _load_yaml_docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "metadata" not in d:
            raise KustomizeError(f"{path}: every document needs kind and metadata")
    return docs


def resource_id(doc: dict) -> tuple[str, str, str, str]:
    """(apiVersion, kind, namespace, name): what kustomize treats as a resource's identity."""
    meta = doc.get("metadata") or {}
    return (doc.get("apiVersion", ""), doc["kind"], meta.get("namespace") or "", meta.get("name", ""))


def _check_unique(docs: list[dict], where: Path) -> None:
    seen = set()
    for d in docs:
        rid = resource_id(d)
        if rid in seen:
            raise KustomizeError(f"{where}: duplicate resource {rid}")
        seen.add(rid)


def _group_version(api_version: str) -> tuple[str, str]:
    return tuple(api_version.split("/", 1)) if "/" in api_version else ("", api_version)


def _matches(doc: dict, target: dict) -> bool:
    """kustomize selector semantics: each given field is an anchored regular expression."""
    group, version = _group_version(doc.get("apiVersion", ""))
    meta = doc.get("metadata") or {}
    fields = {
        "group": group,
        "version": version,
        "kind": doc["kind"],
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace") or "",
    }
    unsupported = set(target) - set(fields)
    if unsupported:
        raise KustomizeError(f"unsupported patch target fields {sorted(unsupported)}")
    return all(re.fullmatch(str(v), fields[k]) for k, v in target.items() if v is not None)


def _apply_patch_entry(docs: list[dict], entry: dict, base: Path) -> list[dict]:
    if "path" in entry:
        text = (base / entry["path"]).read_text()
        label = entry["path"]
    elif "patch" in entry:
        text, label = entry["patch"], "inline patch"
    else:
        raise KustomizeError(f"patch entry needs path or patch: {entry}")
    unsupported = set(entry) - {"path", "patch", "target", "options"}
    if unsupported or entry.get("options"):
        raise KustomizeError(f"{label}: unsupported patch fields {sorted(unsupported) or ['options']}")
    body = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(body, list):
        if not target:
            raise KustomizeError(f"{label}: a JSON 6902 patch needs a target")
        return _apply_to_targets(docs, target, label, lambda d: json6902(d, body))
    if not isinstance(body, dict):
        raise KustomizeError(f"{label}: patch is neither a strategic-merge map nor a JSON 6902 list")
    if not target:
        meta = body.get("metadata") or {}
        group, version = _group_version(body.get("apiVersion", ""))
        target = {
            "kind": body.get("kind"),
            "name": re.escape(meta.get("name", "")),
            "group": re.escape(group),
            "version": re.escape(version),
        }
        if meta.get("namespace"):
            target["namespace"] = re.escape(meta["namespace"])
    if body.get("$patch") == "delete":
        hits = [d for d in docs if _matches(d, target)]
        if not hits:
            raise KustomizeError(f"{label}: no resource matches {target}")
        return [d for d in docs if not _matches(d, target)]
    return _apply_to_targets(docs, target, label, lambda d: strategic_merge(d, body))


def _apply_to_targets(docs, target, label, fn) -> list[dict]:
    out, hits = [], 0
    for d in docs:
        if _matches(d, target):
            hits += 1
            try:
                d = fn(d)
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise KustomizeError(f"{label} on {resource_id(d)}: {exc}") from exc
        out.append(d)
    if not hits:
        raise KustomizeError(f"{label}: no resource matches {target}")
    return out


def strategic_merge(doc: dict, patch: dict) -> dict:
    """Strategic-merge *patch* into a copy of *doc* (maps merge, null deletes, keyed lists merge)."""
    group, _ = _group_version(doc.get("apiVersion", ""))
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    body["metadata"] = {k: v for k, v in (patch.get("metadata") or {}).items() if k not in ("name", "namespace")}
    return _merge_map(copy.deepcopy(doc), body, builtin=group in BUILTIN_GROUPS)


def _merge_map(base: dict, patch: dict, builtin: bool) -> dict:
    for key, value in patch.items():
        if isinstance(key, str) and key.startswith("$"):
            raise KustomizeError(f"strategic-merge directive {key} not supported here")
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _merge_map(base[key], value, builtin)
        elif isinstance(value, list) and isinstance(base.get(key), list):
            base[key] = _merge_list(key, base[key], value, builtin)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _merge_key(field: str, items: list) -> str | None:
    if field == "ports":
        return "containerPort" if all("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field)


def _merge_list(field: str, base: list, patch: list, builtin: bool) -> list:
    key = _merge_key(field, base + patch) if builtin else None
    if key is None or not all(isinstance(i, dict) and key in i for i in base + patch):
        return copy.deepcopy(patch)
    merged = [copy.deepcopy(i) for i in base]
    index = {item[key]: n for n, item in enumerate(merged)}
    for item in patch:
        if item[key] in index:
            n = index[item[key]]
            merged[n] = _merge_map(merged[n], item, builtin)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def json6902(doc: dict, ops: list[dict]) -> dict:
    """Apply RFC 6902 operations to a copy of *doc*."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind = op.get("op")
        if kind in ("add", "replace"):
            _pointer_set(doc, op["path"], copy.deepcopy(op["value"]), insert=kind == "add")
        elif kind == "remove":
            _pointer_remove(doc, op["path"])
        elif kind in ("move", "copy"):
            value = _pointer_get(doc, op["from"])
            if kind == "move":
                _pointer_remove(doc, op["from"])
            _pointer_set(doc, op["path"], copy.deepcopy(value), insert=True)
        elif kind == "test":
            if _pointer_get(doc, op["path"]) != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unknown JSON patch op {kind!r}")
    return doc


def _pointer_tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {pointer!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _step(node: Any, token: str) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, token, allow_end=False)]
    if isinstance(node, dict):
        if token not in node:
            raise KeyError(f"path element {token!r} not found")
        return node[token]
    raise TypeError(f"cannot index {type(node).__name__} with {token!r}")


def _list_index(node: list, token: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit():
        raise ValueError(f"bad list index {token!r}")
    n = int(token)
    if n > len(node) or (n == len(node) and not allow_end):
        raise IndexError(f"list index {n} out of range")
    return n


def _pointer_get(doc: Any, pointer: str) -> Any:
    node = doc
    for token in _pointer_tokens(pointer):
        node = _step(node, token)
    return node


def _parent_and_last(doc: Any, pointer: str) -> tuple[Any, str]:
    """The container a JSON pointer's last element lives in, and that element's token."""
    tokens = _pointer_tokens(pointer)
    if not tokens:
        raise ValueError("a patch cannot replace or remove the whole document")
    parent = doc
    for token in tokens[:-1]:
        parent = _step(parent, token)
    return parent, tokens[-1]


def _pointer_set(doc: Any, pointer: str, value: Any, insert: bool) -> None:
    parent, last = _parent_and_last(doc, pointer)
    if isinstance(parent, list):
        n = _list_index(parent, last, allow_end=insert)
        if insert:
            parent.insert(n, value)
        else:
            parent[n] = value
    elif isinstance(parent, dict):
        if not insert and last not in parent:
            raise KeyError(f"replace: path element {last!r} not found")
        parent[last] = value
    else:
        raise TypeError(f"cannot set {last!r} inside {type(parent).__name__}")


def _pointer_remove(doc: Any, pointer: str) -> None:
    parent, last = _parent_and_last(doc, pointer)
    _step(parent, last)  # the element must exist (same errors as a lookup)
    if isinstance(parent, list):
        del parent[_list_index(parent, last, allow_end=False)]
    else:
        del parent[last]


def _set_namespace(doc: dict, namespace: str) -> dict:
    if doc["kind"] in CLUSTER_SCOPED:
        return doc
    if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        raise KustomizeError("namespace transformer on role bindings is not supported here")
    doc = copy.deepcopy(doc)
    doc.setdefault("metadata", {})["namespace"] = namespace
    return doc


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """'host:5000/repo/img:tag@sha256:..' -> ('host:5000/repo/img', 'tag', 'sha256:..')."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _set_image(doc: dict, spec: dict) -> dict:
    unsupported = set(spec) - {"name", "newName", "newTag", "digest"}
    if unsupported:
        raise KustomizeError(f"unsupported image fields {sorted(unsupported)}")
    doc = copy.deepcopy(doc)
    for container in _containers(doc):
        image = container.get("image")
        if not isinstance(image, str):
            continue
        name, tag, digest = split_image(image)
        if name != spec["name"]:
            continue
        name = spec.get("newName", name)
        if spec.get("digest"):
            tag, digest = None, spec["digest"]
        elif spec.get("newTag") is not None:
            tag, digest = str(spec["newTag"]), None
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    return doc


def _containers(node: Any):
    """Every container map anywhere in the document (kustomize finds them in custom resources too)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _order(doc: dict) -> tuple:
    kind = doc["kind"]
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    api, kind, namespace, name = resource_id(doc)
    group, version = _group_version(api)
    return (rank, group, version, kind, namespace, name)


def sort_resources(docs: list[dict]) -> list[dict]:
    return sorted(docs, key=_order)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        sys.stdout.write(dump(render(argv[0])))
    except KustomizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
