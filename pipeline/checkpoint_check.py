"""The preflight's model checks, in seconds and torch-free (but for a DiffusionGemma
model's knobs, resolved by transformers): the job's Checkpoint opened (engine.checkpoint:
config.json parsed by the model's family, every shard header checked against what it
implies, the adapter planned against the base model, the stop ids and where they come
from), and the run's settings checked against what the engine serving the model reads
(engine.reads) and refuses of every row (its own checks of a one-token row). Each
problem is a one-line CheckpointRefused naming the options it concerns, for JobError."""
from __future__ import annotations

from typing import Any, Dict, Optional

from common.model_source import ModelSourceError, classify
from common.storage import StorageOptions
from engine.checkpoint import Checkpoint, CheckpointError
from engine.engines import engine_for
from engine.models.lora import AdapterError

from .errors import CheckpointRefused


def open_checkpoint(model: str, *, adapter: Optional[str] = None, attention: str = "auto",
                    storage: Optional[StorageOptions] = None, revision: Optional[str] = None) -> Checkpoint:
    """The job's Checkpoint, or CheckpointRefused naming what is wrong and the option."""
    try:
        return Checkpoint.open(model, adapter=adapter, attention=attention, storage=storage, revision=revision)
    except AdapterError as e:
        raise CheckpointRefused(f"{e}", "adapter") from e
    except (ModelSourceError, CheckpointError) as e:
        raise CheckpointRefused(f"{e}", "model", *(["revision"] if revision else [])) from e
    except ValueError as e:  # ConfigRefused: config.json, or an --attention the family does not allow
        raise CheckpointRefused(f"{model}: {e}", "attention" if "--attention" in str(e) else "model") from e


def check_settings(checkpoint: Checkpoint, sampling: Any, engine: Any) -> None:
    """A run whose settings the model's engine would ignore (a DiffusionGemma run with
    block_length, a masked-diffusion one with max_denoising_steps, ...) is refused, naming
    them; so is one whose every row the engine would refuse (`every_row_refusal`)."""
    where = f"{checkpoint.family.name}: {checkpoint.model}"
    err = checkpoint.serving.reads.refusal(sampling, engine)
    if err:
        raise CheckpointRefused(f"{err} ({where})")
    err = prefix_caching_refusal(checkpoint, engine) if engine is not None else None
    if err:
        raise CheckpointRefused(f"{err} ({where})", "enable_prefix_caching")
    moe = checkpoint.config.moe
    err = moe.block_length_refusal(engine.block_length) if moe is not None and engine is not None else None
    if err:
        raise CheckpointRefused(f"{err} ({where})", "block_length")
    err = every_row_refusal(checkpoint, sampling, engine) if sampling is not None and engine is not None else None
    if err:
        raise CheckpointRefused(f"every row would be refused with these settings ({where}): {err}")


def prefix_caching_refusal(checkpoint: Checkpoint, engine: Any) -> Optional[str]:
    """Why the masked-diffusion engine would refuse enable_prefix_caching for this model
    (a prompt whose prefix's K/V depend on what follows it: LLaDA, Dream, D2F; cache none;
    the full canvas), or None. DiffusionGemma's engine says what it reads (engine.reads)."""
    if checkpoint.serving.exact_prefix_cache or not engine.enable_prefix_caching:
        return None
    from engine.prefix_cache import refusal

    cfg = checkpoint.config
    return refusal(cfg.family, cfg.block_causal, engine, engine.full_canvas(cfg.block_causal))


def every_row_refusal(checkpoint: Checkpoint, sampling: Any, engine: Any) -> Optional[str]:
    """What the engine serving this model refuses of the shortest row there is (one token)
    decoded with these settings, by the engine's own checks: DiffusionGemma's knobs
    resolved over its generation_config.json (entropy_bound=0, t_min >= t_max), a decoding
    rule the model's family does not allow (D2F on a bidirectional model, edit_threshold
    outside LLaDA2), max_new_tokens past the model's context or the token budget."""
    return engine_for(checkpoint.serving).every_row_refusal(checkpoint, sampling, engine)


def stop_sources(checkpoint: Checkpoint, override: Optional[list] = None) -> Dict[str, str]:
    """{stop id: where it came from} for the job summary: the checkpoint's (config.json,
    generation_config.json, the chat template), or --stop-token-ids when given."""
    if override is not None:
        return {str(t): "--stop-token-ids" for t in override}
    return {str(t): src for t, src in checkpoint.stops.items()}


__all__ = ["open_checkpoint", "check_settings", "every_row_refusal", "stop_sources", "CheckpointRefused", "classify"]
