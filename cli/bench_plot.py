"""`precast bench --plot`: latency vs throughput, one labelled point per concurrency level (matplotlib, Agg).

matplotlib is optional (``pip install 'precast[bench]'``) and imported only here; the figure is drawn on an
Agg canvas of its own, so no pyplot state or GUI backend is touched.
"""

from __future__ import annotations

import os

from precast.errors import UsageError

__all__ = ["plot_report", "require_matplotlib"]


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'precast[bench]'") from None


def _curve(ax, xs, series, xlabel: str, ylabel: str, concurrency) -> None:
    """Lines through (x, y) per series in concurrency order; each level's points joined by a dotted vertical
    and labelled 'c=N' once, above its highest point. A log y axis when the values span more than 30x (an
    inter-token p50 of 0.1 ms under a p99 of 5 ms would be a flat line at 0)."""
    for label, ys, style in series:
        ax.plot(xs, ys, style, label=label, markersize=6, linewidth=1.6)
    for x, c, *ys in zip(xs, concurrency, *(ys for _, ys, _ in series)):
        ax.vlines(x, min(ys), max(ys), colors="0.55", linestyles=":", linewidth=1)
        ax.annotate(
            f"c={c}", (x, max(ys)), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=9
        )
    values = [y for _, ys, _ in series for y in ys]
    positive = [y for y in values if y > 0]
    top = max(values, default=0.0)
    if positive and top / min(positive) > 30:
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_ylim(min(positive) / 2, top * 2.5)
        ylabel += ", log scale"
    else:
        ax.set_ylim(bottom=0, top=top * 1.2 if top > 0 else 1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0, right=max(xs) * 1.18 if max(xs) > 0 else 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")


def plot_report(report, path: str | os.PathLike) -> None:
    """Write the report's curve: latency p50/p99 vs throughput (LLMs: TTFT and inter-token latency vs
    tokens/s, side by side)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    from precast.cli.commands_bench import title

    levels = [lv for lv in report.levels if lv.latency is not None]
    conc = [lv.concurrency for lv in levels]
    if report.kind == "llm":
        fig = Figure(figsize=(12, 5.2), dpi=110, layout="constrained")
        left, right = fig.subplots(1, 2)
        tps = [lv.tokens_per_s or 0.0 for lv in levels]
        xlabel = "throughput (output tokens/s, all requests)"
        _curve(
            left,
            tps,
            [
                ("TTFT p50", [lv.ttft.p50_ms for lv in levels], "o-"),
                ("TTFT p99", [lv.ttft.p99_ms for lv in levels], "s--"),
            ],
            xlabel,
            "time to first token (ms)",
            conc,
        )
        _curve(
            right,
            tps,
            [
                ("ITL p50", [lv.itl.p50_ms if lv.itl else 0.0 for lv in levels], "o-"),
                ("ITL p99", [lv.itl.p99_ms if lv.itl else 0.0 for lv in levels], "s--"),
            ],
            xlabel,
            "inter-token latency (ms)",
            conc,
        )
        s = report.llm
        sub = f"prompt {s.prompt_len} + {s.output_len} generated tokens per request; c = concurrent requests"
    else:
        fig = Figure(figsize=(8.5, 5.5), dpi=110, layout="constrained")
        ax = fig.subplots()
        batch = report.items_per_request
        unit = "inferences/s" if batch == 1 else f"requests/s, batch {batch}"
        _curve(
            ax,
            [lv.requests_per_s for lv in levels],
            [
                ("p50", [lv.latency.p50_ms for lv in levels], "o-"),
                ("p99", [lv.latency.p99_ms for lv in levels], "s--"),
            ],
            f"throughput ({unit})",
            "latency per request (ms)",
            conc,
        )
        dims = ", ".join(f"{k}={v}" for k, v in report.dims.items())
        sub = f"{dims}; c = concurrent clients" if dims else "c = concurrent clients"
    fig.suptitle(f"precast bench: {title(report)}\n{sub}", fontsize=10.5)
    fig.savefig(os.fspath(path))
