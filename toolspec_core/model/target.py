"""The target model: one small protocol over an HF causal LM (single process or tensor-parallel)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from toolspec_core.model.attention import use_grouped_sdpa
from toolspec_core.model.batch_forward import Segment, supports_batched
from toolspec_core.model.block_pool import pool_for
from toolspec_core.model.cpu_linears import tune_cpu_linears, tune_reduced_linears
from toolspec_core.model.embedded import EMBEDDED_MODEL_NAME, ModelFileError, embedded_model_dir
from toolspec_core.model.kv import HFKV, KVCache, SeqKV
from toolspec_core.model.prompting import eos_ids_of
from toolspec_core.model.ragged import resolve_attention
from toolspec_core.model.step_plan import StepPlan
from toolspec_core.model.step_runner import StepOutput, StepRunner, cache_kwarg, hf_hidden, logits_head

__all__ = ["StepOutput", "StepPlan", "Target", "cache_kwarg", "from_model", "load_target"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512_BF16 or AMX): there oneDNN's bf16 GEMMs
    read half the bytes of float32 at the same or a higher FLOP rate; elsewhere bf16 is converted
    in software and runs slower than float32."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        try:
            if check is not None and check():
                return True
        except RuntimeError:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool({"avx512_bf16", "amx_bf16"} & set(line.split()))
    except OSError:
        pass
    return False


def resolve_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """A dtype by its config name. ``auto``: bfloat16 where the device computes it natively -- a
    CPU with AVX512_BF16 or AMX (:func:`cpu_has_bf16`), a GPU of compute capability 8 or more (or
    an accelerator this process cannot see, as when a capacity plan is made) -- else float32."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if str(device).startswith("cpu"):
            return torch.bfloat16 if cpu_has_bf16() else torch.float32
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float32
        return torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class Target:
    """An HF causal LM plus its tokenizer: the calls the engine makes (``step``, ``logits``).

    ``step`` runs one verify forward of many sequences through the step runner
    (:mod:`toolspec_core.model.step_runner`, the one place that decides how a step runs); a
    tensor-parallel target (``deployments/tp``) overrides it to run the same runner on its ranks.

    ``attention``: how the batched forward attends over a block pool's sequences, one of
    :data:`~toolspec_core.model.ragged.ATTENTION` ("auto": one ragged call a layer on CUDA, the
    per-sequence loop on the CPU); ``cuda_graphs``: replay captured decode steps
    (:mod:`toolspec_core.model.graphs`; CUDA and the ragged attention only)."""

    model: torch.nn.Module
    tokenizer: object
    name: str = "model"
    eos_ids: tuple[int, ...] = ()
    max_context: int = 32768
    attention: str = "auto"
    cuda_graphs: bool = False

    def __post_init__(self):
        mode = resolve_attention(self.attention, self.device)  # ValueError for an unknown name
        if self.cuda_graphs and (self.device.type != "cuda" or mode != "ragged"):
            raise ValueError(
                f"cuda_graphs needs a CUDA model and the ragged attention (device {self.device}, attention {mode})"
            )
        self._runner = None  # the StepRunner of the pool the steps run in
        self._alone = None  # the StepRunner of sequences with caches of their own

    @property
    def attention_mode(self) -> str:
        """The attention the batched forward runs: "per_sequence" or "ragged" (``attention`` resolved)."""
        return resolve_attention(self.attention, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @functools.cached_property
    def batched(self) -> bool:
        """Whether ``forward`` runs all sequences in one pass (the model's family is supported)."""
        return supports_batched(self.model)

    def new_cache(self) -> KVCache:
        """An empty KV cache of the kind ``forward`` takes: a :class:`SeqKV`, or HF's own cache
        (:class:`HFKV`) where the batched forward does not cover the family."""
        if self.batched:
            return SeqKV(self.model.config.num_hidden_layers)
        return HFKV(self.hf_cache())

    def block_pool(self, tokens: int, block_tokens: int = 16, prefix_caching: bool = True):
        """A KV block pool of ``tokens`` rows for this target's sequences, or None where ``forward``
        cannot use one (a family the batched forward does not cover)."""
        return pool_for(self.model, tokens, block_tokens, prefix_caching) if self.batched else None

    def kv_budget_tokens(self, fraction: float) -> int | None:
        """KV tokens that fit in ``fraction`` of the accelerator memory free after the weights
        (None on the CPU, where the pool's size is set, not measured)."""
        if self.device.type != "cuda":
            return None
        from toolspec_core.model.block_pool import kv_bytes_per_token

        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * fraction) // kv_bytes_per_token(self.model.config, self.dtype)

    def runner(self, pool=None) -> StepRunner:
        """The :class:`~toolspec_core.model.step_runner.StepRunner` of this target's steps over
        ``pool``, kept (a graphed runner's buffers write that pool's storage; a step over another
        pool makes that pool's runner the kept one): the scheduler's pool, or None for caches of
        the sequences' own (a scheduler without a pool, :meth:`hidden`; any thread, that runner
        holds no state of a step)."""
        if pool is None:
            if self._alone is None:
                self._alone = StepRunner(self.model, None, self.attention, False, head=self._head())
            return self._alone
        if self._runner is None or self._runner.pool is not pool:
            self._runner = StepRunner(self.model, pool, self.attention, self.cuda_graphs, head=self._head())
        return self._runner

    def _head(self):
        """The runners' head: this target's :meth:`logits` (looked up at each step, so the one
        definition of a row's logits is the target's)."""
        return logits_head(lambda h: self.logits(h))

    def warm_graphs(self, pool, grids: list[tuple[int, int, int]]) -> None:
        """Capture the decode steps of these (running sequences, rows a sequence, KV rows) bucket
        shapes over ``pool`` now (start-up), not at their first use."""
        if not self.cuda_graphs:
            raise ValueError("warm_graphs needs a target made with cuda_graphs=True")
        self.runner(pool).graphs.warm(grids)

    def hf_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, segments: list[Segment], pool=None) -> torch.Tensor:
        """Last-layer hidden states [N, H] of every segment's rows, in order (the step runner's
        forward over ``pool``; None: the per-sequence loop over caches of any kind)."""
        return self.runner(pool).hidden(segments)

    def hidden(self, input_ids, position_ids, parents, cache) -> torch.Tensor:
        """One sequence's forward over a cache of its own, outside any scheduler (the model-level
        tests of the forward and the cache; the engine's steps go through :meth:`step`): input_ids /
        position_ids [1, T]; ``parents`` [T] the rows' parent rows (a tree, as
        :func:`~toolspec_core.engine.verify.tree_inputs` gives them) or None (causal); ``cache``
        from :meth:`new_cache`. Returns last-layer hidden states [T, H]; the cache grows by T rows."""
        return self.runner(None).hidden([Segment(cache, input_ids[0], position_ids[0], parents)])

    def hf_hidden(self, input_ids, position_ids, mask, hf_cache) -> torch.Tensor:
        """:meth:`hidden` through HF's own forward over HF's own cache (:meth:`hf_cache`): the
        reference the batched forward is tested against."""
        return hf_hidden(self.model, input_ids, position_ids, mask, hf_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, V] (fp32, on the model's device)."""
        with torch.inference_mode():
            return self.model.lm_head(hidden).float()

    @property
    def device_walk(self) -> bool:
        """Whether the scheduler asks for greedy walks where the argmax is (an accelerator: no copy
        of every row back; on the CPU the host walk costs less than the tensor ops)."""
        return self.device.type != "cpu"

    @property
    def forward_elsewhere(self) -> bool:
        """Whether the forward leaves the host's cores to other work (an accelerator's): the
        scheduler's default ``overlap`` (:func:`~toolspec_core.engine.scheduler.forward_overlaps_host`).
        On the CPU the forward already uses every core, so a worker thread beside it only adds a
        hand-over each step."""
        return self.device.type != "cpu"

    def step(self, plan: StepPlan, pool=None) -> StepOutput:
        """One verify forward as the scheduler planned it (:class:`~toolspec_core.model.step_plan.StepPlan`),
        run by the step runner over ``pool``, the pool the segments' caches are in."""
        return self.runner(pool).run(plan)


def from_model(model, tokenizer, name: str = "model", attention: str = "auto", cuda_graphs: bool = False) -> Target:
    """Wrap an already-built HF model (tests build tiny random ones); an SDPA model is switched to
    the grouped tree-verify attention (:mod:`toolspec_core.model.attention`). ``attention`` /
    ``cuda_graphs``: see :class:`Target` (ValueError for an unknown attention or graphs off CUDA)."""
    model.eval()
    use_grouped_sdpa(model)
    ctx = getattr(model.config, "max_position_embeddings", None) or 32768
    return Target(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_ids=eos_ids_of(model, tokenizer),
        max_context=ctx,
        attention=attention,
        cuda_graphs=cuda_graphs,
    )


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An HF causal LM as every ToolSpec loader needs it (serving, the tensor-parallel worker, the cost
    probe): SDPA attention -- the tree mask is 4D -- switched to the grouped tree-verify attention
    (``attention.use_grouped_sdpa``). One place, so the loaders cannot drift apart."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    use_grouped_sdpa(model)
    return model.eval()


def load_target(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    tune_gemm: bool = True,
    packed_rows: int = 0,
    device: str = "cpu",
    attention: str = "auto",
    cuda_graphs: bool = False,
) -> Target:
    """Load a local HF model directory, or the embedded default when ``path`` is None/"embedded".

    Both go through the same ``from_pretrained`` code path; SDPA attention is required because
    the tree mask is 4D. ``device``: where the model runs (the engine moves its inputs there).
    ``tune_gemm``, ``packed_rows``: see :func:`tune_cpu_linears` (CPU float32 only;
    ``packed_rows=0`` saves a copy of the weights); a bfloat16 / float16 CPU model's linears go
    through :func:`tune_reduced_linears` instead. ``attention`` / ``cuda_graphs``: see
    :class:`Target`.
    """
    from transformers import AutoTokenizer

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
        model = load_hf_model(path, dtype)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"could not load model from {path}: {exc}") from exc
    if device != "cpu":
        model = model.to(device)
    elif tune_gemm and dtype == torch.float32:
        tune_cpu_linears(model, packed_rows=packed_rows)
    elif tune_gemm:  # a reduced-precision CPU model: every row computed alike (what greedy identity needs)
        tune_reduced_linears(model)
    return from_model(model, tok, name=name, attention=attention, cuda_graphs=cuda_graphs)
