"""Capacity planning: what a model takes on each of its tensor-parallel GPUs, and how many requests
at full context the KV pool left beside it holds.

Why: a config that cannot hold one request fails only after minutes of loading (or with an
out-of-memory error mid-traffic); the arithmetic needs nothing but the model's config.json, so
``toolspec plan`` prints it before anything is deployed and ``build_app`` refuses such a config
(:func:`check_plan`) when ``gpu_memory`` is set.

Sharding model, per GPU (what the workers in ``deployments/tp`` load on each tensor-parallel rank,
``deployments/tp/shards.py``): DeepSpeed AutoTP splits the attention and MLP linears -- q, k, v, o,
gate, up, down weights and the q/k/v biases -- across the ranks (q / k / v / o by heads, gate / up
/ down by the intermediate size); ``embed_tokens`` and ``lm_head`` are split by vocabulary
(``vocab_range``): rank r holds rows ``[r * ceil(V / tp), min((r + 1) * ceil(V / tp), V))`` of
each, the head as a parameter of its own even when the checkpoint ties it to the embeddings, so
rank 0, which holds the most, has ``2 * ceil(V / tp) * hidden`` of them. Only the RMSNorms,
``(2 * layers + 1) * hidden``, are replicated whole on every rank. At ``tp == 1`` the model runs in
the replica's own process (``deployments/tp/placement.py`` ``target_placement``: TP 1 on a GPU the
replica holds), which holds the whole model: the embeddings, and ``lm_head`` only when untied. The
KV cache is split by KV heads: a rank holds ``kv_heads / tp`` of them for every token.

Memory of one GPU: ``gpu_memory * kv_memory_fraction`` is what the replica may use (the fraction
leaves the allocator its headroom, as the engine's pool sizing does); the weights and
:data:`WORKSPACE_RESERVE` come off it, and the rest is the KV pool, in whole blocks of
``block_tokens``. The replica sizes its real pool from the memory free once the weights are
loaded (``deployments/engine_host.py``); this plan predicts it before any GPU is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

from .config import ServeAppConfig, parse_memory

GiB = 2**30
# CUDA context and the cuBLAS / NCCL workspaces (about 0.5-1 GiB a process) plus one forward's
# transient activations; for Qwen2.5 the largest is the fp32 logits, 4 B x 152064 x rows = 0.58 GiB
# at 1024 rows (16 sequences verifying 64-row trees). Bytes, per GPU.
WORKSPACE_RESERVE = 2 * GiB


@dataclass(frozen=True)
class Plan:
    """One model on ``tp`` GPUs of ``gpu_memory`` bytes each. Sizes in bytes and tokens, per GPU
    unless named otherwise."""

    model: str
    tp: int
    dtype: str
    dtype_bytes: int
    params: int  # the whole model
    split_params: int  # one rank's share of the linears and its vocabulary rows of embed_tokens and lm_head
    replicated_params: int  # the RMSNorms: whole on every rank
    weights_per_gpu: int  # (split_params + replicated_params) * dtype_bytes
    gpu_memory: int
    kv_memory_fraction: float
    usable_memory: int  # gpu_memory * kv_memory_fraction: what the replica may fill
    reserve: int  # WORKSPACE_RESERVE unless overridden
    kv_memory: int  # usable_memory - weights_per_gpu - reserve (negative: the weights do not fit)
    kv_bytes_per_token: int  # 2 (K, V) * layers * kv_heads / tp * head_dim * dtype_bytes
    block_tokens: int
    pool_tokens: int  # whole blocks of the KV memory
    context: int  # tokens one request may fill
    context_tokens: int  # the context in whole blocks: what one request takes from the pool
    concurrency: int  # requests at full context the pool holds at once: pool_tokens // context_tokens

    @property
    def fits(self) -> bool:
        return self.concurrency >= 1


def model_shape(spec: str) -> dict:
    """The HF config keys of a model: a model directory (its config.json), a config.json file,
    "embedded" (the embedded target's directory) or a name in ``toolspec_core.model.shapes.SHAPES``
    (a model no one needs to download to plan for). Multimodal configs give their ``text_config``."""
    from toolspec_core.model.shapes import SHAPES

    if spec in SHAPES:
        return dict(SHAPES[spec])
    if spec in ("", "embedded"):
        from toolspec_core.model.embedded import embedded_model_dir

        path = embedded_model_dir() / "config.json"
    else:
        path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"{spec!r} is not a model directory, a config.json, 'embedded' or a known shape ({', '.join(SHAPES)})"
        )
    config = json.loads(path.read_text())
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config


def kv_layout(shape: dict) -> tuple[int, int, int, int]:
    """(layers, attention heads, KV heads, head dim), through the KV pool's own reading of a config."""
    from toolspec_core.model.block_pool import kv_shape

    layers, kv_heads, head_dim = kv_shape(SimpleNamespace(**shape))
    return layers, shape["num_attention_heads"], kv_heads, head_dim


def check_tp(shape: dict, tp: int) -> None:
    """AutoTP splits attention by whole heads: ``tp`` must divide both head counts."""
    _, heads, kv_heads, _ = kv_layout(shape)
    if tp < 1:
        raise ValueError(f"tensor parallel size {tp} must be >= 1")
    bad = [f"{name} {n}" for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)) if n % tp]
    if bad:
        raise ValueError(f"tensor parallel size {tp} does not divide {' and '.join(bad)}")


def qkv_bias(shape: dict) -> bool:
    """Whether q/k/v carry biases: always in Qwen2 (the shapes here), else the config's
    ``attention_bias``. Other biases (Llama's o_proj under attention_bias, mlp_bias) are a
    hidden-size vector a layer and are not counted."""
    return bool(shape.get("attention_bias", shape.get("model_type", "qwen2") == "qwen2"))


def rank_params(shape: dict, tp: int) -> tuple[int, int]:
    """(split, replicated): the parameters rank 0 of ``tp`` holds of what is split across the ranks
    -- its share of the linears and its ``ceil(vocab / tp)`` rows of ``embed_tokens`` and of
    ``lm_head`` -- and of the RMSNorms every rank holds whole (see the module docstring). ``tp == 1``
    is the in-process replica (``deployments/tp/placement.py`` ``target_placement``: TP 1 on a GPU
    the replica holds), which counts the model: the embeddings, and ``lm_head`` only when untied."""
    check_tp(shape, tp)
    layers, heads, kv_heads, head_dim = kv_layout(shape)
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = heads // tp * head_dim, kv_heads // tp * head_dim  # this rank's output columns of q, and of k and v each
    attn = hidden * q + 2 * hidden * kv + q * hidden + (q + 2 * kv if qkv_bias(shape) else 0)  # q, k, v, o
    mlp = 3 * hidden * -(-inter // tp)  # gate, up [inter / tp, hidden], down [hidden, inter / tp]
    if tp == 1:
        untied = not shape.get("tie_word_embeddings", False)
        vocab_rows = vocab * (2 if untied else 1)  # embed_tokens (+ lm_head)
    else:
        vocab_rows = 2 * -(-vocab // tp)  # rank 0's rows of embed_tokens and of lm_head, tied or not
    norms = (2 * layers + 1) * hidden
    return layers * (attn + mlp) + vocab_rows * hidden, norms


def kv_bytes_per_token_per_gpu(shape: dict, tp: int, dtype: str) -> int:
    """K and V bytes one token takes on one rank: 2 * layers * (kv_heads / tp) * head_dim * dtype bytes."""
    from toolspec_core.model.block_pool import kv_bytes_per_token
    from toolspec_core.model.target import resolve_dtype

    check_tp(shape, tp)
    return kv_bytes_per_token(SimpleNamespace(**shape), resolve_dtype(dtype, "cuda")) // tp


def make_plan(
    shape: dict,
    tp: int,
    dtype: str,
    gpu_memory: int,
    context: int | None = None,
    kv_memory_fraction: float = 0.9,
    block_tokens: int = 16,
    reserve: int = WORKSPACE_RESERVE,
    model: str = "",
) -> Plan:
    """The plan of ``shape`` on ``tp`` GPUs of ``gpu_memory`` bytes (``context``: tokens one request
    may fill, default the model's ``max_position_embeddings``)."""
    from toolspec_core.model.target import resolve_dtype

    dtype_bytes = resolve_dtype(dtype, "cuda").itemsize
    split, replicated = rank_params(shape, tp)
    weights = (split + replicated) * dtype_bytes
    usable = round(gpu_memory * kv_memory_fraction)
    kv_memory = usable - weights - reserve
    per_token = kv_bytes_per_token_per_gpu(shape, tp, dtype)
    context = int(context or shape.get("max_position_embeddings") or 0)
    if context < 1:
        raise ValueError("no context length: pass one (the config has no max_position_embeddings)")
    pool_blocks = max(kv_memory, 0) // (per_token * block_tokens)
    context_blocks = -(-context // block_tokens)
    return Plan(
        model=model,
        tp=tp,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        params=sum(rank_params(shape, 1)),
        split_params=split,
        replicated_params=replicated,
        weights_per_gpu=weights,
        gpu_memory=gpu_memory,
        kv_memory_fraction=kv_memory_fraction,
        usable_memory=usable,
        reserve=reserve,
        kv_memory=kv_memory,
        kv_bytes_per_token=per_token,
        block_tokens=block_tokens,
        pool_tokens=pool_blocks * block_tokens,
        context=context,
        context_tokens=context_blocks * block_tokens,
        concurrency=pool_blocks // context_blocks,
    )


def _size(n: int) -> str:
    return f"{n:,} B ({n / GiB:.2f} GiB)"


def refusal(plan: Plan) -> str:
    """Why ``plan`` cannot serve one request, with the arithmetic that says so."""
    return (
        f"{plan.model or 'the model'} does not fit one request of {plan.context:,} tokens on "
        f"tensor_parallel_size {plan.tp} GPUs of {_size(plan.gpu_memory)} ({plan.dtype}): "
        f"weights per GPU {_size(plan.weights_per_gpu)}, so of {_size(plan.usable_memory)} usable "
        f"(kv_memory_fraction {plan.kv_memory_fraction}) less a {_size(plan.reserve)} reserve "
        f"{_size(plan.kv_memory)} is left for KV; one context needs {plan.context_tokens:,} tokens x "
        f"{plan.kv_bytes_per_token:,} B = {_size(plan.context_tokens * plan.kv_bytes_per_token)}. "
        "Raise tensor_parallel_size, lower plan_context_tokens or dtype, or use GPUs with more memory."
    )


def format_plan(plan: Plan) -> str:
    """The plan as ``toolspec plan`` prints it."""
    rows = [
        ("model", f"{plan.model} on {plan.tp} GPU(s), {plan.dtype} ({plan.dtype_bytes} B a value)"),
        ("parameters", f"{plan.params:,} ({plan.params / 1e9:.2f} B)"),
        (
            "weights per GPU",
            f"{_size(plan.weights_per_gpu)}: {plan.split_params:,} split + {plan.replicated_params:,} replicated params",
        ),
        (
            "GPU memory",
            f"{_size(plan.gpu_memory)} x kv_memory_fraction {plan.kv_memory_fraction} = {_size(plan.usable_memory)}",
        ),
        ("reserve", f"{_size(plan.reserve)} (CUDA context, workspaces, one forward's activations)"),
        ("KV memory per GPU", _size(plan.kv_memory)),
        ("KV per token per GPU", f"{plan.kv_bytes_per_token:,} B"),
        ("KV pool per GPU", f"{plan.pool_tokens:,} tokens (blocks of {plan.block_tokens})"),
        ("context", f"{plan.context:,} tokens ({plan.context_tokens:,} in whole blocks)"),
        ("concurrency", f"{plan.concurrency} request(s) at full context"),
    ]
    out = "\n".join(f"{k:22s}{v}" for k, v in rows)
    return out if plan.fits else out + "\n\nDOES NOT FIT: " + refusal(plan)


def config_plan(cfg, shape: dict | None = None, reserve: str | int = WORKSPACE_RESERVE) -> Plan:
    """The plan of a serve config: a :class:`ServeAppConfig`, or ``toolspec plan``'s options, which
    carry its field names (``model``, ``tensor_parallel_size``, ``dtype``, ``gpu_memory``,
    ``plan_context_tokens``, ``kv_memory_fraction``, ``kv_block_tokens``). ``shape``: the model's
    config keys, instead of reading ``cfg.model``'s config.json."""
    return make_plan(
        model_shape(cfg.model) if shape is None else shape,
        cfg.tensor_parallel_size,
        cfg.dtype,
        parse_memory(cfg.gpu_memory),
        context=cfg.plan_context_tokens,
        kv_memory_fraction=cfg.kv_memory_fraction,
        block_tokens=cfg.kv_block_tokens,
        reserve=parse_memory(reserve),
        model=cfg.model,
    )


def check_plan(cfg: ServeAppConfig, shape: dict | None = None) -> Plan | None:
    """Refuse, when the app is built, a config whose GPUs cannot hold the weights and one request at
    full context (``plan_context_tokens``, else the model's window); None when ``gpu_memory`` is
    unset. ``shape``: the model's config keys, instead of reading ``cfg.model``'s config.json."""
    if cfg.gpu_memory is None:
        return None
    plan = config_plan(cfg, shape)
    if not plan.fits:
        raise ValueError(refusal(plan))
    return plan


def main(argv: list[str] | None = None) -> int:
    """``toolspec plan``: print the plan; exit 1 when not even one request fits."""
    fields = ServeAppConfig.model_fields
    p = argparse.ArgumentParser(prog="toolspec plan", description=main.__doc__)
    p.add_argument(
        "--model", default="embedded", help='HF model directory, its config.json, "embedded" or a shape name'
    )
    p.add_argument("--tp", dest="tensor_parallel_size", metavar="TP", type=int, default=1, help="tensor parallel size")
    p.add_argument("--dtype", default="bfloat16", choices=get_args(fields["dtype"].annotation))
    p.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 80GiB, 141GB")
    p.add_argument(
        "--context",
        dest="plan_context_tokens",
        metavar="CONTEXT",
        type=int,
        help="tokens one request may fill (default: the model's window)",
    )
    p.add_argument("--kv-memory-fraction", type=float, default=fields["kv_memory_fraction"].default)
    p.add_argument(
        "--block-tokens",
        dest="kv_block_tokens",
        metavar="BLOCK_TOKENS",
        type=int,
        default=fields["kv_block_tokens"].default,
    )
    p.add_argument("--reserve", default=str(WORKSPACE_RESERVE), help="workspace reserve per GPU (default 2GiB)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    ns = p.parse_args(argv)
    try:
        plan = config_plan(ns, reserve=ns.reserve)
    except (ValueError, FileNotFoundError) as exc:
        print(f"toolspec plan: {exc}")
        return 2
    print(json.dumps(dataclasses.asdict(plan) | {"fits": plan.fits}, indent=2) if ns.json else format_plan(plan))
    return 0 if plan.fits else 1
