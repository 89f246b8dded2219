"""The target model: one small protocol over an HF causal LM (single process or tensor-parallel)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .embedded import EMBEDDED_MODEL_NAME, ModelFileError, embedded_model_dir


class Forward(Protocol):
    """What the decode loop needs from a model: hidden states for new tokens given a cache."""

    def __call__(self, input_ids, position_ids, mask, cache) -> torch.Tensor: ...


@dataclass
class Target:
    """An HF causal LM plus its tokenizer. ``forward`` may be swapped (e.g. tensor-parallel)."""

    model: torch.nn.Module
    tokenizer: object
    name: str = "model"
    eos_ids: tuple[int, ...] = ()
    max_context: int = 32768
    forward_fn: Forward | None = field(default=None, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def hidden(self, input_ids, position_ids, mask, cache) -> torch.Tensor:
        """input_ids/position_ids: [1, T]; mask: [1, 1, T, S] additive or None (causal).

        Returns last-layer hidden states [T, H]; the cache grows by T rows.
        """
        if self.forward_fn is not None:
            return self.forward_fn(input_ids, position_ids, mask, cache)
        with torch.inference_mode():
            out = self.model.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache, use_cache=True
            )
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, V] (fp32)."""
        with torch.inference_mode():
            return self.model.lm_head(hidden).float()


def clone_cache(cache):
    """Independent copy of a (small, per-request) KV cache: a prefix cache shared by methods/requests."""
    return copy.deepcopy(cache)


def turn_end_ids(tokenizer) -> list[int]:
    """Tokens that end an assistant turn, the chat template's own first (<|im_end|> for Qwen).

    Chat models end a turn with these even when generation_config does not say so.
    """
    ids: list[int] = []
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        try:
            tid = tokenizer.convert_tokens_to_ids(tok)
        except (AttributeError, KeyError, TypeError):
            tid = None
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
            ids.append(tid)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in ids:
        ids.append(eos)
    return ids


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = set(turn_end_ids(tokenizer))
    src = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(src, int):
        ids.add(src)
    elif isinstance(src, (list, tuple)):
        ids.update(int(x) for x in src)
    return tuple(sorted(ids))


def from_model(model, tokenizer, name: str = "model") -> Target:
    """Wrap an already-built HF model (tests build tiny random ones)."""
    model.eval()
    ctx = getattr(model.config, "max_position_embeddings", None) or 32768
    return Target(model=model, tokenizer=tokenizer, name=name, eos_ids=_eos_ids(model, tokenizer), max_context=ctx)


SMALL_ROWS = 3  # up to this many rows the BLAS's own matrix-vector kernel is fastest (measured)


def tune_cpu_linears(model: torch.nn.Module, small_rows: int = SMALL_ROWS) -> int:
    """Make every ``nn.Linear`` of a CPU model fast for a few rows at a time (tree verification).

    Why: on x86 CPUs ``F.linear`` switches from a matrix-vector kernel to a GEMM path at 4 rows
    that is 2-2.5x slower than 1-3 rows, while ``x @ W.T`` on a contiguous transposed copy is
    faster from 4 rows up and no slower at prefill sizes, but slower at 2-3 rows
    (``python -m benchmarks.linear_rows`` -> ``benchmarks/results/cpu-linear-rows.json``). The
    run's verify-cost curve moved accordingly (``benchmarks/results/raw/cpu-all/cost.json`` before,
    ``raw/cpu-all-v3/cost.json`` after). Plain decoding (1 row) keeps the untouched kernel. Costs
    one extra copy of the linear weights. Returns how many layers were tuned.
    """
    import torch.nn.functional as F

    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or mod.weight.device.type != "cpu":
            continue
        weight, bias = mod.weight, mod.bias
        weight_t = weight.detach().t().contiguous()  # [in, out]

        def forward(x, weight=weight, bias=bias, weight_t=weight_t):
            if x.numel() <= small_rows * x.shape[-1]:
                return F.linear(x, weight, bias)
            y = x @ weight_t
            return y + bias if bias is not None else y

        mod.forward = forward
        n += 1
    return n


def load_target(path: str | Path | None = None, dtype: torch.dtype = torch.float32, threads: int | None = None,
                tune_gemm: bool = True) -> Target:
    """Load a local HF model directory, or the embedded default when ``path`` is None/"embedded".

    Both go through the same ``from_pretrained`` code path; SDPA attention is required because
    the tree mask is 4D. ``tune_gemm``: see :func:`tune_cpu_linears` (CPU float32 only).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    if path in (None, "", "embedded"):
        path, name = embedded_model_dir(), EMBEDDED_MODEL_NAME
    else:
        path = Path(path)
        name = path.name
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path} is not an HF model directory (no config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"could not load model from {path}: {exc}") from exc
    if tune_gemm and dtype == torch.float32:
        tune_cpu_linears(model)
    return from_model(model, tok, name=name)
