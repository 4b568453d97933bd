"""Run summaries computed from the output blocks as they are written.

Why per block: the writer computes these counts on each block it writes, so the
driver sums small dicts at the end instead of reading every output file back.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, Optional

import pyarrow as pa
import pyarrow.compute as pc


def normalize_answer(text: Optional[str]) -> str:
    """Exact match compares answers with surrounding whitespace removed."""
    return "" if text is None else text.strip()


# Distinct error messages kept per block and in the summary (most frequent first), and
# the length each is cut to: enough to tell what failed without a per-row report.
ERROR_KINDS_PER_BLOCK = 10
TOP_ERRORS = 5
ERROR_TEXT_CHARS = 300


def block_stats(table: pa.Table, reference_column: Optional[str] = "reference") -> Dict[str, Any]:
    """Counts of one output block (see `summarize` for their meaning)."""
    errors = table.column("error").to_pylist()
    kinds = Counter(e[:ERROR_TEXT_CHARS] for e in errors if e)
    out: Dict[str, Any] = {
        "rows": table.num_rows,
        "errors": sum(1 for e in errors if e),
        "error_counts": dict(kinds.most_common(ERROR_KINDS_PER_BLOCK)),
        "generated_tokens": int(pc.sum(table.column("num_generated_tokens")).as_py() or 0),
        "latency_s_sum": float(pc.sum(table.column("latency_s")).as_py() or 0.0),
        "finish_reasons": dict(Counter(table.column("finish_reason").to_pylist())),
    }
    if reference_column and reference_column in table.column_names:
        refs = table.column(reference_column).to_pylist()
        texts = table.column("generated_text").to_pylist()
        scored = [(r, t) for r, t in zip(refs, texts) if r is not None]
        out["scored"] = len(scored)
        out["exact_matches"] = sum(1 for r, t in scored if t is not None
                                   and normalize_answer(t) == normalize_answer(str(r)))
    return out


def summarize(block_stats_list: Iterable[Dict[str, Any]], wall_s: float, **extra: Any) -> Dict[str, Any]:
    """One summary: rows, errors, generated tokens, tokens/s over the wall time, and
    exact-match accuracy over rows that have a reference (None when none has)."""
    rows = errors = tokens = scored = matches = files = 0
    latency = 0.0
    reasons: Counter = Counter()
    kinds: Counter = Counter()
    have_refs = False
    for s in block_stats_list:
        if not s.get("rows"):
            continue
        files += 1
        rows += s["rows"]
        errors += s["errors"]
        tokens += s["generated_tokens"]
        latency += s["latency_s_sum"]
        reasons.update(s["finish_reasons"])
        kinds.update(s.get("error_counts", {}))
        if "scored" in s:
            have_refs = True
            scored += s["scored"]
            matches += s["exact_matches"]
    return {
        "rows": rows,
        "errors": errors,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "mean_latency_s": latency / rows if rows else 0.0,
        "finish_reasons": dict(sorted(reasons.items())),
        "error_fraction": errors / rows if rows else 0.0,
        # most frequent distinct messages (counts per block's most frequent: a lower bound)
        "top_errors": [{"error": e, "count": n} for e, n in kinds.most_common(TOP_ERRORS)],
        "exact_match": (matches / scored if scored else None) if have_refs else None,
        "exact_matches": matches if have_refs else None,
        "scored_rows": scored if have_refs else None,
        "files": files,
        **extra,
    }


def format_summary(summary: Dict[str, Any]) -> str:
    """The one-line-per-field text the job prints at the end."""
    em = summary.get("exact_match")
    lines = [
        f"rows               {summary['rows']}",
        f"errors             {summary['errors']}",
        *[f"  {e['count']:>6} x {e['error']}" for e in summary.get("top_errors") or []],
        f"generated tokens   {summary['generated_tokens']}",
        f"tokens/s           {summary['tokens_per_s']:.1f}",
        f"wall time          {summary['wall_s']:.2f} s",
        f"finish reasons     {summary['finish_reasons']}",
    ]
    if em is not None:
        lines.append(f"exact match        {em:.3f} ({summary['exact_matches']}/{summary['scored_rows']})")
    if summary.get("duplicate_ids"):
        d = summary["duplicate_ids"]
        lines.append(f"duplicate ids      {d['count']} ids ({d['extra_rows']} extra rows), e.g. {d['first']}")
    if summary.get("rows_skipped"):
        lines.append(f"resumed            {summary['rows_skipped']} rows already in the output skipped")
    if summary.get("output"):
        lines.append(f"output             {summary['output']}")
    return "\n".join(lines)
