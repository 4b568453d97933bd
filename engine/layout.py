"""What a row's family and canvas imply for the batch it is laid out in: where its
blocks start, which token ids mark a mask and a pad, how wide a row is and what the
engine's settings allow. One object, built once per engine (and by the preflight, which
checks a job's settings with it): the rules' checks, the batch's re-layout and the
runner read it. Torch-free at import."""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineConfig
from .models.config import ModelConfig
from .models.families.base import BlockLayout, Family
from .sequence import RowShape


@dataclass(frozen=True)
class Layout:
    """The model's config (its family among it), the rows' shape and the engine's config."""

    model: ModelConfig
    shape: RowShape
    config: EngineConfig

    @property
    def family(self) -> Family:
        """The model's family (its decoding traits): the config's own, never a second copy."""
        return self.model.family

    @property
    def block_length(self) -> int:
        return self.shape.block_length

    @property
    def full_canvas(self) -> bool:
        return self.shape.full_canvas

    @property
    def absolute(self) -> bool:
        """Blocks at multiples of the block length from position 0, the prompt's among them
        (BlockLayout.ABSOLUTE: LLaDA2); else blocks start after the prompt."""
        return self.family.blocks == BlockLayout.ABSOLUTE

    @property
    def mask_id(self) -> int:
        return self.model.mask_token_id

    @property
    def pad_id(self) -> int:
        return self.model.pad_token_id

    @property
    def steps(self) -> int:
        """Denoising steps per block (EngineConfig.steps_per_block)."""
        return self.config.steps_per_block
