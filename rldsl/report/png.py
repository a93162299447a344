"""The report as one PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from rldsl.report.data import NESTED_PREFIX, ReportData

_COLUMNS = 2
_TITLE_INCHES = 0.3  # the figure's title and subtitle, above every panel


def write_png(data: ReportData, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve_rows = -(-(len(data.curves) + 1) // _COLUMNS)  # the curves and the lag histogram
    trace_rows = 3 if data.time_edges else 0  # stage busy, per-GPU strip, timeline
    heights = [1.0] * curve_rows + ([1.1, 0.25 + 0.18 * len(data.gpu_busy), 0.4 + 0.16 * len(data.timeline)]
                                    if trace_rows else [])
    height = 2.4 * sum(heights) + 1.0
    fig = plt.figure(figsize=(13, height))
    grid = fig.add_gridspec(len(heights), _COLUMNS, height_ratios=heights)
    fig.suptitle(f"{data.title}\n{data.subtitle}", fontsize=12, y=1 - 0.08 / height, va="top")
    panels = list(data.curves.items())
    for index, (name, series) in enumerate(panels):
        ax = fig.add_subplot(grid[index // _COLUMNS, index % _COLUMNS])
        ax.plot(series.x, series.y, marker="o" if len(series.x) < 30 else None, markersize=3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if "accuracy" in name:
            ax.set_ylim(0, 1)
    ax = fig.add_subplot(grid[len(panels) // _COLUMNS, len(panels) % _COLUMNS])
    lags = sorted(data.lag_histogram)
    ax.bar([str(lag) for lag in lags], [data.lag_histogram[lag] for lag in lags], color="tab:purple")
    ax.set_title("lag of trained samples (trainer version - generating version)", fontsize=10)
    ax.set_xlabel("lag", fontsize=8)
    if trace_rows:
        _trace_panels(fig, grid, curve_rows, data)
    fig.tight_layout(rect=(0, 0, 1, 1 - _TITLE_INCHES / height))  # the two-line title keeps its own band
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _trace_panels(fig, grid, row: int, data: ReportData) -> None:
    ax = fig.add_subplot(grid[row, :])
    for stage, series in data.stage_busy.items():
        ax.plot(series.x, series.y, label=stage)
    ax.set_ylim(0, 1.05)
    ax.set_title("busy share of each stage's actors over time (from trace.json)", fontsize=10)
    ax.set_xlabel("seconds since the first traced call", fontsize=8)
    ax.legend(fontsize=8, loc="upper right", ncols=min(6, len(data.stage_busy)))
    ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[row + 1, :])
    names = list(data.gpu_busy)
    ax.imshow([data.gpu_busy[n] for n in names], aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest",
              extent=(data.time_edges[0], data.time_edges[-1], len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    share = [sum(v) / len(v) for v in data.gpu_busy.values()]
    ax.set_title("GPU utilisation: share of each GPU's time some stage was active "
                 f"(mean {' '.join(f'{n} {s:.0%}' for n, s in zip(names, share))})", fontsize=10)
    ax = fig.add_subplot(grid[row + 2, :])
    import matplotlib

    colors = {}
    palette = [matplotlib.colormaps["tab20"](i) for i in range(20)]
    tracks = list(data.timeline)
    for index, track in enumerate(tracks):
        for start, duration, name in data.timeline[track]:
            color = colors.setdefault(name, palette[len(colors) % len(palette)])
            # data-plane calls sit inside a stage call: a thin bar along the bottom, the call stays visible
            bar = (index + 0.1, 0.3) if name.startswith(NESTED_PREFIX) else (index - 0.4, 0.8)
            ax.broken_barh([(start, duration)], bar, color=color)
    ax.set_yticks(range(len(tracks)), tracks, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(data.time_edges[0], data.time_edges[-1])
    ax.set_title("timeline: every stage call per actor (thin: its data-plane calls)", fontsize=10)
    ax.legend(handles=[_patch(c, n) for n, c in colors.items()], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.12), ncols=min(7, len(colors)), frameon=False)


def _patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)
