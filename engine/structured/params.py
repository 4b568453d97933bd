"""A row's `structured_outputs` (vLLM's StructuredOutputsParams names) read into one
Constraint: exactly one of `regex`, `choice` (a list of strings), `json` (a JSON schema,
a dict or its text) or `json_object`; `grammar` (a context-free grammar) is refused until
it is supported. Torch-free: SamplingParams.validate and the preflight read it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .regular import MAX_GROUP_DEPTH, group_depth, refusal

KINDS = ("regex", "choice", "json", "json_object")
REFUSED = {"grammar": "a context-free grammar is not supported yet (regular languages only: regex, choice, json, "
                      "json_object)",
           "structural_tag": "structural_tag is not supported (regex, choice, json, json_object are)"}
# vLLM's keys that change nothing here when left at their defaults
IGNORED_WHEN_DEFAULT = {"disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
                        "whitespace_pattern": None, "backend": None}


@dataclass(frozen=True)
class Constraint:
    """One regular language over the answer's text: `kind` and its canonical `spec`
    (the regex; the choices as a JSON list; the schema as sorted JSON). Equal constraints
    compare (and cache) equal."""

    kind: str
    spec: str

    def regex(self) -> str:
        """The language as a regular expression (a JSON schema's through outlines-core)."""
        if self.kind == "regex":
            return self.spec
        if self.kind == "choice":
            return "(" + "|".join(re.escape(c) for c in json.loads(self.spec)) + ")"
        from outlines_core.json_schema import build_regex_from_schema

        return build_regex_from_schema(self.spec if self.kind == "json" else '{"type": "object"}')

    def describe(self) -> str:
        return f"{self.kind} {self.spec[:80]!r}"


def parse(value: Any) -> Optional[Constraint]:
    """`value` (a dict, or its JSON text) as a Constraint; None when unset. A ValueError
    names what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs must be an object (regex, choice, json or json_object), "
                             f"got text that is not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r:.80}")
    given = {k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)}
    for key, why in REFUSED.items():
        if key in given:
            raise ValueError(f"structured_outputs.{key}: {why}")
    for key, default in IGNORED_WHEN_DEFAULT.items():
        if key in given and given.pop(key) != default:
            raise ValueError(f"structured_outputs.{key} is not supported (leave it unset)")
    unknown = sorted(k for k in given if k not in KINDS)
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {unknown}; known: {', '.join(KINDS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                         f"{sorted(given) or 'none'}")
    kind, spec = next(iter(given.items()))
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {spec!r:.80}")
        if group_depth(spec) > MAX_GROUP_DEPTH:
            raise ValueError(f"structured_outputs.regex {spec!r:.80}: its groups are nested too deeply to parse "
                             f"(more than {MAX_GROUP_DEPTH} levels)")
        try:
            re.compile(spec)
        except re.error as e:
            raise ValueError(f"structured_outputs.regex {spec!r:.80} is not a regular expression ({e})") from None
        why = refusal(spec)
        if why:
            raise ValueError(f"structured_outputs.regex {spec!r:.80}: {why}")
        return Constraint("regex", spec)
    if kind == "choice":
        items = list(spec) if isinstance(spec, (list, tuple)) or hasattr(spec, "tolist") else None
        if not items or not all(isinstance(c, str) and c for c in items):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {spec!r:.80}")
        return Constraint("choice", json.dumps(list(items)))
    if kind == "json":
        try:
            return json_constraint(spec)
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply to read") from None
    if spec is not True:
        raise ValueError(f"structured_outputs.json_object must be true, got {spec!r:.80}")
    return Constraint("json_object", "true")


def json_constraint(spec: Any) -> Constraint:
    schema = spec
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not JSON ({e})") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {schema!r:.80}")
    pattern_refusal(schema)
    return Constraint("json", json.dumps(bounded_integers(schema), sort_keys=True))


def pattern_refusal(schema: Any) -> None:
    """A ValueError naming a schema's `pattern` that no DFA compiles (regular.refusal)."""
    if isinstance(schema, list):
        for x in schema:
            pattern_refusal(x)
    elif isinstance(schema, Mapping):
        for k, v in schema.items():
            if k == "pattern" and isinstance(v, str):
                try:
                    why = refusal(v)
                except ValueError as e:
                    why = str(e)
                if why:
                    raise ValueError(f"structured_outputs.json: pattern {v!r:.80}: {why}")
            else:
                pattern_refusal(v)


ENUM_MAX = 1000  # an integer's bounds become an enum of at most this many values


def bounded_integers(schema: Any) -> Any:
    """`schema` with every integer's minimum / maximum as the enum of its values:
    outlines-core's JSON schema regex ignores integer bounds, an enum it enforces. Bounds
    it cannot enforce so (one-sided, exclusive, wider than ENUM_MAX values, on numbers)
    are refused rather than ignored."""
    if isinstance(schema, list):
        return [bounded_integers(x) for x in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: bounded_integers(v) for k, v in schema.items()}
    keys = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"} & set(out)
    if keys and out.get("type") == "integer" and keys <= {"minimum", "maximum"} and len(keys) == 2:
        lo, hi = out.pop("minimum"), out.pop("maximum")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= hi - lo < ENUM_MAX):
            raise ValueError(f"structured_outputs.json: integer bounds [{lo!r}, {hi!r}] are enforced for at most "
                             f"{ENUM_MAX} integer values")
        out.pop("type")
        out["enum"] = list(range(lo, hi + 1))
    elif keys and out.get("type") in ("integer", "number"):
        raise ValueError(f"structured_outputs.json: {', '.join(sorted(keys))} on a {out['type']} is not enforced "
                         "(integers: give both minimum and maximum)")
    return out


def from_response_format(value: Any) -> Optional[dict]:
    """OpenAI's `response_format` as structured_outputs: {"type": "json_schema",
    "json_schema": {"schema": ...}} -> json, {"type": "json_object"} -> json_object,
    {"type": "text"} -> None. A ValueError names anything else."""
    if not isinstance(value, Mapping):
        raise ValueError(f"response_format must be an object, got {value!r:.80}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, Mapping) or not isinstance(js.get("schema"), Mapping):
            raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
        return {"json": json.dumps(js["schema"], sort_keys=True)}
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
