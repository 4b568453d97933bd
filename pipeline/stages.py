"""The CPU stages around the engine: chat template, tokenize, detokenize.

Each stage is a plain function over a pyarrow batch (so user columns pass through with
their exact types) that adds or replaces only its own columns, wrapped in a small
callable object that Ray Data runs as tasks. Tasks rather than an actor pool (as
`ray.data.llm` uses): they run in Ray's pooled task workers, which the read and write
tasks use anyway and which outlive a dataset, and they fuse with the read; a tokenize
and a detokenize actor are two more processes per run, measured at about a tenth of a
small run's CPU on a 2-core machine. Each worker loads the tokenizer once
(`load_tokenizer` caches it, without torch), well before the engines have loaded their
models, which is when rows reach them (`wait_for_engines_s`). A row that cannot be
prepared gets a message in the internal error column and is skipped by the engine,
which turns it into an output row with `finish_reason="error"`.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import pyarrow as pa

from common.schema import INTERNAL_COLUMNS, PRE_ERROR, STOP_TEXT, TEXT_PROMPT, TOKEN_IDS  # noqa: F401 - re-exported
from common.tokenizer import PromptTooLong, encode_bounded, load_tokenizer

from actors.row_values import RowValueError, check_model, parse_messages, parse_token_ids, row_error

logger = logging.getLogger(__name__)


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


def resolve_chat_template(value: Optional[str]) -> Optional[str]:
    """The Jinja text of `chat_template`: a path to a template file (as vLLM's
    `--chat-template`), or the template itself (as ray.data.llm's `chat_template`).
    Read on the driver, so workers never need the file."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template (--chat-template)")


def template_of(model: str, chat_template: Optional[str] = None, config: Optional[Dict[str, Any]] = None
                ) -> Optional[str]:
    """The chat template prompts would be rendered with: `chat_template`, else the
    tokenizer's own, else None. `config`: the model's config.json as read (load_tokenizer)."""
    if chat_template:
        return chat_template
    tok = load_tokenizer(model, config)
    return getattr(tok, "chat_template", None) if tok is not None else None


def chat_stage_kwargs(config: Any, chat_template: Optional[str]) -> Optional[Dict[str, Any]]:
    """The `chat` argument of the tokenize stage for a DLLMProcessorConfig and the template
    read on the driver (`chat_template`, its text; None: the tokenizer's), or None when chat
    templates are off (`apply_chat_template=False`). With None (auto) the stage renders only
    the batches that have the messages column, when there is a template. Rendering runs
    inside the tokenize stage rather than in a stage of its own: one pass over each batch."""
    if config.apply_chat_template is False:
        return None
    return dict(messages_column=config.messages_column, chat_template=chat_template,
                mode=config.apply_chat_template, keep_prompt=config.keep_prompt,
                template_kwargs=config.chat_template_kwargs)


def render_chat(tok: Any, messages: List[Dict[str, Any]], chat_template: Optional[str],
                template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """One conversation as text. The last turn the user's: add the generation prompt (a
    new assistant turn). The assistant's (a prefill): continue that turn instead of
    opening a new one (transformers' continue_final_message), as vLLM's chat API does.
    `template_kwargs`: chat_template_kwargs, variables the template reads (e.g.
    enable_thinking), passed to apply_chat_template as ray.data.llm and vLLM pass them."""
    turns = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    prefill = turns[-1].get("role") == "assistant"
    return tok.apply_chat_template(turns, chat_template=chat_template, tokenize=False,
                                   add_generation_prompt=not prefill, continue_final_message=prefill,
                                   **(template_kwargs or {}))


def chat_template_stage(batch: pa.Table, *, model: str, messages_column: str, chat_template: Optional[str] = None,
                        mode: Optional[bool] = True, prompt_column: str = "prompt", keep_prompt: bool = True,
                        config: Optional[Dict[str, Any]] = None,
                        template_kwargs: Optional[Dict[str, Any]] = None) -> pa.Table:
    """Render `messages_column` (a list of {role, content}) with `chat_template` or the
    tokenizer's into the text the engine gets; with `keep_prompt` it is also the output's
    `prompt_column` (as ray.data.llm keeps it), so what the model saw can be audited.
    `mode`: True renders (a missing column or template is an error), None (auto) renders
    only when the batch has the column and a template exists; a row whose messages are
    null then keeps its text prompt. `template_kwargs`: see render_chat."""
    names = batch.column_names
    if messages_column not in names:
        if mode is None:
            return batch
        raise ValueError(f"apply_chat_template is set but the input has no {messages_column!r} column")
    tok = load_tokenizer(model, config)
    template = template_of(model, chat_template, config)
    if mode is None and template is None:
        return batch
    errors = _errors(batch)
    given = batch.column(prompt_column).to_pylist() if prompt_column in names else [None] * batch.num_rows
    texts: List[Optional[str]] = [None] * batch.num_rows
    for i, messages in enumerate(batch.column(messages_column).to_pylist()):
        if errors[i]:
            continue
        if messages is None and mode is None and isinstance(given[i], str):
            texts[i] = given[i]  # auto: a text-prompt row among chat rows
            continue
        try:
            if tok is None:
                raise ValueError(f"model {model} has no tokenizer to apply a chat template with")
            if template is None:
                raise ValueError(f"the tokenizer of {model} has no chat template; give chat_template "
                                 "(--chat-template PATH)")
            if messages is None:
                raise RowValueError(f"{messages_column!r} is null" + (
                    "" if isinstance(given[i], str) else f", and so is {prompt_column!r}"))
            if not messages:
                raise ValueError(f"{messages_column!r} is empty")
            texts[i] = render_chat(tok, parse_messages(messages, messages_column), chat_template, template_kwargs)
        except Exception as e:  # noqa: BLE001 - per-row error
            errors[i] = row_error(e, "chat template failed")
    batch = _set(batch, TEXT_PROMPT, texts, pa.string())
    if keep_prompt:
        batch = _set(batch, prompt_column, [t if t is not None else g for t, g in zip(texts, given)], pa.string())
    return _set(batch, PRE_ERROR, errors, pa.string())


_RAW_PROMPT_NOTED: Set[str] = set()


def note_raw_prompts(model: str, tok: Any, column: str) -> None:
    """Say once per process that raw text goes to a model that has a chat template: an
    instruct model given unrendered prompts answers worse, silently. Not when the template
    renders a user's turn as its bare text: raw text is then what it would render."""
    if model in _RAW_PROMPT_NOTED or not getattr(tok, "chat_template", None):
        return
    _RAW_PROMPT_NOTED.add(model)
    probe = "copy: ab"
    try:  # a template that renders a user's turn as its bare text (the embedded tiny model's): nothing to say
        if render_chat(tok, [{"role": "user", "content": probe}], None) == probe:
            return
    except Exception:  # noqa: BLE001 - a template that needs more than one turn: say it
        pass
    logger.warning("prompts in column %r are raw text, but the tokenizer of %s has a chat template: they are "
                   "sent as they are. Give a messages column to have them rendered (apply_chat_template).",
                   column, model)


def refuse_other_models(batch: pa.Table, column: str, served: List[str], serving: str) -> pa.Table:
    """Make every row whose `column` names a model other than the one served an error row
    (actors/row_values.check_model), before anything is rendered or tokenized for it."""
    if column not in batch.column_names:
        return batch
    errors = _errors(batch)
    for i, value in enumerate(batch.column(column).to_pylist()):
        try:
            check_model(value, column, served, serving)
        except Exception as e:  # noqa: BLE001 - per-row error
            errors[i] = errors[i] or row_error(e, f"bad {column!r}")
    return _set(batch, PRE_ERROR, errors, pa.string())


def _unused_messages(batch: pa.Table, column: str, chat: Optional[Dict[str, Any]]) -> List[Optional[str]]:
    """Per row, why its `column` chat turns were not used (None where it has none, or when
    they were rendered): the chat stage is off, or there is no template to render them."""
    if column not in batch.column_names or TEXT_PROMPT in batch.column_names:
        return [None] * batch.num_rows
    why = ("apply_chat_template is off" if chat is None else
           "the model has no chat template (give one: chat_template, --chat-template PATH)")
    return [None if v is None else f"{column!r} not used: {why}"
            for v in batch.column(column).to_pylist()]


def tokenize_stage(batch: pa.Table, *, model: str, prompt_column: str, prompt_token_ids_column: str,
                   add_special_tokens: bool = False, chat: Optional[Dict[str, Any]] = None,
                   config: Optional[Dict[str, Any]] = None, vocab: Optional[int] = None,
                   messages_column: str = "messages", max_prompt_tokens: Optional[int] = None,
                   models: Optional[Dict[str, Any]] = None) -> pa.Table:
    """Add the internal token-id column from, in order of preference: the chat-template
    text, pre-tokenized `prompt_token_ids_column`, or text `prompt_column`. `chat`
    (`chat_stage_kwargs`): render the messages first (see chat_template_stage).
    `config`, `vocab`: the model's config.json and vocabulary size as read (a run's
    Checkpoint); pre-tokenized ids past the vocabulary are refused per row here.
    `max_prompt_tokens`: a text prompt certainly longer is refused before it is tokenized
    whole (common/tokenizer.encode_bounded). `models`: refuse_other_models' arguments,
    checked first. A row with chat turns that were not rendered says so."""
    if models is not None:
        batch = refuse_other_models(batch, **models)
    if chat is not None:
        batch = chat_template_stage(batch, model=model, prompt_column=prompt_column, config=config, **chat)
    names = batch.column_names
    errors = _errors(batch)
    unused = _unused_messages(batch, messages_column, chat)
    ids: List[Optional[List[int]]] = [None] * batch.num_rows
    if TEXT_PROMPT in names:
        source, texts = "chat template", batch.column(TEXT_PROMPT).to_pylist()
    elif prompt_token_ids_column in names:
        source, texts = None, None
        for i, v in enumerate(batch.column(prompt_token_ids_column).to_pylist()):
            try:  # per-row error: not a list of integers in the vocabulary
                ids[i] = parse_token_ids(v, prompt_token_ids_column, vocab)
            except Exception as e:  # noqa: BLE001
                errors[i] = errors[i] or row_error(e, f"{prompt_token_ids_column!r} is not a list of token ids")
    elif prompt_column in names:
        source, col = prompt_column, batch.column(prompt_column)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            texts, bad, fixed = _prompt_texts(col, prompt_column)
            errors = [e or b for e, b in zip(errors, bad)]
            if fixed is not col:
                batch = batch.set_column(names.index(prompt_column), prompt_column, fixed)
        else:
            texts = col.to_pylist()
    elif messages_column in names:  # turns that were not rendered: each row says so below
        source, texts = prompt_column, [None] * batch.num_rows
    else:
        raise ValueError(f"input rows need a {prompt_column!r}, {prompt_token_ids_column!r} or chat "
                         f"messages column; got columns {names}")
    if texts is not None:
        tok = load_tokenizer(model, config)
        if source == prompt_column:
            note_raw_prompts(model, tok, prompt_column)
        for i, text in enumerate(texts):
            if errors[i]:
                continue
            if text is None:
                errors[i] = f"{unused[i]}, and the row has no {source!r}" if unused[i] else f"{source!r} is null"
            elif not isinstance(text, str):
                errors[i] = f"{source!r} is not a string (got {type(text).__name__})"
            elif not text:
                errors[i] = "empty prompt" if source == prompt_column else (
                    f"empty prompt (the chat template renders {chat['messages_column']!r} as no text)")
            elif text.isspace():  # (not strip(): no copy of a long prompt)
                errors[i] = f"empty prompt ({source!r} is only whitespace)"
            elif tok is None:
                errors[i] = f"model {model} has no tokenizer; give {prompt_token_ids_column!r} instead of text"
            else:
                try:
                    ids[i] = encode_bounded(tok, text, max_prompt_tokens, add_special_tokens)
                except PromptTooLong as e:
                    errors[i] = (f"prompt too long for the model's context (or token_budget): {e}; "
                                 "the rest not tokenized")
                    continue
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
            errors[i] = (f"{unused[i]}, and the row has no {prompt_token_ids_column!r}" if unused[i] else
                         f"{prompt_token_ids_column!r} is null")
    if TEXT_PROMPT in names:
        batch = batch.drop_columns([TEXT_PROMPT])
    batch = _set(batch, TOKEN_IDS, ids, pa.list_(pa.int64()))
    return _set(batch, PRE_ERROR, errors, pa.string())


def detokenize_stage(batch: pa.Table, *, model: str, detokenize: bool = True, skip_special_tokens: bool = True,
                     config: Optional[Dict[str, Any]] = None) -> pa.Table:
    """Add `generated_text` and drop the internal columns. A row that had stop strings
    takes the engine's text, which is cut before the first stop string (as vLLM's)."""
    tok = load_tokenizer(model, config) if detokenize else None
    texts: List[Optional[str]] = []
    errors = batch.column("error").to_pylist()
    cut = batch.column(STOP_TEXT).to_pylist() if STOP_TEXT in batch.column_names else [None] * batch.num_rows
    for ids, err, stop_text in zip(batch.column("generated_token_ids").to_pylist(), errors, cut):
        ok = tok is not None and not err
        texts.append(stop_text if stop_text is not None and ok else
                     tok.decode(ids, skip_special_tokens=skip_special_tokens) if ok else None)
    batch = batch.drop_columns([c for c in INTERNAL_COLUMNS if c in batch.column_names])
    return _set(batch, "generated_text", texts, pa.string())


# (model, hub revision, run id) -> a folder of its tokenizer files on this node
_local_dirs: Dict[Tuple[str, Optional[str], str], str] = {}


class _StageTask:
    """One stage with its settings, called by Ray Data on each batch (Ray Data names the
    stage after the class), over the run's Checkpoint (engine.checkpoint): its config and
    vocabulary as the preflight read them, and a folder of its tokenizer files on this
    node (a remote model's fetched without weights once per worker process and run, since
    these tasks may run on nodes the driver never saw; a later run checks the remote again)."""

    stage: Callable[..., pa.Table]

    def __init__(self, *, checkpoint: Any, run_id: str = "", **kwargs: Any):
        self.checkpoint, self.run_id, self.kwargs = checkpoint, run_id, kwargs

    def __call__(self, batch: pa.Table) -> pa.Table:
        ckpt = self.checkpoint
        key = (ckpt.model, ckpt.revision, self.run_id)
        if key not in _local_dirs:  # once per worker and run, not per batch
            _local_dirs[key] = ckpt.metadata_dir()
        model = dict(model=_local_dirs[key], config=ckpt.hf)
        if self.stage is tokenize_stage:
            model["vocab"] = ckpt.config.vocab_size
        return self.stage(batch, **model, **self.kwargs)


class ChatTemplateUDF(_StageTask):
    stage = staticmethod(chat_template_stage)


class TokenizeUDF(_StageTask):
    stage = staticmethod(tokenize_stage)


class DetokenizeUDF(_StageTask):
    stage = staticmethod(detokenize_stage)
