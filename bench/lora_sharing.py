"""Three LoRA pipelines on one base and one generator, against three
full-parameter pipelines split statically, on the same machine, one after
the other in one invocation.

- shared: `pipelines/lora_many.rlp` (rank-8 adapters; one generator on
  logical GPU 0 serving all three pipelines, `served_by`; the three trainers
  taking turns on GPU 1 through the lease scheduler): 2 GPUs;
- static: the same three pipelines training every weight, each with a
  generator and a trainer of its own on GPUs of its own: 6 GPUs.

Each is a real `rldsl run` (its own local Ray, builtin model, CPU). Printed
side by side: the GPUs the plan uses, the generator processes and their
peak resident memory (summed), the trainers' likewise, the bytes each push
carries, every pipeline's samples/s and the aggregate (all samples over the
longest training loop), and the memory model's per-GPU estimate for the
generators (`rldsl plan`). On a 2-core machine every actor shares the same
two cores, so throughput says what sharing costs, not what GPUs would give.

    python bench/lora_sharing.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.host_memory import peak_rss  # noqa: E402

SHARED = (ROOT / "pipelines" / "lora_many.rlp").read_text()
PIPELINES = ("exact", "chars", "rloo")


def static_text(shared: str) -> str:
    """The shared file's pipelines without adapters, each with its own generator and trainer GPUs."""
    text = shared.replace("gpus_per_node = 2 ", "gpus_per_node = 6 ").replace("  lora_rank = 8 }", " }")
    text = re.sub(r"\n  placement \{ share = \[[^\]]*\] \}[^\n]*", "", text)
    text = text.replace("lr = 5e-3", "lr = 5e-4")  # full weights take the smaller step (multi_pipeline_cpu.rlp)
    for index, name in enumerate(PIPELINES):
        block = text[text.index(f"pipeline {name} {{"):]
        block = block[:block.index("\n}\n") + 3]
        generator = (f"stage generate rollout {{ model = policy  engine = torch  gpus = [{2 * index}]  "
                     "samples_per_prompt = 8  max_new_tokens = 8 }")
        edited = re.sub(r"stage generate rollout \{[^}]*\}", generator, block)
        edited = edited.replace("gpus = [1]", f"gpus = [{2 * index + 1}]")
        text = text.replace(block, edited)
    return text


class PeakMemory:
    """Peak resident memory (VmHWM) of every Ray actor process of the given classes, polled while a run lasts."""

    def __init__(self, classes: tuple[str, ...]) -> None:
        self.classes, self.peaks = classes, {}  # (class, pid) -> bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    self._read(int(pid))

    def _read(self, pid: int) -> None:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            kind = next((c for c in self.classes if f"ray::{c}" in title), None)
            if kind is None:
                return
            peak = peak_rss(pid)
        except (OSError, StopIteration):  # the process ended meanwhile
            return
        self.peaks[(kind, pid)] = max(self.peaks.get((kind, pid), 0), peak)

    def of(self, kind: str) -> tuple[int, int]:
        """(processes, summed peak bytes) of one class."""
        peaks = [b for (k, _), b in self.peaks.items() if k == kind]
        return len(peaks), sum(peaks)


def run(text: str, steps: int, work: Path, label: str) -> dict:
    source, run_dir = work / f"{label}.rlp", work / label
    source.write_text(text)
    plan = subprocess.run([sys.executable, "-m", "rldsl", "plan", str(source)], capture_output=True, text=True,
                          cwd=ROOT)
    if plan.returncode:
        raise SystemExit(f"{label}: rldsl plan failed:\n{plan.stdout}{plan.stderr}")
    args = [sys.executable, "-m", "rldsl", "run", str(source), "--steps", str(steps), "--run-dir", str(run_dir)]
    for name in PIPELINES:
        args += ["--set", f"{name}.run.eval_at_start=false", "--set", f"{name}.run.eval_at_end=false"]
    started = time.monotonic()
    with PeakMemory(("GeneratorWorker", "TrainerWorker")) as memory:
        proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    if proc.returncode:
        raise SystemExit(f"{label}: rldsl run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summaries = {name: json.loads((run_dir / name / "summary.json").read_text()) for name in PIPELINES}
    metrics = [json.loads(line) for line in (run_dir / "exact" / "metrics.jsonl").read_text().splitlines()]
    push = next(m["trainer"]["push_bytes"] for m in metrics if "trainer" in m)
    return {"plan": plan.stdout, "summaries": summaries, "memory": memory, "push": push,
            "wall": time.monotonic() - started}


def aggregate(result: dict) -> float:
    """Every pipeline's trained samples over the longest training loop."""
    summaries = result["summaries"].values()
    return sum(s["ledger"]["trained"] for s in summaries) / max(s["train_loop_s"] for s in summaries)


def gpu_count(plan: str) -> int:
    return int(gpus_used(plan).split("/")[0])


def gpus_used(plan: str) -> str:
    return re.search(r"(\d+/\d+) GPUs", plan).group(1)


def generator_estimate(plan: str) -> str:
    """The memory model's figures for the generators (one line each)."""
    return "; ".join(re.sub(r"\s+", " ", line.strip()) for line in plan.splitlines()
                     if re.match(r"\s+\w+/rollout\s+generation", line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rldsl-lora-sharing-") as tmp:
        results = {"shared (LoRA, one generator)": run(SHARED, args.steps, Path(tmp), "shared"),
                   "static (full weights)": run(static_text(SHARED), args.steps, Path(tmp), "static")}
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    rows = [("GPUs the plan uses", lambda r: gpus_used(r["plan"])),
            ("generator processes, summed peak RSS", lambda r: "{} x, {}".format(
                r["memory"].of("GeneratorWorker")[0], mib(r["memory"].of("GeneratorWorker")[1]))),
            ("trainer processes, summed peak RSS", lambda r: "{} x, {}".format(
                r["memory"].of("TrainerWorker")[0], mib(r["memory"].of("TrainerWorker")[1]))),
            ("bytes per push", lambda r: f"{r['push'] / 1024:.1f} KiB"),
            *((f"{name} samples/s", lambda r, name=name: f"{r['summaries'][name]['samples_per_s']:.1f}")
              for name in PIPELINES),
            ("aggregate samples/s", lambda r: f"{aggregate(r):.1f}"),
            ("aggregate samples/s per GPU used", lambda r: f"{aggregate(r) / gpu_count(r['plan']):.1f}"),
            ("wall clock of the run", lambda r: f"{r['wall']:.0f} s")]
    names = list(results)
    print(f"{args.steps} steps per pipeline, 8 prompts x 8 samples each\n")
    print(f"| | {' | '.join(names)} |\n|---|{'---:|' * len(names)}")
    for label, cell in rows:
        print(f"| {label} | {' | '.join(cell(results[n]) for n in names)} |")
    print()
    for name in names:
        print(f"memory model, {name}: {generator_estimate(results[name]['plan'])}")


if __name__ == "__main__":
    main()
