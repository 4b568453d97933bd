"""What a model family declares, in one object: how its config.json is parsed (the keys
it honours, those that cannot change the math, those accepted at one value only), its
layer (fused or separate q/k/v, QK norm, head_dim, dense or MoE MLP, biases, tied
embeddings: read by engine.models.transformer), its checkpoint weight names, and its
decoding traits (logit shift, where blocks start, the threshold rule, the first-position
rule, the sampled distribution, token editing: read by the engine's decoding rules).
Torch-free: the preflight and the sorter read it in processes that never import torch.

A new family is one module that builds a `Family` and `register`s it (engine.models.
families); docs/adding-a-family.md walks through it."""
from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple, Union

from ...serving import MASKED, Serving  # torch-free: which engine serves a family

# Keys of any Hugging Face config.json that say how a file was written or which code loads
# it, never what the network computes (beside transformers' PreTrainedConfig's own, which
# `common_inert` reads from transformers' source).
LOADING_KEYS = frozenset({"auto_map", "_name_or_path", "torch_dtype", "use_cache", "bos_token_id",
                          "initializer_range", "tokenizer_class", "output_attentions"})
# blockray's own keys (written by save_model): honoured by every family.
BLOCKRAY_KEYS = frozenset({"model_type", "dllm_attention", "eot_token_id", "mask_token_id", "eos_token_id",
                           "pad_token_id"})


class ConfigRefused(ValueError):
    """config.json (or a checkpoint tensor) asks for something the engine does not compute."""


class FamilyNotSupported(ConfigRefused):
    """config.json describes a model family blockray does not implement."""


class BlockLayout(enum.StrEnum):
    """Where a row's blocks start. AFTER_PROMPT: block 0 right after the prompt, the prompt
    one attention segment (LLaDA, Dream, D2F). ABSOLUTE: blocks at multiples of the block
    length from position 0, the prompt's tail opening the first decoded block and the
    prompt block-causal over those blocks (LLaDA2's generate())."""

    AFTER_PROMPT = "after_prompt"
    ABSOLUTE = "absolute"


class ThresholdRule(enum.StrEnum):
    """The `threshold` policy's rule. AT_LEAST_TOP1 (Fast-dLLM): every position whose
    confidence is >= threshold, at least the most confident. SCHEDULE_FLOOR (LLaDA2's
    generate()): confidence strictly greater, at least the fixed schedule's k of the step
    over min(steps, max_new_tokens) steps (k = 1 while token editing, LLaDA2.1's loop).
    BLOCK_FLOOR (SDAR's block_diffusion_generate): the same over steps_per_block steps,
    whatever max_new_tokens. GREATER_AT_LEAST_TOP1 (Fast-dLLM v2's batch_sample): every
    position whose confidence is strictly greater, at least the most confident."""

    AT_LEAST_TOP1 = "at_least_top1"
    GREATER_AT_LEAST_TOP1 = "greater_at_least_top1"
    SCHEDULE_FLOOR = "schedule_floor"
    BLOCK_FLOOR = "block_floor"


class Confidence(enum.StrEnum):
    """Which distribution a step's proposals come from and are ranked by. MODEL (LLaDA's
    generate(), vLLM's order): the model's own probability ranks positions; a sampled
    proposal is drawn after top-k, then top-p. SAMPLED (Dream's sample_tokens, which
    DiffuCoder and Dream-Coder ship unchanged): the logits divided by the temperature
    (when > 0), then top-p, then top-k, and that distribution both draws the proposal and
    gives the confidence (its probability of the token, negative entropy or top-2 margin),
    at temperature 0 too when top-p or top-k is set."""

    MODEL = "model"
    SAMPLED = "sampled"


class Shard(enum.StrEnum):
    """How tensor parallelism splits a module's weights over N ranks (engine.models.
    sharding). COLUMN: output rows split evenly (q, gate, up; their biases with them). KV:
    k and v rows split by K/V head, each rank holding the head its query heads use when
    there are fewer K/V heads than ranks (replicated). QKV: a fused q|k|v projection, each
    part split by head as q, k and v are. ROW: input columns split, the partial outputs
    all-reduced, the bias added once after (o, down). VOCAB: rows split by vocabulary
    (the embedding, whose lookups are all-reduced, and the LM head, whose logits are
    all-gathered). EXPERT: whole experts, rank r owning experts [r E/N, (r+1) E/N) (expert
    parallel; docs/engine.md says why). REPLICATE: every rank holds it (norms, routers)."""

    COLUMN = "column"
    KV = "kv"
    QKV = "qkv"
    ROW = "row"
    VOCAB = "vocab"
    EXPERT = "expert"
    REPLICATE = "replicate"


# blockray's transformer (engine.models.transformer), by internal module name: what every
# masked-diffusion family declares unless it says otherwise (Family.sharding)
TRANSFORMER_SHARDING = {"q": Shard.COLUMN, "k": Shard.KV, "v": Shard.KV, "qkv_proj": Shard.QKV, "o": Shard.ROW,
                        "gate": Shard.COLUMN, "up": Shard.COLUMN, "down": Shard.ROW, "embed": Shard.VOCAB,
                        "lm_head": Shard.VOCAB, "experts": Shard.EXPERT}


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


def _class_keys(path: str, name: Optional[str] = None) -> FrozenSet[str]:
    """The fields of the config classes in transformers source file `path` (all of them, or
    the one called `name`): annotated class attributes (transformers 5) and __init__
    arguments (4.x), ClassVars left out."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    keys: set = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not node.name.endswith("Config") or name not in (None, node.name):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(item.annotation):
                keys.add(item.target.id)
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                keys.update(a.arg for a in item.args.args + item.args.kwonlyargs if a.arg != "self")
    return frozenset(keys)


def _transformers_file(*parts: str) -> str:
    spec = importlib.util.find_spec("transformers")  # located, not imported (its config module imports torch)
    if spec is None or spec.origin is None:
        raise ConfigRefused("transformers is not installed: blockray reads its config classes' keys")
    return os.path.join(os.path.dirname(spec.origin), *parts)


@functools.lru_cache(maxsize=None)
def transformers_config_keys(model: str) -> FrozenSet[str]:
    """The keys transformers' config class of `model` ("qwen2", "qwen3", ...) defines,
    read from transformers' source (no import)."""
    return _class_keys(_transformers_file("models", model, f"configuration_{model}.py"))


@functools.lru_cache(maxsize=1)
def common_inert() -> FrozenSet[str]:
    """Keys any config.json may carry that cannot change the math: PreTrainedConfig's own
    fields (how a config is written and used by transformers' heads and trainers) and the
    loading keys above."""
    return _class_keys(_transformers_file("configuration_utils.py"), "PreTrainedConfig") | LOADING_KEYS


# The Llama / Qwen2 / Ministral decoder layer's modules: internal name (after "layers.{i}.")
# -> checkpoint module (after the family's layer_prefix)
LLAMA_MODULES = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                 "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring).

    config.json: `honoured` are the keys parse() reads; `fixed` the keys accepted only at
    the values the engine implements; `layout`: the transformers config class whose keys
    the family neither reads nor fixes cannot change the math (its modeling code's
    training knobs, cache and init settings), derived from transformers' source rather
    than listed; `ignored`: keys outside that class that cannot change the math, each
    listed on purpose. Any other key is refused (check_config), never silently ignored.

    Weights: internal parameter names are `layers.{i}.{module}[.{sub}...].{weight|bias}`
    (engine.models.transformer), mapped to the checkpoint's through `top_weights`,
    `layer_prefix` + `layer_weights[module]`, and `mlp_weights` for the projections inside
    an MLP (dense layer of a MoE model, expert, shared expert)."""

    name: str  # e.g. "LLaDA"
    model_type: str  # ModelConfig.model_type
    examples: str  # published checkpoints, for messages
    honoured: FrozenSet[str]
    fixed: Mapping[str, Tuple[Any, ...]]
    # the weights of blockray's transformer (serving.own_weights; a masked family must name them)
    top_weights: Mapping[str, str] = field(default_factory=dict)  # internal name -> checkpoint key
    layer_prefix: str = ""  # "model.layers.{i}."
    layer_weights: Mapping[str, str] = field(default_factory=dict)  # internal module -> checkpoint module
    ignored: FrozenSet[str] = frozenset()
    layout: Optional[str] = None  # transformers model whose config class the checkpoint's config.json uses
    aliases: Tuple[str, ...] = ()  # other model_type spellings of config.json
    mlp_weights: Mapping[str, str] = field(default_factory=dict)  # gate/up/down inside an MLP module
    # the layer (ModelConfig holds the rest: head_dim, qk_norm, moe, biases, tied embeddings)
    fused_qkv: bool = False  # one query_key_value projection: q heads, then k, then v
    # decoding traits
    shift_logits: bool = False  # token i predicted at position i-1 (Dream: adapted from an AR model)
    first_position: bool = False  # decoding default: a block's first step commits its first position only
    blocks: BlockLayout = BlockLayout.AFTER_PROMPT
    # the `threshold` policy: a ThresholdRule, or a Selection of the family's own (engine.selection)
    threshold: Union[ThresholdRule, Any] = ThresholdRule.AT_LEAST_TOP1
    confidence: Confidence = Confidence.MODEL
    editing: bool = False  # LLaDA2.1's token editing (SamplingParams.edit_threshold)
    attention: Optional[str] = None  # the attention its layout requires (None: config.json's dllm_attention)
    serving: Serving = MASKED  # which engine serves it (engine.serving), asked rather than compared
    defaults: Mapping[str, Any] = field(default_factory=dict)  # ids published loops default to
    mask_token: Optional[str] = None  # the added token that is the mask where config.json names no mask id
    # tensor parallelism: internal module name -> Shard (anything unnamed is replicated)
    sharding: Mapping[str, Shard] = field(default_factory=lambda: dict(TRANSFORMER_SHARDING))
    # Nemotron-Labs-Diffusion's generate(causal_context=True): the prefix (prompt, committed blocks)
    # attends causally and its K/V are a causal forward's; only the row's current block attends
    # bidirectionally (to itself and the prefix); with first_position its first position is the
    # argmax of the column before it (engine.batch.AttentionMask, engine.runner)
    causal_context: bool = False

    def __post_init__(self) -> None:
        self.serving.check_family(self)

    # --- decoding traits ----------------------------------------------------------------
    def prefix_cache_refusal(self, block_causal: bool) -> Optional[str]:
        """Why a prompt block's K/V cannot be shared between rows (engine.prefix_cache),
        or None. Exact only with blocks at absolute positions and block-causal attention:
        a complete prompt block then attends to itself and the blocks before it, so its
        K/V depend only on the tokens up to its end. With a prompt that is one attention
        segment (blocks after the prompt: LLaDA, Dream, D2F) or bidirectional attention, a
        prefix's K/V depend on the tokens after it: refused, never approximated."""
        if self.blocks != BlockLayout.ABSOLUTE:
            return (f"{self.name} attends over the whole prompt at once (its blocks start after the prompt), so a "
                    f"shared prefix's K/V depend on the rest of each prompt and cannot be reused exactly")
        if not block_causal:
            return (f"this {self.name} model's attention is bidirectional, so a shared prefix's K/V depend on the "
                    f"tokens after it and cannot be reused exactly")
        return None

    def row_refusal(self, req: Any, layout: Any) -> Optional[str]:
        """Why the family's decoding cannot serve request `req` (its rule chosen) under
        `layout` (engine.layout.Layout), or None: engine.rules.row_refusal asks."""
        return None

    # --- config.json --------------------------------------------------------------------
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """Whether config.json `hf` is this family's (by model_type; a family whose
        model_type is shared overrides this)."""
        return hf.get("model_type") in (self.model_type, *self.aliases)

    @property
    def inert(self) -> FrozenSet[str]:
        """The keys accepted without being read: they cannot change what the engine computes."""
        derived = transformers_config_keys(self.layout) if self.layout else frozenset()
        return (derived | self.ignored | common_inert()) - self.honoured - frozenset(self.fixed)

    def check_config(self, hf: Mapping[str, Any]) -> None:
        """Raise ConfigRefused for the first key the engine would not honour."""
        known = self.honoured | BLOCKRAY_KEYS | self.inert
        for key, value in hf.items():
            if key in self.fixed:
                if value in self.fixed[key]:
                    continue
                allowed = " or ".join(repr(v) for v in self.fixed[key])
                raise ConfigRefused(f"config.json {key}={value!r} is not supported by blockray's {self.name} model "
                                    f"(supported: {allowed}); it would compute a different network")
            if key not in known:
                raise ConfigRefused(f"config.json key {key!r} (= {str(value)[:80]!r}) is not one blockray's "
                                    f"{self.name} model honours, and it is not known to be irrelevant; refusing "
                                    f"rather than ignoring it (honoured: {', '.join(sorted(self.honoured))})")

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        """ModelConfig keyword arguments from config.json (after check_config)."""
        raise NotImplementedError

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        raise NotImplementedError

    def tokenizer_ids(self, hf: Mapping[str, Any], tokens: Mapping[str, int], eos: Optional[int]) -> Dict[str, Any]:
        """ModelConfig ids config.json does not name but the tokenizer does (`tokens`: the
        added tokens' ids, `eos`: tokenizer_config.json's eos_token's): by default the mask,
        `mask_token`'s id (SDAR's <|MASK|>, Fast-dLLM v2's |<MASK>|)."""
        if self.mask_token is not None and "mask_token_id" not in hf and self.mask_token in tokens:
            return {"mask_token_id": tokens[self.mask_token]}
        return {}

    def _full_attention(self, hf: Mapping[str, Any]) -> None:
        """Refuse config.json `layer_types` with sliding-window layers (transformers' Qwen2 /
        Qwen3 layouts): the generic Layer attends to every position in every layer."""
        types = hf.get("layer_types")
        if types is not None and any(t != "full_attention" for t in types):
            raise ConfigRefused(f"config.json layer_types {sorted(set(types))} has sliding-window layers; blockray's "
                                f"{self.name} model attends to every position in every layer")

    def _common(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        eos = hf.get("eos_token_id", self.defaults.get("eos_token_id"))
        eos_ids = [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
        return dict(model_type=self.model_type, mask_token_id=hf.get("mask_token_id", self.defaults["mask_token_id"]),
                    eos_token_id=eos_ids[0], eos_token_ids=eos_ids if isinstance(eos, list) else None,
                    pad_token_id=_first(hf.get("pad_token_id")), eot_token_id=hf.get("eot_token_id"),
                    dllm_attention=self.attention or hf.get("dllm_attention", "bidirectional"))

    # --- weights ------------------------------------------------------------------------
    def checkpoint_name(self, internal: str) -> str:
        if internal in self.top_weights:
            return self.top_weights[internal]
        _, i, module, *rest = internal.split(".")  # layers.{i}.{module}[.{sub}...].{weight|bias}
        return self.layer_prefix.format(i=i) + ".".join([self.layer_weights[module],
                                                         *(self.mlp_weights.get(r, r) for r in rest)])

    def attention_shapes(self, cfg: Any, p: str) -> Dict[str, Tuple[int, ...]]:
        """The attention projections of the layer whose names start with `p`."""
        d, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        out: Dict[str, Tuple[int, ...]] = {}
        parts = (("qkv_proj", (H + 2 * Hkv) * hd),) if self.fused_qkv else (("q", H * hd), ("k", Hkv * hd),
                                                                            ("v", Hkv * hd))
        for m, rows in parts:
            out[p + f"{m}.weight"] = (rows, d)
            if cfg.qkv_bias or cfg.linear_bias:
                out[p + f"{m}.bias"] = (rows,)
        out[p + "o.weight"] = (d, H * hd)
        if cfg.linear_bias or cfg.attn_out_bias:
            out[p + "o.bias"] = (d,)
        return out

    @staticmethod
    def mlp_shapes(cfg: Any, i: int, p: str) -> Dict[str, Tuple[int, ...]]:
        """Layer i's MLP: the dense model's gate/up/down; a MoE model's dense layer, or its
        router, expert bias, experts and shared expert."""
        d, m = cfg.hidden_size, cfg.moe

        def swiglu(q: str, f: int, bias: bool = False) -> Dict[str, Tuple[int, ...]]:
            out: Dict[str, Tuple[int, ...]] = {}
            for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                out[f"{q}{name}.weight"] = shape
                if bias:
                    out[f"{q}{name}.bias"] = (shape[0],)
            return out

        if m is None:
            return swiglu(p, cfg.intermediate_size, cfg.linear_bias)
        if m.dense_layers[i]:
            return swiglu(p + "dense.", m.dense_size)
        out: Dict[str, Tuple[int, ...]] = {p + "router.weight": (m.num_experts, d)}
        if m.expert_bias:
            out[p + "expert_bias"] = (m.num_experts,)
        for j in range(m.num_experts):
            out.update(swiglu(p + f"experts.{j}.", m.expert_size))
        if m.shared_size:
            out.update(swiglu(p + "shared.", m.shared_size))
        return out

    def param_shapes(self, cfg: Any) -> Dict[str, Tuple[int, ...]]:
        """{internal parameter name: shape} of the model `cfg` describes (the DLLM's own
        parameters, in its order; engine.loader checks the two agree). ConfigRefused for a
        family whose weights blockray's transformer does not hold (serving.own_weights)."""
        refusal = self.serving.weights_refusal(self)
        if refusal:
            raise ConfigRefused(refusal)
        d, E = cfg.hidden_size, cfg.embedding_size
        out: Dict[str, Tuple[int, ...]] = {"embed.weight": (E, d)}
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            out[p + "attn_norm.weight"] = (d,)
            out.update(self.attention_shapes(cfg, p))
            if cfg.qk_norm:
                out.update({p + "q_norm.weight": (cfg.head_dim,), p + "k_norm.weight": (cfg.head_dim,)})
            out[p + "mlp_norm.weight"] = (d,)
            out.update(self.mlp_shapes(cfg, i, p))
        out["norm.weight"] = (d,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (E, d)
            if cfg.linear_bias:
                out["lm_head.bias"] = (E,)
        return out

    def shard_of(self, internal: str) -> Shard:
        """How tensor parallelism splits parameter `internal` (`sharding`, by the innermost
        module named there; an expert's whole MLP goes with its expert)."""
        parts = internal.split(".")[:-1]
        if "experts" in parts:
            return self.sharding.get("experts", Shard.REPLICATE)
        for part in reversed(parts):
            if part in self.sharding:
                return self.sharding[part]
        return Shard.REPLICATE

    @staticmethod
    def keeps_float32(internal: str) -> bool:
        """Whether parameter `internal` stays float32 in a lower-precision model (MoE routers)."""
        return internal.endswith((".router.weight", ".expert_bias"))

    def checkpoint_shapes(self, cfg: Any) -> Dict[str, Tuple[int, ...]]:
        """{checkpoint key: shape} every checkpoint of `cfg` holds, and nothing else."""
        return {self.checkpoint_name(n): s for n, s in self.param_shapes(cfg).items()}

    def unused_tensors_message(self, unused: Iterable[str], where: str) -> str:
        names: List[str] = sorted(unused)
        return (f"checkpoint {where} holds {len(names)} tensor(s) blockray's {self.name} model does not use, e.g. "
                f"{', '.join(map(repr, names[:3]))}: they would be ignored and the output would differ from the "
                f"published model's (a setting config.json does not declare?); refusing")
