"""The columns that travel between the stages, in one place (torch-free, Ray-free: the
dispatchers, the data stages and the engine actor all import it).

    tokenize stage adds TOKEN_IDS and PRE_ERROR (TEXT_PROMPT only inside it) ->
    engine actor adds OUTPUT_SCHEMA and STOP_TEXT -> dispatcher adds ENGINE_RETRIES ->
    detokenize stage adds generated_text and drops INTERNAL_COLUMNS.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

# Internal columns, dropped before rows leave the processor.
TOKEN_IDS = "__prompt_token_ids"  # the prompt's token ids (tokenize stage)
PRE_ERROR = "__error"  # why a row cannot run, set before the engine (the engine then skips it)
TEXT_PROMPT = "__prompt_text"  # the chat template's text, within the tokenize stage only
# The engine's text of a row that had stop strings (cut before the first one, as vLLM
# does); the detokenize stage prefers it and drops the column.
STOP_TEXT = "__stop_text"
INTERNAL_COLUMNS = (TOKEN_IDS, PRE_ERROR, STOP_TEXT)

# Output columns of an engine actor and their Arrow types (fixed, so every batch has the same schema).
OUTPUT_SCHEMA = pa.schema([
    ("generated_token_ids", pa.list_(pa.int64())),
    ("num_prompt_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("num_blocks", pa.int64()),
    ("num_steps", pa.int64()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("engine_rank", pa.int64()),
    ("latency_s", pa.float64()),
    ("sample_index", pa.int64()),  # 0..n-1: one output row per (input row, sample)
    ("finished_at", pa.float64()),  # Unix time the engine returned the row (summary: generation phase)
    # sampling_params.logprobs (engine.logprobs), null when not asked: per generated token its
    # log-probability at the step that wrote it, and (logprobs > 0) the N most likely tokens there
    ("generated_logprobs", pa.list_(pa.float64())),
    ("top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])))),
])
# Added by the engine stage's dispatcher (actors/engine_router.py): how many times the row's
# batch was sent to another engine because the engine running it was lost (0: never).
ENGINE_RETRIES = pa.field("engine_retries", pa.int64())


def as_table(batch: Any) -> pa.Table:
    """A batch as Ray Data hands it (Arrow, pandas or a dict of columns) as an Arrow table."""
    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return pa.Table.from_pandas(batch, preserve_index=False)
    return pa.table({k: list(v) for k, v in batch.items()})
