"""ModelConfig: one description for every supported dLLM, parsed from (and written back
to) a Hugging Face `config.json` by the model's family (engine.models.families)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..config import Attention, enum_value
from .families import Family, family_for, family_named
from .families.moe import MoESpec
from .rope_scaling import Yarn


@dataclass
class ModelConfig:
    model_type: str  # the family's (engine.models.families): "llada", "Dream", "llada2_moe", ...
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: Optional[int] = None
    eot_token_id: Optional[int] = None  # blockray's own key; checkpoints name theirs in the chat template
    eos_token_ids: Optional[List[int]] = None  # config.json's eos_token_id when it is a list
    # Every id that ends a row (engine.models.stops: set by engine.loader from config.json,
    # generation_config.json and the chat template); None: config.json's eos (and eot).
    stop_ids: Optional[List[int]] = None
    embedding_size: Optional[int] = None  # rows of the embedding (>= vocab_size, padded)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    linear_bias: bool = False  # LLaDA include_bias: every linear has a bias
    max_seq_len: int = 4096
    dllm_attention: Attention = Attention.BIDIRECTIONAL  # or BLOCK_CAUSAL
    extra: Dict[str, Any] = field(default_factory=dict)  # keys known to be irrelevant, written back unchanged
    moe: Optional[MoESpec] = None  # mixture-of-experts layers (LLaDA-MoE); None: dense SwiGLU MLPs
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head
    attn_out_bias: bool = False  # LLaDA2 use_bias: the attention output projection has a bias
    head_dim: Optional[int] = None  # None: hidden_size / n_heads (explicit in Qwen3-style configs)
    rope_yarn: Optional[Yarn] = None  # YaRN's inverse frequencies and attention factor (engine.models.rope_scaling)
    q_position_scale: Optional[Tuple[float, int]] = None  # Llama-4's (beta, original max position): q scaled by position
    # LLaDA2.2's Levenshtein edit tokens (config.json delete_token_id / split_token_id): read by engine.indel
    delete_token_id: Optional[int] = None
    split_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # as_dict() round trip
            self.moe = MoESpec(**self.moe)
        if isinstance(self.rope_yarn, dict):  # as_dict() round trip
            self.rope_yarn = Yarn(**self.rope_yarn)
        if self.q_position_scale is not None:
            self.q_position_scale = (float(self.q_position_scale[0]), int(self.q_position_scale[1]))
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id
        self.dllm_attention = enum_value("dllm_attention", self.dllm_attention, Attention)
        if self.dllm_attention == Attention.AUTO:
            raise ValueError("dllm_attention must be 'bidirectional' or 'block_causal', got 'auto'")
        if self.head_dim is None:
            if self.hidden_size % self.n_heads:
                raise ValueError("hidden_size must divide by n_heads (or head_dim be given)")
            self.head_dim = self.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must divide by n_kv_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def active_intermediate_size(self) -> float:
        """MLP width one token computes per layer (the routed experts' and shared expert's
        for a MoE model): what the cost model and the activation budget count."""
        return self.moe.active_ffn_width() if self.moe is not None else self.intermediate_size

    @property
    def family(self) -> Family:
        return family_named(self.model_type)

    @property
    def shift_logits(self) -> bool:
        """Dream predicts token i from position i-1 (it was adapted from an AR model)."""
        return self.family.shift_logits

    @property
    def block_causal(self) -> bool:
        return self.dllm_attention == Attention.BLOCK_CAUSAL

    @property
    def stop_token_ids(self) -> List[int]:
        """The checkpoint's stop ids when the loader found them, else config.json's."""
        if self.stop_ids is not None:
            return list(self.stop_ids)
        ids = list(self.eos_token_ids or [self.eos_token_id])
        if self.eot_token_id is not None and self.eot_token_id not in ids:
            ids.append(self.eot_token_id)
        return ids

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V of every layer for one cached column: the repo's one K/V-size formula
        (engine.budget and the sorter's cost model both read it)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.family.param_shapes(self).values())

    def active_params(self) -> int:
        """Parameters one token uses: a MoE layer's unchosen experts left out."""
        m = self.moe
        if m is None:
            return self.num_params()
        idle = sum(not dl for dl in m.dense_layers) * (m.num_experts - m.top_k) * 3 * self.hidden_size * m.expert_size
        return self.num_params() - idle

    @classmethod
    def tiny(cls, model_type: str = "llada", **kw: Any) -> "ModelConfig":
        """A small random-weights config for tests and CPU benchmarks."""
        base = dict(model_type=model_type, vocab_size=64, hidden_size=32, n_layers=2, n_heads=4,
                    n_kv_heads=4 if model_type == "llada" else 2, intermediate_size=64,
                    mask_token_id=63, eos_token_id=1, max_seq_len=1024,
                    qkv_bias=model_type == "Dream", rope_theta=10000.0)
        base.update(kw)
        return cls(**base)

    # --- Hugging Face config.json ---------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Dict[str, Any]) -> "ModelConfig":
        """Parse config.json through its family (engine.models.families): a key the engine
        would not honour is refused (ConfigRefused, a ValueError), as is a family it does
        not implement."""
        family = family_for(hf)
        family.check_config(hf)
        return cls.parse(hf, family)

    @classmethod
    def parse(cls, hf: Dict[str, Any], family: Family) -> "ModelConfig":
        """config.json `hf` (checked by `family`) as a ModelConfig; the keys the family knows
        to be irrelevant are kept in `extra` and written back by to_hf."""
        cfg = cls(**family.parse(hf))
        written = cfg.to_hf()
        cfg.extra = {k: v for k, v in hf.items() if k not in family.honoured and k not in written}
        return cfg

    def to_hf(self) -> Dict[str, Any]:
        hf = self.family.to_hf(self)
        eos = self.eos_token_ids if self.eos_token_ids and len(self.eos_token_ids) > 1 else self.eos_token_id
        hf.update(mask_token_id=self.mask_token_id, eos_token_id=eos,
                  pad_token_id=self.pad_token_id, dllm_attention=self.dllm_attention)
        if self.eot_token_id is not None:
            hf["eot_token_id"] = self.eot_token_id
        return {**self.extra, **hf}

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)
