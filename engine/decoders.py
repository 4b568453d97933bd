"""The decoding rules a masked-diffusion engine serves (engine.rules), most specific
first: a request is decoded by the first that applies to its SamplingParams."""
from __future__ import annotations

from typing import Any

from .d2f import D2F
from .editing import EDITING
from .rules import BLOCK, BlockRule
from .subblocks import SUB_BLOCKS

RULES = (D2F, EDITING, SUB_BLOCKS, BLOCK)


def rule_for(params: Any) -> BlockRule:
    return next(r for r in RULES if r.applies(params))
