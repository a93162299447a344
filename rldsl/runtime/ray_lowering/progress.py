"""Live progress of a run (rich on a terminal, a line per step otherwise),
metrics as JSONL and to the run's metric loggers (loggers.py), and the
final summary table."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rldsl.runtime.control.ledger import drop_meaning
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.ray_lowering.evaluation import accuracy_change


class Progress:
    def __init__(self, settings: RunSettings, run_dir: Path, prefix: str = "", live: bool = True,
                 log: tuple[str, ...] = ("tensorboard",), name: str = "rldsl", config: dict | None = None,
                 first_step: int | None = None):
        """``prefix`` starts every line (several pipelines in one run);
        ``live=False`` keeps the line-per-step output on a terminal too;
        ``log``: the metric backends (loggers.py), ``name`` and ``config``
        what they call and record the run; ``first_step``: a resumed run's
        (the steps from there on are trained again, so the loggers drop
        what they hold of them)."""
        from rldsl.runtime.ray_lowering.loggers import MetricLoggers

        self.settings, self.prefix, self.want_live = settings, prefix, live
        self.metrics_path = run_dir / "metrics.jsonl"
        self.loggers = MetricLoggers(log, run_dir, name, config, first_step)
        self.console = _console(stderr=True, log_width=400)  # progress; in a log, one unwrapped line per step
        self.results = _console(stderr=False, log_width=120)  # the final table: stdout, as `check` and `plan`
        self.live = None
        self.started = time.monotonic()
        self.last: dict = {}
        self.notes: list[str] = []
        self.now: dict = {}  # the controller's latest: what each pump waits on, calls in flight per stage
        self.recorded: set[int] = set()  # steps in metrics.jsonl from this process: each once
        self._closed = False

    def __enter__(self) -> "Progress":
        if self.console.is_terminal and self.want_live:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """The live view ends; the loggers stay open for what follows (the
        final evaluation, a stop's last steps) until ``close``."""
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(exc_type, *exc)
            self.live = None  # steps recorded after this print as lines

    def close(self) -> None:
        """Flush and close the metric loggers, once: after the run's last record."""
        if not self._closed:
            self._closed = True
            self.loggers.close()

    def _append(self, record: dict) -> None:
        from rldsl.runtime.run_files import append_text

        append_text(self.metrics_path, json.dumps(record, sort_keys=True) + "\n", sync=False)

    def eval(self, step: int, accuracy: float, **details) -> None:
        """An evaluation's record; ``details``: the weight ``version`` it scored, where it ran (``on``)."""
        self._append({"eval": True, "step": step, "accuracy": accuracy, **details})
        self.loggers.log({"eval/accuracy": accuracy}, step)

    def step(self, record: dict) -> None:
        if record["step"] in self.recorded:
            return
        self.recorded.add(record["step"])
        self.last = record
        self._append(record)
        self._scalars(record)
        if self.live is not None:
            self.live.update(self._render())
        else:
            self.console.print(self.prefix + self._line(record), highlight=False)

    def note(self, text: str) -> None:
        if not text:
            return
        self.notes.append(text)
        if self.live is None:
            self.console.print(self.prefix + text, highlight=False)
        else:
            self.live.update(self._render())

    def waits(self, report: dict) -> None:
        """``report``: the controller's progress answer (``pumps``, ``active``)."""
        self.now = report
        if self.live is not None:
            self.live.update(self._render())

    def _line(self, r: dict) -> str:
        reward = r.get("reward_mean")
        reward_text = f" reward {reward:.3f}" if isinstance(reward, (int, float)) else ""
        reward_text += "".join(f" {name} {value:.3f}" for name, value in (r.get("reward_components") or {}).items()
                               if isinstance(value, (int, float)))
        reward_text += "".join(f" {name} {value:.2f}" for name, value in (r.get("episode_stats") or {}).items()
                               if isinstance(value, (int, float)))
        leases = (f" replicas {r['replicas_awake']} lease waits {r['lease_wait_s']:.1f}s"
                  if "replicas_awake" in r else "")
        mismatch = _mismatch(r.get("trainer") or {})
        masked = f" masked {r['masked']}" if r.get("masked") else ""  # difficulty_mask: in the step, not the loss
        pushed = (r.get("trainer") or {}).get("push_bytes")
        return (f"step {r['step']}/{self.settings.steps} v{r['version']} lag {_hist(r['lag_histogram'])} "
                f"{r['samples_per_s']:.1f} samples/s{reward_text}{masked} busy {_busy(r['busy'])}{leases}"
                f"{' mismatch ' + mismatch if mismatch else ''}{' push ' + _mib(pushed) if pushed else ''}")

    def _render(self):
        from rich.table import Table

        table = Table(show_header=False, box=None, padding=(0, 1))
        r = self.last
        elapsed = time.monotonic() - self.started
        table.add_row("step", f"{r.get('step', 0)}/{self.settings.steps}   version {r.get('version', 0)}   "
                              f"{elapsed:.0f}s")
        if r:
            table.add_row("lag", _hist(r["lag_histogram"]) + f"   (max_lag {self.settings.max_lag})")
            table.add_row("throughput", f"{r['samples_per_s']:.1f} samples/s")
            reward = r.get("reward_mean")
            if isinstance(reward, (int, float)):
                parts = "".join(f"   {name} {value:.3f}" for name, value in (r.get("reward_components") or {}).items()
                                if isinstance(value, (int, float)))
                table.add_row("reward", f"{reward:.3f}{parts}")
            if r.get("episode_stats"):
                table.add_row("episodes", "   ".join(f"{name} {value:.2f}" for name, value in r["episode_stats"].items()
                                                      if isinstance(value, (int, float))))
            table.add_row("busy", _busy(r["busy"]))
            if _mismatch(r.get("trainer") or {}):
                table.add_row("mismatch", _mismatch(r["trainer"]))
            if "replicas_awake" in r:
                table.add_row("leases", f"replicas awake {r['replicas_awake']}, waited {r['lease_wait_s']:.1f}s")
        for note in self.notes[-2:]:
            table.add_row("eval", note)
        if self.now.get("active"):
            table.add_row("stages", _activity(self.now["active"]))
        for pump, text in self.now.get("pumps", {}).items():
            table.add_row(f"{pump} pump", text[:200])
        return table

    def final_table(self, summary: dict, run_dir: Path) -> None:
        from rich.table import Table

        table = Table(title=f"run {summary.get('pipeline', '')}", show_header=False)
        ledger = summary["ledger"]
        rows = [("steps", f"{summary['steps']}"), ("generated", f"{ledger['generated']}"),
                ("trained", f"{ledger['trained']}"),
                ("dropped", ", ".join(f"{k} {v}" for k, v in ledger["dropped"].items()) or "0"),
                *([("masked", f"{ledger['masked']}")] if ledger.get("masked") else []),
                ("max lag", f"{summary['max_lag']}"), ("samples/s", f"{summary['samples_per_s']:.1f}"),
                ("wall clock", f"{summary['wall_clock_s']:.0f}s (training loop {summary['train_loop_s']:.0f}s)")]
        held_out = accuracy_change(summary.get("evals", []), summary["steps"])
        if held_out:
            rows.append(("held-out accuracy", held_out))
        for name, value in rows:
            table.add_row(name, value)
        self.results.print(table)
        for reason, count in ledger["dropped"].items():  # why, once per reason; journal.jsonl has each sample's
            self.results.print(f"{self.prefix}dropped {count} as {reason}: {drop_meaning(reason)}", highlight=False)
        self.results.print(f"{self.prefix}run directory: {run_dir}  (summary.json, metrics.jsonl)", highlight=False)


    def _scalars(self, record: dict) -> None:
        from rldsl.runtime.ray_lowering.loggers import step_scalars

        self.loggers.log(step_scalars(record), record["step"])


def _console(stderr: bool, log_width: int):
    """A rich console on stderr or stdout, ``log_width`` wide when it is no terminal."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=log_width)


def _hist(histogram: dict) -> str:
    return " ".join(f"{lag}:{n}" for lag, n in sorted(histogram.items(), key=lambda kv: int(kv[0]))) or "-"


def _activity(active: dict) -> str:
    """Per stage, busy (with its calls in flight) or idle, now."""
    return "   ".join(f"[green]{name} busy ({n})[/]" if n else f"[dim]{name} idle[/]" for name, n in active.items())


def _mismatch(trainer: dict) -> str:
    """The generator/trainer gap of a step: KL(behaviour || proximal), the weight's range, the share
    corrected, and on the same weights the logprobs' largest difference (``mismatch/...``)."""
    if "mismatch_kl" not in trainer:
        return ""
    text = f"kl {trainer['mismatch_kl']:.2e}"
    if "mismatch_ratio_min" in trainer:
        text += f" ratio {trainer['mismatch_ratio_min']:.2f}..{trainer['mismatch_ratio_max']:.2f}"
    capped = trainer.get("capped_fraction", 0.0)
    text += f" corrected {capped:.1%}" if capped else ""
    if "mismatch/abs_diff_max" in trainer:
        text += (f" same-weights |dlogp| {trainer['mismatch/abs_diff_mean']:.1e} (max "
                 f"{trainer['mismatch/abs_diff_max']:.1e})")
    return text


def _mib(nbytes: float) -> str:
    """A push's size: MiB, or KiB below one (LoRA adapters)."""
    return f"{nbytes / 2**20:.1f}MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f}KiB"


def _busy(busy: dict) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in busy.items())


def rewind_metrics(run_dir: Path, steps_done: int) -> None:
    """metrics.jsonl as it was at the checkpoint a run resumes (or restarts)
    from: the records of later steps go, as those steps are trained again,
    and so does a line torn by a process killed mid-write. Replaced at once."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if (step := _step_of(line)) is not None
            and step <= steps_done]
    temporary = path.with_name(path.name + ".rewind")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
