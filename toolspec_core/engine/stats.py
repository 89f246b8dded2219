"""What a decode reports: per-step accepted / drafted counts, labels and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from toolspec_core.spec.labels import NONE
from toolspec_core.spec.tree import DraftTree, VerifyResult

EARLY_STEPS = 24  # steps per request whose shape GenerationStats.early_steps keeps


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    generated_tokens: int = 0
    forwards: int = 0  # decode-phase target forward passes
    forced: int = 0  # tokens forced by a grammar constraint (emitted without verification)
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per step
    drafted: list[int] = field(default_factory=list)  # tree size per step (after budget)
    step_labels: list[str] = field(default_factory=list)  # state of the step (label of its first node)
    verify_step_s: list[float] = field(default_factory=list)  # seconds of each step's forward + walk + KV commit
    label_drafted: dict[str, int] = field(default_factory=dict)
    label_accepted: dict[str, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    # where the request's time went before its first tokens, for load studies: wall-clock marks
    # (time.time(): queued, admitted, prefill_start, first_token; a server adds its own) and,
    # for the first EARLY_STEPS steps that held it, what each step carried (not in to_dict: a
    # server reports them with its own marks; None: not kept, the request did not ask)
    times: dict[str, float] = field(default_factory=dict)
    early_steps: list[dict] | None = None

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s + self.commit_s

    @property
    def mat(self) -> float:
        """Mean tokens per decode forward, bonus included (emitted tokens only)."""
        decoded = self.generated_tokens - 1 - self.forced  # the first token comes from prefill
        return decoded / self.forwards if self.forwards else 1.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "forwards": self.forwards,
            "forced_tokens": self.forced,
            "mat": self.mat,
            "drafted_tokens": sum(self.drafted),
            "accepted_tokens": sum(self.accepted),
            "accepted_per_step": self.accepted,
            "drafted_per_step": self.drafted,
            "step_labels": self.step_labels,
            "verify_per_step": [round(t, 5) for t in self.verify_step_s],
            "label_drafted": self.label_drafted,
            "label_accepted": self.label_accepted,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "commit_s": self.commit_s,
        }


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (stop string / EOS token included)
    text: str  # decoded text, cut before a stop string; EOS not included
    finish_reason: str  # "stop" | "length"
    stats: GenerationStats
    logprobs: list | None = None  # a TokenLogprob per token, when asked for (DecodeConfig.logprobs)


def record_step(stats: GenerationStats, tree: DraftTree, result: VerifyResult) -> None:
    """Count one verify step: its tree size, accepted path and labels."""
    stats.forwards += 1
    stats.accepted.append(len(result.path))
    stats.drafted.append(len(tree))
    first = result.path[0] if result.path else (0 if tree.tokens else -1)
    stats.step_labels.append(tree.labels[first] if first >= 0 else NONE)
    for lab in tree.labels:
        stats.label_drafted[lab] = stats.label_drafted.get(lab, 0) + 1
    for i in result.path:
        lab = tree.labels[i]
        stats.label_accepted[lab] = stats.label_accepted.get(lab, 0) + 1
