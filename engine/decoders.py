"""The decoding rules a masked-diffusion engine serves (engine.rules), most specific
first: a request is decoded by the first that applies to its SamplingParams."""
from __future__ import annotations

from typing import Any, Optional

from .d2f import D2F
from .editing import EDITING
from .indel import INDEL
from .layout import Layout
from .multi_block import MULTI_BLOCK
from .reads import refusal, unread
from .rules import BLOCK, BlockRule, row_refusal
from .sequence import Request
from .subblocks import SUB_BLOCKS

RULES = (MULTI_BLOCK, D2F, INDEL, EDITING, SUB_BLOCKS, BLOCK)


def rule_for(params: Any) -> BlockRule:
    return next(r for r in RULES if r.applies(params))


def settings_refusal(params: Any, layout: Layout) -> Optional[str]:
    """Why a masked-diffusion engine with `layout` refuses every row decoded with `params`
    (SamplingParams), or None: its own checks (Engine.sampling_reads, then Engine.check)
    of the shortest row there is, one token. Torch-free: the job's preflight runs it."""
    rule = rule_for(params)
    err = params.validate() or refusal(unread(params, rule.reads), f"this row's decoding ({rule.name})")
    if err:
        return err
    req = Request("settings", [0], params, [])
    req.rule = rule
    return row_refusal(req, layout)
