"""The run's trace (spans, the Chrome trace-event file) and `rldsl report`
(PNG and self-contained HTML), without Ray; the HTML also in a real headless
browser when Chromium is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rldsl.report import write_report
from rldsl.report.data import _binned, report_data
from rldsl.runtime.ray_lowering.trace import Tracer, prompt_groups
from rldsl.runtime.ray_lowering.trace_format import chrome_trace, write_chrome_trace


def test_a_span_records_its_call_its_args_and_its_error():
    tracer = Tracer("rollout-0", "rollout", "generate", 0, [1], 0)
    with tracer.span("generate", groups=[3]) as args:
        args["version"] = 2
    with pytest.raises(ValueError), tracer.span("reward"):
        raise ValueError("boom")
    batch = tracer.drain()
    assert batch["actor"]["gpus"] == [1] and [e[0] for e in batch["events"]] == ["generate", "reward"]
    assert batch["events"][0][3] == {"groups": [3], "version": 2}
    assert batch["events"][1][3] == {"error": "ValueError"}
    assert tracer.drain()["events"] == []


def test_group_keys_are_prompt_indices():
    assert prompt_groups(["p/p12/s0", "p/p12/s1", "p/p3/s0"]) == [3, 12]


def batches() -> list[dict]:
    def actor(name, stage, kind, rank, gpus):
        return {"actor": name, "stage": stage, "kind": kind, "rank": rank, "gpus": gpus, "node": 0, "pid": 1}

    return [
        {"actor": actor("rollout-0", "rollout", "generate", 0, [0]),
         "events": [["generate", 1_000_000, 400_000, {"groups": [7], "version": 0}],
                    ["dataplane put", 1_300_000, 50_000, {"rows": 4}]]},
        {"actor": actor("actor-0", "actor", "train", 0, [1]),
         "events": [["train_microbatch", 1_600_000, 200_000, {"groups": [7], "step": 0}]]},
        {"actor": actor("reference-0", "reference", "logprob", 0, [1]),
         "events": [["logprob", 1_450_000, 100_000, {"groups": [7]}]]},
        {"actor": actor("controller", "controller", "controller", 0, []),
         "events": [["dataplane clear", 1_900_000, 10_000, {"rows": 4}]]},
    ]


def test_the_chrome_trace_has_a_track_per_actor_per_stage_and_per_gpu_and_flow_arrows():
    trace = chrome_trace(batches(), "p")
    events = trace["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"stage rollout", "stage reference", "stage actor", "stage controller", "GPU 0:0", "GPU 0:1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0  # relative to the first call
    generate = next(e for e in spans if e["name"] == "generate" and e["cat"] == "generate")
    assert generate["args"]["actor"] == "rollout-0" and generate["dur"] == 400_000
    gpu1 = [e for e in spans if e["cat"] == "gpu" and e["args"]["gpus"] == [1]]
    assert {e["name"] for e in gpu1} == {"train_microbatch", "logprob"} and len({e["pid"] for e in gpu1}) == 1
    start = next(e for e in events if e["ph"] == "s")
    finish = next(e for e in events if e["ph"] == "f")
    assert start["id"] == finish["id"] == 7 and finish["bp"] == "e"
    assert (start["pid"], start["tid"]) == (generate["pid"], generate["tid"])


def test_busy_shares_are_the_union_of_spans_per_bin():
    assert _binned([(0.0, 1.0), (0.5, 1.5), (3.0, 3.5)], [0.0, 1.0, 2.0, 3.0, 4.0]) == [1.0, 0.5, 0.0, 0.5]


def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    steps = [{"step": s, "version": s, "samples": 16, "step_time_s": 0.5, "reward_mean": 0.1 * s,
              "lag_histogram": {"0": 4, "1": 12}, "busy": {}, "samples_per_s": 30.0,
              "trainer": {"kl": 0.01 * s, "tokens": 80, "sequences": 16, "grad_norm": 1.5}} for s in (1, 2, 3)]
    evals = [{"eval": True, "step": 0, "accuracy": 0.25}, {"eval": True, "step": 3, "accuracy": 0.5}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    (path / "trace-events.jsonl").write_text("".join(json.dumps(b) + "\n" for b in batches()))
    write_chrome_trace(path / "trace-events.jsonl", path / "trace.json", "p")
    return path


def test_the_report_has_every_panel(tmp_path):
    data = report_data(run_dir(tmp_path))
    assert data.title == "p — run"
    assert set(data.curves) == {"reward (sampled)", "held-out accuracy (greedy)", "KL to the reference",
                                "response length (tokens)", "gradient norm", "samples/s", "tokens/s"}
    assert data.curves["response length (tokens)"].y == [5.0, 5.0, 5.0]
    assert data.curves["tokens/s"].y == [160.0, 160.0, 160.0]
    assert data.lag_histogram == {0: 12, 1: 36}
    assert set(data.stage_busy) == {"rollout", "reference", "actor"}  # the controller is no stage
    assert set(data.gpu_busy) == {"GPU 0:0", "GPU 0:1"}
    assert max(data.gpu_busy["GPU 0:0"]) == 1.0


def test_report_writes_the_png_and_a_self_contained_html(tmp_path, capsys):
    path = run_dir(tmp_path)
    assert write_report(path, html=True) == 0
    assert (path / "report.png").stat().st_size > 10_000
    page = (path / "report.html").read_text()
    assert "<script src=" not in page and "Plotly.newPlot" in page  # plotly.js inlined: no network
    assert f"wrote {path / 'report.html'}" in capsys.readouterr().out


def test_report_of_a_run_with_one_evaluation_shows_no_change(tmp_path, capsys):
    path = run_dir(tmp_path)  # run { eval_at_start = false }: only the last step was evaluated
    lines = [line for line in (path / "metrics.jsonl").read_text().splitlines() if '"step": 0,' not in line]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert write_report(path) == 0
    assert "held-out accuracy: 0.500 (step 3), the only evaluation" in capsys.readouterr().out


def chromium() -> str:
    """A Chromium on the PATH now (asked when the test runs, not when it is collected), or a skip."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        pytest.skip("no Chromium (apt-get install chromium): the browser test needs one")
    return found


def test_the_html_report_renders_in_a_headless_browser(tmp_path):
    browser = chromium()
    path = run_dir(tmp_path)
    write_report(path, html=True)
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
                          "--dump-dom", (path / "report.html").as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    head = dom[:dom.index("<head>")]
    assert "data-error" not in head, head
    rendered = int(head.split('data-rendered="')[1].split('"')[0])
    assert rendered >= 4  # every chart drew its SVG
