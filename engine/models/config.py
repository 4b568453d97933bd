"""ModelConfig: one description for every supported dLLM, parsed from (and written
back to) the Hugging Face `config.json` of LLaDA or Dream."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

LLADA_8B_EOT = 126348  # LLaDA-8B-Instruct's <|eot_id|>; its config.json does not name it


@dataclass
class ModelConfig:
    model_type: str  # "llada" | "Dream"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: Optional[int] = None
    eot_token_id: Optional[int] = None
    embedding_size: Optional[int] = None  # rows of the embedding (>= vocab_size, padded)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    linear_bias: bool = False  # LLaDA include_bias: every linear has a bias
    max_seq_len: int = 4096
    dllm_attention: str = "bidirectional"  # or "block_causal"
    extra: Dict[str, Any] = field(default_factory=dict)  # unknown keys, written back unchanged

    def __post_init__(self) -> None:
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id
        if self.dllm_attention not in ("bidirectional", "block_causal"):
            raise ValueError(f"dllm_attention must be 'bidirectional' or 'block_causal', got {self.dllm_attention!r}")
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("hidden_size must divide by n_heads and n_heads by n_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def shift_logits(self) -> bool:
        """Dream predicts token i from position i-1 (it was adapted from an AR model)."""
        return self.model_type == "Dream"

    @property
    def block_causal(self) -> bool:
        return self.dllm_attention == "block_causal"

    @property
    def stop_token_ids(self) -> List[int]:
        ids = [self.eos_token_id]
        if self.eot_token_id is not None and self.eot_token_id != self.eos_token_id:
            ids.append(self.eot_token_id)
        return ids

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V of every layer for one cached column: the repo's one K/V-size formula
        (engine.budget and the sorter's cost model both read it)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    def num_params(self) -> int:
        d, f, kv = self.hidden_size, self.intermediate_size, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.embedding_size * d
        return self.embedding_size * d + self.n_layers * per_layer + d + head

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
        mt = hf.get("model_type")
        if mt is None and "d_model" in hf:
            mt = "llada"
        if mt in ("llada", "LLaDA"):
            known = dict(
                model_type="llada", vocab_size=hf["vocab_size"], hidden_size=hf["d_model"],
                n_layers=hf["n_layers"], n_heads=hf["n_heads"],
                n_kv_heads=hf.get("n_kv_heads") or hf["n_heads"],
                intermediate_size=hf["mlp_hidden_size"], mask_token_id=hf.get("mask_token_id", 126336),
                eos_token_id=hf.get("eos_token_id", 126081), pad_token_id=hf.get("pad_token_id"),
                eot_token_id=hf.get("eot_token_id", LLADA_8B_EOT if hf["vocab_size"] == 126464 else None),
                embedding_size=hf.get("embedding_size"), rope_theta=hf.get("rope_theta", 10000.0),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_word_embeddings=hf.get("weight_tying", False),
                linear_bias=hf.get("include_bias", False),
                qkv_bias=hf.get("include_bias", False) or hf.get("include_qkv_bias", False),
                max_seq_len=hf.get("max_sequence_length", 4096),
                dllm_attention=hf.get("dllm_attention", "bidirectional"),
            )
            used = {"model_type", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                    "mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id", "embedding_size", "rope_theta",
                    "rms_norm_eps", "weight_tying", "include_bias", "include_qkv_bias", "max_sequence_length",
                    "dllm_attention"}
        elif mt == "Dream":
            known = dict(
                model_type="Dream", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"], mask_token_id=hf.get("mask_token_id", 151666),
                eos_token_id=hf.get("eos_token_id", 151643), pad_token_id=hf.get("pad_token_id"),
                eot_token_id=hf.get("eot_token_id"), rope_theta=hf.get("rope_theta", 10000.0),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=True, max_seq_len=hf.get("max_position_embeddings", 32768),
                dllm_attention=hf.get("dllm_attention", "bidirectional"),
            )
            used = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "mask_token_id", "eos_token_id", "pad_token_id",
                    "eot_token_id", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                    "dllm_attention"}
        else:
            raise ValueError(f"unsupported model_type {mt!r} in config.json (expected 'llada' or 'Dream')")
        for key, val in list(known.items()):
            if isinstance(val, list):  # some configs list several EOS ids
                known[key] = val[0]
        return cls(**known, extra={k: v for k, v in hf.items() if k not in used})

    def to_hf(self) -> Dict[str, Any]:
        if self.model_type == "llada":
            hf = dict(model_type="llada", vocab_size=self.vocab_size, embedding_size=self.embedding_size,
                      d_model=self.hidden_size, n_layers=self.n_layers, n_heads=self.n_heads,
                      n_kv_heads=self.n_kv_heads, mlp_hidden_size=self.intermediate_size,
                      rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                      weight_tying=self.tie_word_embeddings, include_bias=self.linear_bias,
                      include_qkv_bias=self.qkv_bias, max_sequence_length=self.max_seq_len)
        else:
            hf = dict(model_type="Dream", architectures=["DreamModel"], vocab_size=self.vocab_size,
                      hidden_size=self.hidden_size, num_hidden_layers=self.n_layers,
                      num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
                      intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
                      rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=self.tie_word_embeddings,
                      max_position_embeddings=self.max_seq_len)
        hf.update(mask_token_id=self.mask_token_id, eos_token_id=self.eos_token_id,
                  pad_token_id=self.pad_token_id, dllm_attention=self.dllm_attention)
        if self.eot_token_id is not None:
            hf["eot_token_id"] = self.eot_token_id
        return {**self.extra, **hf}

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)
