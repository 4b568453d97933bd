"""OpenAI Batch files (and `vllm run-batch`'s) in and out, declared once here.

In: one request per line, `{custom_id, method, url, body}`. `parse_lines` turns a file's
lines into rows of the processor's columns: `custom_id` (the row's id), `url`, `model`
(checked per row against the served model by the tokenize stage), `prompt`
(/v1/completions) or `messages` (/v1/chat/completions), `sampling_params` (the body's
sampling keys, by SamplingParams' names), and the line's own error (the internal
PRE_ERROR column, which every stage and the engine honour) when the body asks for
something blockray cannot do: a key it does not implement is named, never ignored. A
line that is no request at all (not a JSON object, no string `custom_id`, a `custom_id`
seen before) refuses the whole file, naming the line: its results could not be matched
to requests.

Out: `write_results_file` reads the run's part files once the run is over and writes
`results.jsonl`, one line per request in input order, `{id, custom_id, response,
error}`: `response.body` is a chat.completion or text_completion object with one choice
per sample (n), and an error line has `error: {code, message}` and `response: null`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import typing
from typing import Any, Collection, Dict, Iterable, List, Optional, Sequence

import pyarrow as pa

from actors.row_values import RowValueError, coerce
from common.schema import PRE_ERROR
from engine.config import SamplingParams
from engine.structured.params import from_response_format

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ID_COLUMN, URL_COLUMN, MODEL_COLUMN = "custom_id", "url", "model"
# The processor columns the rows land in (the config's defaults; the preflight refuses others).
PROMPT_COLUMNS = {CHAT: "messages", COMPLETIONS: "prompt"}
SAMPLING_COLUMN = "sampling_params"
RESULTS_FILE = "results.jsonl"
LINE_KEYS = ("custom_id", "method", "url", "body")
# Body key -> the SamplingParams field it sets; with the prompt key, `model` and `stream`
# (false only), what a body may hold. Anything else is the line's error, naming the key.
SAMPLING_KEYS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n": "n",
                 "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed"}
# response_format -> structured_outputs (engine.structured.params.from_response_format): a schema as its JSON text
STRUCTURED_TYPE = pa.struct([("json", pa.string()), ("json_object", pa.bool_())])
SAMPLING_TYPE = pa.struct([("max_new_tokens", pa.int64()), ("n", pa.int64()), ("temperature", pa.float64()),
                           ("top_p", pa.float64()), ("stop", pa.list_(pa.string())), ("seed", pa.int64()),
                           ("structured_outputs", STRUCTURED_TYPE)])
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


class BatchFileError(ValueError):
    """A line that is no request (not JSON, no custom_id, a repeated one): the file is refused."""


@functools.lru_cache(maxsize=None)
def _hints() -> Dict[str, Any]:
    return typing.get_type_hints(SamplingParams)


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined with newlines (as vLLM does)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise RowValueError(f"{where} must be a string or a list of text parts, got {value!r:.80}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RowValueError(f"{where}[{j}] is not supported: only text parts ({{\"type\": \"text\", \"text\": "
                                f"...}}), got {part!r:.80}")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(value: Any) -> List[Dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RowValueError(f"body.messages must be a non-empty list of messages, got {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise RowValueError(f"{where} must be an object with role and content, got {m!r:.80}")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise RowValueError(f"{where}.{extra[0]} is not supported by blockray (a message is role and content)")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise RowValueError(f"{where}.role must be a non-empty string, got {m.get('role')!r:.80}")
        out.append({"role": m["role"], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _request(row: Dict[str, Any], line: Dict[str, Any]) -> None:
    """Fill `row` from one line's request; raises RowValueError (the line's error)."""
    extra = [k for k in line if k not in LINE_KEYS]
    if extra:
        raise RowValueError(f"key {extra[0]!r} of the line is not supported (a line is {', '.join(LINE_KEYS)})")
    if line.get("method", "POST") != "POST":
        raise RowValueError(f"method {line['method']!r} is not supported (POST only)")
    url, body = line.get("url"), line.get("body")
    if url not in PROMPT_COLUMNS:
        raise RowValueError(f"url {url!r} is not served: {CHAT} or {COMPLETIONS}")
    if not isinstance(body, dict):
        raise RowValueError(f"body must be an object, got {body!r:.80}")
    prompt_key = PROMPT_COLUMNS[url]
    sampling: Dict[str, Any] = {}
    for key, value in body.items():
        if value is None:  # OpenAI: null is the default
            continue
        if key == prompt_key:
            if key == "messages":
                row["messages"] = _messages(value)
            elif isinstance(value, str):
                row["prompt"] = value
            else:
                raise RowValueError(f"body.prompt must be a string (one prompt per line), got {value!r:.80}")
        elif key == "model":
            if not isinstance(value, str):
                raise RowValueError(f"body.model must be a string, got {value!r:.80}")
            row[MODEL_COLUMN] = value
        elif key == "stream":
            if value is not False:
                raise RowValueError(f"body.stream {value!r} is not supported (a batch line is answered whole)")
        elif key == "response_format":
            try:
                structured = from_response_format(value)
            except ValueError as e:
                raise RowValueError(f"body.{e}") from None
            if structured is not None:
                sampling["structured_outputs"] = structured
        elif key in SAMPLING_KEYS:
            name = SAMPLING_KEYS[key]
            value = coerce(value, _hints()[name], f"body.{key}")
            if name in sampling and sampling[name] != value:
                raise RowValueError("body.max_tokens and body.max_completion_tokens disagree")
            sampling[name] = value
        else:
            raise RowValueError(f"body key {key!r} is not supported by blockray on {url} (supported: "
                                f"{', '.join(sorted({prompt_key, 'model', 'stream', 'response_format', *SAMPLING_KEYS}))})")
    if row[prompt_key] is None:
        raise RowValueError(f"body has no {prompt_key!r}")
    row[SAMPLING_COLUMN] = sampling or None


def parse_lines(lines: Iterable[str], where: str, seen: Optional[Dict[str, str]] = None) -> pa.Table:
    """The rows of a file's lines (blank lines skipped); `where` names the file in
    messages, `seen` ({custom_id: where it was}) the ids of files read before. Raises
    BatchFileError naming the first line that is no request."""
    seen = {} if seen is None else seen
    rows = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        at = f"{where} line {number}"
        try:
            line = json.loads(text.rstrip())
        except ValueError as e:
            raise BatchFileError(f"{at} is not JSON ({e})") from None
        if not isinstance(line, dict):
            raise BatchFileError(f"{at} is not a JSON object (a request: {{custom_id, method, url, body}})")
        cid = line.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise BatchFileError(f"{at} has no custom_id (a non-empty string naming the request)")
        if cid in seen:
            raise BatchFileError(f"{at} repeats custom_id {cid!r} of {seen[cid]}: each request needs its own")
        seen[cid] = at
        url = line.get("url")
        row = {ID_COLUMN: cid, URL_COLUMN: url if isinstance(url, str) else None, MODEL_COLUMN: None,
               "prompt": None, "messages": None, SAMPLING_COLUMN: None, PRE_ERROR: None}
        try:
            _request(row, line)
        except RowValueError as e:
            row[PRE_ERROR] = f"{e}"
        rows.append(row)
    return to_table(rows)


def to_table(rows: Sequence[Dict[str, Any]]) -> pa.Table:
    """The rows as Arrow, with a `messages` column when a line is a chat request and a
    `prompt` column when one is a completion (or none is a chat: a batch needs one)."""
    chat = any(r[URL_COLUMN] == CHAT for r in rows)
    text = any(r[URL_COLUMN] != CHAT for r in rows) or not chat
    fields = [(ID_COLUMN, pa.string()), (URL_COLUMN, pa.string()), (MODEL_COLUMN, pa.string()),
              *([("prompt", pa.string())] if text else []), *([("messages", MESSAGES_TYPE)] if chat else []),
              (SAMPLING_COLUMN, SAMPLING_TYPE), (PRE_ERROR, pa.string())]
    schema = pa.schema(fields)
    return pa.Table.from_pylist([{f.name: r[f.name] for f in schema} for r in rows], schema=schema)


def is_batch_line(text: str) -> bool:
    """Whether a file's first line reads as an OpenAI batch request (input format auto)."""
    try:
        line = json.loads(text)
    except ValueError:
        return False
    return isinstance(line, dict) and "custom_id" in line and "body" in line


# --- out ---------------------------------------------------------------------------------

def _hash(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def result_line(custom_id: str, samples: Sequence[Dict[str, Any]], model: str, served: Collection[str],
                chat: bool) -> Dict[str, Any]:
    """One request's results line from its output rows (one per sample, by sample_index)."""
    h = _hash(custom_id)
    line: Dict[str, Any] = {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None, "error": None}
    failed = [s for s in samples if s.get("error")]
    if failed:
        asked = failed[0].get(MODEL_COLUMN)
        code = "model_not_found" if asked is not None and asked not in served else "invalid_request"
        line["error"] = {"code": code, "message": failed[0]["error"]}
        return line
    prompt_tokens = int(samples[0]["num_prompt_tokens"])
    completion_tokens = sum(int(s["num_generated_tokens"]) for s in samples)
    choices = [{"index": k, **({"message": {"role": "assistant", "content": s["generated_text"]}} if chat
                               else {"text": s["generated_text"]}),
                "logprobs": None, "finish_reason": s["finish_reason"]} for k, s in enumerate(samples)]
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": int(min(s["finished_at"] for s in samples)), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    line["response"] = {"status_code": 200, "request_id": f"req_{h}", "body": body}
    return line


RESULT_COLUMNS = ("sample_index", "generated_text", "finish_reason", "error", "num_prompt_tokens",
                  "num_generated_tokens", "finished_at", URL_COLUMN, MODEL_COLUMN, "messages")


def results_text(rows: Iterable[Dict[str, Any]], order: Sequence[str], id_column: str, model: str,
                 served: Collection[str]) -> bytes:
    """results.jsonl's bytes: one line per id of `order` (the input's, in its order) from
    the run's output `rows`. A request is a chat completion when its url says so, else
    when it had chat messages (an input of another format)."""
    by_id: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(str(r[id_column]), []).append(r)
    out = []
    for cid in order:
        samples = sorted(by_id.pop(cid, []), key=lambda s: s.get("sample_index") or 0)
        if not samples:
            raise RuntimeError(f"no output row for {cid!r}: every input row should have one")
        url = samples[0].get(URL_COLUMN)
        chat = url == CHAT if url else samples[0].get("messages") is not None
        out.append(json.dumps(result_line(cid, samples, model, served, chat), ensure_ascii=False))
    return ("\n".join(out) + "\n" if out else "").encode()


def write_results_file(fs: Any, path: str, order: Sequence[str], id_column: str, model: str,
                       served: Collection[str], before_commit: Any = None) -> str:
    """Write `<path>/results.jsonl` from the part files that count there, atomically
    (pipeline/writer.py), after every part; returns its URL. Holds the run's output
    rows on the driver while it runs (an OpenAI batch file is at most 50,000 requests)."""
    from common.storage import join

    from .writer import atomic_write_bytes, part_rows, remove_empty_tmp

    data = results_text(part_rows(fs, path, [id_column, *RESULT_COLUMNS]), order, id_column, model, served)
    target = join(path, RESULTS_FILE)
    atomic_write_bytes(fs, target, data, before_commit)
    remove_empty_tmp(fs, path)
    return fs.unstrip_protocol(target)
