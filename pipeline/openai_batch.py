"""OpenAI Batch files (and `vllm run-batch`'s) in and out, declared once here.

In: one request per line, `{custom_id, method, url, body}`. `parse_lines` turns a file's
lines into rows of the processor's columns: `custom_id` (the row's id), `url`, `model`
(checked per row against the served model by the tokenize stage), `prompt`
(/v1/completions) or `messages` (/v1/chat/completions), `sampling_params` (the body's
sampling keys, by SamplingParams' names), and the line's own error (the internal
PRE_ERROR column, which every stage and the engine honour) when the body asks for
something blockray cannot do: a key it does not implement is named, never ignored. A
line that is no request at all (not a JSON object, no `custom_id` or one that is no
string, a `custom_id` seen before) refuses the whole file, naming the line: its results
could not be matched to requests.

Out: `write_results_file` reads the run's part files once the run is over and writes
`results.jsonl`, one line per request in input order, `{id, custom_id, response,
error}`, as OpenAI's batch output does: `response.body` is a chat.completion or
text_completion object with one choice per sample (n), each with its logprobs in
OpenAI's shape when the run or the line asked for them; a request refused (its line,
its model, its settings) has `response` with status 400 (404: a model not served) and
`body.error` {message, type, param, code}; `error` {code, message} is kept for a request
that could not be run (its engine failed).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import typing
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Sequence

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
# OpenAI's bounds: n (each sample is a request of its own to the engine), and the
# alternatives per token: chat's top_logprobs (with logprobs: true), completions' logprobs
MAX_N = 128
MAX_TOP_LOGPROBS = {CHAT: 20, COMPLETIONS: 5}
LOGPROB_KEYS = {CHAT: ("logprobs", "top_logprobs"), COMPLETIONS: ("logprobs",)}
# response_format -> structured_outputs (engine.structured.params.from_response_format): a schema as its JSON text
STRUCTURED_TYPE = pa.struct([("json", pa.string()), ("json_object", pa.bool_())])
SAMPLING_TYPE = pa.struct([("max_new_tokens", pa.int64()), ("n", pa.int64()), ("temperature", pa.float64()),
                           ("top_p", pa.float64()), ("stop", pa.list_(pa.string())), ("seed", pa.int64()),
                           ("logprobs", pa.int64()), ("structured_outputs", STRUCTURED_TYPE)])
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


class BatchFileError(ValueError):
    """A line that is no request (not JSON, no string custom_id, a repeated one): the file is refused."""


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


def _count(value: Any, where: str, high: int) -> int:
    """An integer in [0, high] (not a bool), else the line's error."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise RowValueError(f"{where} must be an integer from 0 to {high}, got {value!r:.80}")
    return value


def _logprobs(url: str, given: Dict[str, Any]) -> Optional[int]:
    """SamplingParams.logprobs (alternatives per token) from a body's logprob keys:
    chat's `logprobs` (a bool) and `top_logprobs` (0..20, with logprobs true), or
    completions' `logprobs` (0..5); None when not asked."""
    if url == COMPLETIONS:
        return None if "logprobs" not in given else _count(given["logprobs"], "body.logprobs", MAX_TOP_LOGPROBS[url])
    on = given.get("logprobs", False)
    if not isinstance(on, bool):
        raise RowValueError(f"body.logprobs must be true or false on {CHAT}, got {on!r:.80}")
    top = given.get("top_logprobs")
    if top is not None:
        top = _count(top, "body.top_logprobs", MAX_TOP_LOGPROBS[url])
        if not on:
            raise RowValueError("body.top_logprobs needs body.logprobs: true")
    return (top or 0) if on else None


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
    logprob_keys: Dict[str, Any] = {}
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
        elif key in LOGPROB_KEYS[url]:
            logprob_keys[key] = value
        elif key in SAMPLING_KEYS:
            name = SAMPLING_KEYS[key]
            value = coerce(value, _hints()[name], f"body.{key}")
            if name in sampling and sampling[name] != value:
                raise RowValueError("body.max_tokens and body.max_completion_tokens disagree")
            if name == "n" and value > MAX_N:
                raise RowValueError(f"body.n must be at most {MAX_N} (OpenAI's bound), got {value}")
            sampling[name] = value
        else:
            supported = {prompt_key, 'model', 'stream', 'response_format', *SAMPLING_KEYS, *LOGPROB_KEYS[url]}
            raise RowValueError(f"body key {key!r} is not supported by blockray on {url} (supported: "
                                f"{', '.join(sorted(supported))})")
    if row[prompt_key] is None:
        raise RowValueError(f"body has no {prompt_key!r}")
    logprobs = _logprobs(url, logprob_keys)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
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
        if cid is None or cid == "":
            raise BatchFileError(f"{at} has no custom_id (a non-empty string naming the request)")
        if not isinstance(cid, str):
            raise BatchFileError(f"{at} has a custom_id of the wrong type, {type(cid).__name__} {cid!r:.40}: it must "
                                 "be a string (e.g. \"request-1\")")
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


# An engine that failed while running a request (actors/engine_loop.py, actors/tensor_parallel.py
# say so with these words): the request could not be run, which OpenAI reports in `error`,
# not as a refused request's response.
RUN_FAILURES = ("engine step failed", "tensor-parallel group failed", "rebuilding the engine failed",
                "add_request failed")
# OpenAI's log-probability of a token it cannot place; here: a token committed without being chosen (NaN)
UNKNOWN_LOGPROB = -9999.0
_PARAM = re.compile(r"body(?:\.| key '| has no ')(\w+)")

TokenTexts = Callable[[Sequence[int]], List[str]]


def token_texts(load: Callable[[], Any]) -> TokenTexts:
    """Each token id's text as OpenAI's logprobs name tokens (the token decoded alone, as
    vLLM does), by the tokenizer `load` returns, loaded at the first row that needs it."""
    tokenizer: List[Any] = []

    def texts(ids: Sequence[int]) -> List[str]:
        if not tokenizer:
            tokenizer.append(load())
        return [tokenizer[0].decode([int(i)]) for i in ids]
    return texts


def _refused(message: str, asked: Optional[str], served: Collection[str], request_id: str) -> Dict[str, Any]:
    """The response of a request refused before it ran, as OpenAI writes one: status 400
    (404 for a model not served) and `body.error` {message, type, param, code}."""
    wrong_model = asked is not None and asked not in served
    param = _PARAM.match(message)
    error = {"message": message, "type": "invalid_request_error",
             "param": "model" if wrong_model else param.group(1) if param else None,
             "code": "model_not_found" if wrong_model else None}
    return {"status_code": 404 if wrong_model else 400, "request_id": request_id, "body": {"error": error}}


def _logprob(value: Optional[float]) -> float:
    return UNKNOWN_LOGPROB if value is None or math.isnan(value) else float(value)


def choice_logprobs(sample: Dict[str, Any], chat: bool, texts: Optional[TokenTexts]) -> Optional[Dict[str, Any]]:
    """A choice's `logprobs` in OpenAI's shape from the output row's generated_logprobs and
    top_logprobs (engine.logprobs: each token's at the step that wrote it), None when the
    run did not ask for them. Chat: `content`, one entry per token {token, logprob, bytes,
    top_logprobs}; completions: `tokens`, `token_logprobs`, `top_logprobs` (a dict per
    token) and `text_offset` (each token's offset in the answer)."""
    values = sample.get("generated_logprobs")
    if values is None:
        return None
    if texts is None:
        raise RuntimeError("logprobs to write, and no tokenizer to name their tokens")
    ids = list(sample.get("generated_token_ids") or [])
    tops = sample.get("top_logprobs") or [[] for _ in ids]
    tokens = texts(ids)
    alt = [texts([t["token_id"] for t in top or []]) for top in tops]
    if chat:
        def entry(token: str, logprob: Optional[float]) -> Dict[str, Any]:
            return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}
        content = [{**entry(tok, lp), "top_logprobs": [entry(a, t["logprob"]) for a, t in zip(names, top or [])]}
                   for tok, lp, names, top in zip(tokens, values, alt, tops)]
        return {"content": content, "refusal": None}
    offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [_logprob(v) for v in values],
            "top_logprobs": [{a: _logprob(t["logprob"]) for a, t in zip(names, top or [])}
                             for names, top in zip(alt, tops)],
            "text_offset": offsets}


def result_line(custom_id: str, samples: Sequence[Dict[str, Any]], model: str, served: Collection[str],
                chat: bool, texts: Optional[TokenTexts] = None) -> Dict[str, Any]:
    """One request's results line from its output rows (one per sample, by sample_index)."""
    h = _hash(custom_id)
    line: Dict[str, Any] = {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None, "error": None}
    failed = [s for s in samples if s.get("error")]
    if failed:
        message = failed[0]["error"]
        if message.startswith(RUN_FAILURES):
            line["error"] = {"code": "engine_failed", "message": message}
        else:
            line["response"] = _refused(message, failed[0].get(MODEL_COLUMN), served, f"req_{h}")
        return line
    prompt_tokens = int(samples[0]["num_prompt_tokens"])
    completion_tokens = sum(int(s["num_generated_tokens"]) for s in samples)
    choices = [{"index": k, **({"message": {"role": "assistant", "content": s["generated_text"]}} if chat
                               else {"text": s["generated_text"]}),
                "logprobs": choice_logprobs(s, chat, texts), "finish_reason": s["finish_reason"]}
               for k, s in enumerate(samples)]
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": int(min(s["finished_at"] for s in samples)), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    line["response"] = {"status_code": 200, "request_id": f"req_{h}", "body": body}
    return line


RESULT_COLUMNS = ("sample_index", "generated_text", "finish_reason", "error", "num_prompt_tokens",
                  "num_generated_tokens", "finished_at", URL_COLUMN, MODEL_COLUMN, "messages",
                  "generated_token_ids", "generated_logprobs", "top_logprobs")


def results_text(rows: Iterable[Dict[str, Any]], order: Sequence[str], id_column: str, model: str,
                 served: Collection[str], texts: Optional[TokenTexts] = None) -> bytes:
    """results.jsonl's bytes: one line per id of `order` (the input's, in its order) from
    the run's output `rows`. A request is a chat completion when its url says so, else
    when it had chat messages (an input of another format). `texts`: token ids' texts,
    for logprobs (token_texts)."""
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
        out.append(json.dumps(result_line(cid, samples, model, served, chat, texts), ensure_ascii=False))
    return ("\n".join(out) + "\n" if out else "").encode()


def write_results_file(fs: Any, path: str, order: Sequence[str], id_column: str, model: str,
                       served: Collection[str], before_commit: Any = None, texts: Optional[TokenTexts] = None) -> str:
    """Write `<path>/results.jsonl` from the part files that count there, atomically
    (pipeline/writer.py), after every part; returns its URL. Holds the run's output
    rows on the driver while it runs (an OpenAI batch file is at most 50,000 requests)."""
    from common.storage import join

    from .writer import atomic_write_bytes, part_rows, remove_empty_tmp

    data = results_text(part_rows(fs, path, [id_column, *RESULT_COLUMNS]), order, id_column, model, served, texts)
    target = join(path, RESULTS_FILE)
    atomic_write_bytes(fs, target, data, before_commit)
    remove_empty_tmp(fs, path)
    return fs.unstrip_protocol(target)
