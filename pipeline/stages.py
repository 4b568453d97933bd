"""The CPU stages around the engine: chat template, tokenize, detokenize.

Each stage is a plain function over a pyarrow batch (so user columns pass through with
their exact types) that adds or replaces only its own columns, wrapped in a small
callable class that Ray Data runs on an actor pool, as `ray.data.llm` does: the
tokenizer is loaded once when the actor starts, before rows flow, instead of in the
first task of every worker (seconds for `transformers`), which would otherwise trickle
batches to the engines one at a time. A row that cannot be prepared gets a message in
the internal error column and is skipped by the engine, which turns it into an output
row with `finish_reason="error"`.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, List, Optional, Tuple

import pyarrow as pa

# Internal columns, dropped before rows leave the processor.
TOKEN_IDS = "__prompt_token_ids"
PRE_ERROR = "__error"
INTERNAL_COLUMNS = (TOKEN_IDS, PRE_ERROR)
TEXT_PROMPT = "__prompt_text"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model: str) -> bool:
    return any(os.path.exists(os.path.join(model, f)) for f in _TOKENIZER_FILES)


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str):
    """The Hugging Face tokenizer in the model directory (None when it has none); loaded
    from local files only, as the engine's loader does."""
    if not has_tokenizer(model):
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence "model of type llada" noise from config.json
    try:
        # trust_remote_code=False, explicitly: never run a model directory's code, and never
        # let transformers ask an interactive [y/N] question (preflight refuses such models).
        return AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(level)


def _set(table: pa.Table, name: str, values: List[Any], type_: pa.DataType) -> pa.Table:
    arr = pa.array(values, type_)
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, arr)
    return table.append_column(name, arr)


def _prompt_texts(col: pa.ChunkedArray, name: str) -> Tuple[List[Any], List[Optional[str]], pa.ChunkedArray]:
    """(values, per-row error, column) of a text column whose bytes may not be valid UTF-8
    (Arrow does not check what a Parquet file holds): an invalid row gets None and an
    error; the column returned has its invalid bytes replaced by U+FFFD, so that the
    output that carries it stays readable."""
    try:
        return col.to_pylist(), [None] * len(col), col
    except UnicodeDecodeError:
        pass
    raw = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary()).to_pylist()
    values: List[Any] = []
    errors: List[Optional[str]] = []
    for b in raw:
        try:
            values.append(None if b is None else b.decode("utf-8"))
            errors.append(None)
        except UnicodeDecodeError as e:
            values.append(None)
            errors.append(f"prompt is not valid UTF-8 (column {name!r}: {e.reason})")
    fixed = [None if b is None else b.decode("utf-8", "replace") for b in raw]
    return values, errors, pa.chunked_array([pa.array(fixed, col.type)])


def _errors(table: pa.Table) -> List[Optional[str]]:
    return table.column(PRE_ERROR).to_pylist() if PRE_ERROR in table.column_names else [None] * table.num_rows


def chat_template_stage(batch: pa.Table, *, model: str, messages_column: str,
                        chat_template: Optional[str] = None) -> pa.Table:
    """Render `messages_column` (a list of {role, content}) with the tokenizer's chat
    template (or `chat_template`) into an internal text-prompt column."""
    tok = load_tokenizer(model)
    errors = _errors(batch)
    texts: List[Optional[str]] = [None] * batch.num_rows
    if messages_column not in batch.column_names:
        raise ValueError(f"apply_chat_template is set but the input has no {messages_column!r} column")
    for i, messages in enumerate(batch.column(messages_column).to_pylist()):
        if errors[i]:
            continue
        try:
            if tok is None:
                raise ValueError(f"model {model} has no tokenizer to apply a chat template with")
            if not messages:
                raise ValueError(f"{messages_column!r} is empty")
            turns = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
            texts[i] = tok.apply_chat_template(turns, chat_template=chat_template, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - per-row error
            errors[i] = f"chat template failed: {type(e).__name__}: {e}"
    batch = _set(batch, TEXT_PROMPT, texts, pa.string())
    return _set(batch, PRE_ERROR, errors, pa.string())


def tokenize_stage(batch: pa.Table, *, model: str, prompt_column: str, prompt_token_ids_column: str,
                   add_special_tokens: bool = False) -> pa.Table:
    """Add the internal token-id column from, in order of preference: the chat-template
    text, pre-tokenized `prompt_token_ids_column`, or text `prompt_column`."""
    names = batch.column_names
    errors = _errors(batch)
    ids: List[Optional[List[int]]] = [None] * batch.num_rows
    if TEXT_PROMPT in names:
        source, texts = "chat template", batch.column(TEXT_PROMPT).to_pylist()
    elif prompt_token_ids_column in names:
        source, texts = None, None
        for i, v in enumerate(batch.column(prompt_token_ids_column).to_pylist()):
            try:
                ids[i] = None if v is None else [int(t) for t in v]
            except (TypeError, ValueError) as e:  # per-row error: not a list of integers
                errors[i] = errors[i] or f"{prompt_token_ids_column!r} is not a list of token ids: {e}"
    elif prompt_column in names:
        source, col = prompt_column, batch.column(prompt_column)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            texts, bad, fixed = _prompt_texts(col, prompt_column)
            errors = [e or b for e, b in zip(errors, bad)]
            if fixed is not col:
                batch = batch.set_column(names.index(prompt_column), prompt_column, fixed)
        else:
            texts = col.to_pylist()
    else:
        raise ValueError(f"input rows need a {prompt_column!r}, {prompt_token_ids_column!r} or chat "
                         f"messages column; got columns {names}")
    if texts is not None:
        tok = load_tokenizer(model)
        for i, text in enumerate(texts):
            if errors[i]:
                continue
            if text is None:
                errors[i] = f"{source!r} is null"
            elif not isinstance(text, str):
                errors[i] = f"{source!r} is not a string (got {type(text).__name__})"
            elif not text:
                errors[i] = "empty prompt"
            elif not text.strip():
                errors[i] = f"empty prompt ({source!r} is only whitespace)"
            elif tok is None:
                errors[i] = f"model {model} has no tokenizer; give {prompt_token_ids_column!r} instead of text"
            else:
                try:
                    ids[i] = list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
                except Exception as e:  # noqa: BLE001 - per-row error
                    errors[i] = f"{source!r} does not tokenize: {type(e).__name__}: {e}"
                    continue
                unk = getattr(tok, "unk_token_id", None)
                if not ids[i]:
                    errors[i], ids[i] = f"{source!r} does not tokenize: it gives no tokens", None
                elif unk is not None and unk in ids[i]:
                    n = sum(1 for t in ids[i] if t == unk)
                    errors[i], ids[i] = (f"{source!r} does not tokenize: {n} of {len(ids[i])} tokens are the "
                                         f"unknown token {tok.unk_token!r} (characters the tokenizer lacks)"), None
    for i, v in enumerate(ids):
        if v is None and not errors[i]:
            errors[i] = f"{prompt_token_ids_column!r} is null"
    if TEXT_PROMPT in names:
        batch = batch.drop_columns([TEXT_PROMPT])
    batch = _set(batch, TOKEN_IDS, ids, pa.list_(pa.int64()))
    return _set(batch, PRE_ERROR, errors, pa.string())


def detokenize_stage(batch: pa.Table, *, model: str, detokenize: bool = True,
                     skip_special_tokens: bool = True) -> pa.Table:
    """Add `generated_text` and drop the internal columns."""
    tok = load_tokenizer(model) if detokenize else None
    texts: List[Optional[str]] = []
    errors = batch.column("error").to_pylist()
    for ids, err in zip(batch.column("generated_token_ids").to_pylist(), errors):
        ok = tok is not None and not err
        texts.append(tok.decode(ids, skip_special_tokens=skip_special_tokens) if ok else None)
    batch = batch.drop_columns([c for c in INTERNAL_COLUMNS if c in batch.column_names])
    return _set(batch, "generated_text", texts, pa.string())


class _StageUDF:
    """A Ray Data callable class around one stage function: the actor loads the
    tokenizer once (cached by load_tokenizer), then every batch reuses it."""

    stage: Callable[..., pa.Table]

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        if kwargs.get("detokenize", True):
            load_tokenizer(kwargs["model"])

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.stage(batch, **self.kwargs)


class ChatTemplateUDF(_StageUDF):
    stage = staticmethod(chat_template_stage)


class TokenizeUDF(_StageUDF):
    stage = staticmethod(tokenize_stage)


class DetokenizeUDF(_StageUDF):
    stage = staticmethod(detokenize_stage)
