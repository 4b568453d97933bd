"""What a model family declares, in one object: how its config.json is parsed (and which
keys it honours, knows to be irrelevant, or accepts only at one value), its checkpoint
weight names and shapes, and its decoding traits. Torch-free: the preflight and the
sorter's cost model read it in processes that never import torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Tuple

# Keys of any Hugging Face config.json that describe how a file was written or which code
# loads it, never what the network computes.
COMMON_IGNORED = frozenset({
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache", "_name_or_path",
    "bos_token_id", "initializer_range", "tokenizer_class", "return_dict", "output_hidden_states",
    "output_attentions", "is_encoder_decoder", "id2label", "label2id",
})
# blockray's own keys (written by save_model): honoured by every family.
BLOCKRAY_KEYS = frozenset({"model_type", "dllm_attention", "eot_token_id", "mask_token_id", "eos_token_id",
                           "pad_token_id"})


class ConfigRefused(ValueError):
    """config.json (or a checkpoint tensor) asks for something the engine does not compute."""


class FamilyNotSupported(ConfigRefused):
    """config.json describes a model family blockray does not implement."""


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


@dataclass(frozen=True)
class Family:
    """One model family. `honoured`: config.json keys parse() reads; `ignored`: keys that
    cannot change what this engine computes (dropout, init, kernels), each listed on
    purpose; `fixed`: keys accepted only at the values the engine implements. Any other
    key is refused (check_config), never silently ignored."""

    name: str  # e.g. "LLaDA"
    model_type: str  # ModelConfig.model_type
    examples: str  # published checkpoints, for messages
    honoured: FrozenSet[str]
    ignored: FrozenSet[str]
    fixed: Mapping[str, Tuple[Any, ...]]
    top_weights: Mapping[str, str]  # internal name -> checkpoint key
    layer_prefix: str  # "model.layers.{i}."
    layer_weights: Mapping[str, str]  # internal module -> checkpoint module
    shift_logits: bool  # token i predicted at position i-1 (Dream: adapted from an AR model)
    first_position: bool  # decoding default: Dream commits a block's first position first
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # LLaDA2's decoding (engine.llada2): blocks at absolute positions, the prompt block-causal,
    # its threshold rule, and LLaDA2.1's token editing
    llada2: bool = False

    # --- config.json --------------------------------------------------------------------
    def check_config(self, hf: Mapping[str, Any]) -> None:
        """Raise ConfigRefused for the first key the engine would not honour."""
        known = self.honoured | BLOCKRAY_KEYS
        for key, value in hf.items():
            if key in known or key in self.ignored or key in COMMON_IGNORED:
                continue
            if key in self.fixed:
                if value in self.fixed[key]:
                    continue
                allowed = " or ".join(repr(v) for v in self.fixed[key])
                raise ConfigRefused(f"config.json {key}={value!r} is not supported by blockray's {self.name} model "
                                    f"(supported: {allowed}); it would compute a different network")
            raise ConfigRefused(f"config.json key {key!r} (= {str(value)[:80]!r}) is not one blockray's {self.name} "
                                f"model honours, and it is not known to be irrelevant; refusing rather than "
                                f"ignoring it (honoured: {', '.join(sorted(self.honoured))})")

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        """ModelConfig keyword arguments from config.json (after check_config)."""
        raise NotImplementedError

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        raise NotImplementedError

    def _common(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        eos = hf.get("eos_token_id", self.defaults.get("eos_token_id"))
        eos_ids = [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
        return dict(model_type=self.model_type, mask_token_id=hf.get("mask_token_id", self.defaults["mask_token_id"]),
                    eos_token_id=eos_ids[0], eos_token_ids=eos_ids if isinstance(eos, list) else None, pad_token_id=_first(hf.get("pad_token_id")),
                    eot_token_id=hf.get("eot_token_id"),
                    dllm_attention=hf.get("dllm_attention", "bidirectional"))

    # --- weights ------------------------------------------------------------------------
    def checkpoint_name(self, internal: str) -> str:
        if internal in self.top_weights:
            return self.top_weights[internal]
        _, i, module, kind = internal.split(".")  # layers.{i}.{module}.{weight|bias}
        return self.layer_prefix.format(i=i) + f"{self.layer_weights[module]}.{kind}"

    def param_shapes(self, cfg: Any) -> Dict[str, Tuple[int, ...]]:
        """{internal parameter name: shape} of the model `cfg` describes (the DLLM's own
        parameters, in its order; engine.loader checks the two agree)."""
        d, kv, f, E = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.embedding_size
        qkv_b, b = cfg.qkv_bias or cfg.linear_bias, cfg.linear_bias
        out: Dict[str, Tuple[int, ...]] = {"embed.weight": (E, d)}
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            out[p + "attn_norm.weight"] = (d,)
            for m, rows in (("q", d), ("k", kv), ("v", kv)):
                out[p + f"{m}.weight"] = (rows, d)
                if qkv_b:
                    out[p + f"{m}.bias"] = (rows,)
            for m, shape in (("o", (d, d)), ("mlp_norm", (d,)), ("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                out[p + f"{m}.weight"] = shape
                if b and m != "mlp_norm":
                    out[p + f"{m}.bias"] = (shape[0],)
        out["norm.weight"] = (d,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (E, d)
            if b:
                out["lm_head.bias"] = (E,)
        return out

    def keeps_float32(self, internal: str) -> bool:
        """Whether parameter `internal` stays float32 in a lower-precision model (MoE routers)."""
        return False

    def checkpoint_shapes(self, cfg: Any) -> Dict[str, Tuple[int, ...]]:
        """{checkpoint key: shape} every checkpoint of `cfg` holds, and nothing else."""
        return {self.checkpoint_name(n): s for n, s in self.param_shapes(cfg).items()}

    def unused_tensors_message(self, unused: Iterable[str], where: str) -> str:
        names: List[str] = sorted(unused)
        return (f"checkpoint {where} holds {len(names)} tensor(s) blockray's {self.name} model does not use, e.g. "
                f"{', '.join(map(repr, names[:3]))}: they would be ignored and the output would differ from the "
                f"published model's (a setting config.json does not declare?); refusing")
