"""Run summaries computed from the output blocks as they are written.

Why per block: the writer computes these counts on each block it writes, so the
driver sums small dicts at the end instead of reading every output file back.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
from collections import Counter
from typing import Any, Dict, Iterable, List, Optional

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


# Per-row latencies are summed up as a histogram over log-spaced buckets (20 per decade,
# so a percentile read from it is within 6% of the exact one): blocks merge by adding
# counts, and the driver never holds one number per row.
LATENCY_BUCKETS_PER_DECADE = 20
LATENCY_MIN_S = 1e-4


def latency_bucket(seconds: float) -> int:
    """The histogram bucket of a latency: 0 for anything up to LATENCY_MIN_S."""
    if seconds <= LATENCY_MIN_S:
        return 0
    return 1 + int(math.floor(math.log10(seconds / LATENCY_MIN_S) * LATENCY_BUCKETS_PER_DECADE))


def bucket_seconds(bucket: int) -> float:
    """The geometric middle of a bucket (its representative latency)."""
    if bucket <= 0:
        return LATENCY_MIN_S
    return LATENCY_MIN_S * 10 ** ((bucket - 0.5) / LATENCY_BUCKETS_PER_DECADE)


def percentiles(hist: Dict[int, int], qs: Iterable[float] = (50, 90, 99)) -> Dict[str, Optional[float]]:
    """{"p50": s, ...} of a latency histogram ({bucket: count}); None when it is empty."""
    total = sum(hist.values())
    out: Dict[str, Optional[float]] = {}
    for q in qs:
        if not total:
            out[f"p{q:g}"] = None
            continue
        rank, seen = math.ceil(total * q / 100), 0
        for b in sorted(hist):
            seen += hist[b]
            if seen >= rank:
                out[f"p{q:g}"] = round(bucket_seconds(b), 6)
                break
    return out


def _min_max(values: List[Optional[float]]) -> "tuple[Optional[float], Optional[float]]":
    vals = [v for v in values if v is not None]
    return (min(vals), max(vals)) if vals else (None, None)


def _sum_by(pairs: Iterable["tuple[Any, int]"]) -> Counter:
    out: Counter = Counter()
    for k, n in pairs:
        out[k] += n
    return out


# tokens/s over time is kept in at most this many equal bins of the generation phase
TIME_BINS = 60


def tokens_over_time(by_second: Dict[int, int]) -> Optional[Dict[str, Any]]:
    """{"start": Unix s, "bin_s": width, "tokens_per_s": [...]} over at most TIME_BINS bins
    of whole seconds, from {second: generated tokens}; None when nothing was generated."""
    if not by_second:
        return None
    start, end = min(by_second), max(by_second) + 1
    width = max(1, math.ceil((end - start) / TIME_BINS))
    bins = [0] * math.ceil((end - start) / width)
    for sec, n in by_second.items():
        bins[(sec - start) // width] += n
    return {"start": start, "bin_s": width, "tokens_per_s": [round(n / width, 3) for n in bins]}


def block_stats(table: pa.Table, reference_column: Optional[str] = "reference") -> Dict[str, Any]:
    """Counts of one output block (see `summarize` for their meaning)."""
    errors = table.column("error").to_pylist()
    kinds = Counter(e[:ERROR_TEXT_CHARS] for e in errors if e)
    latencies = table.column("latency_s").to_pylist()
    names = table.column_names
    blocks = table.column("num_blocks").to_pylist() if "num_blocks" in names else [None] * table.num_rows
    steps = table.column("num_steps").to_pylist() if "num_steps" in names else [None] * table.num_rows
    tokens = table.column("num_generated_tokens").to_pylist()
    ranks = table.column("engine_rank").to_pylist() if "engine_rank" in names else [None] * table.num_rows
    ran = [e is None for e in errors]
    finished = table.column("finished_at").to_pylist() if "finished_at" in names else []
    starts = [f - (lat or 0.0) for f, lat, ok in zip(finished, latencies, ran) if f is not None and ok]
    out: Dict[str, Any] = {
        "rows": table.num_rows,
        "errors": sum(1 for e in errors if e),
        "error_counts": dict(kinds.most_common(ERROR_KINDS_PER_BLOCK)),
        "generated_tokens": int(pc.sum(table.column("num_generated_tokens")).as_py() or 0),
        "latency_s_sum": float(pc.sum(table.column("latency_s")).as_py() or 0.0),
        "finish_reasons": dict(Counter(table.column("finish_reason").to_pylist())),
        # rows the engine ran (not error rows): their latency and blocks to finish
        "latency_hist": dict(Counter(latency_bucket(lat or 0.0) for lat, ok in zip(latencies, ran) if ok)),
        "blocks_hist": dict(Counter(int(b) for b, ok in zip(blocks, ran) if ok and b is not None)),
        "steps_hist": dict(Counter(int(n) for n, ok in zip(steps, ran) if ok and n is not None)),
        # generated tokens by the Unix second the engine returned their row (tokens/s over time)
        "tokens_by_second": dict(_sum_by((int(f), n or 0) for f, n, ok in zip(finished, tokens, ran)
                                         if ok and f is not None)),
        "engine_rows": dict(Counter(int(r) for r in ranks if r is not None and r >= 0)),
        "first_start": _min_max(starts)[0],
        "last_finish": _min_max([f for f, ok in zip(finished, ran) if ok])[1],
        "input_rows": (sum(1 for k in table.column("sample_index").to_pylist() if not k)
                       if "sample_index" in names else table.num_rows),
        # rows whose batch was sent to another engine because the engine running it was lost
        "engine_retried_rows": (sum(1 for k in table.column("engine_retries").to_pylist() if k)
                                if "engine_retries" in names else 0),
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
    rows = errors = tokens = scored = matches = files = input_rows = retried = 0
    latency = 0.0
    reasons: Counter = Counter()
    kinds: Counter = Counter()
    lat_hist: Counter = Counter()
    blocks_hist: Counter = Counter()
    steps_hist: Counter = Counter()
    by_second: Counter = Counter()
    engine_rows: Counter = Counter()
    starts: List[Optional[float]] = []
    ends: List[Optional[float]] = []
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
        lat_hist.update({int(k): v for k, v in s.get("latency_hist", {}).items()})
        blocks_hist.update({int(k): v for k, v in s.get("blocks_hist", {}).items()})
        steps_hist.update({int(k): v for k, v in s.get("steps_hist", {}).items()})
        by_second.update({int(k): v for k, v in s.get("tokens_by_second", {}).items()})
        engine_rows.update({int(k): v for k, v in s.get("engine_rows", {}).items()})
        starts.append(s.get("first_start"))
        ends.append(s.get("last_finish"))
        input_rows += s.get("input_rows", s["rows"])
        retried += s.get("engine_retried_rows", 0)
        if "scored" in s:
            have_refs = True
            scored += s["scored"]
            matches += s["exact_matches"]
    first, last = _min_max(starts)[0], _min_max(ends)[1]
    gen_s = (last - first) if first is not None and last is not None and last > first else None
    return {
        "rows": rows,
        "input_rows": input_rows,  # rows with sample_index 0: rows below counts each of n samples
        "errors": errors,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,  # whole job: start-up, reading, writing
        # generation phase: from the first row an engine took to the last row it returned
        "generation_s": gen_s,
        "generation_tokens_per_s": tokens / gen_s if gen_s else None,
        "wall_s": wall_s,
        "mean_latency_s": latency / rows if rows else 0.0,
        # per-row latency (arrival at the engine to its result) of the rows the engine ran
        "latency_s": percentiles(lat_hist),
        # their latency histogram: {bucket's middle latency in s: rows}
        "latency_histogram": {f"{bucket_seconds(k):.6g}": lat_hist[k] for k in sorted(lat_hist)},
        # rows the engine ran, by the number of blocks they took (a dLLM's "length")
        "blocks_to_finish": {str(k): blocks_hist[k] for k in sorted(blocks_hist)},
        # ... and by the denoising steps they took (the engine's per-request count, num_steps)
        "steps_to_finish": {str(k): steps_hist[k] for k in sorted(steps_hist)},
        "tokens_over_time": tokens_over_time(by_second),
        "engine_rows": {str(k): engine_rows[k] for k in sorted(engine_rows)},  # rows by engine_rank
        "finish_reasons": dict(sorted(reasons.items())),
        "error_fraction": errors / rows if rows else 0.0,
        # rows run again on another engine because the engine running them was lost
        "engine_retried_rows": retried,
        # most frequent distinct messages (counts per block's most frequent: a lower bound)
        "top_errors": [{"error": e, "count": n} for e, n in kinds.most_common(TOP_ERRORS)],
        "exact_match": (matches / scored if scored else None) if have_refs else None,
        "exact_matches": matches if have_refs else None,
        "scored_rows": scored if have_refs else None,
        "files": files,
        **extra,
    }


def _git_commit() -> Optional[str]:
    """The checkout's commit when blockray runs from a git clone (None from a wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _version() -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("blockray")
    except PackageNotFoundError:
        return None


def run_record(config: Any, checkpoint: Any) -> Dict[str, Any]:
    """What a run was, so that its summary.json says how to repeat it: every field of the
    processor config (engine and sampling included), the model, a hash of its config.json
    and the fingerprint of its files (engine.checkpoint), blockray's version and git
    commit when known."""
    return {
        "config": dataclasses.asdict(config),
        "model": config.model,
        "model_config_sha256": checkpoint.config_sha256,
        "model_fingerprint": checkpoint.fingerprint,
        "blockray_version": _version(),
        "git_commit": _git_commit(),
    }


def format_summary(summary: Dict[str, Any]) -> str:
    """The one-line-per-field text the job prints at the end."""
    em = summary.get("exact_match")
    lines = [
        f"rows               {summary['rows']}",
        f"errors             {summary['errors']}",
        *[f"  {e['count']:>6} x {e['error']}" for e in summary.get("top_errors") or []],
        f"generated tokens   {summary['generated_tokens']}",
        f"tokens/s           {summary['tokens_per_s']:.1f}" + (
            f" (generation phase {summary['generation_tokens_per_s']:.1f})"
            if summary.get("generation_tokens_per_s") else ""),
        f"wall time          {summary['wall_s']:.2f} s",
        *(["latency p50/90/99  " + " / ".join(f"{summary['latency_s'][q]:.2f}" for q in ("p50", "p90", "p99"))
           + " s"] if (summary.get("latency_s") or {}).get("p50") is not None else []),
        f"finish reasons     {summary['finish_reasons']}",
        *(["stop token ids     " + ", ".join(f"{t} ({src})" for t, src in summary["stop_token_ids"].items())]
          if summary.get("stop_token_ids") else []),
    ]
    if em is not None:
        lines.append(f"exact match        {em:.3f} ({summary['exact_matches']}/{summary['scored_rows']})")
    budgets = {r: e["token_budget"] for r, e in (summary.get("engines") or {}).items() if e.get("token_budget")}
    if budgets:  # per engine: planned on a GPU from its free memory unless given (engine.budget)
        lines.append("token budget       " + ", ".join(f"engine {r}: {n}" for r, n in budgets.items()))
    if summary.get("duplicate_ids"):
        d = summary["duplicate_ids"]
        lines.append(f"duplicate ids      {d['count']} ids ({d['extra_rows']} extra rows), e.g. {d['first']}")
    if summary.get("ids_note"):
        lines.append(f"ids                {summary['ids_note']}")
    if summary.get("rows_skipped"):
        lines.append(f"resumed            {summary['rows_skipped']} rows already in the output skipped")
    if summary.get("output"):
        lines.append(f"output             {summary['output']}")
    if summary.get("report_file"):
        lines.append(f"report             {summary['report_file']}")
    return "\n".join(lines)
