"""The multi-turn example learns on the CPU: `rldsl run pipelines/multiturn_arith.rlp`
with a real local Ray, each sample an episode of the builtin ArithRetry environment."""

import json

import pytest

from tests.runs import rldsl_here

pytestmark = [pytest.mark.ray]


def test_multiturn_arith_learns_and_needs_fewer_turns(tmp_path):
    proc = rldsl_here("run", "pipelines/multiturn_arith.rlp", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 30
    assert ledger["generated"] == ledger["trained"] + sum(ledger["dropped"].values())
    assert set(ledger["dropped"]) <= {"environment_raised", "run_finished"}  # none for a round trip: tokens stay
    assert ledger["trained"] >= 0.99 * 30 * 128
    # held-out first-turn success rises (0.28 -> 0.61 measured)
    assert summary["eval_end"] >= summary["eval_start"] + 0.1, (summary["eval_start"], summary["eval_end"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "episode_stats" in s]
    turns = [s["episode_stats"]["turns"] for s in steps]
    rewards = [s["reward_mean"] for s in steps]
    assert len(turns) == 30 and all(1.0 <= t <= 3.0 for t in turns)
    # the episodes' reward rises and they need fewer turns (2.50 -> 2.17 and 0.25 -> 0.41 measured)
    assert sum(turns[-10:]) / 10 < sum(turns[:5]) / 5 - 0.1, turns
    assert sum(rewards[-10:]) / 10 > sum(rewards[:5]) / 5 + 0.05, rewards
    assert " turns " in proc.stderr  # on every step line
    assert not any("reward_components" in s for s in steps)  # turns are no reward: a channel of their own
    journal = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    episodes = [e for e in journal if e["e"] == "episodes"]
    assert episodes and all(len(e["turns"]) == len(e["keys"]) for e in episodes)
