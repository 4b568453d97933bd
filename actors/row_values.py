"""The boundary where untrusted per-row values become typed values.

A row's `sampling_params`, seed column, prompt token ids, chat messages and `model` come from a
user's Parquet file or Dataset with whatever Arrow type it had: strings where numbers
belong, NaN and inf, integers past int64, lists where scalars belong, nulls, nested
structs. Every stage that reads one of them before the engine (tokenize, chat template,
the sorter's key and cost, the engine actor) parses it here, inside the row's own try, so
one bad value becomes that row's error naming the field, never the batch's.

Sampling parameters are coerced field by field from `SamplingParams`'s own type hints
(so a field added to the dataclass is covered with no list to keep in sync), then checked
by `SamplingParams.validate`.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import numbers
import typing
from typing import Any, Collection, Dict, List, Mapping, Optional

from engine.config import SamplingParams  # dataclasses only: no torch

INT64 = (-(2**63), 2**63 - 1)


class RowValueError(ValueError):
    """One row's value is unusable; the message names the field."""


def as_int(value: Any, name: str, lo: int = INT64[0], hi: int = INT64[1]) -> int:
    """An integer in [lo, hi] from an int or an integral finite float (7.0, never 7.9); bools refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RowValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not isinstance(value, numbers.Integral):
        f = float(value)
        if not math.isfinite(f) or f != math.floor(f):
            raise RowValueError(f"{name} must be an integer, got {value!r}")
    out = int(value)
    if not lo <= out <= hi:
        raise RowValueError(f"{name} must be an integer in [{lo}, {hi}], got {out}")
    return out


def as_float(value: Any, name: str) -> float:
    """A finite float from an int or float; strings, bools, NaN, inf refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RowValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise RowValueError(f"{name} must be a finite number, got {value!r}")
    return out


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1)


def coerce(value: Any, tp: Any, name: str) -> Any:
    """`value` as the type hint `tp` says (Optional, bool, int, float, str, Literal,
    Sequence[int|str|float]); a type it does not know passes the value through."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return coerce(value, rest[0], name)
        return value
    if value is None:
        raise RowValueError(f"{name} must not be null")
    if origin is typing.Literal:
        if not isinstance(value, str) or value not in args:
            raise RowValueError(f"{name} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise RowValueError(f"{name} must be true or false, got {value!r}")
        return value
    if tp is int:
        return as_int(value, name)
    if tp is float:
        return as_float(value, name)
    if tp is str:
        if not isinstance(value, str):
            raise RowValueError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
        return value
    if origin in (list, tuple, collections.abc.Sequence) and args:
        item = args[0]
        if item is str and isinstance(value, str):
            return [value]  # a lone stop string
        if not _is_list(value):
            raise RowValueError(f"{name} must be a list, got {value!r} ({type(value).__name__})")
        return [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(list(value))]
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_sampling(override: Any, base: SamplingParams, column: str = "sampling_params") -> SamplingParams:
    """`base` with a row's overrides applied: every non-null entry (vLLM's names accepted)
    coerced to its field's type, unknown keys named, the result validated. Raises
    RowValueError("bad <column>: <field> …")."""
    if override is None or (isinstance(override, Mapping) and not override):
        return base
    if not isinstance(override, Mapping):
        raise RowValueError(f"bad {column}: must be a struct (a dict of sampling parameters), "
                            f"got {override!r:.80} ({type(override).__name__})")
    hints = _hints(SamplingParams)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    given: Dict[str, Any] = {}
    try:
        for key, value in override.items():
            if value is None:
                continue  # an Arrow struct gives every row every key
            name = SamplingParams.ALIASES.get(key, key)
            given[key] = coerce(value, hints[name], key) if name in known else value
        params = SamplingParams.from_dict(given, base)  # names unknown keys
        bad = params.validate()
    except RowValueError as e:
        raise RowValueError(f"bad {column}: {e}") from None
    except Exception as e:  # noqa: BLE001 - anything else about this row's value is its error too
        raise RowValueError(f"bad {column}: {e}") from None
    if bad:
        raise RowValueError(f"bad {column}: {bad}")
    return params


def parse_seed(value: Any, column: Optional[str]) -> Optional[int]:
    """A row's seed-column value as an int (None stays None)."""
    if value is None:
        return None
    try:
        return as_int(value, "seed")
    except RowValueError as e:
        raise RowValueError(f"bad seed column {column!r}: {e}") from None


def parse_token_ids(value: Any, column: str, vocab_size: Optional[int] = None) -> Optional[List[int]]:
    """A row's pre-tokenized prompt as a list of ints in [0, vocab_size) (None stays None):
    integral floats accepted, 7.9 / NaN / inf / strings / nested lists refused, never
    truncated; an id past the vocabulary (or int64) is "outside the vocabulary"."""
    if value is None:
        return None
    if not _is_list(value):
        raise RowValueError(f"{column!r} must be a list of token ids, got {value!r:.80} ({type(value).__name__})")
    if not len(value):
        raise RowValueError(f"empty prompt ({column!r} is an empty list)")
    hi = (vocab_size - 1) if vocab_size else INT64[1]
    out = []
    for i, t in enumerate(list(value)):
        if isinstance(t, numbers.Integral) and not isinstance(t, bool) and not 0 <= int(t) <= hi:
            bound = f"[0, {vocab_size})" if vocab_size else "(int64)"
            raise RowValueError(f"{column!r}: token id {int(t)} outside the vocabulary {bound}")
        try:
            out.append(as_int(t, f"{column}[{i}]", 0, hi))
        except RowValueError as e:
            raise RowValueError(f"{column!r} is not a list of token ids: {e}") from None
    return out


def parse_messages(value: Any, column: str) -> List[Dict[str, Any]]:
    """A row's chat turns as a non-empty list of dicts whose `role` is a non-empty string
    and whose `content` is a string; other keys pass through. A null or missing content
    is refused: a template renders it as an empty turn, a prompt the user never wrote."""
    if not _is_list(value):
        raise RowValueError(f"{column!r} must be a list of {{role, content}} turns, got {value!r:.80} "
                            f"({type(value).__name__})")
    turns = list(value)
    if not turns:
        raise RowValueError(f"{column!r} is empty")
    out = []
    for i, m in enumerate(turns):
        if not isinstance(m, Mapping):
            raise RowValueError(f"{column}[{i}] must be a {{role, content}} struct, got {m!r:.80}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RowValueError(f"{column}[{i}].role must be a non-empty string, got {role!r:.80}")
        if content is None:
            raise RowValueError(f"{column}[{i}].content is null (a {role} turn without text)")
        if not isinstance(content, str):
            raise RowValueError(f"{column}[{i}].content must be a string, got {content!r:.80}")
        out.append({k: v for k, v in dict(m).items() if v is not None})
    return out


def check_model(value: Any, column: str, served: Collection[str], serving: str) -> None:
    """A row's `column` value naming the model or LoRA adapter it is for (ray.data.llm's
    per-row `model`, vLLM's request `model`): null, or a name of what this run serves
    (`served`; `serving` says it in words), passes; any other name is refused, since a run
    serves one model and loads no adapter per row: generating it would silently answer with
    another model than the one asked for."""
    if value is None:
        return
    if not isinstance(value, str):
        raise RowValueError(f"{column!r} must be a model name, got {value!r:.80} ({type(value).__name__})")
    if value not in served and value.rstrip("/") not in served:
        raise RowValueError(f"the row asks for model {value!r} (its {column!r} column), but this run serves "
                            f"{serving}: one model per run, no per-row model or LoRA adapter; run those rows "
                            f"with that model (or rename the column if it means something else)")


def row_error(e: BaseException, what: str) -> str:
    """The error text of a row whose stage step raised: the boundary's message as it is,
    anything else with its type, so a stage never fails the batch for one row."""
    return str(e) if isinstance(e, RowValueError) else f"{what}: {type(e).__name__}: {e}"


__all__ = ["RowValueError", "as_int", "as_float", "coerce", "parse_sampling", "parse_seed", "parse_token_ids",
           "parse_messages", "check_model", "row_error"]
