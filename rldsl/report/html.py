"""The report as one self-contained HTML page: interactive Plotly charts with
plotly.js inlined, so it opens anywhere without a network.

Plotly, not Vega-Lite: its Python package ships the JavaScript it needs,
where Vega-Lite would have to be fetched or vendored separately.
"""

from __future__ import annotations

import html
from pathlib import Path

from rldsl.report.data import NESTED_PREFIX, ReportData

# The page marks itself rendered once every chart is drawn, or records the
# first script error, so a headless browser can tell (tests/test_report.py).
_WATCH = """<script>
window.addEventListener("error", function (e) { document.documentElement.dataset.error = String(e.message); });
</script>"""
_DONE = "document.documentElement.dataset.rendered = document.querySelectorAll('.main-svg').length;"


def write_html(data: ReportData, path: Path) -> Path:
    figures = _figures(data)
    # plotly.js once, inlined in the first chart; the last chart's script says the page is done
    charts = [figure.to_html(full_html=False, include_plotlyjs=index == 0,
                             post_script=_DONE if index == len(figures) - 1 else None)
              for index, figure in enumerate(figures)]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(data.title)}</title>
{_WATCH}
<style>body {{ font-family: sans-serif; margin: 1.5em; }} h1 {{ font-size: 1.3em; }}</style>
</head><body>
<h1>{html.escape(data.title)}</h1><p>{html.escape(data.subtitle)}</p>
{''.join(charts)}
</body></html>
"""
    path.write_text(page)
    return path


def _figures(data: ReportData) -> list:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(data.curves) + ["lag of trained samples"]
    rows = -(-len(names) // 2)
    curves = make_subplots(rows=rows, cols=2, subplot_titles=names)
    for index, (name, series) in enumerate(data.curves.items()):
        curves.add_trace(go.Scatter(x=series.x, y=series.y, name=name, mode="lines+markers"),
                         row=index // 2 + 1, col=index % 2 + 1)
    lags = sorted(data.lag_histogram)
    curves.add_trace(go.Bar(x=[str(lag) for lag in lags], y=[data.lag_histogram[lag] for lag in lags], name="lag"),
                     row=len(data.curves) // 2 + 1, col=len(data.curves) % 2 + 1)
    curves.update_layout(height=260 * rows, showlegend=False, title="training")
    figures = [curves]
    if data.time_edges:
        busy = go.Figure([go.Scatter(x=s.x, y=s.y, name=stage, mode="lines") for stage, s in data.stage_busy.items()])
        busy.update_layout(title="busy share of each stage's actors over time (from trace.json)", height=320,
                           xaxis_title="seconds since the first traced call", yaxis_range=[0, 1.05])
        centres = [(a + b) / 2 for a, b in zip(data.time_edges, data.time_edges[1:])]
        gpus = go.Figure(go.Heatmap(z=list(data.gpu_busy.values()), x=centres, y=list(data.gpu_busy),
                                    colorscale="Greens", zmin=0, zmax=1,
                                    # the title beside the bar, not above it: a strip a few rows high has
                                    # no height to spare for both
                                    colorbar={"title": {"text": "busy", "side": "right"}, "thickness": 14,
                                              "len": 1.0, "tickvals": [0, 0.5, 1]}))
        gpus.update_layout(title="GPU utilisation: share of each GPU's time some stage was active",
                           height=200 + 40 * len(data.gpu_busy), yaxis={"autorange": "reversed"})
        figures += [busy, gpus, _timeline(data)]
    return figures


def _timeline(data: ReportData):
    import plotly.graph_objects as go

    by_name: dict[str, tuple[list, list, list]] = {}
    for track, spans in data.timeline.items():
        for start, duration, name in spans:
            xs, bases, ys = by_name.setdefault(name, ([], [], []))
            xs.append(duration)
            bases.append(start)
            ys.append(track)
    figure = go.Figure([go.Bar(x=xs, base=bases, y=ys, orientation="h", name=name,
                               width=0.3 if name.startswith(NESTED_PREFIX) else 0.8)
                        for name, (xs, bases, ys) in by_name.items()])
    figure.update_layout(title="timeline: every stage call per actor (thin: its data-plane calls)", barmode="overlay",
                         height=160 + 28 * len(data.timeline), xaxis_title="seconds",
                         yaxis={"autorange": "reversed"})
    return figure
