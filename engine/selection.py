"""Which masked positions of a block a denoising step commits: one class per policy
behind one interface (as SGLang's srt/dllm/algorithm/ keeps one class per algorithm).
A row names its policy (SamplingParams.policy); the `threshold` policy is the model
family's (Family.threshold: a ThresholdRule, or a Selection of its own), so a family's
threshold semantics is a parameter or a class here, never an edit of
engine.decoding.select. Each class follows its reference loop (see SamplingParams):
LLaDA's `generate`, Fast-dLLM's `get_transfer_index(_dynamic)`, LLaDA2's and SDAR's
floors, Fast-dLLM v2's `batch_sample`, Dream's `alg`s, JetEngine's entropy bound.

A policy chooses for every row of the batch at once, vectorised ([B, L] in, [B, L]
out); engine.decoding.select keeps each row's own policy's choice. Torch is imported
when a policy chooses, so the preflight may read the registry without it."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

DREAM_EPS = 1e-3  # Dream's generation_config.eps: the last timestep of its schedule
NO_CAP = 2**31  # a floor's steps that max_new_tokens does not cap


@dataclass
class Candidates:
    """What a policy reads of a step: the candidates' confidence `conf` [B, L] (float64,
    -inf where no mask may be chosen), `is_mask` [B, L], each row's `step` [B] inside its
    block (device), its parameters (`params`, engine.decoding.RowParams: `params.dev.<name>`,
    and `params.extra[<name>]` for what the policy declared in `row_values`), the block
    length and steps per block. The derived values are computed once, when a policy asks."""

    conf: "torch.Tensor"
    is_mask: "torch.Tensor"
    step: "torch.Tensor"
    params: Any
    block_length: int
    steps: int

    @cached_property
    def rank(self) -> "torch.Tensor":
        """Rank of each position by descending confidence (0 = most confident); stable, so
        ties break by position the same way in any batch."""
        import torch

        conf = self.conf
        order = conf.argsort(dim=1, descending=True, stable=True)
        ar = torch.arange(conf.shape[1], device=conf.device).expand_as(order)
        return torch.empty_like(order).scatter_(1, order, ar)

    @cached_property
    def n_mask(self) -> "torch.Tensor":
        return self.is_mask.sum(1)

    @cached_property
    def sorted_conf(self) -> "torch.Tensor":
        return self.conf.sort(dim=1, descending=True).values


class Selection:
    """A step's policy: `choose` the positions [B, L] to commit (the caller keeps its own
    rows' choice, forces the cap's last step and the first position, and drops non-masks).
    `scheduled`: the policy fills a block within S steps (its step cap is S; else max(S, L),
    a bound only a model that proposes the mask token itself reaches). `row_values`: per-row
    host tensors the policy reads (uploaded once per batch layout, in RowParams.extra)."""

    name = ""
    scheduled = False

    def choose(self, c: Candidates) -> "torch.Tensor":
        raise NotImplementedError

    def row_values(self, params: Sequence[Any], floor_one: Sequence[bool]) -> Dict[str, "torch.Tensor"]:
        """{name: host [B] tensor} for rows with SamplingParams `params`; `floor_one`: the rows
        whose decoding rule takes at least one position a step (LLaDA2.1's editing)."""
        return {}


class Fixed(Selection):
    """LLaDA's schedule: the k_s most confident masks, L tokens over S steps as evenly as
    possible, the earliest steps taking the remainder."""

    name, scheduled = "fixed", True

    def choose(self, c: Candidates) -> "torch.Tensor":
        return c.rank < fixed_schedule(c.step, c.block_length, c.steps)[:, None]


@dataclass(frozen=True)
class Threshold(Selection):
    """Every position whose confidence passes the row's threshold (>=, or > when `strict`),
    at least the most confident one; with a `floor`, strictly greater and at least the fixed
    schedule's k of the step over the row's floor steps (min(steps, max_new_tokens) when
    `capped`: LLaDA2.0's generate(); steps: SDAR's), k = 1 for the rows whose rule asks
    (LLaDA2.1's editing loop)."""

    strict: bool = False
    floor: bool = False
    capped: bool = False
    name: str = field(default="threshold", init=False)

    def row_values(self, params: Sequence[Any], floor_one: Sequence[bool]) -> Dict[str, "torch.Tensor"]:
        if not self.floor:
            return {}
        import torch

        return {"floor_steps": torch.tensor([p.max_new_tokens if self.capped else NO_CAP for p in params],
                                            dtype=torch.long),
                "floor_one": torch.tensor([int(f) for f in floor_one], dtype=torch.long)}

    def choose(self, c: Candidates) -> "torch.Tensor":
        thr = c.params.dev.threshold[:, None]
        if self.floor:
            import torch

            L = c.block_length
            s_row = c.params.extra["floor_steps"].clamp(max=c.steps)
            k = torch.where(c.params.extra["floor_one"].bool(), 1, L // s_row + (c.step < L % s_row).long())
            return (c.conf > thr) | (c.rank < k[:, None])
        return ((c.conf > thr) if self.strict else (c.conf >= thr)) | (c.rank == 0)


class Factor(Selection):
    """Fast-dLLM's get_transfer_index_dynamic: k = how many leading sorted confidences pass
    1 - f/(n+1) (the first always passes); the reference then takes k, but 1 when k == 0 and
    all n masks when k >= n - 1."""

    name = "factor"

    def choose(self, c: Candidates) -> "torch.Tensor":
        import torch

        conf, n_mask = c.conf, c.n_mask
        n = torch.arange(1, conf.shape[1] + 1, device=conf.device, dtype=torch.float64)
        bar = 1.0 - c.params.dev.factor[:, None] / (n + 1.0)
        bar[:, 0] = -1.0
        k = (c.sorted_conf >= bar).long().cumprod(dim=1).sum(dim=1)
        n_take = torch.where(k == 0, 1, torch.where(k >= n_mask - 1, n_mask, k))
        return c.rank < n_take[:, None]


class Timestep(Selection):
    """Dream's schedule: at step s, int(n * (1 - t_{s+1} / t_s)) of the n masks left; all of
    them at the last step."""

    name, scheduled = "timestep", True

    def choose(self, c: Candidates) -> "torch.Tensor":
        return c.rank < timestep_schedule(c.step, c.n_mask, c.steps)[:, None]


class Origin(Selection):
    """Dream's alg="origin": each mask independently, when its uniform draw (its confidence)
    is below 1 - t_{s+1} / t_s."""

    name, scheduled = "origin", True

    def choose(self, c: Candidates) -> "torch.Tensor":
        return c.conf < transfer_fraction(c.step, c.steps).double()[:, None]


class EntropyBound(Selection):
    """JetEngine's entropy_bounded: the lowest-entropy masks (conf is minus the entropy)
    while the running sum of their entropies stays below the row's bound; at least one."""

    name = "entropy_bound"

    def choose(self, c: Candidates) -> "torch.Tensor":
        k = ((-c.sorted_conf).cumsum(dim=1) < c.params.dev.entropy_bound[:, None]).sum(dim=1).clamp(min=1)
        return c.rank < k[:, None]


# the policies a row may name, in the order of their ids (a row's id picks its policy's choice)
POLICIES: Tuple[Selection, ...] = (Fixed(), Threshold(), Factor(), Timestep(), Origin(), EntropyBound())
POLICY_IDS = {p.name: i for i, p in enumerate(POLICIES)}

# engine.models.families.base.ThresholdRule's values (a StrEnum: its members are these strings)
THRESHOLDS = {"at_least_top1": Threshold(), "greater_at_least_top1": Threshold(strict=True),
              "schedule_floor": Threshold(floor=True, capped=True), "block_floor": Threshold(floor=True)}


def threshold_policy(rule: Any) -> Selection:
    """The `threshold` policy a family declares: a ThresholdRule's, or its own Selection."""
    if isinstance(rule, Selection):
        return rule
    if str(rule) not in THRESHOLDS:
        raise ValueError(f"unknown threshold rule {rule!r}: one of {sorted(THRESHOLDS)}, or an "
                         "engine.selection.Selection")
    return THRESHOLDS[str(rule)]


def policies_with(threshold: Optional[Selection]) -> Tuple[Selection, ...]:
    """POLICIES, the `threshold` one the family's."""
    if threshold is None:
        return POLICIES
    return tuple(threshold if p.name == "threshold" else p for p in POLICIES)


def fixed_schedule(step: "torch.Tensor", block_length: int, steps: int) -> "torch.Tensor":
    """LLaDA's schedule: L tokens over S steps as evenly as possible, earliest steps take
    the remainder. `step` [B] is each row's step index inside its block."""
    base, rem = divmod(block_length, steps)
    return base + (step < rem).long()


def transfer_fraction(step: "torch.Tensor", steps: int) -> "torch.Tensor":
    """Dream's 1 - t_{s+1} / t_s at step s, t = linspace(1, eps, S+1) in float32 as Dream
    computes it."""
    import torch

    t = torch.linspace(1, DREAM_EPS, steps + 1, device=step.device)
    s = step.clamp(max=steps - 1)
    return 1 - t[s + 1] / t[s]


def timestep_schedule(step: "torch.Tensor", n_mask: "torch.Tensor", steps: int) -> "torch.Tensor":
    """Dream's schedule: at step s, int(n * (1 - t_{s+1} / t_s)) of the n masks left; all
    of them at the last step."""
    import torch

    k = (n_mask.float() * transfer_fraction(step, steps)).long()
    return torch.where(step >= steps - 1, n_mask, k)
