"""verifiers environments run unchanged: a taskset of verifiers 0.4 (the real
package) named by an environment's `fn` plays each episode as a verifiers
rollout through the replica's endpoint, scored by the taskset's own rubric."""

import contextlib
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("verifiers.v1", reason="the `verifiers` extra is not installed")

from rldsl.runtime import protocols as p  # noqa: E402
from rldsl.runtime.engines.batching import ContinuousBatcher  # noqa: E402
from rldsl.runtime.engines.torch.common import response_logprobs  # noqa: E402
from rldsl.runtime.engines.torch.generate import TorchGenerator  # noqa: E402
from rldsl.runtime.environments import EpisodeStatus  # noqa: E402
from rldsl.runtime.environments.conversation import TranscriptTurns  # noqa: E402
from rldsl.runtime.environments.harness import HarnessRunner  # noqa: E402
from rldsl.runtime.environments.host import EnvironmentHost  # noqa: E402
from rldsl.runtime.environments.protocol import EnvironmentLoadError, is_harness, is_verifiers_taskset, \
    load_environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = f"verifiers_arith:SumTaskset@{ROOT / 'pipelines'}"

# Tasksets of the tests' own, beside them in a temporary directory: one whose reward raises, one its module
# does not export.
TASKSETS = '''
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str


class Broken(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        raise RuntimeError("the rubric broke")


class BrokenTaskset(vf.Taskset[Broken, vf.TasksetConfig]):
    def load(self):
        return []


class Hidden(vf.Taskset[Broken, vf.TasksetConfig]):
    def load(self):
        return []


__all__ = ["BrokenTaskset"]
'''


@pytest.fixture(scope="module")
def model():
    from rldsl.runtime.engines.torch.warmstart import load_warm_started

    return load_warm_started("builtin:arith", seed=0)  # answers sums without a carry (cached)


@contextlib.contextmanager
def _runner(model, spec: str):
    host = EnvironmentHost(spec, 20.0, 1)
    assert host.kind == "harness"
    runner = HarnessRunner(ContinuousBatcher(TorchGenerator(model, max_new_tokens=4)), host,
                           TranscriptTurns(model.tokenizer), model.tokenizer, 1, 4)
    try:
        yield runner
    finally:
        host.close()
        runner.close()


def test_a_taskset_is_recognised_by_its_bases_and_becomes_a_harness():
    import sys

    sys.path.insert(0, str(ROOT / "pipelines"))
    try:
        import verifiers_arith
    finally:
        sys.path.remove(str(ROOT / "pipelines"))
    assert is_verifiers_taskset(verifiers_arith.SumTaskset) and not is_verifiers_taskset(verifiers_arith.SumTask)
    assert is_harness(load_environment(SHIPPED))


def test_episodes_are_the_generated_tokens_scored_by_the_tasksets_rubric(model):
    """The rows the taskset loaded (12+13=) and a row it did not (123+4=, past its operands) are both
    played; the reward is the taskset's exact match of the reply, which is the tokens as sampled."""
    prompts = [p.Prompt(0, "12+13=", "25"), p.Prompt(1, "123+4=", "127")]
    with _runner(model, SHIPPED) as runner:
        batch, failures = runner.run(prompts, 4, seed=0)
    assert not failures and batch[p.FIELD_TURNS].tolist() == [1] * 8
    tokenizer = model.tokenizer
    for row in range(8):
        mask = batch[p.FIELD_RESPONSE_MASK][row].bool()
        reply = tokenizer.decode(batch[p.FIELD_RESPONSE_IDS][row][mask].tolist())
        answer = prompts[row // 4].answer
        assert batch[p.FIELD_EPISODE_REWARD][row].item() == float(reply.strip() == answer)
        assert batch[p.FIELD_LOSS_MASK][row][mask].all()  # one reply, all the model's
    assert batch[p.FIELD_EPISODE_REWARD][:4].sum() > 0  # right answers are scored right
    with torch.no_grad():
        recomputed = response_logprobs(model, batch)
    trained = p.trained_tokens(batch).bool()
    assert torch.allclose(recomputed[trained], batch[p.FIELD_BEHAVIOUR_LOGPROBS][trained], atol=1e-4)


def test_a_failed_rollout_drops_its_sample_and_an_unexported_taskset_is_refused(model, tmp_path):
    (tmp_path / "broken_tasks.py").write_text(textwrap.dedent(TASKSETS))
    with _runner(model, f"broken_tasks:BrokenTaskset@{tmp_path}") as runner:
        batch, failures = runner.run([p.Prompt(0, "1+1=", "2")], 2, seed=0)
    assert [EpisodeStatus(int(s)) for s in batch[p.FIELD_EPISODE_STATUS]] == [EpisodeStatus.RAISED] * 2
    assert "the rubric broke" in failures[0][1]
    with pytest.raises(EnvironmentLoadError, match="exports in `__all__`"):
        load_environment(f"broken_tasks:Hidden@{tmp_path}")


@pytest.mark.ray
def test_the_shipped_pipeline_trains_on_verifiers_rollouts(tmp_path):
    """The shipped pipeline (less its frozen reference, one environment server) in a real run: the
    replica's endpoint, inside a Ray worker, serves the rollouts' processes, and every one is trained.
    The run of an agent harness on Ray."""
    from tests.runs import rldsl_here  # here: the module's other tests start no Ray (and run beside the Ray tests)

    shutil.copy(ROOT / "pipelines" / "verifiers_arith.py", tmp_path)
    text = (ROOT / "pipelines" / "verifiers_arith.rlp").read_text()
    text = (text.replace("stage logprob reference { model = policy  frozen  colocate = actor }\n", "")
            .replace("-> score -> reference -> actor", "-> score -> actor").replace("kl = 0.001", "kl = 0.0")
            .replace("timeout = 20s", "timeout = 20s  processes = 1"))
    (tmp_path / "verifiers.rlp").write_text(text)
    run_dir = tmp_path / "run"
    result = rldsl_here("run", str(tmp_path / "verifiers.rlp"), "--steps", "3", "--set", "actor.prompts_per_step=2",
                        "--set", "prompts.eval_size=0", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger"]["trained"] == 3 * 2 * 8 and not summary["ledger"]["dropped"]
