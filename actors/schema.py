"""The columns the engine stage adds to every row (torch-free: the stage's dispatchers,
actors/engine_router.py, and the data side import it without loading the engine)."""
from __future__ import annotations

import pyarrow as pa

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
])
# The engine's text of a row that had stop strings (cut before the first one, as vLLM
# does); pipeline/stages.py's detokenize stage prefers it and drops the column.
STOP_TEXT = "__stop_text"
# Added by the engine stage's dispatcher (actors/engine_router.py): how many times the row's
# batch was sent to another engine because the engine running it was lost (0: never).
ENGINE_RETRIES = pa.field("engine_retries", pa.int64())
