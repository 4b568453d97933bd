"""Which engine serves a model family, as an object the rest of blockray asks rather than
branches on: MASKED (engine.engine.Engine: masked diffusion over blockray's own
transformer, in blocks) or CANVAS (engine.canvas: DiffusionGemma through transformers'
own class, over a random canvas). A family declares one (Family.serving); the Checkpoint
hands it on (Checkpoint.serving).

Why an object: what differs between the two engines (whose weights blockray reads and
shards, what a block is for the sorter, which SamplingParams each reads, whether a
warm-up, a GPU-memory plan or the tokenizer apply) was 17 `serving == ...` branches in 9
files; each is now one question, answered here once per mode.

Torch-free and import-light (engine.reads only): the family registry, the preflight and
the sorter import it in processes that never load torch. What needs the engines
themselves (building one, its own refusal of a one-token row) is engine.engines', which
sits above the engines and the checkpoint they load (so no import cycle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional

from .reads import CANVAS as CANVAS_READS, MASKED as MASKED_READS, Reads


@dataclass(frozen=True)
class Serving:
    """One serving mode (see the module docstring). The attributes are the questions its
    callers ask; the subclasses answer the ones that take arguments."""

    name: str  # "masked" / "canvas": in messages and records
    engine: str  # the engine, for messages
    reads: Reads  # which SamplingParams / EngineConfig fields its engine reads (engine.reads)
    # blockray's transformer computes it: the family names its weights (param_shapes), the
    # shard headers are checked, an adapter merges, the preflight checks a tensor-parallel
    # size against engine.models.sharding.ShardPlan, and the loader (engine.loader) builds it
    own_weights: bool
    plans_memory: bool  # its token budget is planned from GPU memory (engine.budget): resources check it fits
    warms_up: bool  # the actor runs one throwaway request first (actors.engine_build.warm_up)
    uses_tokenizer: bool  # stop strings are decided on the text, structured outputs compiled over the vocabulary
    # a prompt prefix's K/V never depend on what follows it (the canvas's causal encoder): the
    # prefix cache is on unless refused; otherwise engine.prefix_cache decides per family
    exact_prefix_cache: bool

    MASKED: ClassVar["Serving"]
    CANVAS: ClassVar["Serving"]

    def __reduce__(self):
        """Unpickled as the module's own instance (a Checkpoint travels to every engine)."""
        return serving_named, (self.name,)

    def __str__(self) -> str:
        return self.name

    # --- what a family declares -------------------------------------------------------
    def check_family(self, family: Any) -> None:
        """Refuse a Family declaration this mode cannot serve (a masked family that names no weights)."""

    def weights_refusal(self, family: Any) -> Optional[str]:
        """Why blockray's transformer does not hold `family`'s weights, or None."""
        return None

    def adapter_refusal(self, family: Any, model: str) -> Optional[str]:
        """Why an adapter (a LoRA merged into the weights) does not apply, or None."""
        return None

    def attention_refusal(self, family: Any, attention: Any) -> Optional[str]:
        """Why --attention `attention` cannot be chosen for `family`, or None."""
        if family.attention is not None and attention != family.attention:
            return (f"--attention {attention}: {family.name}'s decoding needs {family.attention} attention "
                    "(its blocks and its K/V are laid out for it)")
        return None

    # --- what the sorter's cost model charges -------------------------------------------
    def block(self, checkpoint: Any, sampling: Any, engine: Any) -> Dict[str, Any]:
        """What a block is as this engine runs it (pipeline.sorting's Roofline keywords:
        block_length, steps_per_block, cache, full_canvas)."""
        raise NotImplementedError


@dataclass(frozen=True)
class MaskedServing(Serving):
    """The block engine (engine.engine): blockray's transformer, the family's weights."""

    def check_family(self, family: Any) -> None:
        if not family.layer_weights or not family.layer_prefix:
            raise ValueError(f"family {family.name}: a masked-diffusion family names its checkpoint's weights "
                             "(layer_prefix, layer_weights)")

    def block(self, checkpoint: Any, sampling: Any, engine: Any) -> Dict[str, Any]:
        return dict(block_length=engine.block_length, steps_per_block=engine.steps_per_block, cache=engine.cache,
                    full_canvas=engine.full_canvas(checkpoint.config.block_causal))


@dataclass(frozen=True)
class CanvasServing(Serving):
    """The canvas engine (engine.canvas): transformers' own class reads the weights and
    attends its own way; blockray plans no token budget for it."""

    def weights_refusal(self, family: Any) -> Optional[str]:
        return (f"{family.name}'s weights are read by transformers' own class ({self.engine}), not by "
                "blockray's transformer")

    def adapter_refusal(self, family: Any, model: str) -> Optional[str]:
        return (f"an adapter (a LoRA merged into a masked-diffusion model) does not apply to {family.name} "
                f"({model}); drop --adapter")

    def attention_refusal(self, family: Any, attention: Any) -> Optional[str]:
        return f"--attention {attention} applies to masked-diffusion models only; {family.name}'s attention is its own"

    def block(self, checkpoint: Any, sampling: Any, engine: Any) -> Dict[str, Any]:
        """A canvas (`canvas_length`) of at most `max_denoising_steps` decoder steps (the
        request's knob, else generation_config.json's, else transformers' default); the
        encoder writes the prompt once and every committed canvas once: cache "persistent"
        on a block canvas."""
        family = checkpoint.family
        return dict(block_length=family.canvas_length(checkpoint.hf),
                    steps_per_block=family.denoising_steps(sampling, checkpoint.generation), cache="persistent",
                    full_canvas=False)


MASKED = MaskedServing("masked", "the masked-diffusion engine", MASKED_READS, own_weights=True, plans_memory=True,
                       warms_up=True, uses_tokenizer=True, exact_prefix_cache=False)
CANVAS = CanvasServing("canvas", "engine.canvas", CANVAS_READS, own_weights=False, plans_memory=False,
                       warms_up=False, uses_tokenizer=False, exact_prefix_cache=True)
Serving.MASKED, Serving.CANVAS = MASKED, CANVAS
SERVINGS: Mapping[str, Serving] = {s.name: s for s in (MASKED, CANVAS)}


def serving_named(name: str) -> Serving:
    """The mode called `name` ("masked", "canvas")."""
    return SERVINGS[name]


__all__ = ["Serving", "MaskedServing", "CanvasServing", "MASKED", "CANVAS", "SERVINGS", "serving_named"]
