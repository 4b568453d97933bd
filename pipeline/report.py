"""report.html: one self-contained static page per run, beside summary.json.

Drawn from the summary alone (counts, latency, blocks and steps to finish, tokens/s over
time, the engines' own stats), so it costs the driver nothing per row. The plots are SVG
written here rather than with matplotlib: a few bar charts do not justify a plotting
library (and its fonts, image backends and a few tens of MB) as a run-time dependency of
every driver, and inline SVG keeps the page a single file that fetches nothing.
"""
from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from common.storage import StorageOptions, join
from .summary import bucket_seconds, latency_bucket
from .writer import Output, _json_default, _output, atomic_write_bytes

REPORT_FILE = "report.html"


@dataclass
class Chart:
    """A bar chart (or a line, `line=True`) of `values` over `labels`, as inline SVG."""

    title: str
    labels: Sequence[str]
    values: Sequence[float]
    x_label: str
    y_label: str
    line: bool = False
    width: int = 620
    height: int = 240

    def svg(self) -> str:
        if not self.values:
            return f'<p class="empty">{html.escape(self.title)}: no data</p>'
        left, right, top, bottom = 60, 12, 28, 44
        w, h = self.width - left - right, self.height - top - bottom
        vmax, grid = nice_axis(max(self.values))
        n = len(self.values)
        step = w / n
        y = lambda v: top + h - h * v / vmax  # noqa: E731
        parts = [f'<svg class="plot" role="img" xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                 f'height="{self.height}" viewBox="0 0 {self.width} {self.height}">',
                 f'<title>{html.escape(self.title)}</title>',
                 f'<text x="{left}" y="16" class="t">{html.escape(self.title)}</text>']
        for i in range(grid + 1):  # horizontal grid and y ticks
            v = vmax * i / grid
            parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="g"/>'
                         f'<text x="{left - 4}" y="{y(v) + 4:.1f}" class="yt">{fmt(v)}</text>')
        if self.line:
            pts = " ".join(f"{left + step * (i + 0.5):.1f},{y(v):.1f}" for i, v in enumerate(self.values))
            parts.append(f'<polyline points="{pts}" class="l"/>')
        for i, (lab, v) in enumerate(zip(self.labels, self.values)):
            x = left + step * i
            tip = f"<title>{html.escape(str(lab))}: {fmt(v)}</title>"
            if self.line:
                parts.append(f'<circle cx="{x + step / 2:.1f}" cy="{y(v):.1f}" r="2.5" class="p">{tip}</circle>')
            else:
                parts.append(f'<rect x="{x + step * 0.1:.1f}" y="{y(v):.1f}" width="{max(step * 0.8, 1):.1f}" '
                             f'height="{top + h - y(v):.1f}" class="b">{tip}</rect>')
            if i % max(1, math.ceil(n / 12)) == 0:  # at most ~12 x labels
                parts.append(f'<text x="{x + step / 2:.1f}" y="{top + h + 14}" class="xt">{html.escape(str(lab))}'
                             '</text>')
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{top + h}" y2="{top + h}" class="a"/>'
                     f'<text x="{left + w / 2}" y="{self.height - 6}" class="xl">{html.escape(self.x_label)}</text>'
                     f'<text x="14" y="{top + h / 2}" class="yl" transform="rotate(-90 14 {top + h / 2})">'
                     f'{html.escape(self.y_label)}</text></svg>')
        return "".join(parts)


# an axis' top as mantissa x 10^k, and the number of grid steps that keeps its ticks round
AXIS_STEPS = {1: 5, 1.2: 4, 1.5: 3, 2: 4, 2.5: 5, 3: 3, 4: 4, 5: 5, 6: 3, 8: 4, 10: 5}


def nice_axis(v: float) -> "tuple[float, int]":
    """(top, grid steps) of a y axis reaching v: the smallest round top at or above it."""
    if v <= 0:
        return 1.0, 5
    p = 10 ** math.floor(math.log10(v))
    m = next(m for m in AXIS_STEPS if m * p >= v * (1 - 1e-9))
    return m * p, AXIS_STEPS[m]


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 0.01 or abs(v) >= 1e5):
            return f"{v:.3g}"
        return f"{v:,.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v):,}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[Sequence[Any]], head: Optional[Sequence[str]] = None) -> str:
    cells = lambda tag, r: "".join(f"<{tag}>{html.escape(fmt(c))}</{tag}>" for c in r)  # noqa: E731
    return ("<table>" + (f"<tr>{cells('th', head)}</tr>" if head else "")
            + "".join(f"<tr>{cells('td', r)}</tr>" for r in rows) + "</table>")


def contiguous(hist: Dict[str, int], index: Callable[[str], int] = int,
               label: Callable[[int], str] = str) -> Dict[str, int]:
    """A histogram {label: count} with the empty bins between its first and last put back;
    `index` maps a label to its bin number, `label` a bin number to its label."""
    counts = {index(k): n for k, n in hist.items()}
    return {label(i): counts.get(i, 0) for i in range(min(counts), max(counts) + 1)} if counts else {}


def charts(summary: Dict[str, Any]) -> List[Chart]:
    """The plots of a run, in page order."""
    lat = contiguous(summary.get("latency_histogram") or {}, lambda k: latency_bucket(float(k)),
                     lambda i: f"{bucket_seconds(i):.3g}")
    blocks = contiguous(summary.get("blocks_to_finish") or {})
    steps = contiguous(summary.get("steps_to_finish") or {})
    tot = summary.get("tokens_over_time") or {}
    engines = summary.get("engines") or {}
    rates = tot.get("tokens_per_s") or []
    return [
        Chart("Request latency (rows the engines ran)", list(lat), list(lat.values()),
              "latency, s (log-spaced buckets)", "rows"),
        Chart("Blocks to finish", list(blocks), list(blocks.values()), "blocks", "rows"),
        Chart("Denoising steps per request", list(steps), list(steps.values()), "steps", "rows"),
        Chart("Generated tokens / s over time", [f"{i * tot.get('bin_s', 1)}" for i in range(len(rates))], rates,
              f"seconds since the first row finished (bins of {tot.get('bin_s', 1)} s)", "tokens / s", line=True),
        Chart("Busy time per engine", [f"engine {r}" for r in engines],
              [e.get("busy_s") or 0.0 for e in engines.values()], "engine rank", "seconds in step()"),
        Chart("Padding per engine", [f"engine {r}" for r in engines],
              [e.get("padding_fraction") or 0.0 for e in engines.values()], "engine rank", "padded / computed cells"),
    ]


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1320px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}.plots{display:flex;flex-wrap:wrap;gap:12px}.empty{color:#888}
svg.plot{border:1px solid #eee;background:#fff}.t{font-weight:600;font-size:13px}
.b{fill:#4878a8}.l{fill:none;stroke:#4878a8;stroke-width:2}.p{fill:#4878a8}.g{stroke:#eee}.a{stroke:#888}
.yt{font-size:10px;text-anchor:end}.xt{font-size:10px;text-anchor:middle}.xl,.yl{font-size:11px;text-anchor:middle}
pre{background:#f8f8f8;padding:8px;overflow:auto;font-size:12px}
"""


def budget_text(engine: Dict[str, Any]) -> Optional[str]:
    """An engine's token budget and where it came from (engine.budget.Budget): "12345
    (planned: gpu_memory_utilization 0.9 of 79.1 GiB, 71.0 GiB free)", "65536 (default)"."""
    b = engine.get("budget") or {}
    n = b.get("token_budget", engine.get("token_budget"))
    if n is None:
        return None
    if b.get("source") == "planned":
        return (f"{n} (planned: gpu_memory_utilization {b['gpu_memory_utilization']:g} of "
                f"{b['total_bytes'] / 2**30:.1f} GiB, {b['free_bytes'] / 2**30:.1f} GiB free)")
    source = {"token_budget": " (given)", "default": " (default)"}.get(b.get("source"), "")
    return f"{n}{source}"


def render_report(summary: Dict[str, Any]) -> str:
    """The report page of a run's summary (summarize's dict plus run_offline's fields)."""
    s = summary
    lat = s.get("latency_s") or {}
    engines = s.get("engines") or {}
    computed = sum(e.get("computed_cells") or 0 for e in engines.values())
    padded = sum(e.get("padded_cells") or 0 for e in engines.values())
    rows_by_engine = s.get("engine_rows") or {}
    title = f"blockray run {s.get('run_id') or ''}"
    counts = [
        ("status", s.get("status")), ("model", s.get("model")), ("output", s.get("output")),
        ("rows", s.get("rows")), ("input rows", s.get("input_rows")), ("errors", s.get("errors")),
        ("error fraction", s.get("error_fraction")), ("rows skipped (resumed)", s.get("rows_skipped")),
        ("generated tokens", s.get("generated_tokens")), ("tokens / s (whole job)", s.get("tokens_per_s")),
        ("tokens / s (generation phase)", s.get("generation_tokens_per_s")), ("wall time, s", s.get("wall_s")),
        ("generation phase, s", s.get("generation_s")), ("engines", s.get("num_engines")),
        ("devices per engine (tensor_parallel_size)", s.get("tensor_parallel_size")),
        ("exact match", s.get("exact_match")), ("finish reasons", json.dumps(s.get("finish_reasons") or {})),
    ]
    engine_rows = [(r, rows_by_engine.get(r), budget_text(e), e.get("busy_s"), e.get("forward_s"), e.get("steps"),
                    e.get("generated_tokens"), e.get("padding_fraction")) for r, e in engines.items()]
    errors = [(e["count"], e["error"]) for e in s.get("top_errors") or []]
    record = {k: s.get(k) for k in ("config", "model_config_sha256", "blockray_version", "git_commit", "input")}
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>written {html.escape(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}; the numbers are summary.json's.</p>",
        "<h2>Counts</h2>", table(counts),
        "<h2>Latency</h2>", table([[lat.get(q) for q in ("p50", "p90", "p99")] + [s.get("mean_latency_s")]],
                                  ["p50, s", "p90, s", "p99, s", "mean, s"]),
        '<div class="plots">', *(c.svg() for c in charts(s)), "</div>",
        "<h2>Engines</h2>",
        table(engine_rows, ["rank", "rows", "token budget", "busy s", "forward s", "steps", "generated tokens",
                            "padding"])
        if engine_rows else '<p class="empty">no engine stats</p>',
        "<h2>Padding and retries</h2>",
        table([("padded / computed cells, all engines", padded / computed if computed else None),
               ("rows run again after an engine was lost", s.get("engine_retried_rows"))]),
        "<h2>Top errors</h2>", table(errors, ["rows", "error"]) if errors else "<p>none</p>",
        "<h2>Config</h2>",
        f"<pre>{html.escape(json.dumps(record, indent=2, sort_keys=True, default=_json_default))}</pre>",
    ]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def write_report(output: Output, summary: Dict[str, Any], storage: Optional[StorageOptions] = None) -> str:
    """Write report.html into the output folder; returns its URL."""
    fs, path = _output(output, storage)
    target = join(path, REPORT_FILE)
    atomic_write_bytes(fs, target, render_report(summary).encode())
    return fs.unstrip_protocol(target)


__all__ = ["REPORT_FILE", "Chart", "render_report", "write_report"]
