"""The one serving configuration, validated once by ``build_app`` and handed to every deployment.

Keys mirror ``serve run deployments.app:build_app key=value`` / a RayService ``args:`` block, so
string values from the command line are coerced (``tensor_parallel_size=2``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

# the resource Ray gives the head node alone
HEAD_RESOURCE = "node:__internal_head__"


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?\s*$", re.IGNORECASE)


def parse_memory(value: str | int) -> int:
    """Bytes of a memory size: an int, or "80GiB" / "80Gi" (binary), "141GB" / "141G" (decimal),
    "1.5TiB", "85899345920". Both spellings because GPU makers quote GB and Kubernetes writes Gi."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = value
    else:
        m = _MEMORY.match(str(value))
        if m is None:
            raise ValueError(f"memory size {value!r}: expected bytes or a number with a unit, e.g. 80GiB, 141GB, 80Gi")
        number, unit = m.group(1), _UNITS[(m.group(2) or "").upper()]
        out = int(number) * unit if number.isdigit() else int(float(number) * unit)
    if out <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    return out


class AutoscalingConfig(BaseModel):
    """Ray Serve autoscaling on queue length (ongoing requests per replica)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)  # the window Serve averages the queue length over

    @model_validator(mode="after")
    def _order(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must be <= max_replicas")
        return self

    def to_serve(self) -> dict:
        return self.model_dump()


# The embedded Qwen2.5-Coder-0.5B keyed at its 6th of 24 layers ranked the offered tools as well as
# at its top, on the three dev sets (offered-tools top-1 0.835 vs 0.817, value recall 0.217 both;
# benchmarks/results/retrieval/retrieval-key-eval-3bench-*), for a quarter of the encoder's work.
EMBEDDED_ENCODER_LAYERS = 6


class EncoderConfig(BaseModel):
    """The Retrieval deployment's own encoder (``retrieval_service.embedding.HFEmbedder``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "embedded"  # a local HF directory (e.g. a Qwen embedding model), or the embedded Qwen
    pooling: Literal["mean", "last"] = "mean"
    max_length: int = Field(512, ge=8, le=32768)  # tokens of a request's text the encoder reads
    prefix: str = ""  # an instruction some embedding models put before a query
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int | None = Field(None, ge=1)  # torch threads of the Retrieval actor (CPU)
    num_gpus: float = Field(0.0, ge=0, le=1)  # a GPU fraction for the actor (device cuda)
    # pool the states after the first N decoder layers: a shallower, cheaper encoder with its own
    # vector space. None: the model's default -- EMBEDDED_ENCODER_LAYERS for the embedded Qwen,
    # every layer of any other model (an embedding model is trained to be read at its top)
    layers: int | None = Field(None, ge=1)

    def depth(self) -> int | None:
        """The layers the encoder keeps (None: all)."""
        if self.layers is None and self.model in ("", "embedded"):
            return EMBEDDED_ENCODER_LAYERS
        return self.layers


class RetrievalConfig(BaseModel):
    """The shared call library (``retrieval_service``) as its own deployment."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # StoreConfig kwargs: backend ("memory" | "edge" | "qdrant_local" | "qdrant_url"), path, url, ...
    store: dict[str, Any] = Field(default_factory=dict)
    # "qwen": the deployment's encoder over the request text (one vector space for every
    # replica); "hybrid": that vector beside the hashed lexical one (mean of the two cosines);
    # "lexical": the hashed n-grams alone; "hidden": the target's last-layer state of the final
    # prompt token, computed by the replica after the prefill (tied to the target model);
    # "auto": hidden where the encoder would share a CPU target's cores, else qwen (resolve_key)
    key: Literal["auto", "qwen", "hybrid", "lexical", "hidden"] = "auto"
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    max_batch_size: int = Field(16, ge=1, le=256)  # queries of all replicas the encoder embeds at once (1: no batching)
    batch_wait_timeout_s: float = Field(0.005, ge=0, le=1)  # how long the first query of a batch waits for more
    lexical_dim: int = Field(1024, gt=0, le=65536)
    timeout_s: float = Field(1.0, gt=0, le=30)  # a search's bound: the request is waiting for it
    # a completed call's write: waited for and sent again until then (nobody waits for it)
    add_deadline_s: float = Field(120.0, gt=0, le=3600)
    top_k: int = Field(10, ge=1, le=100)
    cache_entries: int = Field(256, ge=0)  # replica-local cache of recent search results
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    # custom Ray resources the actor needs, e.g. {"retrieval_gpu": 1} offered only by the worker
    # group meant for it (so its GPU fraction never lands on a GPU a TP replica needs)
    resources: dict[str, float] = Field(default_factory=dict)

    def text_key(self) -> bool:
        """Whether replicas send request text and the deployment keys it (every key but hidden)."""
        return self.concrete_key() != "hidden"

    def concrete_key(self) -> str:
        """The key this config keys the library with. ``auto`` stands for ``qwen`` here: a retrieval
        config alone knows no target to take a hidden state from (an app resolves ``auto`` against
        its target when it is validated: :func:`resolve_key`)."""
        return "qwen" if self.key == "auto" else self.key


def key_collection(key: str, target_model: str) -> str | None:
    """The store collection of a key's vector space where the store config names none: ``None``
    (the store's default) for the Qwen encoder's, one of its own for every other key and, for
    ``hidden``, for every target -- so a library kept on disk is never searched with vectors of
    another space (the embedded encoder's and the embedded target's are both 896 wide)."""
    if key == "qwen":
        return None
    if key != "hidden":
        return f"toolspec_calls_{key}"
    name = re.sub(r"[^A-Za-z0-9_-]", "-", os.path.basename(os.path.normpath(target_model or "embedded")))
    return f"toolspec_calls_hidden_{name}"[:128]


def resolve_key(key: str, target_device: str, encoder_device: str, dedicated: bool, target_model: str) -> str:
    """The retrieval key ``auto`` stands for in an app.

    ``hidden`` where the Retrieval deployment's encoder would run on the cores of a CPU target:
    the encoder's forward (~0.5 s a search on two cores) then preempts the engine's OpenMP team,
    whose every barrier waits on the preempted thread; on the committed cached load test that
    cost ToolSpec 7-14% of its tokens/s at c = 4-16 for ~4% of the machine's CPU, while the
    hidden key's drafts are worth the same (MAT within 0.01 of the Qwen key's on every dev set;
    docs/results.md). ``qwen`` wherever the encoder has cores or a GPU of its own -- the encoder
    on cuda, the deployment placed by a custom resource (``dedicated``), a target on a GPU --
    and for the scripted target, which runs no model to take a hidden state from: one vector
    space for the replicas of any target, and the better ranking of the offered tools (top-1
    0.835 vs 0.788). ``target_device``: ``cpu`` or ``cuda`` (``auto`` already resolved)."""
    if key != "auto":
        return key
    if encoder_device == "cuda" or dedicated or target_device == "cuda" or target_model == "scripted":
        return "qwen"
    return "hidden"


class RequestLimits(BaseModel):
    """What one request may hold. Each breach is a 4xx naming the limit (413 for the body), checked
    before any of the request reaches the engine."""

    model_config = ConfigDict(extra="forbid")

    body_bytes: int = Field(4 * 2**20, ge=1024)
    messages: int = Field(1024, ge=1)
    tools: int = Field(256, ge=1)
    stop: int = Field(4, ge=0, le=64)
    schema_depth: int = Field(32, ge=2, le=256)  # nesting of objects / arrays in one JSON schema
    schema_nodes: int = Field(20_000, ge=10)  # JSON values in one schema
    json_depth: int = Field(64, ge=8, le=512)  # nesting of the whole request body
    prompt_tokens: int | None = Field(None, ge=1)  # None: the model's context window


REMOVED_OPTIONS = {
    "engine": "every replica runs one engine, the batched step scheduler (max_num_seqs sequences per step)",
    "prefix_cache_entries": "prompt prefixes are cached in the KV block pool (prefix_caching: true / false)",
}


class ServeAppConfig(BaseModel):
    """Everything ``build_app`` needs; see deployments/README.md for a commented example."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # HF directory, "embedded" (Qwen2.5-Coder-0.5B-Instruct), or "scripted": a target that costs
    # nothing and writes a fixed tool call (deployments/scripted.py; measures the serving stack alone)
    model: str = "embedded"
    served_model_name: str | None = None  # default: the model directory's name
    method: str = "toolspec"  # toolspec_core.drafters.methods.REGISTRY name; fails fast if it cannot be built
    method_options: dict[str, Any] = Field(default_factory=dict)
    # auto: bfloat16 on a GPU that has it and on a CPU that computes it natively (AVX512_BF16 or
    # AMX), float32 elsewhere (toolspec_core.model.target.resolve_dtype). float32 is the default:
    # in bf16 / fp16 greedy output can leave plain greedy's at near-ties (README, limitations)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when the replica sees a GPU
    # how a step attends over the pool's sequences: one ragged call a layer, the per-sequence loop,
    # or auto (ragged on cuda, the loop on the cpu; toolspec_core.model.ragged)
    attention: Literal["auto", "ragged", "per_sequence"] = "auto"
    # replay decode steps from CUDA graphs (cuda and the ragged attention), the shapes of up to
    # cuda_graphs_warm_tokens KV rows captured when the replica starts, larger ones at first use;
    # a replica that finds no GPU (device auto) or cannot capture them runs its steps eager and logs why
    cuda_graphs: bool = False
    cuda_graphs_warm_tokens: int = Field(2048, ge=0, le=1 << 20)
    # torch intra-op threads per replica (None on a CPU: every core it may run on)
    threads: int | None = Field(None, ge=1)
    # CPU fp32, opt-in: verify forwards of 4..N rows through MKL's packed GEMM (one more weight copy)
    cpu_packed_rows: int = Field(0, ge=0, le=64)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    tp_worker_num_cpus: float = Field(0.0, ge=0)
    tp_worker_num_gpus: float | None = Field(None, ge=0)  # None: 1 per TP worker on cuda, else 0
    # the replica's placement group: its own bundle, then one per TP rank; STRICT_PACK keeps the
    # ranks on one node (NVLink, loopback rendezvous)
    tp_placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    tp_start_timeout_s: float = Field(600.0, gt=0)  # workers placed and sharded within this, or the replica fails
    # capacity plan (``toolspec plan``), checked when the app is built: memory of one GPU (e.g.
    # "80GiB"; None: not checked) and the context each request may fill (None: the model's window)
    gpu_memory: str | None = None
    plan_context_tokens: int | None = Field(None, ge=1)
    cost_model: Literal["measure", "reference", "flat", "none"] = "measure"
    calibrate_cost: bool = False  # refit the cost curve from the verify steps really paid (budget.Calibration)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    api_key: SecretStr | None = None  # one key for everything: tenant "default", admin
    api_keys_file: str | None = None  # keys -> tenants and limits (deployments/keys.py), e.g. a mounted Secret
    api_key_env: str | None = "TOOLSPEC_API_KEY"

    num_replicas: int = Field(1, ge=1)
    # requests in flight per replica, those waiting for the batch or for KV blocks included (what
    # Serve's autoscaling counts); at least max_num_seqs keeps the batch full
    max_ongoing_requests: int = Field(16, ge=1, le=1024)
    # sequences one replica's engine verifies together in each forward (more wait for admission)
    max_num_seqs: int = Field(16, ge=1, le=1024)
    # prompt rows the engine prefills per step, beside the decoding sequences (a long prompt
    # stalls them by one chunk a step at most)
    prefill_chunk_tokens: int = Field(512, ge=16, le=65536)
    # the batched engine's KV block pool, allocated once per replica: its size in tokens (None: on
    # cuda kv_memory_fraction of the memory free after the weights; on cpu kv_cpu_gib, at most
    # half the memory the process may still take, at least the model's context window), tokens
    # per block, and the prefix cache kept in it
    kv_pool_tokens: int | None = Field(None, ge=64)
    kv_block_tokens: int = Field(16, ge=1, le=256)
    kv_memory_fraction: float = Field(0.9, gt=0, le=0.98)
    # on cpu, GiB of KV pool (like vLLM's VLLM_CPU_KVCACHE_SPACE): the prefix cache keeps every
    # recent tool prompt; pages cost memory only once a block is written
    kv_cpu_gib: float = Field(4.0, gt=0, le=4096)
    # automatic prefix caching in the pool (false: every prompt is prefilled whole, e.g. to measure it)
    prefix_caching: bool = True
    autoscaling: AutoscalingConfig | None = None
    replica_num_cpus: float = Field(1.0, ge=0)
    replica_num_gpus: float = Field(0.0, ge=0)
    # custom Ray resources each engine replica needs, e.g. {"replica": 1} offered only by the node
    # group meant for replicas (deployments/topology.py; the cpu-cluster overlay's rayStartParams)
    replica_resources: dict[str, float] = Field(default_factory=dict)
    # model "scripted" only: tokens each step commits (k > 1: the script's next k - 1 drafted, all accepted)
    scripted_tokens_per_step: int = Field(1, ge=1, le=16)
    # model "scripted" only: seconds each step takes, a stand-in for a real model's forward (load
    # tests of autoscaling and node loss need requests that stay in flight)
    scripted_step_s: float = Field(0.0, ge=0, le=10)
    # the Gate deployment (per-key limits and metrics shared by the replicas)
    gate_num_cpus: float = Field(0.0, ge=0)
    # the app's HTTP entry: "replica" (Serve's proxy -> an engine replica, which serves the API
    # itself; a replica lost mid-request is the proxy's plain 500) or "failover" (an ``Ingress``
    # deployment on the head relays each request to a replica: one more hop per response
    # message, and a lost replica costs a retry or a 503 / SSE error with code replica_lost;
    # deployments/failover.py)
    ingress: Literal["replica", "failover"] = "replica"
    # "failover": tries on another replica when one is lost before it received the request
    ingress_retries: int = Field(1, ge=0, le=3)
    # "failover": the Retry-After (s) of the 503 a lost replica's request gets
    ingress_retry_after_s: int = Field(1, ge=0, le=600)
    # "failover": the Ingress deployment's Ray resources; the head node by default (where Serve's
    # proxy and controller run), never a worker node a replica may be lost with
    ingress_resources: dict[str, float] = Field(default_factory=lambda: {HEAD_RESOURCE: 0.001})

    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    # shortcuts for a remote Qdrant (what the k8s manifests set): retrieval.store backend qdrant_url
    qdrant_url: str | None = None
    qdrant_api_key_env: str | None = None
    max_tokens_default: int = Field(512, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # temperature when a request sends none (OpenAI's is 1.0; greedy keeps tool calls deterministic)
    default_temperature: float = Field(0.0, ge=0, le=2)
    # every response's ``toolspec`` field carries the request's timeline and early steps (~3 KB;
    # otherwise only for requests that ask: ``toolspec.timeline`` or the X-ToolSpec-Timeline header)
    timeline: bool = False

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        return v

    @field_validator("gpu_memory")
    @classmethod
    def _gpu_memory(cls, v: str | None) -> str | None:
        """A size the capacity plan can read (e.g. 80GiB, 141GB), refused here rather than when planning."""
        if v is not None:
            parse_memory(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        """Options a replica no longer has, refused saying what serves instead."""
        if isinstance(data, dict):
            for key, why in REMOVED_OPTIONS.items():
                if key in data:
                    raise ValueError(f"{key!r} is not an option: {why}; remove it from the config")
        return data

    @model_validator(mode="after")
    def _check(self) -> "ServeAppConfig":
        if self.max_tokens_default > self.max_tokens_limit:
            raise ValueError("max_tokens_default must be <= max_tokens_limit")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("float16 is not supported on cpu; use float32 or bfloat16")
        if self.cuda_graphs:
            if self.device == "cpu":
                raise ValueError(
                    "cuda_graphs needs a GPU: device is cpu (set device: cuda or auto, or cuda_graphs: false)"
                )
            if self.attention == "per_sequence":
                raise ValueError(
                    "cuda_graphs replays the ragged attention's steps: attention per_sequence cannot use them "
                    "(set attention: ragged or auto)"
                )
            if self.model == "scripted":
                raise ValueError("cuda_graphs: the scripted target runs no model (set cuda_graphs: false)")
        if self.retrieval.key == "auto":
            r = self.retrieval
            key = resolve_key("auto", self.target_device(), r.encoder.device, bool(r.resources), self.model)
            self.retrieval = r.model_copy(update={"key": key})
        backend = self.store_config(1).get("backend", "edge")
        r = self.retrieval
        if r.enabled and r.num_replicas > 1 and backend != "qdrant_url":
            raise ValueError(
                f"retrieval.num_replicas {r.num_replicas} with the {backend!r} store: an embedded store lives in one "
                "process, so each retrieval replica would hold a library of its own; use one replica, or a Qdrant "
                "server (qdrant_url, or retrieval.store.backend qdrant_url) for several"
            )
        if self.qdrant_url and self.retrieval.store.get("backend", "qdrant_url") != "qdrant_url":
            raise ValueError("qdrant_url conflicts with retrieval.store.backend")
        return self

    def store_config(self, dim: int) -> dict:
        """StoreConfig kwargs for the retrieval deployment (``dim`` = the retrieval key's size)."""
        store = dict(self.retrieval.store)
        if self.qdrant_url:
            store.setdefault("backend", "qdrant_url")
            store.setdefault("url", self.qdrant_url)
            if self.qdrant_api_key_env and os.environ.get(self.qdrant_api_key_env):
                store.setdefault("api_key", os.environ[self.qdrant_api_key_env])
        store.setdefault("dim", dim)
        collection = key_collection(self.retrieval.concrete_key(), self.model)
        if collection is not None:
            store.setdefault("collection", collection)
        return store

    def resolved_api_key(self) -> str | None:
        """The bearer token clients must send: ``api_key`` or the env var ``api_key_env``."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None

    def target_device(self) -> str:
        """``cpu`` or ``cuda``: ``device``, with ``auto`` counted as cuda when the cluster building
        the app has GPUs (what the replica will see)."""
        if self.device == "auto":
            return "cuda" if _cluster_gpus() else "cpu"
        return self.device

    def placement_bundles(self) -> list[dict] | None:
        """The replica's placement group when it drives tensor-parallel workers (bundle 0: the
        replica and rank 0; one more per rank), else None. ``device: auto`` counts as cuda when the
        cluster building the app has GPUs."""
        from .tp.placement import placement_bundles, target_placement, worker_gpus

        device = self.target_device()
        if target_placement(self.tensor_parallel_size, device, self.replica_num_gpus) == "replica":
            return None
        gpus = worker_gpus(self.tp_worker_num_gpus, device)
        return placement_bundles(
            self.tensor_parallel_size, self.replica_num_cpus, self.replica_num_gpus, self.tp_worker_num_cpus, gpus
        )

    def retrieval_actor_options(self) -> dict:
        """Ray actor options of the ``Retrieval`` deployment (its encoder's GPU fraction only for
        a key the deployment encodes)."""
        r = self.retrieval
        gpus = r.encoder.num_gpus if r.concrete_key() in ("qwen", "hybrid") else 0
        return {"num_cpus": r.num_cpus, "num_gpus": gpus, "resources": dict(r.resources)}

    def gate_actor_options(self) -> dict:
        """Ray actor options of the ``Gate`` deployment."""
        return {"num_cpus": self.gate_num_cpus}

    def ingress_actor_options(self) -> dict:
        """Ray actor options of the ``Ingress`` deployment (``ingress: failover``)."""
        return {"num_cpus": 0, "resources": dict(self.ingress_resources)}

    def deployment_options(self) -> dict:
        """Ray Serve options of the engine replica deployment."""
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.replica_num_cpus, "num_gpus": self.replica_num_gpus},
        }
        if self.replica_resources:
            opts["ray_actor_options"]["resources"] = dict(self.replica_resources)
        bundles = self.placement_bundles()
        if bundles is not None:
            bundles[0].update(self.replica_resources)  # the replica's actor runs in bundle 0
            opts["placement_group_bundles"] = bundles
            opts["placement_group_strategy"] = self.tp_placement_strategy
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.to_serve()
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


def _cluster_gpus() -> float:
    try:
        import ray

        return ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    except Exception:
        return 0


def served_name(cfg: ServeAppConfig) -> str:
    """The model id clients send and /v1/models lists."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model in ("", "embedded"):
        from toolspec_core.model.embedded import EMBEDDED_MODEL_NAME

        return EMBEDDED_MODEL_NAME
    return os.path.basename(os.path.normpath(cfg.model))
