"""Offline checks of the Kubernetes manifests in k8s/ (issue 7): every overlay renders and
validates, and a planted error of each kind makes validation fail."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
sys.path.insert(0, str(K8S))

import k8s_render  # noqa: E402
import k8s_validate  # noqa: E402
from k8s_validate import ManifestError  # noqa: E402

OVERLAYS = {p.name: p for p in k8s_validate.overlays()}
BUILDER = "deployments.app:build_app"


@pytest.fixture(scope="module")
def crd_path() -> str:
    try:
        return str(k8s_validate.find_crd())
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def rendered(crd_path) -> dict[str, list[dict]]:
    return {name: k8s_render.render(path) for name, path in OVERLAYS.items()}


def _one(docs, kind, name=None):
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, got {len(hits)}"
    return hits[0]


def _args(docs) -> dict:
    (app,) = k8s_validate.applications(_one(docs, "RayService"))
    return app["args"]


def _groups(docs) -> dict[str, dict]:
    return {g["groupName"]: g for g in _one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _worker(docs) -> dict:
    """The worker group that runs the engine replicas (workerGroupSpecs[0])."""
    return _one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _gpus(group) -> int:
    return int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_both_overlays_exist():
    assert {"cpu-dev", "gpu-prod"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_renders_and_validates(rendered, crd_path, overlay):
    docs = k8s_validate.validate_documents(rendered[overlay], crd_path=crd_path)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("RayService", "toolspec"),
        ("StatefulSet", "qdrant"),
        ("Service", "qdrant"),
        ("Secret", "toolspec-secrets"),
        ("PodMonitor", "toolspec"),
        ("Namespace", docs[0]["metadata"]["name"]),
    } <= kinds
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {_one(docs, "Namespace")["metadata"]["name"]}
    sts = _one(docs, "StatefulSet", "qdrant")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_renderer_matches_kustomize(overlay):
    """The offline renderer must print exactly what `kubectl kustomize` prints."""
    for cmd in (["kustomize", "build"], ["kubectl", "kustomize"]):
        if shutil.which(cmd[0]):
            break
    else:
        pytest.skip("neither kustomize nor kubectl on PATH; offline renderer not cross-checked")
    proc = subprocess.run(cmd + [str(OVERLAYS[overlay])], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"{' '.join(cmd)} unusable here: {proc.stderr.strip()[:200]}")
    assert k8s_render.dump(k8s_render.render(OVERLAYS[overlay])) == proc.stdout


def test_rayservice_serve_config(rendered):
    for overlay, docs in rendered.items():
        rs = _one(docs, "RayService")
        assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
        (app,) = k8s_validate.applications(rs)
        assert app["import_path"] == BUILDER, overlay
        args = app["args"]
        assert {
            "model",
            "tensor_parallel_size",
            "dtype",
            "qdrant_url",
            "api_key_env",
            "max_ongoing_requests",
            "autoscaling",
            "retrieval",
        } <= set(args), overlay
        assert {"min_replicas", "max_replicas", "target_ongoing_requests"} <= set(args["autoscaling"])
        assert args["retrieval"]["enabled"] is True


def test_gpu_prod_is_sized_for_qwen72b(rendered):
    docs = rendered["gpu-prod"]
    args, group = _args(docs), _worker(docs)
    assert args["tensor_parallel_size"] in (4, 8) and args["model"] != "embedded"
    pod = group["template"]["spec"]
    gpus = int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus % args["tensor_parallel_size"] == 0
    assert pod["nodeSelector"] and pod["tolerations"]
    assert group["maxReplicas"] > group["minReplicas"] >= 1
    assert args["autoscaling"]["max_replicas"] > args["autoscaling"]["min_replicas"]
    assert _one(docs, "PersistentVolumeClaim", "toolspec-models")


def test_gpu_prod_passes_the_capacity_plan(rendered):
    """The app's own build-time check (deployments.plan.check_plan) on the rendered args, with the
    built-in Qwen2.5-72B config: the model directory exists only in the cluster."""
    from deployments.plan import check_plan, model_shape, parse_memory

    docs = rendered["gpu-prod"]
    args = _args(docs)
    assert args["model"].endswith("/Qwen2.5-72B-Instruct")
    assert (args["device"], args["dtype"], args["tensor_parallel_size"]) == ("cuda", "bfloat16", 8)
    assert (args["attention"], args["cuda_graphs"]) == ("ragged", True)  # the fast decode step, graphs at start-up
    # gpu_memory is at most what the node selector's GPU has (NVIDIA-H100-80GB-HBM3: 81559MiB < 80 GiB)
    product = _worker(docs)["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    assert 0 < parse_memory(args["gpu_memory"]) <= int(re.search(r"(\d+)GB", product).group(1)) * 2**30
    cfg = k8s_validate.validate_app_args(args)
    shape = model_shape("qwen2.5-72b")
    plan = check_plan(cfg, shape)
    # 81559MiB x 0.9 less 18,178,859,008 B of weights per GPU and the 2 GiB reserve: 1,382,864 tokens
    assert plan.fits and plan.pool_tokens == 1_382_864 and plan.concurrency == 1_382_864 // 32768 == 42
    # TP 2: 72,707,522,560 B (67.71 GiB) of weights per GPU leave 12,896 tokens, not one 32,768-token context
    with pytest.raises(ValueError, match="does not fit"):
        check_plan(cfg.model_copy(update={"tensor_parallel_size": 2}), shape)


def test_cpu_dev_is_small_and_gpu_free(rendered):
    docs = rendered["cpu-dev"]
    args, group = _args(docs), _worker(docs)
    assert args["model"] == "embedded" and args["tensor_parallel_size"] == 1
    assert args["autoscaling"]["min_replicas"] == args["autoscaling"]["max_replicas"] == 1
    assert group["minReplicas"] == group["maxReplicas"] == 1
    pod = group["template"]["spec"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(_one(docs, "RayService"))
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_cpu_dev_encoder_on_cpu_with_its_own_threads(rendered):
    """cpu-dev: the Retrieval deployment's encoder is the embedded model (in the CPU image) on CPU,
    with its own torch threads and Ray CPUs, which fit the one worker beside the replica's."""
    docs = rendered["cpu-dev"]
    args = _args(docs)
    cfg = k8s_validate.validate_app_args(args)
    r = cfg.retrieval
    assert r.enabled and r.key == "qwen"
    assert (r.encoder.model, r.encoder.device, r.encoder.num_gpus) == ("embedded", "cpu", 0)
    assert r.encoder.threads and r.num_cpus >= r.encoder.threads
    assert list(_groups(docs)) == ["cpu-workers"]
    pod_cpus = float(_worker(docs)["rayStartParams"]["num-cpus"])
    assert cfg.replica_num_cpus + r.num_cpus <= pod_cpus


def test_gpu_prod_encoder_on_a_gpu_beyond_the_tp_pods(rendered):
    """gpu-prod: every GPU of a gpu-workers pod is reserved by a tp-8 replica's placement group, so
    the encoder's GPU fraction needs a worker group of fewer GPUs than a replica takes."""
    docs = rendered["gpu-prod"]
    cfg = k8s_validate.validate_app_args(_args(docs))
    r, tp = cfg.retrieval, cfg.tensor_parallel_size
    assert r.enabled and r.key == "qwen"
    assert r.encoder.model == "/models/Qwen3-Embedding-0.6B" and r.encoder.pooling == "last"
    assert r.encoder.prefix.startswith("Instruct: ") and r.encoder.prefix.endswith("\nQuery:")
    assert r.encoder.device == "cuda" and 0 < r.encoder.num_gpus <= 1
    assert r.max_batch_size > 1
    groups = _groups(docs)
    engine = groups["gpu-workers"]
    assert _gpus(engine) % tp == 0
    assert cfg.placement_bundles() is not None  # the replica's placement group holds the tp ranks' GPUs
    spare = {name: g for name, g in groups.items() if 0 < _gpus(g) < tp}
    assert list(spare) == ["retrieval-gpu"]
    group = spare["retrieval-gpu"]
    assert group["minReplicas"] >= 1 and _gpus(group) * int(1 / r.encoder.num_gpus) >= r.num_replicas
    # the actor asks for a resource only that group offers: it never takes a TP replica's GPU
    assert r.resources == {"retrieval_gpu": 1.0}
    assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {"retrieval_gpu": 1}
    pod = group["template"]["spec"]
    # its own node pool (marked CHANGE), not the 8-GPU nodes of the replicas
    assert pod["nodeSelector"] and pod["nodeSelector"] != engine["template"]["spec"]["nodeSelector"]
    assert pod["tolerations"]
    # the encoder's weights come from the models volume, read-only
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    assert mounts["models"]["mountPath"] == "/models" and claims["models"] == "toolspec-models"
    assert r.encoder.model.startswith(mounts["models"]["mountPath"] + "/")


def test_gpu_prod_encoder_without_a_spare_gpu_fails(rendered, crd_path):
    """Without the retrieval-gpu group nothing offers the encoder's fraction: validation says so."""
    broken = k8s_validate.mutated(rendered["gpu-prod"], "RayService", lambda d: _rs(d)["workerGroupSpecs"].pop(1))
    with pytest.raises(ManifestError, match="no tensor-parallel placement group reserves"):
        k8s_validate.validate_documents(broken, crd_path=crd_path)


@pytest.mark.parametrize(
    "old,new,match",
    [
        ("num_gpus: 0.25", "num_gpus: 0", "device cuda needs num_gpus"),
        ("device: cuda\n          num_gpus", "device: cpu\n          num_gpus", "never uses"),
    ],
)
@pytest.mark.parametrize("key", ["qwen", "auto"])
def test_gpu_prod_encoder_device_mismatch_fails(rendered, crd_path, old, new, match, key):
    """Checked for the key as written and for ``auto``, which the validator resolves as the app
    does (an encoder on cuda: the Qwen key)."""

    def edit(d):
        _serve(d, "key: qwen", f"key: {key}")
        _serve(d, old, new)

    broken = k8s_validate.mutated(rendered["gpu-prod"], "RayService", edit)
    with pytest.raises(ManifestError, match=match):
        k8s_validate.validate_documents(broken, crd_path=crd_path)


def test_cpu_dev_auto_key_is_the_hidden_state(rendered, crd_path):
    """cpu-dev with ``key: auto``: the encoder would share the CPU target's pod, so the app keys on
    the target's hidden state; an encoder on cuda makes ``auto`` the Qwen key, whose GPU fraction
    the validator then checks."""
    auto = k8s_validate.mutated(rendered["cpu-dev"], "RayService", lambda d: _serve(d, "key: qwen", "key: auto"))
    k8s_validate.validate_documents(auto, crd_path=crd_path)
    assert k8s_validate.validate_app_args(_args(auto)).retrieval.key == "hidden"
    groups = list(_groups(auto).values())
    args = _args(auto)
    args["retrieval"]["encoder"] |= {"device": "cuda", "num_gpus": 0}
    assert any("needs num_gpus" in p for p in k8s_validate._check_retrieval("app", args, groups))


def test_cpu_dev_encoder_cpus_beyond_the_pod_fail(rendered, crd_path):
    broken = k8s_validate.mutated(rendered["cpu-dev"], "RayService", lambda d: _serve(d, "num_cpus: 2", "num_cpus: 6"))
    with pytest.raises(ManifestError, match="retrieval.num_cpus 6"):
        k8s_validate.validate_documents(broken, crd_path=crd_path)


def test_worker_probes_hit_health(rendered):
    for docs in rendered.values():
        for group in _groups(docs).values():
            container = group["template"]["spec"]["containers"][0]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"] == {"path": "/health", "port": "serve"}


def test_import_path_resolves_to_builder():
    if importlib.util.find_spec("deployments.app") is None:
        pytest.skip("deployments/app.py does not exist yet (issue 6); import_path not resolvable")
    builder = k8s_validate.resolve_import_path(BUILDER)
    assert callable(builder)


def test_app_args_match_builder_config(rendered):
    if importlib.util.find_spec("deployments.config") is None:
        pytest.skip("deployments/config.py does not exist yet (issue 6); args not checked")
    for docs in rendered.values():
        k8s_validate.validate_app_args(_args(docs))


def test_base_alone_is_not_deployable(crd_path):
    with pytest.raises(ManifestError, match="placeholder"):
        k8s_validate.validate_overlay(K8S / "base", crd_path=crd_path)


# ------------------------------------------------------------- planted errors must fail


def _rs(d):
    return d["spec"]["rayClusterConfig"]


def _serve(d, old, new):
    assert old in d["spec"]["serveConfigV2"]
    d["spec"]["serveConfigV2"] = d["spec"]["serveConfigV2"].replace(old, new)


PLANTED = {
    "sts wrong type": ("StatefulSet", lambda d: d["spec"].__setitem__("replicas", "one"), "replicas"),
    "sts unknown field": (
        "StatefulSet",
        lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolicyy", "Always"),
        "imagePullPolicyy",
    ),
    "service bad port": ("Service", lambda d: d["spec"]["ports"][0].__setitem__("port", "http"), "port"),
    "secret unknown field": ("Secret", lambda d: d.__setitem__("stringdata", {}), "stringdata"),
    "rayservice wrong type": (
        "RayService",
        lambda d: _rs(d).__setitem__("enableInTreeAutoscaling", "yes"),
        "enableInTreeAutoscaling",
    ),
    "rayservice unknown field": (
        "RayService",
        lambda d: _rs(d)["workerGroupSpecs"][0].__setitem__("maxReplica", 3),
        "maxReplica",
    ),
    "rayservice missing required": (
        "RayService",
        lambda d: _rs(d)["workerGroupSpecs"][0].pop("minReplicas"),
        "minReplicas",
    ),
    "rayStartParams not string": (
        "RayService",
        lambda d: _rs(d)["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),
        "num-cpus",
    ),
    "serve config bad type": ("RayService", lambda d: _serve(d, "port: 8000", "port: eighty"), "http_options.port"),
    "serve config unknown key": ("RayService", lambda d: _serve(d, "route_prefix:", "route_prefx:"), "route_prefx"),
    "serve config bad import path": ("RayService", lambda d: _serve(d, BUILDER, "build_app"), "import"),
    "serve config not yaml": ("RayService", lambda d: d["spec"].__setitem__("serveConfigV2", "a: [1"), "YAML"),
    "head readiness on /health": (
        "RayService",
        lambda d: _rs(d)["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__(
            "readinessProbe", {"httpGet": {"path": "/health", "port": "serve"}}
        ),
        "head",
    ),
    "dangling secret key": (
        "RayService",
        lambda d: _serve(d, "api_key_env: TOOLSPEC_API_KEY", "api_key_env: MISSING_KEY"),
        "MISSING_KEY",
    ),
    "podmonitor port not on the pods": (
        "PodMonitor",
        lambda d: d["spec"]["podMetricsEndpoints"][0].__setitem__("port", "http"),
        "no container port named 'http'",
    ),
    "podmonitor selects no pods": (
        "PodMonitor",
        lambda d: d["spec"]["selector"]["matchLabels"].__setitem__("app.kubernetes.io/component", "ray-hed"),
        "matches no pod template",
    ),
    "podmonitor unknown field": (
        "PodMonitor",
        lambda d: d["spec"]["podMetricsEndpoints"][0].__setitem__("pathh", "/metrics"),
        "unknown field pathh",
    ),
    "podmonitor bad interval": (
        "PodMonitor",
        lambda d: d["spec"]["podMetricsEndpoints"][0].__setitem__("interval", "30"),
        "not a duration",
    ),
    "qdrant url to nowhere": (
        "RayService",
        lambda d: _serve(d, "http://qdrant:6333", "http://qdrant:7000"),
        "qdrant_url",
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_error_fails(rendered, crd_path, case):
    kind, mutate, match = PLANTED[case]
    for docs in rendered.values():
        broken = k8s_validate.mutated(docs, kind, mutate)
        with pytest.raises(ManifestError, match=match):
            k8s_validate.validate_documents(broken, crd_path=crd_path)


def test_gpu_sizing_mismatch_fails(rendered, crd_path):
    broken = k8s_validate.mutated(
        rendered["gpu-prod"], "RayService", lambda d: _serve(d, "tensor_parallel_size: 8", "tensor_parallel_size: 3")
    )
    with pytest.raises(ManifestError, match="multiple of tensor_parallel_size"):
        k8s_validate.validate_documents(broken, crd_path=crd_path)


@pytest.fixture()
def k8s_copy(tmp_path) -> Path:
    shutil.copytree(K8S, tmp_path / "k8s", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "k8s"


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_broken_manifest_file_fails(k8s_copy, crd_path):
    _edit(k8s_copy / "base" / "qdrant.yaml", "replicas: 1", "replicas: one")
    with pytest.raises(ManifestError, match="replicas"):
        k8s_validate.validate_overlay(k8s_copy / "overlays" / "gpu-prod", crd_path=crd_path)


def test_broken_crd_field_in_file_fails(k8s_copy, crd_path):
    _edit(k8s_copy / "base" / "rayservice.yaml", "enableInTreeAutoscaling: true", "enableInTreeAutoscaling: 1")
    with pytest.raises(ManifestError, match="enableInTreeAutoscaling"):
        k8s_validate.validate_overlay(k8s_copy / "overlays" / "cpu-dev", crd_path=crd_path)


def test_patch_to_missing_path_fails_to_render(k8s_copy):
    _edit(
        k8s_copy / "overlays" / "cpu-dev" / "rayservice-cpu.yaml",
        "workerGroupSpecs/0/groupName",
        "workerGroupSpecs/1/groupName",
    )
    with pytest.raises(k8s_render.KustomizeError):
        k8s_render.render(k8s_copy / "overlays" / "cpu-dev")


def test_unsupported_kustomize_feature_is_refused(k8s_copy):
    (k8s_copy / "overlays" / "gpu-prod" / "kustomization.yaml").open("a").write("namePrefix: x-\n")
    with pytest.raises(k8s_render.KustomizeError, match="namePrefix"):
        k8s_render.render(k8s_copy / "overlays" / "gpu-prod")


def test_validate_cli(capsys):
    assert k8s_validate.main([]) == 0
    assert capsys.readouterr().out.count("ok ") == len(OVERLAYS)


# ------------------------------------------------------------- renderer unit checks


def test_json6902_ops():
    doc = {"a": {"b": [1, 2]}, "c": "x"}
    out = k8s_render.json6902(
        doc,
        [
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "replace", "path": "/c", "value": "y"},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "copy", "from": "/c", "path": "/d~1e"},
        ],
    )
    assert out == {"a": {"b": [2, 3]}, "c": "y", "d/e": "y"} and doc["c"] == "x"
    with pytest.raises(KeyError):
        k8s_render.json6902(doc, [{"op": "replace", "path": "/missing", "value": 1}])


def test_strategic_merge_keys_only_for_builtin_kinds():
    base = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "a", "image": "i", "args": ["1"]}], "tolerations": [{"key": "k"}]}
            }
        },
    }
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": {"spec": {"containers": [{"name": "a", "args": ["2"]}], "tolerations": [{"key": "t"}]}}},
    }
    out = k8s_render.strategic_merge(base, patch)["spec"]["template"]["spec"]
    assert out["containers"] == [{"name": "a", "image": "i", "args": ["2"]}]
    assert out["tolerations"] == [{"key": "t"}]
    custom = dict(base, apiVersion="ray.io/v1", kind="RayService")
    out = k8s_render.strategic_merge(custom, dict(patch, apiVersion="ray.io/v1", kind="RayService"))
    assert out["spec"]["template"]["spec"]["containers"] == [{"name": "a", "args": ["2"]}]


@pytest.mark.parametrize(
    "image,parts",
    [
        ("toolspec", ("toolspec", None, None)),
        ("qdrant/qdrant:v1.13.0", ("qdrant/qdrant", "v1.13.0", None)),
        ("reg:5000/a/b:1@sha256:ab", ("reg:5000/a/b", "1", "sha256:ab")),
        ("reg:5000/a/b", ("reg:5000/a/b", None, None)),
    ],
)
def test_split_image(image, parts):
    assert k8s_render.split_image(image) == parts


def _topology(docs):
    from deployments.topology import node_groups, rayservice_app_config

    rs = _one(docs, "RayService")
    return node_groups(rs), rayservice_app_config(rs)


def test_cpu_cluster_places_each_deployment_on_its_own_node_group(rendered):
    """cpu-cluster: the engine replicas only on the cpu-replicas group (one per node: its `replica`
    resource), the Retrieval deployment only on the retrieval group, nothing that needs CPUs on the
    head -- read from the rendered manifests by the code the local cluster is started from."""
    from deployments.topology import placement, replica_room

    groups, cfg = _topology(rendered["cpu-cluster"])
    by_name = {g.name: g for g in groups}
    assert by_name["head"].num_cpus == 0 and by_name["cpu-replicas"].count == 2 and by_name["retrieval"].count == 1
    assert dict(by_name["cpu-replicas"].resources) == {"replica": 1.0}
    assert dict(by_name["retrieval"].resources) == {"retrieval": 1.0}
    where = placement(cfg, groups)
    assert where["Replica"] == ["cpu-replicas"] and where["Retrieval"] == ["retrieval"]
    assert replica_room(cfg, groups) == cfg.autoscaling.max_replicas == 2


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu-prod"])
def test_every_overlay_has_a_home_for_every_deployment(rendered, overlay):
    from deployments.topology import placement, replica_room

    groups, cfg = _topology(rendered[overlay])
    assert all(placement(cfg, groups).values())
    assert replica_room(cfg, groups, grown=True) >= cfg.autoscaling.max_replicas


@pytest.mark.parametrize(
    "old,new,match",
    [
        ("resources: {retrieval: 1}", "resources: {ret: 1}", "no node group can hold the Retrieval"),
        ("max_replicas: 2", "max_replicas: 3", "3 engine replicas do not fit"),
    ],
)
def test_a_deployment_without_room_on_the_node_groups_fails(rendered, crd_path, old, new, match):
    broken = k8s_validate.mutated(rendered["cpu-cluster"], "RayService", lambda d: _serve(d, old, new))
    with pytest.raises(ManifestError, match=match):
        k8s_validate.validate_documents(broken, crd_path=crd_path)


def test_kuberay_quoted_resources_are_read():
    from deployments.topology import start_params

    assert start_params({"num-cpus": "2", "resources": '"{\\"retrieval_gpu\\": 1}"'}) == (
        2.0,
        None,
        {"retrieval_gpu": 1.0},
    )
    assert start_params({"resources": '{"replica": 2}'}) == (None, None, {"replica": 2.0})
