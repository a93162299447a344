"""OpenEnv environments run unchanged: `environment { fn = "module:Class" }`
naming a subclass of openenv-core's `Environment` runs it in the episode's
process (rldsl.runtime.environments.openenv_adapter), on the real package."""

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openenv.core.env_server.interfaces")  # the `openenv` extra, installed by `test`

from rldsl.models import load_model  # noqa: E402
from rldsl.runtime import protocols as p  # noqa: E402
from rldsl.runtime.engines.batching import ContinuousBatcher  # noqa: E402
from rldsl.runtime.engines.torch.generate import TorchGenerator  # noqa: E402
from rldsl.runtime.environments.conversation import TranscriptTurns  # noqa: E402
from rldsl.runtime.environments.episodes import EpisodeRunner  # noqa: E402
from rldsl.runtime.environments.host import EnvironmentHost  # noqa: E402
from rldsl.runtime.environments.openenv_adapter import task_seed  # noqa: E402
from rldsl.runtime.environments.protocol import EnvironmentLoadError, load_environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "pipelines"

# OpenEnv's own `openenv init` template, as a user has it: reset() and step(action) take nothing else,
# the observation has two fields, the state is the instance's
ECHO = """
    from uuid import uuid4

    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field


    class EchoAction(Action):
        message: str = Field(..., description="Message to echo back")


    class EchoObservation(Observation):
        echoed_message: str = Field(default="")
        message_length: int = Field(default=0)


    class EchoEnvironment(Environment):
        def __init__(self):
            self._state = State(episode_id=str(uuid4()), step_count=0)

        def reset(self) -> EchoObservation:
            self._state = State(episode_id=str(uuid4()), step_count=0)
            return EchoObservation(echoed_message="ready", done=False, reward=0.0)

        def step(self, action: EchoAction) -> EchoObservation:
            self._state.step_count += 1
            message = action.message
            return EchoObservation(echoed_message=f"{self._state.step_count}:{message}",
                                   message_length=len(message), done=self._state.step_count >= 2,
                                   reward=len(message) * 0.1)

        @property
        def state(self) -> State:
            return self._state


    class SeededEnvironment(Environment[EchoAction, EchoObservation, State]):
        '''Draws its task from the seed; async; its step takes the action unannotated.'''
        async def reset_async(self, seed=None, episode_id=None, **kwargs):
            self.seed, self.kwargs = seed, sorted(kwargs)
            return EchoObservation(echoed_message=f"task {seed} {episode_id is not None} {self.kwargs}")

        def reset(self, seed=None, episode_id=None, **kwargs):
            raise AssertionError("the async reset is the one to call")

        async def step_async(self, action, timeout_s=None, **kwargs):
            return EchoObservation(echoed_message=action.message, done=True, reward=None)

        def step(self, action, timeout_s=None, **kwargs):
            raise AssertionError("the async step is the one to call")

        @property
        def state(self):
            return State()


    class TwoFields(Action):
        tool_name: str
        arguments: dict


    class ToolEnvironment(Environment):
        def reset(self):
            return EchoObservation()

        def step(self, action: TwoFields):
            return EchoObservation()

        @property
        def state(self):
            return State()
"""


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("openenv")
    (directory / "echo_env.py").write_text(textwrap.dedent(ECHO))
    return directory


def _exchange(spec: str, calls: list[list[tuple]]) -> list[list]:
    """Each episode's calls in turn, every episode in a process of its own; the answers per episode."""
    host = EnvironmentHost(spec, 20.0, 1)
    try:
        processes = host.open(len(calls))
        answers = [[] for _ in calls]
        for turn in range(max(map(len, calls))):
            pending = [(i, calls[i][turn]) for i in range(len(calls)) if turn < len(calls[i])]
            replies = host.exchange([(processes[i], call) for i, call in pending])
            for (i, _), reply in zip(pending, replies):
                answers[i].append(reply)
        host.finish(processes)
    finally:
        host.close()
    return answers


def test_the_templates_echo_environment_runs_unchanged_and_keeps_its_state(echo_dir):
    """`reset()` takes no arguments and `step(action)` only the action; the
    observation's one text field is the message; its reward and done are the step's."""
    [[reset, first, second]] = _exchange(f"echo_env:EchoEnvironment@{echo_dir}",
                                         [[("reset", "12+19=", "31"), ("step", [], "hello"), ("step", [], "abc")]])
    assert reset == ("ok", [{"role": "user", "content": "ready"}])
    assert first == ("ok", ({"role": "user", "content": "1:hello"}, pytest.approx(0.5), False))
    assert second == ("ok", ({"role": "user", "content": "2:abc"}, pytest.approx(0.3), True))  # its step count lived on


def test_a_seeded_async_environment_gets_one_seed_per_prompt(echo_dir):
    """reset gets `seed` and `episode_id` (its `**kwargs` does not receive the
    dataset's prompt); both samples of a prompt play the same task; the async
    methods are the ones awaited; a reward of None is 0."""
    spec = f"echo_env:SeededEnvironment@{echo_dir}"
    answers = _exchange(spec, [[("reset", "12+19=", "31"), ("step", [], "31")]] * 2
                        + [[("reset", "7", "")]])
    seed = task_seed("12+19=")
    assert answers[0][0] == answers[1][0] == ("ok", [{"role": "user", "content": f"task {seed} True []"}])
    assert answers[0][1] == ("ok", ({"role": "user", "content": "31"}, 0.0, True))
    assert answers[2][0] == ("ok", [{"role": "user", "content": "task 7 True []"}])  # a prompt that is a number


def test_an_action_the_completion_cannot_fill_is_refused_at_load(echo_dir):
    with pytest.raises(EnvironmentLoadError, match=r"TwoFields has fields tool_name, arguments.*one text"):
        load_environment(f"echo_env:ToolEnvironment@{echo_dir}")
    assert load_environment(f"echo_env:EchoEnvironment@{echo_dir}").openenv_class.__name__ == "EchoEnvironment"


def test_the_shipped_environment_plays_episodes_of_the_tiny_model():
    """`pipelines/openenv_arith.py` under the episode loop: every sample of a
    prompt is an episode of up to 3 turns, trained in token space, none dropped."""
    model = load_model("builtin:tiny-lm", seed=0)
    host = EnvironmentHost(f"openenv_arith:ArithEnvironment@{PIPELINES}", 20.0, 2)
    try:
        runner = EpisodeRunner(ContinuousBatcher(TorchGenerator(model, max_new_tokens=4)), host,
                               TranscriptTurns(model.tokenizer), model.tokenizer, 3, 36)
        batch, failures = runner.run([p.Prompt(0, "12+19=", "31"), p.Prompt(1, "3+4=", "7")], 4, seed=0)
    finally:
        host.close()
    assert not failures
    turns = batch[p.FIELD_TURNS].tolist()
    assert len(turns) == 8 and all(1 <= t <= 3 for t in turns)
    rewards = batch[p.FIELD_EPISODE_REWARD].tolist()
    assert all(r in (0.0, 0.25, 0.5, 1.0) for r in rewards)
    for row, t in enumerate(turns):  # each wrong answer heard its hint and the question again, as context
        mask, trained = batch[p.FIELD_RESPONSE_MASK][row].bool(), batch[p.FIELD_LOSS_MASK][row].bool()
        observed = model.tokenizer.decode(batch[p.FIELD_RESPONSE_IDS][row][mask & ~trained].tolist())
        assert observed.count("12+19=" if row < 4 else "3+4=") == t - 1, (observed, t)


@pytest.mark.ray
def test_the_openenv_pipeline_runs(tmp_path):
    """`rldsl run pipelines/multiturn_openenv.rlp`, 3 steps: each sample an
    episode of the OpenEnv environment in a real Ray run; nothing dropped."""
    from tests.runs import rldsl_here

    run_dir = tmp_path / "run"
    result = rldsl_here("run", "pipelines/multiturn_openenv.rlp", "--steps", "3", "--run-dir", str(run_dir),
                        "--set", "prompts.eval_size=0")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["ledger"]["trained"] == 3 * 16 * 8 and not summary["ledger"]["dropped"], summary["ledger"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = [s["episode_stats"]["turns"] for s in steps if "episode_stats" in s]
    assert len(turns) == 3 and all(1.0 <= t <= 3.0 for t in turns)
