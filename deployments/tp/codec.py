"""The step message of a tensor-parallel target: the scheduler's step plan and the KV operations.

A step reaches the ranks as fixed-layout int arrays (:mod:`deployments.tp.channel` carries them,
no pickling): the KV operations since the last step (:class:`KVOps`, which the ranks' storage
replays first) and every field of the scheduler's :class:`~toolspec_core.model.step_plan.StepPlan`
-- each sequence's :class:`~toolspec_core.model.step_plan.SeqRows` fields, its rows' tokens,
positions and parent rows, the :class:`~toolspec_core.model.step_plan.LogitIndex` views, the
hidden rows and the walk inputs. :func:`decode_plan` rebuilds that same plan over the rank's
views of the sequences' block tables; nothing in it is derived again on a rank. Rank 0's answer
(:func:`encode_answer`) goes back the same way.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from toolspec_core.model.batch_forward import Segment
from toolspec_core.model.step_plan import LogitIndex, SeqRows, StepPlan
from toolspec_core.model.step_runner import StepOutput

STEP, STOP = 1, 0
# SeqRows as one int row of the message's sequence table (the segment: its rows elsewhere; tree: parents given)
SEQ_FIELDS = ("sid", "kv_len", "start", "n", "roots", "logit", "logits", "hidden", "hiddens", "walk")
SEQ_COLS = len(SEQ_FIELDS) + 1  # + tree
INDEX_FIELDS = tuple(f.name for f in dataclasses.fields(LogitIndex))
PLAN_AT = 5  # the plan's arrays follow meta, sent, tables, frees and moves


@dataclass
class KVOps:
    """The KV operations since the last step, replayed in this order on every rank's storage:
    ``tables`` of sequences the pool opened ``(sid, table, shared)``, ``frees`` (sids whose
    sequence ended), ``moves``: verify commits' slot moves ``(src, dst)``, each [n]."""

    tables: list[tuple[int, list[int], int]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    moves: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (_ints([]), _ints([])))


def _ints(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def plan_arrays(plan: StepPlan) -> list[np.ndarray]:
    """Every field of ``plan`` as int arrays: the sequence table [S, SEQ_COLS], ids [N], pos [N],
    the tree segments' parent rows (concatenated), the :class:`LogitIndex` views in field order,
    the hidden rows and the walk inputs [B, 1 + 2T] ([0, 0]: none)."""
    seqs = [[getattr(s, f) for f in SEQ_FIELDS] + [int(s.segment.tree)] for s in plan.seqs]
    segs = plan.segments
    parents = [p for s in segs if s.tree for p in s.parents]
    walk = plan.walk.numpy() if plan.walk is not None else np.zeros((0, 0), dtype=np.int64)
    return [
        np.asarray(seqs, dtype=np.int64).reshape(-1, SEQ_COLS),
        _ints(torch.cat([s.ids for s in segs]).numpy() if segs else []),
        _ints(torch.cat([s.pos for s in segs]).numpy() if segs else []),
        _ints(parents),
        *(_ints(getattr(plan.logits, f)) for f in INDEX_FIELDS),
        _ints(plan.hidden_rows),
        walk.astype(np.int64, copy=False),
    ]


def encode_step(plan: StepPlan, ops: KVOps, sent: float) -> list[np.ndarray]:
    """The step message: meta, the replica's clock ``sent`` when it began handing the step over,
    ``ops``, then :func:`plan_arrays`."""
    tables = [np.concatenate([_ints([sid, shared, len(t)]), _ints(t)]) for sid, t, shared in ops.tables]
    src, dst = ops.moves
    return [
        _ints([STEP, int(plan.argmax), len(ops.tables)]),
        np.array([sent], dtype=np.float64),
        np.concatenate(tables) if tables else _ints([]),
        _ints(ops.frees),
        np.stack([_ints(src), _ints(dst)]),
        *plan_arrays(plan),
    ]


def stop_message() -> list[np.ndarray]:
    return [_ints([STOP, 0, 0])]


def decode_ops(arrays: list[np.ndarray]) -> tuple[KVOps, float] | None:
    """The message's KV operations and ``sent`` (None: the stop message)."""
    meta = arrays[0]
    if int(meta[0]) == STOP:
        return None
    flat, tables, o = arrays[2].tolist(), [], 0
    for _ in range(int(meta[2])):
        sid, shared, n = flat[o : o + 3]
        tables.append((sid, flat[o + 3 : o + 3 + n], shared))
        o += 3 + n
    return KVOps(tables, arrays[3].tolist(), (arrays[4][0], arrays[4][1])), float(arrays[1][0])


def decode_plan(arrays: list[np.ndarray], views: dict) -> StepPlan:
    """The message's :class:`StepPlan`, each segment over ``views[sid]`` (the rank's view of the
    sequence's block table, opened by the message's KV operations)."""
    seqs_a, ids_a, pos_a, parents_a = arrays[PLAN_AT : PLAN_AT + 4]
    k = PLAN_AT + 4
    index = LogitIndex(*(a.tolist() for a in arrays[k : k + len(INDEX_FIELDS)]))
    hidden_rows, walk = arrays[k + len(INDEX_FIELDS)].tolist(), arrays[k + len(INDEX_FIELDS) + 1]
    ids, pos, parents = torch.from_numpy(ids_a), torch.from_numpy(pos_a), parents_a.tolist()
    seqs, p = [], 0
    for row in seqs_a.tolist():
        fields = dict(zip(SEQ_FIELDS, row))
        a, n, tree = fields["start"], fields["n"], row[-1]
        rows = parents[p : p + n] if tree else None
        p += n if tree else 0
        seqs.append(SeqRows(Segment(views.get(fields["sid"]), ids[a : a + n], pos[a : a + n], rows), **fields))
    return StepPlan(seqs, index, hidden_rows, torch.from_numpy(walk) if walk.size else None, bool(arrays[0][1]))


def plan_digest(plan: StepPlan, prev: int = 0) -> int:
    """A CRC-32 of ``plan``'s fields (:func:`plan_arrays`, the sids left out: they are of one
    process's pool), chained on ``prev``: what a test compares between the single device and the
    ranks, step by step."""
    arrays = plan_arrays(plan)
    arrays[0] = arrays[0][:, 1:]
    crc = zlib.crc32(np.array([int(plan.argmax)], dtype=np.int64).tobytes(), prev)
    for a in arrays:
        crc = zlib.crc32(np.array(a.shape, dtype=np.int64).tobytes(), crc)
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


def encode_answer(out: StepOutput, forward_s: float) -> list[np.ndarray]:
    """Rank 0's answer: the argmax the host reads, the walks, full rows and hidden states."""
    need = [j for j, c in enumerate(out.choice or []) if c is not None]
    picked = [out.choice[j] for j in need]
    walks = np.asarray(out.walks, dtype=np.int64) if out.walks else np.zeros((0, 0), dtype=np.int64)  # [B, 2 + T]
    full = out.logits.float().cpu().numpy() if out.logits is not None else np.zeros((0, 0), np.float32)
    hidden = out.hidden.float().cpu().numpy() if out.hidden is not None else np.zeros((0, 0), np.float32)
    has = [int(out.choice is not None), int(out.logits is not None), int(out.hidden is not None)]
    return [
        _ints([0, len(out.choice or [])] + has),
        _ints(need),
        _ints(picked),
        walks,
        full,
        hidden,
        np.array([forward_s], dtype=np.float64),
    ]


def error_answer(exc: BaseException) -> list[np.ndarray]:
    return [_ints([1]), np.frombuffer(f"{type(exc).__name__}: {exc}".encode()[:4000], dtype=np.uint8)]


def decode_answer(arrays: list[np.ndarray], full_rows: list[int]) -> tuple[StepOutput, float]:
    """(the step's :class:`StepOutput`, rank 0's step seconds); RuntimeError for a rank's error."""
    meta = arrays[0]
    if int(meta[0]) != 0:
        raise RuntimeError(f"tensor-parallel step failed on rank 0: {arrays[1].tobytes().decode(errors='replace')}")
    m, has_choice, has_full, has_hidden = (int(x) for x in meta[1:5])
    choice = None
    if has_choice:
        choice = [None] * m
        for j, c in zip(arrays[1].tolist(), arrays[2].tolist()):
            choice[j] = c
    full = torch.from_numpy(arrays[4]) if has_full else None
    hidden = torch.from_numpy(arrays[5]) if has_hidden else None
    index = {j: i for i, j in enumerate(full_rows)}
    return StepOutput(choice, arrays[3].tolist(), full, index, hidden), float(arrays[6][0])
