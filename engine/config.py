"""Configuration dataclasses: what the engine is asked to do (EngineConfig) and how
each request is decoded (SamplingParams)."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any, Dict, Literal, Optional, Sequence, Union, get_args

from .modes import CacheMode as CacheModeRule, cache_mode

Policy = Literal["fixed", "threshold", "factor", "timestep", "origin", "entropy_bound"]
Remasking = Literal["low_confidence", "random", "entropy", "margin", "sequential"]
CacheMode = Literal["none", "refresh", "persistent", "dual"]
# Nemotron-Labs-Diffusion's three modes of one checkpoint (engine.linear_spec serves the last two)
Decoding = Literal["diffusion", "linear_spec", "ar"]
Canvas = Literal["auto", "block", "full"]
AdvanceMode = Literal["block", "step"]


class SchedulerKind(enum.StrEnum):
    """Who runs in an engine's next step (engine.scheduler, engine.canvas): `blockserve`
    (block-grained continuous batching within the token budget), `static` (Fast-dLLM's
    fixed groups run in lock step) and `sequential` (one request at a time), the baselines."""

    BLOCKSERVE = "blockserve"
    STATIC = "static"
    SEQUENTIAL = "sequential"


class Attention(enum.StrEnum):
    """A masked-diffusion model's attention: `bidirectional` (every column sees every
    column) or `block_causal` (the prompt sees the prompt, block j the prompt, earlier
    blocks and itself); as an override (`--attention`), `auto` keeps what the checkpoint
    declares."""

    AUTO = "auto"
    BIDIRECTIONAL = "bidirectional"
    BLOCK_CAUSAL = "block_causal"


def enum_value(name: str, value: Any, kind: type) -> Any:
    """`value` as a member of the StrEnum `kind`; a ValueError naming the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(repr(k.value) for k in kind)}, got {value!r}") from None


def not_one_of(name: str, value: Any, kind: Any) -> Optional[str]:
    """The message for a value outside a Literal's choices, else None (one rule for every choice field)."""
    choices = get_args(kind)
    return None if value in choices else f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"


@dataclass(frozen=True)
class Bounds:
    """A numeric option's range, declared once in its dataclass field's metadata
    (`metadata={"bounds": at_least(1, integer=True)}`) and checked by `out_of_bounds`:
    the one rule for every numeric setting, whether it comes from a flag (the CLI checks
    it as it parses), a model's blockray.json, a library caller or a row's
    sampling_params. None (unset, off) is never out of bounds."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # low itself excluded
    high_open: bool = False
    integer: bool = False
    note: str = ""  # what special values mean, e.g. " (0 or -1: off)"

    def text(self) -> str:
        """'>= 1', '> 0', 'in (0, 1]'."""
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}" if self.high is not None else ""

    def error(self, name: str, value: Any) -> Optional[str]:
        """The message for a value of the wrong type or out of range, else None."""
        if value is None:
            return None
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if self.integer:
            kind, ok = "an integer", number and isinstance(value, numbers.Integral)
        else:
            finite = number and math.isfinite(float(value))
            kind, ok = ("" if finite else "a finite number" if number else "a number"), finite
        if ok:
            v = int(value) if self.integer else float(value)
            ok = (self.low is None or (v > self.low if self.low_open else v >= self.low)) and (
                self.high is None or (v < self.high if self.high_open else v <= self.high))
        return None if ok else f"{name} must be {' '.join(filter(None, (kind, self.text())))}{self.note}, got {value!r}"


def at_least(low: float, *, integer: bool = False, note: str = "") -> Bounds:
    return Bounds(low=low, integer=integer, note=note)


def above(low: float) -> Bounds:
    return Bounds(low=low, low_open=True)


def within(low: float, high: float, *, low_open: bool = False, integer: bool = False) -> Bounds:
    return Bounds(low=low, high=high, low_open=low_open, integer=integer)


def bounds_of(cls: type, name: str) -> Optional[Bounds]:
    """The Bounds declared on field `name` of dataclass `cls`, if any."""
    return next((f.metadata.get("bounds") for f in fields(cls) if f.name == name), None)


def out_of_bounds(obj: Any) -> Optional[str]:
    """The first field of dataclass `obj` outside its declared Bounds, as a message naming
    it; None when every field is within."""
    for f in fields(obj):
        b = f.metadata.get("bounds")
        err = b.error(f.name, getattr(obj, f.name)) if b is not None else None
        if err:
            return err
    return None


MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """Per-request decoding settings. `stop_token_ids=None` means the checkpoint's stop
    ids (engine.models.stops: config.json's and generation_config.json's eos_token_id and
    the chat template's end-of-turn token).

    Which masked positions of the current block get their token at a step:
    - `policy`: `fixed` (LLaDA: the block's masks split evenly over `steps_per_block`
      steps, earliest steps take the remainder), `threshold` (Fast-dLLM: every
      position with confidence >= `threshold`, at least the most confident one; runs
      until the block is filled, so at most L steps), `factor` (Fast-dLLM's
      `get_transfer_index_dynamic`), `timestep` (Dream's schedule: at step s the
      fraction 1 - t_{s+1}/t_s of the remaining masks, t = linspace(1, 1e-3, S+1)),
      `origin` (Dream's alg="origin": each mask independently with probability
      1 - t_{s+1}/t_s, drawn from the request's seeded noise; remasking unused),
      `entropy_bound` (JetEngine's entropy_bounded, SDAR's fast engine: the masks in
      order of entropy, lowest first, while their summed entropy stays below
      `entropy_bound`, at least one; runs until the block is filled; remasking unused).
      Dream's own `diffusion_generate` is one block of max_new_tokens decoded in
      `steps` steps with first_position off; its alg maskgit_plus / entropy /
      topk_margin is `timestep` with remasking low_confidence / entropy / margin
      (docs/models/dream.md), and its `alg_temp` > 0 draws the step's k positions
      without replacement from softmax(confidence / alg_temp) (Gumbel top-k: the
      distribution of Dream's torch.multinomial, from the request's seeded noise).
    - `remasking`, the confidence that ranks positions: `low_confidence` (probability
      of the proposed token), `random` (LLaDA's random remasking, seeded per request),
      `entropy` (Dream: negative entropy of the distribution), `margin` (Dream's
      top-1 minus top-2 probability), `sequential` (SDAR's: left to right, the leftmost
      masks first; with the `fixed` policy only).
    - `first_position` (Dream's block decoding): the first step of every block commits
      exactly the block's first position, predicted from the token before it. None:
      on for Dream checkpoints, off for LLaDA, as their reference code does.

    vLLM's names mean what they mean there: `temperature` (0: greedy), `top_k` (0 or
    -1: off) and `top_p` (1: off) restrict the tokens a sampled proposal may take (the
    confidence that ranks positions stays the model's own probability), `stop`
    (strings: the request ends at the block boundary after the first one, and its text
    is cut before it, or kept with `include_stop_str_in_output`), `seed`, `n` (samples per
    row; the pipeline expands a row into n requests with seeds derived from the row's),
    `min_tokens` (no stop id or stop string ends a row before it has that many generated
    tokens: the stop ids' logits are -inf at the answer's first min_tokens positions, so
    no proposal there is a stop id, and a stop string counts only where it ends past
    the text of the first min_tokens - 1 tokens), `ignore_eos` (the checkpoint's stop ids
    do not end the row; explicit `stop_token_ids` and stop strings still do),
    `logprobs` (engine.logprobs: per generated token,
    the log-probability the model gave it at the step that wrote it, and N alternatives).
    `max_tokens` and `max_completion_tokens` are names of max_new_tokens (in `from_dict`
    and as keyword arguments); `detokenize` is accepted and changes nothing
    (generated_text is the processor's detokenize setting's, as with ray.data.llm, whose
    detokenize stage makes the text), and so are `skip_special_tokens=True` and
    `spaces_between_special_tokens=True` (vLLM's defaults, what the text is decoded with;
    False is refused naming the key: the job's skip_special_tokens decides the text).

    SDAR / TraDo checkpoints (ThresholdRule.BLOCK_FLOOR): `threshold` is
    block_diffusion_generate's low_confidence_dynamic (strictly greater, at least the `fixed`
    schedule's k of the step over steps_per_block steps); `fixed` is its
    low_confidence_static, and `fixed` with remasking `sequential` its sequential.

    LLaDA2 checkpoints (their family's ThresholdRule.SCHEDULE_FLOOR): `threshold` is
    LLaDA2's rule (confidence strictly greater, at least the `fixed` schedule's k of the
    step, so LLaDA2.1's k = 1 is steps_per_block = block_length), and `edit_threshold`
    (None: off) turns on LLaDA2.1's token editing (engine.editing) with at most
    `max_post_steps` editing-only steps per block; other families refuse edit_threshold,
    and max_post_steps is refused without it.

    D2F (Discrete Diffusion Forcing, engine.d2f): `block_add_threshold` set (None: one
    block at a time) keeps several blocks of the request in flight: a block is added
    once the last one's decoded fraction reaches it, a block may force its most
    confident token only once its predecessor's decoded fraction reaches
    `decoded_token_threshold`, and `threshold` is D2F's skip_threshold (a token is
    committed when its probability is strictly greater). D2F decodes
    max_new_tokens // block_length whole blocks, with policy "threshold" and
    low_confidence remasking, on block-causal models only.

    d3LLM (engine.multi_block): `multi_block=True` decodes SGLang's FullAttnMultiBlock: all
    max_new_tokens masks present from the start (a multiple of block_length), every column
    recomputed at every step (cache none), greedy; block k+1 is active once block k's
    decoded fraction reaches `block_add_threshold` (None: 0.1) and fully active once it
    reaches `decoded_token_threshold`; every mask up to the last active block whose
    entropy is strictly below `entropy_threshold` is committed, and the first fully active
    block still holding masks commits its lowest-entropy mask when it committed none.
    Bidirectional models (LLaDA, Dream) only.

    LLaDA2.2 (engine.indel): `edit_ops=True` decodes its Levenshtein edit loop on a checkpoint
    naming DELETE / SPLIT tokens (config.json delete_token_id / split_token_id): `threshold`
    is its M2T threshold (2.2's default 0.5: preset "llada2.2"), `edit_threshold` its T2T
    threshold (None: 0.0), `max_post_steps` the steps without an original mask before the
    final round, `max_steps_per_block` its hard cap; `edit_ops_variant` 'sglang' takes
    SGLang's JointThresholdInDel floor, counter, bound and anti-loop instead of HF's."""

    max_new_tokens: int = field(default=64, metadata={"bounds": at_least(1, integer=True), "help": (
        "tokens to generate at most per row (vLLM: max_tokens); rounded up to whole blocks")})
    policy: Policy = field(default="threshold", metadata={"help": (
        "which masked positions a step unmasks: fixed (LLaDA's schedule), threshold/factor (Fast-dLLM), "
        "timestep (Dream's schedule), origin (Dream's alg=origin: each mask at random), entropy_bound "
        "(JetEngine's entropy_bounded: the lowest-entropy masks while their summed entropy stays below "
        "entropy_bound)")})
    threshold: float = field(default=0.9, metadata={"bounds": within(0, 1, low_open=True), "help": (
        "policy threshold: unmask every position whose confidence is at least this (at least one per step)")})
    factor: float = field(default=1.0, metadata={"bounds": above(0),
        "help": "policy factor: Fast-dLLM's factor rule constant"})
    temperature: float = field(default=0.0, metadata={"bounds": at_least(0), "help": (
        "0: greedy; > 0: sample the proposals with float64 Gumbel noise")})
    stop_token_ids: Optional[Sequence[int]] = field(default=None, metadata={"help": (
        "token ids that end a row (none: the checkpoint's: config.json's and generation_config.json's "
        "eos_token_id and the chat template's end-of-turn token, <|eot_id|> / <|im_end|>, where the tokenizer "
        "defines it; the job summary lists them with their source)")})
    seed: Optional[int] = field(default=None, metadata={"bounds": Bounds(integer=True), "help": (
        "seed of the sampling noise and random remasking; per row, a row's tokens never depend on its batch")})
    remasking: Remasking = field(default="low_confidence", metadata={"help": (
        "the confidence that ranks masked positions: low_confidence, random (LLaDA), entropy or margin "
        "(Dream), sequential (SDAR: left to right; policy fixed)")})
    first_position: Optional[bool] = field(default=None, metadata={"help": (
        "Dream's block decoding: a block's first step commits only its first position (auto: on for Dream, "
        "off for LLaDA)")})
    alg_temp: float = field(default=0.0, metadata={"bounds": at_least(0), "help": (
        "Dream's alg_temp, policy timestep: 0 takes the step's k most confident masks; > 0 draws them without "
        "replacement from softmax(confidence / alg_temp), from the request's seeded noise")})
    top_p: float = field(default=1.0, metadata={"bounds": within(0, 1, low_open=True),
        "help": "nucleus sampling of the proposals (1: off)"})
    top_k: int = field(default=0, metadata={"bounds": at_least(-1, integer=True, note=" (0 or -1: off)"), "help": (
        "sample the proposals from the k most likely tokens (0 or -1: off)")})
    stop: Optional[Sequence[str]] = field(default=None, metadata={"help": (
        "stop strings: a row ends at the block holding the first one, its text is cut before it")})
    n: int = field(default=1, metadata={"bounds": at_least(1, integer=True), "help": (
        "samples per row, with seeds derived from the row's (output rows carry sample_index)")})
    block_add_threshold: Optional[float] = field(default=None, metadata={"bounds": within(0, 1), "help": (
        "D2F pipelined decoding (block-causal models): add the next block once the last one's decoded "
        "fraction reaches this; threshold is then D2F's skip_threshold (none: one block at a time); "
        "multi_block: activate the next block once its predecessor's decoded fraction reaches this (none: 0.1)")})
    decoded_token_threshold: float = field(default=0.95, metadata={"bounds": within(0, 1), "help": (
        "D2F: a block forces its most confident token only once its predecessor's decoded fraction reaches "
        "this; multi_block: a block is fully active (may be forced) from then on")})
    # d3LLM's multi-block decoding (engine.multi_block); False: off
    multi_block: bool = field(default=False, metadata={"help": (
        "d3LLM's multi-block decoding (SGLang's FullAttnMultiBlock; bidirectional LLaDA / Dream models, cache "
        "none): every block's masks present, a block activated once its predecessor's decoded fraction reaches "
        "block_add_threshold (none: 0.1), every mask up to the last active block committed when its entropy "
        "is below entropy_threshold, the first fully active unfinished block forced to its lowest-entropy mask")})
    entropy_threshold: float = field(default=0.4, metadata={"bounds": above(0), "help": (
        "multi_block: commit every eligible mask whose entropy (nats) is strictly below this")})
    # Fast-dLLM v2's sub-blocks (engine.subblocks); None: the whole block at once.
    sub_block_length: Optional[int] = field(default=None, metadata={"bounds": at_least(1, integer=True), "help": (
        "Fast-dLLM v2's small blocks: a step unmasks only the leftmost sub-block of this many positions that "
        "still holds masks (must divide block_length; none: the whole block)")})
    # LLaDA2.1's token editing (engine.editing); None: no editing. Other families refuse it.
    edit_threshold: Optional[float] = field(default=None, metadata={"bounds": within(0, 1), "help": (
        "LLaDA2.1 token editing: a decoded token of the current block is rewritten when the new argmax differs "
        "and its probability is strictly greater than this (none: no editing)")})
    max_post_steps: int = field(default=16, metadata={"bounds": at_least(0, integer=True), "help": (
        "LLaDA2.1 token editing: editing-only steps at most once the block has no mask (ending at the first "
        "step without an edit)")})
    # DiffusionGemma's knobs, under transformers' names (engine.canvas); None: the checkpoint's
    # generation_config.json, then transformers' defaults. Other families do not read them.
    max_denoising_steps: Optional[int] = field(default=None, metadata={"bounds": at_least(1, integer=True), "help": (
        "DiffusionGemma: denoising steps per canvas at most (none: generation_config.json)")})
    entropy_bound: Optional[float] = field(default=None, metadata={"bounds": above(0), "help": (
        "policy entropy_bound: a step commits the lowest-entropy masks while their summed entropy stays below "
        "this, at least one (none: 0.35, JetEngine's eb_threshold); DiffusionGemma: a step accepts the "
        "lowest-entropy tokens whose summed entropy minus the largest stays within this (none: "
        "generation_config.json's sampler_config)")})
    t_min: Optional[float] = field(default=None, metadata={"bounds": at_least(0), "help": (
        "DiffusionGemma: temperature at the last denoising step (none: generation_config.json)")})
    t_max: Optional[float] = field(default=None, metadata={"bounds": at_least(0), "help": (
        "DiffusionGemma: temperature at the first denoising step (none: generation_config.json)")})
    stability_threshold: Optional[int] = field(default=None, metadata={"bounds": at_least(0, integer=True), "help": (
        "DiffusionGemma: steps the argmax canvas must stay unchanged to stop a canvas early "
        "(none: generation_config.json)")})
    confidence_threshold: Optional[float] = field(default=None, metadata={"bounds": above(0), "help": (
        "DiffusionGemma: a canvas stops early once its mean token entropy is below this "
        "(none: generation_config.json)")})
    # vLLM's names (masked-diffusion engine; DiffusionGemma's refuses them)
    min_tokens: int = field(default=0, metadata={"bounds": at_least(0, integer=True), "help": (
        "no stop id or stop string ends a row before it has this many generated tokens (the stop ids' logits "
        "are -inf at those answer positions)")})
    ignore_eos: bool = field(default=False, metadata={"help": (
        "the checkpoint's stop ids (EOS, end of turn) do not end a row; explicit stop_token_ids and stop "
        "strings still do")})
    include_stop_str_in_output: bool = field(default=False, metadata={"help": (
        "keep the stop string that ended a row in its text")})
    logprobs: Optional[Union[bool, int]] = field(default=None, metadata={
        "bounds": within(0, MAX_LOGPROBS, integer=True), "help": (
            "per generated token, the log-probability the model gave it at the step that wrote it "
            "(generated_logprobs), and this many most likely alternatives (top_logprobs); true: 0; none: off")})
    # vLLM's StructuredOutputsParams (engine.structured): the answer is a string of a regular language
    structured_outputs: Optional[Dict[str, Any]] = field(default=None, metadata={"json": True, "help": (
        "constrain every answer to a language: {\"regex\": ...}, {\"choice\": [...]}, {\"json\": schema} or "
        "{\"json_object\": true} (vLLM's StructuredOutputsParams; masked-diffusion models; none: off)")})
    # Nemotron-Labs-Diffusion's other modes (engine.linear_spec); "diffusion": the family's own loop
    decoding: Decoding = field(default="diffusion", metadata={"help": (
        "diffusion: the model's diffusion loop; linear_spec: LinearSpec self-speculation (per block one "
        "bidirectional draft and one causal verify forward, the longest agreeing prefix plus one token kept; "
        "Nemotron-Labs-Diffusion, greedy); ar: plain causal greedy decoding through the same weights")})
    draft_threshold: Optional[float] = field(default=None, metadata={"bounds": within(0, 1, low_open=True), "help": (
        "decoding linear_spec: the draft repeats its bidirectional pass, each committing the masks whose "
        "probability is at least this (at least the most confident), until the block holds no mask; "
        "none: one pass fills every mask (the published default, threshold 0)")})
    # LLaDA2.2's Levenshtein edit loop (engine.indel); False: off. Checkpoints naming DELETE/SPLIT tokens need it
    edit_ops: bool = field(default=False, metadata={"help": (
        "LLaDA2.2's Levenshtein edit loop (checkpoints whose config.json names delete_token_id / split_token_id): "
        "mask -> token writes over threshold (at least the schedule's count plus the masks edits created), "
        "token -> token rewrites over edit_threshold (none: 0.0) that may DELETE a position or SPLIT it into a "
        "mask and its token, an anti-loop resample, a final round after max_post_steps steps without an original "
        "mask; greedy. LLaDA2.2's defaults: --preset llada2.2")})
    edit_ops_variant: str = field(default="hf", metadata={"help": (
        "edit_ops: 'hf' (the published loop: scheduled M2T floor, post-step counter reset while original masks "
        "remain, random anti-loop position from the row's seed, max_steps_per_block) or 'sglang' (SGLang's "
        "JointThresholdInDel: floor 1, counter never reset, block_length + max_post_steps + 1 steps, the "
        "lowest-confidence anti-loop position)")})
    max_steps_per_block: int = field(default=1000, metadata={"bounds": at_least(2, integer=True), "help": (
        "edit_ops ('hf'): steps per block at most; the last is the final round")})
    # vLLM's other names, as keyword arguments (from_dict maps them): not fields
    max_tokens: InitVar[Optional[int]] = None
    max_completion_tokens: InitVar[Optional[int]] = None
    detokenize: InitVar[Optional[bool]] = None
    skip_special_tokens: InitVar[Optional[bool]] = None
    spaces_between_special_tokens: InitVar[Optional[bool]] = None

    ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}  # vLLM's names -> ours
    # vLLM's keys accepted with the values that change nothing here (see the docstring), and why others are refused
    NO_OP = {"detokenize": ((True, False), ""),
             "skip_special_tokens": ((True,), "the text leaves special tokens out as the job's skip_special_tokens "
                                              "says (--no-skip-special-tokens for the whole job)"),
             "spaces_between_special_tokens": ((True,), "the text is decoded with the tokenizer's default")}

    def __post_init__(self, max_tokens: Optional[int], max_completion_tokens: Optional[int],
                      detokenize: Optional[bool], skip_special_tokens: Optional[bool],
                      spaces_between_special_tokens: Optional[bool]) -> None:
        given = {k: v for k, v in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens))
                 if v is not None}
        if len(set(given.values())) > 1:
            raise ValueError(f"max_tokens and max_completion_tokens disagree: {given}")
        if given:
            self.max_new_tokens = next(iter(given.values()))
        for key, value in (("detokenize", detokenize), ("skip_special_tokens", skip_special_tokens),
                           ("spaces_between_special_tokens", spaces_between_special_tokens)):
            err = self.no_op_refusal(key, value)
            if err:
                raise ValueError(err)
        if isinstance(self.logprobs, bool):  # vLLM / OpenAI: true asks for the chosen token's only
            self.logprobs = 0 if self.logprobs else None

    @classmethod
    def from_dict(cls, d: Dict[str, Any], base: Optional["SamplingParams"] = None) -> "SamplingParams":
        """`base` (default: the defaults) with the non-null entries of `d` applied,
        vLLM's names accepted; unknown keys raise a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        out: Dict[str, Any] = {}
        for key, value in dict(d).items():
            name = cls.ALIASES.get(key, key)
            if name not in known and key not in cls.NO_OP:
                unknown = sorted(k for k in d if cls.ALIASES.get(k, k) not in known and k not in cls.NO_OP)
                raise ValueError(f"unknown sampling parameter(s) {unknown}; "
                                 f"known: {sorted(known | set(cls.ALIASES) | set(cls.NO_OP))}")
            if key in cls.NO_OP:
                err = cls.no_op_refusal(key, value)
                if err:
                    raise ValueError(err)
            elif value is not None:
                if name in out and out[name] != value:
                    same = sorted(k for k in d if cls.ALIASES.get(k, k) == name and d[k] is not None)
                    raise ValueError(f"{' and '.join(same)} name the same setting and disagree")
                out[name] = value
        if isinstance(out.get("stop"), str):
            out["stop"] = [out["stop"]]
        if "stop_token_ids" in out:
            out["stop_token_ids"] = [int(t) for t in out["stop_token_ids"]]
        return replace(base or cls(), **out)

    @classmethod
    def no_op_refusal(cls, key: str, value: Any) -> Optional[str]:
        """Why vLLM's key `key` cannot take `value` here (a value that would change the
        results), or None (null or a value that changes nothing)."""
        ok, why = cls.NO_OP[key]
        if value is None or any(value is v for v in ok):
            return None
        if not isinstance(value, bool):
            return f"{key} must be true or false, got {value!r}"
        return f"{key}={value!r} is not supported per row: {why}"

    def validate(self) -> Optional[str]:
        """A message naming the bad field, or None; per request, so one bad row never
        fails its neighbours."""
        err = out_of_bounds(self)
        if err:
            return err
        for name, kind in (("policy", Policy), ("remasking", Remasking)):
            err = not_one_of(name, getattr(self, name), kind)
            if err:
                return err
        if self.policy == "origin" and self.remasking != "low_confidence":
            return (f"policy 'origin' (Dream's alg='origin') unmasks positions at random and reads no confidence; "
                    f"leave remasking at 'low_confidence', got {self.remasking!r}")
        if self.alg_temp > 0 and self.policy != "timestep":
            return (f"alg_temp (Dream's) draws the k positions of policy 'timestep' (Dream's maskgit_plus, "
                    f"entropy, topk_margin); got policy {self.policy!r}")
        if self.policy == "entropy_bound" and self.remasking != "low_confidence":
            return (f"policy 'entropy_bound' ranks the masks by their entropy, not by the remasking confidence; "
                    f"leave remasking at 'low_confidence', got {self.remasking!r}")
        if self.remasking == "sequential" and self.policy != "fixed":
            return (f"remasking 'sequential' (left to right) takes the fixed schedule's k positions a step: it "
                    f"needs policy 'fixed', got {self.policy!r}")
        if self.first_position not in (None, True, False):
            return f"first_position must be true, false or null, got {self.first_position!r}"
        if self.stop is not None and (isinstance(self.stop, str) or not all(isinstance(x, str) and x
                                                                             for x in self.stop)):
            return f"stop must be a list of non-empty strings, got {self.stop!r}"
        if self.min_tokens > self.max_new_tokens:
            return f"min_tokens={self.min_tokens} must be at most max_new_tokens={self.max_new_tokens}"
        for name in ("ignore_eos", "include_stop_str_in_output", "multi_block", "edit_ops"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be true or false, got {getattr(self, name)!r}"
        if self.structured_outputs is not None:
            from .structured.params import parse  # torch-free

            try:
                parse(self.structured_outputs)
            except ValueError as e:
                return str(e)
            if self.min_tokens:
                return "structured_outputs with min_tokens is not supported: the language decides where the answer ends"
            if self.edit_threshold is not None:
                return ("structured_outputs with edit_threshold (token editing) is not supported: editing rewrites "
                        "tokens the constraint already checked")
        err = not_one_of("decoding", self.decoding, Decoding)
        if err:
            return err
        if self.edit_ops_variant not in ("hf", "sglang"):
            return f"edit_ops_variant must be 'hf' or 'sglang', got {self.edit_ops_variant!r}"
        if self.edit_ops and self.structured_outputs is not None:
            return ("structured_outputs with edit_ops (LLaDA2.2's edit loop) is not supported: its edits delete and "
                    "insert tokens the constraint already checked")
        if self.d2f and ((self.policy, self.remasking) != ("threshold", "low_confidence") or self.first_position):
            return ("block_add_threshold (D2F) decodes with policy 'threshold', remasking 'low_confidence' "
                    f"and no first_position, got {self.policy!r}, {self.remasking!r}, {self.first_position!r}")
        return None

    @property
    def d2f(self) -> bool:
        """D2F pipelined block decoding (several blocks in flight)."""
        return self.block_add_threshold is not None and not self.multi_block


# The token budget of an engine on a device without a memory query (CPU), when
# EngineConfig.token_budget is not given; GPU engines plan theirs (engine.budget).
DEFAULT_TOKEN_BUDGET = 65536


@dataclass
class EngineConfig:
    """How one engine batches and caches. `token_budget` bounds the padded batch
    area |A| * max_i(width_i) of every forward; `max_batch_size` is B for the static
    baseline and a cap on active requests for blockserve.

    `token_budget` given is the user's fixed budget and wins. Unset (None), each engine
    resolves it once at start (engine.budget.resolve_token_budget): on a GPU, planned from
    the device's free memory so that weights, K/V and activations stay within
    `gpu_memory_utilization` of it (vLLM's knob); on a device without a memory query
    (CPU), the fixed DEFAULT_TOKEN_BUDGET. The engine, its scheduler and its rules then
    read the resolved number; before that (the job's preflight, the sorter) None means
    "not known yet", and each engine refuses a row wider than its own budget.

    `canvas`: what a row holds. `block` (BlockServe's box): prompt, committed blocks
    and the current block, width p + (b+1) L. `full` (LLaDA's `generate`, Fast-dLLM):
    prompt and all ceil(max_new_tokens / L) blocks, the later ones still masked and
    attended to, width p + K L from admission. Bidirectional checkpoints need `full`
    to reproduce their reference tokens; for block-causal ones a masked suffix is
    invisible, so `block` gives the same tokens for less. `auto`: `full` for
    bidirectional models, `block` for block-causal ones.

    `cache`: `none` recomputes every row at every step; `refresh` (Fast-dLLM's prefix
    cache) computes the whole row at a block's first step and then the block (and,
    under `full`, the masked suffix) against the cached prefix; `dual` (Fast-dLLM's
    dual cache) also caches the suffix at the block's first step and then forwards
    only the block's L columns; `persistent` keeps the committed prefix's K/V across
    blocks (exact for block-causal models only)."""

    block_length: int = field(default=32, metadata={"bounds": at_least(1, integer=True), "help": (
        "tokens per block (L): a block is denoised, then committed")})
    steps_per_block: int = field(default=32, metadata={"bounds": at_least(1, integer=True), "help": (
        "denoising steps per block (S) of the scheduled policies")})
    cache: CacheMode = field(default="refresh", metadata={"help": (
        "K/V cache: none, refresh (Fast-dLLM prefix cache), dual (prefix and masked suffix), persistent "
        "(block-causal models)")})
    token_budget: Optional[int] = field(default=None, metadata={"bounds": at_least(2, integer=True), "help": (
        "cells (rows x width) of the padded batch box an engine may forward at once; given, it is used as is "
        "(it wins over gpu_memory_utilization); none: each engine plans it at start from its GPU's free memory "
        f"and gpu_memory_utilization, on CPU {DEFAULT_TOKEN_BUDGET}")})
    gpu_memory_utilization: float = field(default=0.9, metadata={"bounds": within(0, 1, low_open=True), "help": (
        "share of each GPU's memory an engine may use for weights, K/V and activations (vLLM's name): sizes the "
        "token budget when token_budget is not given, and the preflight refuses a model that cannot fit in it; "
        "refused on an engine without a GPU")})
    scheduler: SchedulerKind = field(default=SchedulerKind.BLOCKSERVE, metadata={"help": (
        "blockserve (continuous, block-grained batching), static or sequential (the baselines)")})
    max_batch_size: int = field(default=256, metadata={"bounds": at_least(1, integer=True), "help": (
        "cap on the requests an engine runs at once (the group size B of static)")})
    advance: AdvanceMode = field(default="block", metadata={"help": (
        "block: requests join and leave at block-cycle boundaries; step: at any denoising step")})
    canvas: Canvas = field(default="auto", metadata={"help": (
        "full: prompt + every masked block (LLaDA's generate, Fast-dLLM); block: BlockServe's box; auto: full"
        " for bidirectional models, block for block-causal ones")})
    forward_overhead_cells: Optional[float] = field(default=None, metadata={"bounds": at_least(0), "help": (
        "what one more forward costs the catch-up planner, in query cells (none: fitted online from the "
        "engine's own forwards; set it, e.g. to a run's recorded EngineStats.forward_overhead_cells, for the "
        "same forwards, padding and tokens on every run)")})
    compile_decode: bool = field(default=False, metadata={"help": (
        "run each step's whole-batch forward through torch.compile with static shapes, under every cache mode: "
        "rows, query columns and key width padded up to a small ladder of buckets (engine.buckets; the padding "
        "is masked out, the same tokens), the K/V views marked static, so that CUDA (mode reduce-overhead) "
        "captures one CUDA graph per bucket and replays it; CPU: inductor. The K/V slots hold 1.25x more "
        "for the padding (the token budget planned accordingly); a step whose bucket does not fit runs eager "
        "(EngineStats.uncompiled_steps), and every step does once dynamo hits its recompile limit "
        "(EngineStats.compile_fallbacks); off: eager")})
    profile: bool = field(default=False, metadata={"help": (
        "synchronize the device after every forward so forward_s is exact (costs throughput on a GPU; "
        "off, the host runs ahead of the device)")})
    enable_prefix_caching: Optional[bool] = field(default=None, metadata={"help": (
        "share the K/V of prompt blocks between rows whose prompts start with the same complete blocks "
        "(vLLM's name). Exact only for block-causal families with blocks at absolute positions (LLaDA2.x, SDAR, "
        "Fast-dLLM v2) with a K/V cache and the block canvas, and for DiffusionGemma: auto turns it on there "
        "and off elsewhere; on is refused where it is not exact; off never caches")})
    tensor_parallel_size: int = field(default=1, metadata={"bounds": at_least(1, integer=True), "help": (
        "devices one engine spans (vLLM's name): each holds its shard of the weights (engine.parallel, "
        "engine.models.sharding) and every rank runs the same engine loop in lock step")})
    # what compiling one row's structured_outputs may cost (engine.structured.automaton): over a cap, that row
    # is an error naming it; the engine and the other rows are untouched
    structured_max_states: int = field(default=10_000, metadata={"bounds": at_least(1, integer=True), "help": (
        "structured outputs: states a constraint's automaton may have; its regex's DFA is counted up to this "
        "before anything is built, and the token-level index is held to it too (a row over it is an error "
        "naming this option)")})
    structured_max_chars: int = field(default=65_536, metadata={"bounds": at_least(1, integer=True), "help": (
        "structured outputs: characters a constraint's regex, choice list or JSON schema (and the regex it "
        "becomes) may have (a row over it is an error naming this option)")})
    structured_compile_timeout_s: float = field(default=60.0, metadata={"bounds": above(0), "help": (
        "structured outputs: seconds compiling one constraint may take (outlines-core's token index, built in a "
        "child process that is killed past this; a row over it is an error naming this option)")})

    def __post_init__(self) -> None:
        err = out_of_bounds(self)
        if err:
            raise ValueError(err)
        self.scheduler = enum_value("scheduler", self.scheduler, SchedulerKind)
        for name, kind in (("cache", CacheMode), ("canvas", Canvas), ("advance", AdvanceMode)):
            err = not_one_of(name, getattr(self, name), kind)
            if err:
                raise ValueError(err)
        if self.token_budget is not None and self.token_budget < self.block_length + 1:
            raise ValueError(f"token_budget must exceed block_length, got token_budget={self.token_budget} "
                             f"block_length={self.block_length}")

    @property
    def mode(self) -> CacheModeRule:
        """The cache mode's rules (engine.modes): what a step computes, stores and keeps."""
        return cache_mode(self.cache)

    def fixed_token_budget(self) -> int:
        """The given token_budget, else DEFAULT_TOKEN_BUDGET: the budget of an engine that
        plans none (no device memory query, DiffusionGemma's canvas engine)."""
        return DEFAULT_TOKEN_BUDGET if self.token_budget is None else self.token_budget

    def full_canvas(self, block_causal: bool) -> bool:
        """Whether rows hold the full canvas on a model with this attention ("auto":
        where a masked suffix is visible, i.e. bidirectional models)."""
        return self.canvas == "full" or (self.canvas == "auto" and not block_causal)
