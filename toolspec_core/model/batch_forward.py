"""One target forward over the rows of many sequences, each attending only to its own KV.

Every row of every sequence (prefill chunks, root chains, draft trees) is concatenated into one
[1, N, H] activation: embeddings, norms, the q / k / v / o projections and the MLP run once over
all N rows -- the weights are read once per step however many sequences run, which is where a
batch's speed comes from. Attention is per sequence by default: its rows' keys and values are
written into its own cache (any :class:`~toolspec_core.model.kv.KVCache`) and its queries attend
over that cache with its own tree mask; where every sequence's cache is a block table of one
pool, the ragged attention (:mod:`toolspec_core.model.ragged`) does the same for all of them in
one call a layer. Rows never see another sequence's, so a sequence's output is what it is
alone up to the linears' row-count-dependent rounding (the same as a bigger draft tree).

The decoder layers are the HF modules themselves (``input_layernorm``, ``self_attn.q_proj``,
...), so the CPU linears (:mod:`toolspec_core.model.cpu_linears`) and tensor-parallel shards
that replace those modules are used as they are. Families with this layer shape (Llama, Qwen2,
Qwen3, Mistral without a sliding window) are supported; :func:`supports_batched` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from toolspec_core.model.kv import KVCache
from toolspec_core.model.rows_attention import load as load_rows_attention
from toolspec_core.model.rows_attention import rows_attention, rows_parents

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
CAUSAL_KERNEL = True  # long first prefill chunks attend through causal_attention (False: a causal mask tensor)
# a masked causal chunk of more rows attends in row blocks of this many (0: one call; blocked_masks says why)
ROW_BLOCK = 256
CAUSAL_MIN_ROWS = 576  # from this many rows (benchmarks/results/measurements/prefill-attention-cpu-epyc-481a359.json); below, SDPA's CPU kernel blocks a per-head causal call more finely and it measured slower


@dataclass
class Segment:
    """One sequence's rows in a batched forward.

    ``ids`` / ``pos`` [n] (long). A tree's rows (a root chain with a draft tree) carry their
    visibility once, as ``parents`` [n]: each row's parent row among them (-1: none, the row hangs
    off the cache; a row sees itself and its ancestors, and every row sees the whole cache),
    what :func:`~toolspec_core.engine.verify.row_parents` gives. The ragged attention's plan and a
    tensor-parallel plan read the parents (:func:`parents_visible`, all trees at once); the paths
    that take an additive float mask (the per-sequence loop, HF's own forward) build it from them
    when they run (:func:`tree_masks`, :meth:`attn_mask`), so a step on the ragged path never
    makes one. None: causal rows (a prefill chunk; a single decode row sees everything).
    """

    cache: KVCache
    ids: torch.Tensor
    pos: torch.Tensor
    parents: list[int] | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def tree(self) -> bool:
        """Whether the rows see each other as a tree (parents given), not causally."""
        return self.parents is not None

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask [1, 1, n, n] of these rows, built now from ``parents`` (None: causal rows)."""
        if self.parents is None:
            return None
        return tree_masks(self.parents, [len(self)], dtype)[0]


def parents_visible(parents, sizes: list[int]) -> np.ndarray:
    """bool [S, m, m] (m: the largest size): for each of S segments whose rows' parents are
    ``parents`` (:attr:`Segment.parents`, concatenated: [sum(sizes)], -1: none), which of its rows
    each row sees -- itself and its ancestors; padding sees nothing. All segments at once, one
    numpy pass per level of the deepest tree, instead of a mask read back per sequence."""
    s, m = len(sizes), max(sizes, default=0)
    vis = np.zeros((s, m, m), dtype=bool)
    if not s:
        return vis
    lens = np.asarray(sizes)
    real = np.arange(m)[None] < lens[:, None]  # [S, m]
    par = np.full((s, m), -1, dtype=np.int64)
    par[real] = np.asarray(parents, dtype=np.int64)
    si, ri = np.nonzero(real)
    vis[si, ri, ri] = True
    up = par[si, ri]  # each real row's current ancestor
    while True:
        has = up >= 0
        if not has.any():
            return vis
        si, ri, up = si[has], ri[has], up[has]
        vis[si, ri, up] = True
        up = par[si, up]


def tree_masks(parents, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each of the trees' additive masks [1, 1, n, n] from their rows' ``parents`` (concatenated,
    as in :func:`parents_visible`): views of one [S, 1, m, m] tensor made at once. What the
    paths that take a float mask build, where they run."""
    if not sizes:
        return []
    seen = torch.from_numpy(parents_visible(parents, sizes))
    masks = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]  # [S, 1, m, m]
    return [masks[k : k + 1, :, :n, :n] for k, n in enumerate(sizes)]


def supports_batched(model: torch.nn.Module) -> bool:
    """Whether :func:`batched_forward` reproduces this HF model's forward."""
    cfg = getattr(model, "config", None)
    core = getattr(model, "model", None)
    if cfg is None or core is None or getattr(cfg, "model_type", None) not in FAMILIES:
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return False
    layer = core.layers[0]
    attn = getattr(layer, "self_attn", None)
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")) and all(
        hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [1, heads, N, D] with cos / sin [1, 1, N, D]: bitwise HF's
    ``x * cos + rotate_half(x) * sin`` (``a + (-b) * c`` is ``a - b * c`` in IEEE arithmetic)
    without ``rotate_half``'s negated copy, concatenation and full-width temporaries: on the
    strided q of a 512-row chunk HF's function took ~3 ms a layer on the CPU, this ~0.3 ms."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def causal_mask(prefix: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n, prefix + n] additive: row i sees the prefix and rows <= i."""
    cols = torch.arange(prefix + n, device=device)
    rows = torch.arange(n, device=device)[:, None] + prefix
    return torch.where(cols[None, :] <= rows, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


def segment_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [1, H, n, D], k / v [1, H_kv, S, D], mask [1, 1, g * n, S] (see :func:`grouped_mask`) or
    None -> [1, n, H * D].

    The ``g = H / H_kv`` query heads that share a KV head are stacked as ``g * n`` rows of that
    head, so the KV heads are never copied (:mod:`toolspec_core.model.attention` measures why).
    """
    _, h, n, d = q.shape
    hkv = k.shape[1]
    q, k, v, mask, dtype = exact_inputs(q, k, v, mask)
    qg = q.reshape(1, hkv, (h // hkv) * n, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [1, H_kv, g*n, D]
    return out.reshape(1, h, n, d).transpose(1, 2).reshape(1, n, h * d).to(dtype)


def exact_inputs(q, k, v, mask):
    """q, k, v and the mask in float32 where they are a reduced-precision CPU model's, and the
    dtype the output goes back to. SDPA's bfloat16 CPU kernel rounds a block's softmax weights to
    bfloat16 before multiplying them with V, and its query blocks follow the rows of the call, so
    a row's output depends, by bfloat16 ulps, on how many rows share its call. In float32 a row in
    a masked call is still up to ~1e-7 from the row alone (``benchmarks.studies.attention_rows``),
    which rounding back to bfloat16 turns into ulps on ~0.01% of the elements: so every row of a
    reduced-precision model -- decode and tree rows, where plain greedy and a verify step must
    agree, and prompt rows, which a loaded server cuts into other chunks than an idle one -- goes
    through the fixed-order kernel instead (:func:`fixed_order_kernel`), and only the kernel's
    fallback comes here. The copies are the rows' K and V, small beside a layer's weights."""
    dtype = q.dtype
    if dtype in (torch.float32, torch.float64) or q.device.type != "cpu":
        return q, k, v, mask, dtype
    to = torch.float32
    return q.to(to), k.to(to), v.to(to), None if mask is None else mask.to(to), dtype


def causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """A sequence's first prefill chunk (no cached prefix) without a mask tensor: q [1, H, n, D],
    k / v [1, H_kv, n, D] -> [1, n, H * D].

    Why: with a materialized [g * n, n] causal mask SDPA's CPU flash kernel computes every block
    of the score matrix and adds the mask; with ``is_causal`` it skips the blocks above the
    diagonal and reads no mask. The result equals the masked call's to float rounding (a skipped block's
    every score is masked to zero weight; tested). Taken from :data:`CAUSAL_MIN_ROWS` rows: on this
    CPU the causal call was 1.09-1.52x faster at 576-1,024 rows and 0.77-0.97x at 128-512, where the
    grouped masked call (7x the query rows) gets the kernel's larger query blocks. A chunk after a cached prefix keeps the mask:
    SDPA's ``is_causal`` is top-left aligned, and splitting such a chunk into its rows over the
    prefix and over themselves (two calls merged by their log-sum-exps) measured slower than the
    masked call (``python -m benchmarks.studies.prefill_forward``)."""
    _, h, n, d = q.shape
    q, k, v, _, dtype = exact_inputs(q, k, v, None)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # [1, H, n, D]
    return out.transpose(1, 2).reshape(1, n, h * d).to(dtype)


def blocked_masks(
    prefix: int, n: int, g: int, dtype: torch.dtype, device, block: int
) -> list[tuple[int, int, torch.Tensor]]:
    """A causal chunk of ``n`` rows after ``prefix`` cached rows as row blocks of ``block``:
    ``(a, b, mask)`` per block, rows ``a..b`` of the chunk and their grouped mask [1, 1, g * (b - a),
    prefix + b] over only the keys they may see.

    Why: one masked call computes every score of the [n, prefix + n] rectangle and masks those
    right of the diagonal away; in blocks, block j never computes the columns past its own last
    row -- a first chunk of 512 rows in two blocks does 3/4 of the score work. Each block keeps
    the grouped layout (``g`` x its rows as query rows), which is what made the masked call
    faster than the causal kernel at these sizes. The result equals the one call's to float
    rounding (the same scores, softmax over the same unmasked columns)."""
    out = []
    for a in range(0, n, block):
        b = min(n, a + block)
        out.append((a, b, grouped_mask(causal_mask(prefix + a, b - a, dtype, device), g)))
    return out


def blocked_attention(q, k, v, blocks: list[tuple[int, int, torch.Tensor]], prefix: int, scale: float) -> torch.Tensor:
    """q [1, H, n, D], k / v [1, H_kv, prefix + n, D] through :func:`blocked_masks`' blocks -> [1, n, H * D]."""
    outs = [
        segment_attention(q[:, :, a:b], k[:, :, : prefix + b], v[:, :, : prefix + b], m, scale) for a, b, m in blocks
    ]
    return torch.cat(outs, 1) if len(outs) > 1 else outs[0]


def grouped_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """[1, 1, n, S] -> [1, 1, g * n, S]: the mask of the stacked query rows, built once a forward
    (not once a layer)."""
    return mask.repeat(1, 1, g, 1)


ROWS = object()  # a segment's attention through the fixed-order rows kernel


def fixed_order_kernel(dtype: torch.dtype, device) -> object | None:
    """The fixed-order attention kernel where a model's rows need it (decode, tree and prompt rows
    alike): a bfloat16 / float16 model on the CPU, whose rounding turns SDPA's row-dependent last
    bits into whole ulps
    (:mod:`toolspec_core.model.rows_attention` says why); None for float32 models and GPUs (and
    where the kernel is not built)."""
    if dtype not in (torch.bfloat16, torch.float16) or torch.device(device).type != "cpu":
        return None
    return load_rows_attention()


def batched_forward(model: torch.nn.Module, segments: list[Segment]) -> torch.Tensor:
    """Last-layer hidden states [N, H] of all segments' rows, in order; every cache grows by its rows.

    Attention runs one call a sequence, over any :class:`~toolspec_core.model.kv.KVCache`
    (the step runner, :mod:`toolspec_core.model.step_runner`, chooses between this and one call for all).
    Inputs may be on the CPU; they are moved to the model's device here.
    """
    core = model.model
    dev = core.embed_tokens.weight.device
    dtype = core.embed_tokens.weight.dtype
    ids = torch.cat([s.ids for s in segments]).to(dev, non_blocking=True)  # [N]
    pos = torch.cat([s.pos for s in segments]).to(dev, non_blocking=True)  # [N]
    cfg = model.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head (the same on a TP shard)
    exact = fixed_order_kernel(dtype, dev)
    drawn = [s for s in segments if s.tree] if exact is None else []  # the kernel takes parents, not masks
    built = iter(tree_masks([p for s in drawn for p in s.parents], [len(s) for s in drawn], dtype))  # all at once
    bounds, masks, prefixes, o = [], [], [], 0
    for s in segments:
        n, prefix = len(s), s.cache.get_seq_length()
        prefixes.append(prefix)
        bounds.append((o, o + n))
        o += n
        if exact is not None:
            # every row in a fixed order: decode and tree rows as alone, prompt rows however chunked
            masks.append((ROWS, rows_parents(s.parents, n)))
        elif s.tree:
            m = next(built)  # [1, 1, n, n]
            masks.append(grouped_mask(widen(m.to(dev, dtype, non_blocking=True), prefix), g))
        elif n >= CAUSAL_MIN_ROWS and prefix == 0 and CAUSAL_KERNEL:
            masks.append("causal")  # a first prefill chunk: causal_attention, no mask tensor
        elif ROW_BLOCK and n > ROW_BLOCK and dtype == torch.float32:
            # a float32 model's prefill chunk in row blocks (a reduced-precision CPU model's rows
            # all take the fixed-order kernel above)
            masks.append(blocked_masks(prefix, n, g, dtype, dev, ROW_BLOCK))
        elif n > 1:
            masks.append(grouped_mask(causal_mask(prefix, n, dtype, dev), g))
        else:
            masks.append(None)  # one row attends to the whole cache

    def attend(li: int, q, k, v, scale: float) -> torch.Tensor:
        outs = []
        for s, (a, b), m, prefix in zip(segments, bounds, masks, prefixes):
            keys, values = s.cache.write(li, k[:, :, a:b], v[:, :, a:b])  # [1, H_kv, S, D]
            if isinstance(m, tuple):  # (ROWS, parents [n]): built once a forward, not once a layer
                outs.append(rows_attention(exact, q[:, :, a:b], keys, values, m[1], prefix, scale))
            elif isinstance(m, str):  # "causal"
                outs.append(causal_attention(q[:, :, a:b], keys, values, scale))
            elif isinstance(m, list):  # row blocks of a prefill chunk
                outs.append(blocked_attention(q[:, :, a:b], keys, values, m, prefix, scale))
            else:
                outs.append(segment_attention(q[:, :, a:b], keys, values, m, scale))
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    x = decoder_layers(model, ids, pos, attend)
    for s in segments:
        s.cache.advance(len(s))
    return x


def decoder_layers(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
    """The decoder over rows ``ids`` / ``pos`` [N] (on the model's device) -> last-layer hidden
    states [N, H]; ``attend(layer, q [1, H, N, D], k / v [1, H_kv, N, D], scale)`` -> [1, N, H * D]
    stores the rows' K / V and attends (per sequence, or all at once over the block pool)."""
    core = model.model
    with torch.inference_mode():
        x = core.embed_tokens(ids[None])  # [1, N, H]
        cos, sin = core.rotary_emb(x, pos[None])  # [1, N, D] each
        cos4, sin4 = cos[:, None], sin[:, None]  # [1, 1, N, D]
        for li, layer in enumerate(core.layers[: model.config.num_hidden_layers]):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (1, h.shape[1], -1, attn.head_dim)
            q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, N, D]
            q, k = rope(q, cos4, sin4), rope(k, cos4, sin4)
            x = x + attn.o_proj(attend(li, q, k, v, attn.scaling))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = core.norm(x)
    return x[0]


def widen(mask: torch.Tensor, prefix: int) -> torch.Tensor:
    """A mask over the new rows only, [1, 1, n, n] (what the scheduler builds) -> [1, 1, n, prefix + n]:
    every new row sees the whole cached prefix. A mask already that wide is returned as it is."""
    n = mask.shape[-2]
    return F.pad(mask, (prefix + n - mask.shape[-1], 0)) if mask.shape[-1] < prefix + n else mask
