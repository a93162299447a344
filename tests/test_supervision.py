"""An actor killed mid-run (``ray.kill``, as a pre-empted node or an OOM
would end it): generator, reward and logprob actors are replaced and the
run finishes with every sample accounted for; a lost trainer rank ends the
run with a named error and exit code 3."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tests.runs import lean_chaos, rldsl_here, shared_ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

STEPS = 10
RESTART_STEPS = 6  # killed after step 4, restarted from the checkpoint at 3: steps 4 to 6 again
CHAOS = (ROOT / "pipelines" / "sim_chaos.rlp").read_text()


def run_and_kill(tmp_path: Path, victims: str | list[str], checkpoint_every: int = 0, text: str | None = None,
                 steps: int = STEPS, kill_after: int = 2, args: tuple[str, ...] = (),
                 metrics: str | tuple[str, ...] = "metrics.jsonl"):
    """`rldsl run ARGS` on the session's Ray; each of ``victims`` (actor names) killed in turn, the first once
    ``kill_after`` steps are in ``metrics`` (of the run directory; several: in each), each next one that many
    steps after the one before was replaced."""
    victims = [victims] if isinstance(victims, str) else victims
    source, run_dir = tmp_path / "chaos.rlp", tmp_path / "run"
    source.write_text(text or lean_chaos(CHAOS).replace("steps = 600", f"steps = {steps}")
                      .replace("checkpoint_every = 25", f"checkpoint_every = {checkpoint_every}"))
    killed = []
    shared_ray()  # up before the killer looks for its victims
    files = [run_dir / name for name in ((metrics,) if isinstance(metrics, str) else metrics)]
    killer = threading.Thread(target=_kill_in_turn, args=(files, victims, killed, kill_after), daemon=True)
    killer.start()
    result = rldsl_here("run", str(source), "--run-dir", str(run_dir), *args)
    killer.join(timeout=5)
    assert killed == victims, f"the run ended before every kill ({killed}): {result.stderr[-3000:]}"
    return result, run_dir


def _kill_in_turn(metrics: list[Path], victims: list[str], killed: list, every: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    after = 0  # steps done when the last victim's replacement was up
    for victim in victims:
        _wait(lambda: min(_steps(path) for path in metrics) >= after + every, deadline)
        ray.kill(ray.get_actor(victim))
        killed.append(victim)
        if victim != victims[-1]:  # the supervisor names a replacement NAME~1
            _wait(lambda: _exists(f"{victim}~1"), deadline)
            after = min(_steps(path) for path in metrics)


def _steps(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def _wait(condition, deadline: float):
    while time.monotonic() < deadline and ray.is_initialized():  # not past the session's Ray
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return condition()


def audit(run_dir: Path):
    return rldsl_here("audit", str(run_dir))


VICTIMS = ["rollout-1", "score-0", "reference-0"]


@pytest.mark.ray
def test_killed_stateless_actors_are_replaced_and_the_run_finishes(tmp_path):
    """A generator replica, a reward worker and a logprob rank killed in turn, each replaced."""
    text = CHAOS.replace("steps = 600", f"steps = {3 * STEPS}").replace("checkpoint_every = 25", "checkpoint_every = 0")
    result, run_dir = run_and_kill(tmp_path, VICTIMS, text=text)  # two generator replicas: one is killed
    assert result.returncode == 0, result.stderr[-3000:]
    for victim in VICTIMS:
        assert f"recovered: {victim} died" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 * STEPS
    assert [r["stage"] + "-" + str(r["rank"]) for r in summary["recoveries"]] == VICTIMS
    ledger = summary["ledger"]
    assert ledger["open"] == 0
    assert ledger["trained"] + sum(ledger["dropped"].values()) == ledger["generated"]
    assert ledger["trained"] >= 3 * STEPS * 4 * 4 - len(VICTIMS) * 4 * 4  # at most the groups in flight were lost
    audited = audit(run_dir)
    assert audited.returncode == 0, audited.stdout + audited.stderr


@pytest.mark.ray
@pytest.mark.parametrize(("victim", "named"), [("actor-0", "trainer rank 0 of `actor` died"),
                                               ("controller", "the controller died: its process ended")])
def test_a_killed_trainer_rank_or_controller_without_a_checkpoint_ends_the_run_with_a_named_error(tmp_path, victim,
                                                                                                  named):
    result, run_dir = run_and_kill(tmp_path, victim)
    assert result.returncode == 3, result.stderr[-3000:]
    assert named in result.stderr and "OOM" not in result.stderr  # what died, not Ray's list of guesses
    assert "Traceback" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit"] == "failed" and named in summary["error"]
    audited = audit(run_dir)
    assert audited.returncode == 0, audited.stdout + audited.stderr  # what did happen is consistent, if unfinished


@pytest.mark.ray
def test_a_killed_trainer_rank_restarts_the_run_from_its_last_checkpoint(tmp_path):
    """Lost after step 4 with a checkpoint at step 3: the run restarts from it and
    trains step 4 (and any after) again; metrics.jsonl keeps one record for each."""
    slow_trainer = lean_chaos(CHAOS).replace("steps = 600", f"steps = {RESTART_STEPS}") \
        .replace("checkpoint_every = 25", "checkpoint_every = 3")
    slow_trainer = slow_trainer.replace("engine = sim(latency = 20ms)", "engine = sim(latency = 200ms)")
    result, run_dir = run_and_kill(tmp_path, "actor-0", text=slow_trainer, kill_after=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restarting every actor from v" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == RESTART_STEPS and summary["exit"] == "finished"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("eval")] == list(range(1, RESTART_STEPS + 1))
    audited = audit(run_dir)
    assert audited.returncode == 0, audited.stdout + audited.stderr  # nothing trained twice across the restart


# ---------------------------------------------------------------- the control plane's side, in process


def test_a_generator_replica_that_cannot_be_replaced_is_retired_and_the_run_goes_on():
    import dataclasses

    from rldsl.runtime.control.errors import WorkerLost
    from rldsl.runtime.engines.sim import Latency
    from rldsl.runtime.inprocess import SimConfig
    from tests.test_controller import make_settings, run_controller

    settings = make_settings(prompts_per_step=4, samples_per_prompt=2, steps=4, max_lag=1)
    config = SimConfig(generate=Latency.constant(0.002), generators=2, microbatch=Latency.constant(0.002))
    calls_after_loss = []

    def wrap(handles):
        async def generate(replica, *args):
            if replica == 1:
                calls_after_loss.append(replica)
                raise WorkerLost("rollout", 1, "ActorDiedError: killed", replica=1)
            return await handles.generate(replica, *args)

        return dataclasses.replace(handles, generate=generate)

    summary, _, _ = run_controller(settings, config, wrap=wrap)
    assert summary["steps"] == 4
    ledger = summary["ledger"]
    assert ledger["open"] == 0 and ledger["dropped"].get("worker_died", 0) == 2  # the one group sent to it
    assert calls_after_loss == [1]  # retired after its loss: nothing more is sent to it


def test_a_rank_lost_for_good_is_recorded_once_and_said_once(capsys):
    """What `retired` means to the user: a line and a summary entry, once per rank."""
    import asyncio
    from types import SimpleNamespace

    from rldsl.runtime.control.errors import WorkerLost
    from rldsl.runtime.ray_lowering.pipeline_driver import PipelineDriver
    from rldsl.runtime.ray_lowering.supervision import ActorSpec, Supervisor

    spec = ActorSpec("rollout", "generate", 1, object, (), {"name": "rollout-1"}, False)  # not replaceable
    supervisor = Supervisor({"rollout": [spec, spec]}, {"rollout": ["actor-0", "dead"]})
    for _ in range(2):  # two callers saw the death
        with pytest.raises(WorkerLost):
            asyncio.run(supervisor.replace("rollout", 1, "dead", RuntimeError("ActorDiedError: killed")))
    assert supervisor.losses == [{"stage": "rollout", "rank": 1, "cause": "RuntimeError: ActorDiedError: killed"}]
    driver = SimpleNamespace(traces=SimpleNamespace(replace=lambda *a: None), _recoveries_shown=0, _losses_shown=0,
                             prefix="", say=lambda text: print(text))
    for _ in range(2):  # two polls
        PipelineDriver._show_recoveries(driver, {"recoveries": [], "losses": supervisor.losses})
    said = capsys.readouterr().out
    assert said.count("lost: rollout-1 died and could not be replaced") == 1 and "the run goes on" in said


TORCH_WITH_EVALUATION = """
pipeline chaos
cluster { nodes = 1  gpus_per_node = 2 }
model policy { source = "builtin:tiny-lm" }
dataset prompts { source = "builtin:arith"  eval_size = 16 }
stage generate rollout { model = policy  engine = torch  gpus = 1  samples_per_prompt = 4  max_new_tokens = 8 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = torch  gpus = 1  prompts_per_step = 4  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
staleness { max_lag = 1 }
run { steps = 8  eval_every = 2  watchdog = 120s }
"""


@pytest.mark.ray
def test_a_killed_evaluator_is_replaced_and_evaluation_goes_on(tmp_path):
    result, run_dir = run_and_kill(tmp_path, "evaluator", text=TORCH_WITH_EVALUATION)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recovered: the evaluator died" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["evals"][-1]["step"] == 8  # the final evaluation still ran
