"""What each engine reads of SamplingParams and EngineConfig, declared once: a field an
engine (or a row's decoding rule) does not read is refused when it is set to anything
but its default, never silently ignored (`unread`). The refusals are derived from these
sets, so a field added to either dataclass is refused by every engine that does not
declare it. Torch-free: the preflight checks a job's settings with it before Ray starts;
tests/test_engine_fields.py checks the sets against what the engines actually read."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, FrozenSet, List, Optional

from .config import EngineConfig, SamplingParams

# Read by the step's logits processors (engine.processors), each declaring its own, and by
# the noise every row may draw (engine.processors.draws_noise)
MIN_TOKENS_SAMPLING = frozenset({"min_tokens"})
STRUCTURED_SAMPLING = frozenset({"structured_outputs"})
LOGPROB_SAMPLING = frozenset({"logprobs"})
NOISE_SAMPLING = frozenset({"temperature", "remasking", "policy", "alg_temp", "seed"})
# Read by every masked-diffusion decoding rule (engine.rules)
MASKED_SAMPLING = frozenset({"max_new_tokens", "policy", "threshold", "factor", "temperature", "stop_token_ids",
                             "seed", "remasking", "first_position", "top_p", "top_k", "stop", "entropy_bound",
                             "alg_temp", "ignore_eos", "include_stop_str_in_output"}) \
    | MIN_TOKENS_SAMPLING | STRUCTURED_SAMPLING | LOGPROB_SAMPLING | NOISE_SAMPLING
EDITING_SAMPLING = frozenset({"edit_threshold", "max_post_steps"})  # engine.editing
D2F_SAMPLING = frozenset({"block_add_threshold", "decoded_token_threshold"})  # engine.d2f
SUB_BLOCK_SAMPLING = frozenset({"sub_block_length"})  # engine.subblocks
# d3LLM's multi-block decoding (engine.multi_block): greedy, its own selection (no policy, remasking,
# temperature); the length, the stops and the seed (read, unused at temperature 0) as every rule
MULTI_BLOCK_SAMPLING = frozenset({"multi_block", "block_add_threshold", "decoded_token_threshold",
                                  "entropy_threshold"})
MULTI_BLOCK_ROW = frozenset({"max_new_tokens", "stop_token_ids", "stop", "ignore_eos", "include_stop_str_in_output",
                             "seed"}) | MULTI_BLOCK_SAMPLING
# Nemotron-Labs-Diffusion's LinearSpec and AR modes (engine.linear_spec): greedy, the length and the stops
LINEAR_SPEC_SAMPLING = frozenset({"decoding", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed",
                                  "draft_threshold"})
LINEAR_SPEC_ENGINE = frozenset({"token_budget", "scheduler", "max_batch_size", "block_length"})
# LLaDA2.2's Levenshtein edit loop (engine.indel): greedy, its own M2T / T2T rules (no policy, remasking,
# temperature, logprobs, structured outputs, min_tokens); the length, the stops and the seed (its anti-loop draw)
INDEL_SAMPLING = frozenset({"edit_ops", "edit_ops_variant", "max_steps_per_block"})
INDEL_ROW = frozenset({"max_new_tokens", "threshold", "stop_token_ids", "stop", "ignore_eos",
                       "include_stop_str_in_output", "seed", "edit_threshold", "max_post_steps"}) | INDEL_SAMPLING
# DiffusionGemma's canvas engine (engine.canvas): transformers' knobs
CANVAS_SAMPLING = frozenset({"max_new_tokens", "seed", "max_denoising_steps", "entropy_bound", "t_min", "t_max",
                             "stability_threshold", "confidence_threshold"})
MASKED_ENGINE = frozenset(f.name for f in fields(EngineConfig))
CANVAS_ENGINE = frozenset({"token_budget", "scheduler", "max_batch_size", "enable_prefix_caching",
                           "tensor_parallel_size"})


# who reads a field, for the refusal's message
READERS = ((MASKED_SAMPLING, "masked-diffusion models"), (EDITING_SAMPLING, "LLaDA2.1 token editing (edit_threshold)"),
           (D2F_SAMPLING, "D2F decoding (block_add_threshold)"),
           (SUB_BLOCK_SAMPLING, "sub-block decoding (Fast-dLLM v2)"),
           (MULTI_BLOCK_SAMPLING, "d3LLM multi-block decoding (multi_block)"), (CANVAS_SAMPLING, "DiffusionGemma"),
           (LINEAR_SPEC_SAMPLING, "LinearSpec / AR decoding (decoding, engine.linear_spec)"),
           (INDEL_SAMPLING, "LLaDA2.2's edit loop (edit_ops)"))


def unread(obj: Any, reads: FrozenSet[str]) -> List[str]:
    """The fields of dataclass `obj` set to a non-default value that `reads` leaves out."""
    default = type(obj)()
    return [f.name for f in fields(obj) if f.name not in reads and getattr(obj, f.name) != getattr(default, f.name)]


def refusal(names: List[str], here: str) -> Optional[str]:
    """One line naming the fields `here` would ignore and who reads each; None when none."""
    if not names:
        return None
    def who(name: str) -> str:
        readers = [what for group, what in READERS if name in group]
        return f"{name} (read by {' and '.join(readers)})" if readers else name
    return (f"{', '.join(map(who, names))}: not read by {here}, which would ignore "
            f"{'it' if len(names) == 1 else 'them'}; leave {'it' if len(names) == 1 else 'them'} at the default")


@dataclass(frozen=True)
class Reads:
    """What an engine reads of SamplingParams and EngineConfig (engine.rules' rules read
    subsets of `sampling`)."""

    name: str  # for messages: "the masked-diffusion engine", "DiffusionGemma's canvas engine"
    sampling: FrozenSet[str]
    engine: FrozenSet[str]

    def refusal(self, sampling: Optional[SamplingParams] = None, engine: Optional[EngineConfig] = None) -> Optional[str]:
        """Why these settings cannot run here (the fields it would ignore), or None."""
        bad = (unread(sampling, self.sampling) if sampling is not None else []) + (
            unread(engine, self.engine) if engine is not None else [])
        return refusal(bad, self.name)


MASKED = Reads("the masked-diffusion engine",
               MASKED_SAMPLING | EDITING_SAMPLING | D2F_SAMPLING | SUB_BLOCK_SAMPLING | MULTI_BLOCK_SAMPLING
               | LINEAR_SPEC_SAMPLING | INDEL_SAMPLING,
               MASKED_ENGINE)
CANVAS = Reads("DiffusionGemma's canvas engine", CANVAS_SAMPLING, CANVAS_ENGINE)
LINEAR_SPEC = Reads("the LinearSpec / AR engine", LINEAR_SPEC_SAMPLING, LINEAR_SPEC_ENGINE)
