"""What a mixture-of-experts backbone routes and computes, in one torch-free object: the
families parse it from config.json (llada_moe.py), engine/models/moe.py computes it, and
the K/V budget and the sorter's cost model read its active width per token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class MoESpec:
    """`dense_layers[i]`: layer i has a dense MLP of `dense_size` instead of experts.
    Routing: `score` ("softmax" | "sigmoid") of float32 router logits; `expert_bias`: a
    per-expert bias added to the scores; `bias_in_weights`: whether that biased score is
    also the mixing weight (LLaDA-MoE's published block) or used for selection only
    (LLaDA2, DeepSeek-V3 style); `n_group`/`topk_group`: group-limited top-k;
    `renormalize`: weights divided by their sum; times `scaling`.
    Block routing (LLaDA2.2's gate, when `expert_capacity` is set; n_group/topk_group are
    then unused): per `block_size` tokens at absolute positions of a row, the
    `expert_capacity` experts whose best biased score over the block's tokens is highest
    are admitted, and each token takes its top_k among them (engine.models.moe.route)."""

    num_experts: int
    top_k: int
    expert_size: int
    dense_size: int
    dense_layers: Tuple[bool, ...]
    shared_size: Optional[int] = None
    score: str = "softmax"
    expert_bias: bool = False
    bias_in_weights: bool = True
    renormalize: bool = False
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    expert_capacity: Optional[int] = None
    block_size: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(bool(d) for d in self.dense_layers))
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE router score must be 'softmax' or 'sigmoid', got {self.score!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} lie in 1..n_group")
        if (self.expert_capacity is None) != (self.block_size is None):
            raise ValueError(f"block routing needs both expert_capacity and block_size, got "
                             f"expert_capacity={self.expert_capacity} block_size={self.block_size}")
        if self.expert_capacity is not None:
            if not self.top_k <= self.expert_capacity <= self.num_experts:
                raise ValueError(f"expert_capacity={self.expert_capacity} must lie in num_experts_per_tok="
                                 f"{self.top_k}..num_experts={self.num_experts}: each token picks its top_k "
                                 f"among the experts admitted for its block")
            if self.block_size < 1:
                raise ValueError(f"block_size={self.block_size} must be at least 1")

    @property
    def block_routed(self) -> bool:
        """Whether experts are admitted per block of tokens (LLaDA2.2) before each token's top_k."""
        return self.expert_capacity is not None

    def block_length_refusal(self, block_length: int) -> Optional[str]:
        """Why an engine decoding blocks of `block_length` cannot run this routing, or None:
        block routing admits experts per block_size positions, so every forward must hold
        whole routing blocks at their absolute positions (the published gate asserts a
        whole number of them); a block-only step over part of one would route it on part
        of its tokens."""
        if self.block_size is None or block_length % self.block_size == 0:
            return None
        return (f"block_length={block_length} is not a multiple of the model's routing block_size={self.block_size}: "
                f"its MoE gate admits expert_capacity={self.expert_capacity} experts per block of {self.block_size} "
                f"positions, and a step over part of a block would route it on part of its tokens")

    def ffn_width(self, layer: int) -> int:
        """Active MLP width of one token in `layer` (routed experts + shared, or dense)."""
        if self.dense_layers[layer]:
            return self.dense_size
        return self.top_k * self.expert_size + (self.shared_size or 0)

    def active_ffn_width(self) -> float:
        """Mean active MLP width per layer: what a token computes, whatever the expert count."""
        return sum(self.ffn_width(i) for i in range(len(self.dense_layers))) / len(self.dense_layers)
