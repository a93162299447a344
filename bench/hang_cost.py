"""What hung user code costs a whole run: the training loop's time with an
environment that hangs on 5% of its `step` calls, and with a reward that
spins on 2% of its samples, each against the same run without hangs, side by
side in one invocation.

- environment: `pipelines/multiturn_arith.rlp` (16 groups of 8 episodes a
  step, 2 environment processes, `timeout = 5s`), its `ArithRetry` changed to
  sleep for 60 s on 5% of the `step` calls (chosen by a hash of the episode
  and turn, the same in every run);
- reward: `pipelines/grpo_async.rlp` with `exact_match` changed to spin,
  holding a CPU, on 2% of the samples (by a hash of the response and
  prompt), the reward stage's `timeout = 5s`.

    python bench/hang_cost.py [--steps 10] [--only environment|reward] [--straggler 8]

Prints each run's training loop (summary.json `train_loop_s`), the samples
each dropped as hung (at a timeout or as a straggler), and the ratio to its clean run: with hangs as the pipelines
are (only `timeout`), and with hangs and `straggler = F` on the environment
or the reward stage (a call F times the usual is taken for hung); and what
`straggler = F` drops of the clean run (a healthy call taken for hung).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HANGS = '''
import hashlib, time

from rldsl.environments import ArithRetry
from rldsl.rewards import exact_match


def _share(*parts) -> float:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2 ** 32


class HangingRetry(ArithRetry):
    """ArithRetry, except that 5% of its steps sleep for a minute."""

    def step(self, messages, completion):
        if _share(self.prompt, len(messages), completion, id(self)) < 0.05:
            time.sleep(60)
        return super().step(messages, completion)


def spinning_match(response, answer, prompt=""):
    """exact_match, except that it spins on 2% of the samples."""
    if _share(response, prompt, time.monotonic_ns()) < 0.02:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
    return exact_match(response, answer, prompt)
'''


HUNG = ("environment_timeout", "environment_straggler", "reward_timeout", "reward_straggler")  # taken for hung


def run(pipeline_text: str, directory: Path, name: str, steps: int) -> dict:
    source = directory / f"{name}.rlp"
    source.write_text(pipeline_text)
    run_dir = directory / f"run-{name}"
    done = subprocess.run([sys.executable, "-m", "rldsl", "run", str(source), "--steps", str(steps),
                           "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    dropped = summary["ledger"]["dropped"]
    return {"loop_s": summary["train_loop_s"], "dropped": sum(dropped.get(reason, 0) for reason in HUNG)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", choices=("environment", "reward"), help="one case alone")
    parser.add_argument("--straggler", type=float, default=8.0, help="the `straggler` factor of the third run")
    args = parser.parse_args()
    multiturn = (ROOT / "pipelines" / "multiturn_arith.rlp").read_text()
    default = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    hanging_env = multiturn.replace('fn = "rldsl.environments:ArithRetry"', 'fn = "hangs:HangingRetry"')
    hanging_reward = default.replace('fn = "rldsl.rewards:exact_match"', 'fn = "hangs:spinning_match"')
    cut_env = lambda text: text.replace("  timeout = 5s\n", f"  timeout = 5s\n  straggler = {args.straggler:g}\n")
    cut_reward = lambda text: text.replace("timeout = 5s }", f"timeout = 5s  straggler = {args.straggler:g} }}")
    cases = {  # clean, with hangs, with hangs and `straggler`, clean with `straggler`
        "environment": (multiturn, hanging_env, cut_env(hanging_env), cut_env(multiturn)),
        "reward": (default, hanging_reward, cut_reward(hanging_reward), cut_reward(default)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "hangs.py").write_text(HANGS)
        print(f"{args.steps} steps each; training loop seconds (summary.json train_loop_s), samples dropped as "
              "hung (a timeout or a straggler)")
        factor = f"straggler = {args.straggler:g}"
        print(f"| user code | clean | with hangs | ratio | dropped | with hangs, {factor} | ratio | dropped "
              f"| clean, {factor}: dropped |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, texts in cases.items():
            if args.only and name != args.only:
                continue
            assert len(set(texts)) == 4, f"{name}: a pipeline changed, update this benchmark's edits"
            clean, hanging, cut, clean_cut = (run(text, directory, f"{name}-{kind}", args.steps) for text, kind
                                              in zip(texts, ("clean", "hangs", "straggler", "clean-straggler")))
            print(f"| {name} | {clean['loop_s']:.1f} | {hanging['loop_s']:.1f} | "
                  f"{hanging['loop_s'] / clean['loop_s']:.2f}x | {hanging['dropped']} | {cut['loop_s']:.1f} | "
                  f"{cut['loop_s'] / clean['loop_s']:.2f}x | {cut['dropped']} | {clean_cut['dropped']} |", flush=True)


if __name__ == "__main__":
    main()
