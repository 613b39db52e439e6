"""The dashboard's charts: small inline SVG drawn on the server (no script, no library)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = ["count_chart", "duration", "latency_chart", "series_chart", "sparkline", "time_chart"]


def sparkline(values: list[float], width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of ``values`` (oldest first), scaled to its maximum."""
    if len(values) < 2:
        return ""
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - v / top * (height - 4):.1f}" for i, v in enumerate(values))
    return (f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="requests per second, last {len(values)} samples"><polyline fill="none" '
            f'stroke="currentColor" stroke-width="1.5" points="{points}"/></svg>')


def duration(seconds: float | None) -> str:
    """``seconds`` for people: ``850 µs``, ``12.4 ms``, ``1.25 s``, ``3m05s``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60.0:
        return f"{seconds:.3g} s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def latency_chart(p50: Sequence[float | None], p99: Sequence[float | None], *, what: str, span: str,
                  width: int = 150, height: int = 32) -> str:
    """Two lines, p50 (solid) and p99 (dashed), one point per slot (oldest first), on one scale
    from zero to the highest p99 (written in the corner); a slot without a time breaks the lines."""
    if len(p50) < 2 or all(v is None for v in p99):
        return ""
    top = max(v for v in (*p50, *p99) if v is not None) or 1.0
    step = width / (len(p50) - 1)

    def lines(values: Sequence[float | None], css: str) -> str:
        return _lines(values, css, step, lambda v: height - 2 - v / top * (height - 10), dot=1.5)

    return (f'<svg class="latency" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{what} p50 and p99, {span}"><text x="0" y="7">'
            f'{duration(top)}</text>{lines(p99, "p99")}{lines(p50, "p50")}</svg>')


def _lines(values: Sequence[float | None], css: str, step: float, y: Callable[[float], float], *, dot: float) -> str:
    """One polyline per run of values (None breaks the line), a dot for a run of one point (a
    polyline of one point shows nothing)."""
    runs: list[list[str]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            runs.append([])
        else:
            runs[-1].append(f"{i * step:.1f},{y(v):.1f}")
    return "".join(f'<polyline class="{css}" points="{" ".join(r)}"/>' if len(r) > 1 else
                   f'<circle class="{css}" cx="{r[0].split(",")[0]}" cy="{r[0].split(",")[1]}" r="{dot}"/>'
                   for r in runs if r)


def series_chart(series: Sequence[tuple[str, Sequence[float | None]]], starts: Sequence[float], *, what: str,
                 label: Callable[[float], str], width: int = 900, height: int = 120) -> str:
    """Lines over time (one per ``(css class, values)``, a value per point, None a gap) on one scale
    from zero to the highest value (written top left), with the first, middle and last times below."""
    values = [v for _, points in series for v in points if v is not None]
    if len(starts) < 2 or not values:
        return f'<p class="note" data-testid="no-chart">No {what} stored for this span.</p>'
    top = max(values) or 1.0
    plot_h = height - 16
    step = width / (len(starts) - 1)

    def lines(points: Sequence[float | None], css: str) -> str:
        return _lines(points, css, step, lambda v: plot_h - 2 - v / top * (plot_h - 12), dot=2)

    ticks = "".join(f'<text x="{x:.0f}" y="{height - 2}" text-anchor="{anchor}">{_hhmm(starts[i])}</text>'
                    for i, x, anchor in ((0, 0, "start"), (len(starts) // 2, len(starts) // 2 * step, "middle"),
                                         (len(starts) - 1, width, "end")))
    return (f'<svg class="history" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{what}"><line class="axis" x1="0" y1="{plot_h}" x2="{width}" y2="{plot_h}"/>'
            f'<text x="0" y="9">{label(top)}</text>{"".join(lines(p, css) for css, p in series)}{ticks}</svg>')


def count_chart(points: Sequence[Any], step: int) -> str:
    """Requests per minute over time: done (solid) and enqueued (dashed), from history points."""
    return series_chart([("enqueued", [None if p.empty else p.enqueued / step for p in points]),
                         ("done", [None if p.empty else p.done / step for p in points])],
                        [p.start for p in points], what="requests per minute", label=lambda v: f"{v:,.0f}/min")


def time_chart(points: Sequence[Any], kind: str) -> str:
    """A wait or run time's p50 (solid) and p99 (dashed) over time, from history points."""
    return series_chart([("p99", [getattr(p, f"{kind}_p99") for p in points]),
                         ("p50", [getattr(p, f"{kind}_p50") for p in points])],
                        [p.start for p in points], what=f"{kind} p50 and p99", label=duration)


def _hhmm(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M")
