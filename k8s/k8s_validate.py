"""Validate the rendered manifests offline, before any cluster sees them.

Checks, per rendered overlay:
- core kinds against the Kubernetes OpenAPI schemas with ``kubernetes-validate`` (strict:
  unknown fields are errors);
- the RayService against KubeRay's CRD schema with ``jsonschema``, made strict the way the API
  server's strict field validation is (unknown fields are errors instead of being pruned);
- ``serveConfigV2`` with ``ray.serve.schema.ServeDeploySchema`` plus a check for unknown keys
  (the pydantic model ignores them, Serve would too, silently);
- the Prometheus Operator ``PodMonitor`` structurally (no CRD schema ships here): known fields
  only, a label selector, endpoints naming a port and an absolute path;
- cross references a schema cannot see: secrets/claims/env vars/services named in one object
  exist in another, probes hit the Serve port, GPU sizing matches tensor parallelism, the
  Retrieval deployment's encoder gets a GPU no replica's placement group reserves (or CPUs one
  pod has), a PodMonitor selects pods that have the ports it scrapes.
``resolve_import_path`` and ``validate_app_args`` check the app builder itself (tests call
them once ``deployments.app`` exists).

Usage: python k8s/k8s_validate.py [OVERLAY_DIR ...]   (default: every overlay)
"""

from __future__ import annotations

import copy
import functools
import gzip
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k8s_render  # noqa: E402  (sibling module; k8s/ is not a package)

K8S_DIR = Path(__file__).resolve().parent
OVERLAYS_DIR = K8S_DIR / "overlays"
# KubeRay's RayService CRD, kept in the repository (schema/README.md: its source and commit)
CRD = K8S_DIR / "schema" / "ray.io_rayservices.yaml.gz"
KUBERNETES_VERSION = "1.31.0"
SERVE_PORT_NAME = "serve"
HEALTH_PATH = "/health"
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def find_crd() -> Path:
    """KubeRay's RayService CRD: $TOOLSPEC_RAYSERVICE_CRD (another KubeRay release's, plain or
    gzipped YAML), else the one in ``k8s/schema``."""
    path = Path(os.environ.get("TOOLSPEC_RAYSERVICE_CRD") or CRD)
    if not path.is_file():
        raise FileNotFoundError(f"RayService CRD not found: {path}")
    return path


class ManifestError(ValueError):
    """One or more manifests are invalid; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def overlays() -> list[Path]:
    return sorted(p for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())


def _label(doc: dict) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


# ---------------------------------------------------------------- core kinds


def validate_core(doc: dict, version: str = KUBERNETES_VERSION) -> None:
    """Strict OpenAPI validation of a built-in kind; raises kubernetes_validate.ValidationError."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, version, strict=True)


# ---------------------------------------------------------------- RayService


def strict_schema(schema: Any) -> Any:
    """Copy of a CRD schema where objects with declared properties reject unknown fields."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=4)
def crd_validator(path: str | None = None, version: str = "v1"):
    """A jsonschema validator for the RayService CRD's served *version*, strict."""
    import jsonschema

    path = path or str(find_crd())
    text = gzip.decompress(Path(path).read_bytes()).decode() if path.endswith(".gz") else Path(path).read_text()
    crd = yaml.safe_load(text)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = strict_schema(v["schema"]["openAPIV3Schema"])
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
            return cls(schema)
    raise ManifestError([f"CRD {path} has no version {version}"])


def validate_rayservice(doc: dict, crd_path: str | None = None) -> dict:
    """Validate against the CRD and the Serve schema; returns the parsed serve config."""
    problems = []
    api_version = doc.get("apiVersion", "")
    if api_version != "ray.io/v1":
        problems.append(f"{_label(doc)}: apiVersion {api_version!r}, expected ray.io/v1")
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS_1123.match(name or "") or len(name) > 63:
        problems.append(f"{_label(doc)}: metadata.name {name!r} is not a DNS-1123 label")
    validator = crd_validator(crd_path)
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = "/".join(str(p) for p in err.absolute_path)
        problems.append(f"{_label(doc)}: {where}: {err.message}")
    serve = None
    try:
        serve = validate_serve_config(doc.get("spec", {}).get("serveConfigV2"))
    except ManifestError as exc:
        problems.extend(f"{_label(doc)}: serveConfigV2: {p}" for p in exc.problems)
    if problems:
        raise ManifestError(problems)
    return serve


def validate_serve_config(text: Any) -> dict:
    """serveConfigV2 must be YAML that ServeDeploySchema accepts, with no unknown keys."""
    from pydantic import ValidationError
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    if not isinstance(text, str):
        raise ManifestError([f"must be a YAML string, got {type(text).__name__}"])
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError([f"not valid YAML: {exc}"]) from exc
    if not isinstance(config, dict):
        raise ManifestError(["must be a YAML mapping"])
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        raise ManifestError([f"ServeDeploySchema: {exc}"]) from exc
    problems = _unknown_keys(config, ServeDeploySchema, "")
    problems += _unknown_keys(config.get("http_options") or {}, HTTPOptionsSchema, "http_options.")
    for n, app in enumerate(config.get("applications") or []):
        problems += _unknown_keys(app, ServeApplicationSchema, f"applications[{n}].")
    if problems:
        raise ManifestError(problems)
    return config


def _unknown_keys(data: dict, model, prefix: str) -> list[str]:
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    return [f"unknown key {prefix}{k}" for k in data if k not in known]


# ---------------------------------------------------------------- PodMonitor

PODMONITOR_API = "monitoring.coreos.com/v1"
# the fields of the Prometheus Operator's PodMonitor CRD (v1) a manifest here may use
PODMONITOR_SPEC_FIELDS = {
    "attachMetadata",
    "bodySizeLimit",
    "jobLabel",
    "keepDroppedTargets",
    "labelLimit",
    "labelNameLengthLimit",
    "labelValueLengthLimit",
    "namespaceSelector",
    "podMetricsEndpoints",
    "podTargetLabels",
    "sampleLimit",
    "scrapeClass",
    "scrapeProtocols",
    "selector",
    "targetLimit",
}
PODMONITOR_ENDPOINT_FIELDS = {
    "authorization",
    "basicAuth",
    "bearerTokenSecret",
    "enableHttp2",
    "filterRunning",
    "followRedirects",
    "honorLabels",
    "honorTimestamps",
    "interval",
    "metricRelabelings",
    "params",
    "path",
    "port",
    "portNumber",
    "proxyUrl",
    "relabelings",
    "scheme",
    "scrapeTimeout",
    "tlsConfig",
}
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def validate_podmonitor(doc: dict) -> list[str]:
    """Problems of a PodMonitor by the structure its CRD requires (no schema of it ships here)."""
    label = _label(doc)
    problems = []
    if doc.get("apiVersion") != PODMONITOR_API:
        problems.append(f"{label}: apiVersion {doc.get('apiVersion')!r}, expected {PODMONITOR_API}")
    problems += [f"{label}: unknown field {k}" for k in doc if k not in ("apiVersion", "kind", "metadata", "spec")]
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS_1123.match(name or "") or len(name) > 253:
        problems.append(f"{label}: metadata.name {name!r} is not a DNS-1123 name")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems + [f"{label}: spec must be a mapping"]
    problems += [f"{label}: spec: unknown field {k}" for k in spec if k not in PODMONITOR_SPEC_FIELDS]
    selector = spec.get("selector")
    labels = (selector or {}).get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(selector, dict) or not (labels or selector.get("matchExpressions")):
        problems.append(f"{label}: spec.selector needs matchLabels or matchExpressions")
    elif labels is not None and not (
        isinstance(labels, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        problems.append(f"{label}: spec.selector.matchLabels must map strings to strings")
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return problems + [f"{label}: spec.podMetricsEndpoints must be a non-empty list"]
    for n, ep in enumerate(endpoints):
        where = f"{label}: spec.podMetricsEndpoints[{n}]"
        if not isinstance(ep, dict):
            problems.append(f"{where} must be a mapping")
            continue
        problems += [f"{where}: unknown field {k}" for k in ep if k not in PODMONITOR_ENDPOINT_FIELDS]
        if not isinstance(ep.get("port"), str) and not isinstance(ep.get("portNumber"), int):
            problems.append(f"{where}: needs port (a container port name) or portNumber")
        if not str(ep.get("path", "/metrics")).startswith("/"):
            problems.append(f"{where}: path {ep['path']!r} must start with '/'")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not DURATION.match(str(ep[key])):
                problems.append(f"{where}: {key} {ep[key]!r} is not a duration such as 30s")
    return problems


def _check_podmonitor(doc: dict, docs: list[dict]) -> list[str]:
    """The pods a PodMonitor selects exist (in its namespace) and name the ports it scrapes."""
    labels = doc["spec"]["selector"].get("matchLabels") or {}
    namespace = doc["metadata"].get("namespace")
    pods = [
        (d, group, template)
        for d in docs
        if d["metadata"].get("namespace") == namespace
        for group, template in _pod_templates(d)
        if labels.items() <= ((template.get("metadata") or {}).get("labels") or {}).items()
    ]
    if not pods:
        return [f"{_label(doc)}: selector {labels} matches no pod template"]
    problems = []
    for ep in doc["spec"]["podMetricsEndpoints"]:
        if "port" not in ep:
            continue
        for d, group, template in pods:
            names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports") or []}
            if ep["port"] not in names:
                problems.append(f"{_label(doc)}: {_label(d)} {group} has no container port named {ep['port']!r}")
    return problems


# ---------------------------------------------------------------- the app builder


def resolve_import_path(import_path: str):
    """Import 'pkg.module:attr' (or 'pkg.module.attr') the way Serve does; must be callable."""
    if ":" in import_path:
        module_name, _, attr = import_path.partition(":")
    else:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"bad import path {import_path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{import_path} is not callable")
    return obj


def validate_app_args(args: dict, config_path: str = "deployments.config:ServeAppConfig"):
    """Validate the application args with the builder's own pydantic config."""
    module_name, _, attr = config_path.partition(":")
    model = getattr(importlib.import_module(module_name), attr)
    return model.model_validate(args)


def applications(rayservice: dict) -> list[dict]:
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return list(config.get("applications") or [])


# ---------------------------------------------------------------- cross references


def _pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(group, pod template) of every pod an object creates: a RayService's head and worker
    groups, a workload's one template."""
    if doc["kind"] == "RayService":
        rc = doc["spec"]["rayClusterConfig"]
        out = [("head", rc["headGroupSpec"]["template"])]
        out += [(g["groupName"], g["template"]) for g in rc.get("workerGroupSpecs") or []]
        return out
    template = (doc.get("spec") or {}).get("template")
    return [("pod", template)] if isinstance(template, dict) and template.get("spec") else []


def _pod_specs(doc: dict) -> list[tuple[str, dict]]:
    return [(group, template["spec"]) for group, template in _pod_templates(doc)]


def _quantity(value: Any) -> int:
    return int(str(value)) if value is not None else 0


def check_references(docs: list[dict]) -> list[str]:
    """Problems no single schema sees: dangling names and mismatched sizing."""
    problems: list[str] = []
    secrets = {
        d["metadata"]["name"]: set((d.get("stringData") or {}) | (d.get("data") or {}))
        for d in docs
        if d["kind"] == "Secret"
    }
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    services = {
        d["metadata"]["name"]: {p["port"] for p in d["spec"].get("ports", [])} for d in docs if d["kind"] == "Service"
    }
    for doc in docs:
        for group, pod in _pod_specs(doc):
            template_claims = {t["metadata"]["name"] for t in (doc.get("spec") or {}).get("volumeClaimTemplates") or []}
            volumes = {v["name"] for v in pod.get("volumes") or []} | template_claims
            for v in pod.get("volumes") or []:
                claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
                if claim and claim not in claims:
                    problems.append(f"{_label(doc)} {group}: volume {v['name']} claims missing PVC {claim}")
            for c in pod.get("containers") or []:
                for m in c.get("volumeMounts") or []:
                    if m["name"] not in volumes:
                        problems.append(f"{_label(doc)} {group}/{c['name']}: mount of undefined volume {m['name']}")
                for e in c.get("env") or []:
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref and ref["key"] not in secrets.get(ref["name"], set()):
                        problems.append(
                            f"{_label(doc)} {group}/{c['name']}: env {e['name']} "
                            f"needs secret {ref['name']}/{ref['key']}"
                        )
    for doc in docs:
        if doc["kind"] == "RayService":
            problems += _check_rayservice(doc, services)
        elif doc["kind"] == "PodMonitor":
            problems += _check_podmonitor(doc, docs)
    return problems


def _check_rayservice(doc: dict, services: dict) -> list[str]:
    problems: list[str] = []
    label = _label(doc)
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    port = (serve.get("http_options") or {}).get("port", 8000)
    rc = doc["spec"]["rayClusterConfig"]
    if not rc.get("enableInTreeAutoscaling"):
        problems.append(f"{label}: enableInTreeAutoscaling must be true")
    pods = _pod_specs(doc)
    for group, pod in pods:
        for c in pod["containers"]:
            if c.get("image", "").split(":")[0] == "toolspec":
                problems.append(f"{label} {group}/{c['name']}: image is the unset placeholder 'toolspec'")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
            if ports.get(SERVE_PORT_NAME) != port:
                problems.append(
                    f"{label} {group}/{c['name']}: container port '{SERVE_PORT_NAME}' "
                    f"must be the Serve HTTP port {port}"
                )
            env = {e["name"] for e in c.get("env") or []}
            for app in serve.get("applications") or []:
                args = app.get("args") or {}
                for key in ("api_key_env", "qdrant_api_key_env"):
                    if args.get(key) and args[key] not in env:
                        problems.append(f"{label} {group}/{c['name']}: env {args[key]} ({key}) not set")
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    if (head.get("readinessProbe") or {}).get("httpGet", {}).get("path") == HEALTH_PATH:
        problems.append(
            f"{label}: the head must not gate readiness on {HEALTH_PATH}: KubeRay "
            "deploys serveConfigV2 only after the head is Ready"
        )
    idle = (rc.get("autoscalerOptions") or {}).get("idleTimeoutSeconds", 60)
    for group in rc.get("workerGroupSpecs") or []:
        name = group["groupName"]
        c = group["template"]["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            get = (c.get(probe) or {}).get("httpGet") or {}
            if get.get("path") != HEALTH_PATH or get.get("port") not in (SERVE_PORT_NAME, port):
                problems.append(f"{label} {name}: {probe} must GET {HEALTH_PATH} on the Serve port")
        live = c.get("livenessProbe") or {}
        window = live.get("periodSeconds", 10) * live.get("failureThreshold", 3)
        if window <= idle:
            problems.append(
                f"{label} {name}: liveness window {window}s must exceed the autoscaler idle timeout {idle}s"
            )
        if not group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]:
            problems.append(f"{label} {name}: replicas outside [minReplicas, maxReplicas]")
        gpus = _group_gpus(group)
        for app in serve.get("applications") or []:
            args = app.get("args") or {}
            tp = int(args.get("tensor_parallel_size", 1))
            if not gpus and tp > 1 and args.get("model") != "embedded":
                problems.append(f"{label} {name}: tensor_parallel_size {tp} without GPUs")
    for app in serve.get("applications") or []:
        args = app.get("args") or {}
        problems += _check_engine_gpus(label, args, rc.get("workerGroupSpecs") or [])
        problems += _check_retrieval(label, args, rc.get("workerGroupSpecs") or [])
        problems += _check_placement(label, doc, args)
        host, _, qport = str(args.get("qdrant_url", "")).split("://")[-1].partition(":")
        if args.get("qdrant_url") and (
            host.split(".")[0] not in services or int(qport or 80) not in services[host.split(".")[0]]
        ):
            problems.append(f"{label}: qdrant_url {args['qdrant_url']} names no rendered Service port")
    return problems


def _group_gpus(group: dict) -> int:
    """GPUs of one pod of a worker group (its Ray container's nvidia.com/gpu limit)."""
    c = group["template"]["spec"]["containers"][0]
    return _quantity((c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu"))


def _group_cpus(group: dict) -> float:
    """Ray CPUs of one pod of a worker group: rayStartParams num-cpus, else the container's CPU
    limit or request (what KubeRay passes to ``ray start``)."""
    if "num-cpus" in (group.get("rayStartParams") or {}):
        return float(group["rayStartParams"]["num-cpus"])
    res = group["template"]["spec"]["containers"][0].get("resources") or {}
    value = str((res.get("limits") or {}).get("cpu") or (res.get("requests") or {}).get("cpu") or 0)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def _engine_holds_gpus(args: dict, tp: int) -> bool:
    """Whether a replica's placement group reserves whole GPUs, one per tensor-parallel rank."""
    return tp > 1 and args.get("device", "auto") != "cpu"


def _check_engine_gpus(label: str, args: dict, groups: list[dict]) -> list[str]:
    """Groups whose pods can hold a replica (at least tensor_parallel_size GPUs) hold whole
    replicas, and together room for Serve's max_replicas; groups with fewer GPUs (e.g. one for
    the Retrieval encoder) hold no replica."""
    problems = []
    tp = int(args.get("tensor_parallel_size", 1))
    scaling = args.get("autoscaling") or {}
    engine = [(g, _group_gpus(g)) for g in groups if _group_gpus(g) >= tp and _group_gpus(g)]
    if tp > 1 and any(_group_gpus(g) for g in groups) and not engine:
        problems.append(f"{label}: no worker group has the {tp} GPUs a tensor_parallel_size {tp} replica needs")
    room = 0
    for g, gpus in engine:
        if gpus % tp:
            problems.append(
                f"{label} {g['groupName']}: {gpus} GPUs per pod is not a multiple of tensor_parallel_size {tp}"
            )
        else:
            room += g["maxReplicas"] * (gpus // tp)
    if engine and not problems and scaling.get("max_replicas", 1) > room:
        pods = ", ".join(f"{g['maxReplicas']} pods of {gpus} GPUs ({g['groupName']})" for g, gpus in engine)
        problems.append(f"{label}: Serve max_replicas {scaling['max_replicas']} cannot fit in {pods}")
    return problems


def _check_retrieval(label: str, args: dict, groups: list[dict]) -> list[str]:
    """The Retrieval deployment's actor fits a worker pod: its encoder's GPU fraction on a GPU no
    replica's placement group reserves (with tensor parallelism every GPU of a pod that holds a
    replica is taken), its CPUs on one pod."""
    r = args.get("retrieval") or {}
    if r.get("enabled", True) in (False, "false", "False"):
        return []
    from deployments.config import resolve_key

    problems = []
    try:
        replicas = int(r.get("num_replicas", 1))
        num_cpus = float(r.get("num_cpus", 0))
        enc = r.get("encoder") or {}
        target = args.get("device", "auto")
        if target == "auto":  # what build_app sees: cuda when the cluster has GPUs
            target = "cuda" if any(_group_gpus(g) for g in groups) else "cpu"
        key = resolve_key(
            r.get("key", "auto"), target, enc.get("device", "cpu"), bool(r.get("resources")), args.get("model", "")
        )
        fraction = float(enc.get("num_gpus", 0)) if key in ("qwen", "hybrid") else 0.0
    except (TypeError, ValueError):
        return []  # the app's own config reports it (validate_app_args)
    if num_cpus > max((_group_cpus(g) for g in groups), default=0):
        problems.append(f"{label}: retrieval.num_cpus {num_cpus:g} is more than any worker pod's Ray CPUs")
    if key not in ("qwen", "hybrid"):
        return problems
    device = enc.get("device", "cpu")
    if device == "cuda" and fraction <= 0:
        problems.append(f"{label}: retrieval.encoder.device cuda needs num_gpus > 0 (else the actor sees no GPU)")
    if device != "cuda" and fraction > 0:
        problems.append(
            f"{label}: retrieval.encoder.num_gpus {fraction:g} reserves a GPU the {device} encoder never uses"
        )
    if fraction <= 0:
        return problems
    tp = int(args.get("tensor_parallel_size", 1))
    spare = [g for g in groups if 0 < _group_gpus(g) < tp] if _engine_holds_gpus(args, tp) else groups
    room = sum(g["maxReplicas"] * _group_gpus(g) for g in spare) * int(1 / fraction + 1e-9)
    if room < replicas:
        where = f"fewer than the {tp} GPUs of a replica" if _engine_holds_gpus(args, tp) else "GPUs"
        problems.append(
            f"{label}: retrieval.encoder.num_gpus {fraction:g} x {replicas} replica(s) needs a GPU no "
            f"tensor-parallel placement group reserves: add a worker group with {where} "
            "(overlays/gpu-prod/retrieval-gpu.yaml)"
        )
    return problems


def _check_placement(label: str, doc: dict, args: dict) -> list[str]:
    """Every deployment has a node group whose nodes can hold its actor (CPUs, GPUs and custom
    resources, as Ray places it: deployments/topology.py, which the local multi-node cluster is
    started from), and Serve's max_replicas fit the groups at their maxReplicas."""
    from deployments.config import ServeAppConfig
    from deployments.topology import node_groups, placement, replica_room

    try:
        cfg = ServeAppConfig.model_validate(args)
    except Exception:
        return []  # the app's own config reports it (validate_app_args)
    groups = node_groups(doc)
    problems = [
        f"{label}: no node group can hold the {name} deployment's actor ({', '.join(g.name for g in groups)})"
        for name, where in placement(cfg, groups).items()
        if not where
    ]
    most = cfg.autoscaling.max_replicas if cfg.autoscaling else cfg.num_replicas
    if not problems and most > replica_room(cfg, groups, grown=True):
        problems.append(f"{label}: {most} engine replicas do not fit the node groups' resources")
    return problems


# ---------------------------------------------------------------- everything


def validate_documents(docs: list[dict], version: str = KUBERNETES_VERSION, crd_path: str | None = None) -> list[dict]:
    """Validate every document; raise one ManifestError listing all problems."""
    import kubernetes_validate

    problems: list[str] = []
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc:
            problems.append(f"not a Kubernetes object: {str(doc)[:80]}")
            continue
        if doc["kind"] == "RayService":
            try:
                validate_rayservice(doc, crd_path)
            except ManifestError as exc:
                problems.extend(exc.problems)
            continue
        if doc["kind"] == "PodMonitor":
            problems += validate_podmonitor(doc)
            continue
        try:
            validate_core(doc, version)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{_label(doc)}: no schema for {doc.get('apiVersion')} {doc['kind']}")
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            problems.append(f"{_label(doc)}: {where}: {exc.message}")
    if not problems:
        problems = check_references(docs)
    if problems:
        raise ManifestError(problems)
    return docs


def validate_overlay(path: str | Path, **kw) -> list[dict]:
    """Render *path* with the offline renderer and validate the result."""
    return validate_documents(k8s_render.render(path), **kw)


def mutated(docs: list[dict], kind: str, fn) -> list[dict]:
    """Deep copy of *docs* with *fn* applied to the first document of *kind* (for planted errors)."""
    docs = copy.deepcopy(docs)
    fn(next(d for d in docs if d["kind"] == kind))
    return docs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    targets = [Path(a) for a in argv] or overlays()
    failed = 0
    for target in targets:
        try:
            docs = validate_overlay(target)
        except (ManifestError, k8s_render.KustomizeError) as exc:
            failed += 1
            print(f"FAIL {target}\n  " + str(exc).replace("\n", "\n  "))
            continue
        kinds = ", ".join(_label(d) for d in docs)
        print(f"ok   {target}: {kinds}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
