"""The two engines behind one interface: what a serving mode (engine.serving) needs of
its engine itself, that is building it from a Checkpoint and its own refusal of the
shortest row there is. Both engines are EngineCores (engine.core) once built, so the
actor's loop drives either the same way.

Why apart from engine.serving: these load the engines (torch, the loader, the
Checkpoint), and the family registry holds the serving mode; putting them there would
make the registry import the engines that import it. Here they sit above both, looked up
by the mode (`engine_for`). Torch-free at import (the preflight imports it): each method
imports what it runs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .serving import CANVAS, MASKED, Serving
from .speculative import SELF_SPECULATIVE, serves, settings_refusal as spec_refusal


@dataclass
class Built:
    """What an engine actor (or a tensor-parallel rank) keeps of one build: the model, its
    Budget, the EngineConfig with its token budget resolved, and a factory of fresh engines
    (the first one, and one after each failed step)."""

    model: Any
    budget: Any
    config: Any
    factory: Callable[[], Any]


class ServingEngine:
    """One mode's engine (see the module docstring)."""

    def build(self, ckpt: Any, config: Any, *, dtype: Any, device: Any, weights_dir: str,
              tokenizer: Callable[[], Any], record_batches: bool = False, tp: Any = None) -> Built:
        """Load `ckpt`'s model on `device` in `dtype` (this rank's shard under `tp`,
        engine.parallel) and plan its budget. `tokenizer`: read when an engine is built."""
        raise NotImplementedError

    def every_row_refusal(self, checkpoint: Any, sampling: Any, engine: Any) -> Optional[str]:
        """What this engine refuses of a one-token row decoded with `sampling` under
        `engine` (the preflight's check that the job can run at all), or None."""
        raise NotImplementedError


class BlockEngine(ServingEngine):
    """engine.engine.Engine over blockray's transformer: the budget planned from the
    device's memory once the weights are loaded."""

    def build(self, ckpt: Any, config: Any, *, dtype: Any, device: Any, weights_dir: str,
              tokenizer: Callable[[], Any], record_batches: bool = False, tp: Any = None) -> Built:
        from .budget import resolve_token_budget
        from .engine import Engine
        from .loader import load_model

        shard = {} if tp is None else {"tp": tp}  # one device: load_model's call as it always was
        model, _ = load_model(ckpt, dtype=dtype, device=device, tokenizer=False, weights_dir=weights_dir, **shard)
        # once, with the weights loaded and before any engine (warm-up and restarts alike); a
        # shard's model config is already its rank's: planned as one device (as Engine does)
        budget = resolve_token_budget(config if tp is None else dataclasses.replace(config, tensor_parallel_size=1),
                                      model.config, model.dtype, device)
        config = dataclasses.replace(config, token_budget=budget.token_budget)
        make = lambda: Engine(model, config, tokenizer=tokenizer(), record_batches=record_batches)  # noqa: E731
        # LinearSpec / AR rows beside the diffusion rows (engine.linear_spec), on one device
        if tp is None and model.config.model_type in SELF_SPECULATIVE:
            from .linear_spec import DecodingModes

            block = make
            adapter = ckpt.adapter.source if ckpt.adapter is not None else None
            make = lambda: DecodingModes.over(block(), adapter)  # noqa: E731
        return Built(model, budget, config, make)

    def every_row_refusal(self, checkpoint: Any, sampling: Any, engine: Any) -> Optional[str]:
        """A decoding rule the family does not allow (D2F on a bidirectional model,
        edit_threshold outside LLaDA2), max_new_tokens past the context or the budget."""
        from .decoders import settings_refusal
        from .layout import Layout
        from .sequence import RowShape

        cfg = checkpoint.config
        if serves(sampling):  # decoding linear_spec / ar: engine.linear_spec's checks
            return spec_refusal(sampling, cfg, engine, checkpoint.adapter.source if checkpoint.adapter else None)
        shape = RowShape(engine.block_length, engine.full_canvas(cfg.block_causal))
        return settings_refusal(sampling, Layout(cfg, shape, engine))


class CanvasEngines(ServingEngine):
    """engine.canvas.CanvasServe over transformers' DiffusionGemma class: no budget planned
    (the given one, else the default)."""

    def build(self, ckpt: Any, config: Any, *, dtype: Any, device: Any, weights_dir: str,
              tokenizer: Callable[[], Any], record_batches: bool = False, tp: Any = None) -> Built:
        from .budget import fixed_budget
        from .canvas import CanvasParams, CanvasServe, load_diffusion_gemma

        shard = {} if tp is None else {"tp": tp}
        defaults = CanvasParams.from_generation(ckpt.generation)
        model = load_diffusion_gemma(ckpt, dtype, str(device), weights_dir=weights_dir, **shard)
        return Built(model, fixed_budget(config), config, lambda: CanvasServe(model, defaults, config))

    def every_row_refusal(self, checkpoint: Any, sampling: Any, engine: Any) -> Optional[str]:
        """DiffusionGemma's knobs resolved over its generation_config.json (entropy_bound=0,
        t_min >= t_max), a canvas past the token budget. Imports torch and transformers."""
        from .canvas.params import CanvasParams, budget_refusal

        knobs = CanvasParams.from_generation(checkpoint.generation).override(sampling)
        return knobs.validate() or budget_refusal(1, sampling.max_new_tokens,
                                                  checkpoint.family.canvas_length(checkpoint.hf),
                                                  engine.fixed_token_budget())


ENGINES: Mapping[Serving, ServingEngine] = {MASKED: BlockEngine(), CANVAS: CanvasEngines()}


def engine_for(serving: Serving) -> ServingEngine:
    """The engine that serves mode `serving` (engine.serving)."""
    return ENGINES[serving]


__all__ = ["Built", "ServingEngine", "BlockEngine", "CanvasEngines", "ENGINES", "engine_for"]
