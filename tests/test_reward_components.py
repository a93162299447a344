"""Named reward components: `fn = [name("module:function", weight = w), ...]`
in a reward stage. The checks, the plan, the weighted sum in the reward
processes, and each component's mean in the step record and its metrics."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.rewards import WeightedRewards, load_reward
from rldsl.runtime.control.buffer import Group
from rldsl.runtime.control.rollout_pump import _reward_or_failure
from rldsl.runtime.control.train_pump import _component_means
from rldsl.runtime.protocols import ComponentReward, RewardFailure
from rldsl.runtime.ray_lowering.loggers import step_scalars
from rldsl.runtime.reward_pool import RewardPool

BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()
SINGLE = 'fn = "rldsl.rewards:exact_match"'
COMPONENTS = ('fn = [correct("rldsl.rewards:exact_match"), close("rldsl.rewards:char_match", weight = 0.5),\n'
              '      penalty("tests.reward_fns:raise_on_bad", weight = -0.25)]')


def compiled(fn: str, base_dir: Path = Path("/")):  # `/` holds no module of these names: nothing is anchored
    assert SINGLE in BASE
    return compile_source(BASE.replace(SINGLE, fn), "t.rlp", base_dir=base_dir)


def errors(fn: str) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in compiled(fn).diagnostics if d.is_error]


def test_components_reach_the_plan_and_a_single_function_is_unchanged():
    result = compiled(COMPONENTS)
    assert result.ok, [d.message for d in result.diagnostics]
    assert result.plan.pipeline().stage("score").settings["fn"] == [
        {"name": "correct", "fn": "rldsl.rewards:exact_match", "weight": 1.0},
        {"name": "close", "fn": "rldsl.rewards:char_match", "weight": 0.5},
        {"name": "penalty", "fn": "tests.reward_fns:raise_on_bad", "weight": -0.25}]
    assert compiled(SINGLE).plan.pipeline().stage("score").settings["fn"] == "rldsl.rewards:exact_match"


def test_a_component_beside_the_pipeline_file_is_anchored(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def tagged(response, answer, prompt):\n    return 1.0\n")
    text = BASE.replace(SINGLE, 'fn = [tagged("my_rewards:tagged", weight = 0.1)]')
    fn = compile_source(text, "t.rlp", base_dir=tmp_path).plan.pipeline().stage("score").settings["fn"]
    assert fn == [{"name": "tagged", "fn": f"my_rewards:tagged@{tmp_path.resolve()}", "weight": 0.1}]


@pytest.mark.parametrize(("fn", "code", "says"), [
    ('fn = [correct("rldsl.rewards")]', "RLP104", "is not a `module:function` reference"),
    ('fn = [correct("rldsl.rewards:exact_match", weight = "high")]', "RLP104", "expected a number"),
    ('fn = [correct("rldsl.rewards:exact_match", weight = 2s)]', "RLP104", "expected a number"),
    ('fn = [correct("m:f"), correct("m:g")]', "RLP102", "`correct` given twice"),
    ('fn = ["rldsl.rewards:exact_match"]', "RLP104", "expected a named reward component"),
    ('fn = [correct("m:f", wieght = 2)]', "RLP103", "takes no `wieght`"),
    ('fn = [correct(weight = 2)]', "RLP104", "names no function"),
    ("fn = []", "RLP104", "an empty reward list"),
])
def test_a_bad_component_gets_a_coded_diagnostic(fn, code, says):
    found = errors(fn)
    assert any(c == code and says in message for c, message in found), found


def test_the_reward_is_the_weighted_sum_of_its_components():
    spec = compiled(COMPONENTS).plan.pipeline().stage("score").settings["fn"]
    reward = load_reward(spec)
    assert isinstance(reward, WeightedRewards)
    assert reward.parts("abcd", "abcx", "") == {"correct": 0.0, "close": 0.75, "penalty": 1.0}
    assert reward("abcd", "abcx", "") == pytest.approx(0.5 * 0.75 - 0.25)
    assert reward("ab", "ab", "") == pytest.approx(1.0 + 0.5 - 0.25)


def test_reward_processes_return_the_sum_with_its_parts():
    spec = compiled(COMPONENTS).plan.pipeline().stage("score").settings["fn"]
    pool = RewardPool(spec, processes=1, timeout_s=10)
    try:
        pool.wait_ready()
        right, partly, bad = pool.score([("ab", "ab", ""), ("abcd", "abcx", ""), ("bad", "bad", "")])
    finally:
        pool.close()
    assert isinstance(right, ComponentReward) and right == pytest.approx(1.25)
    assert right.parts == {"correct": 1.0, "close": 1.0, "penalty": 1.0}
    assert partly == pytest.approx(0.125) and partly.parts["close"] == 0.75
    assert isinstance(bad, RewardFailure) and "component 'penalty'" in bad.detail  # one failing part drops it
    copy = pickle.loads(pickle.dumps(right))  # as it crosses from the reward worker to the controller
    assert copy == right and copy.parts == right.parts


def test_each_component_mean_reaches_the_step_record_and_the_metrics():
    kept = _reward_or_failure(ComponentReward(1.5, {"correct": 1.0, "close": 1.0}))
    assert kept.parts == {"correct": 1.0, "close": 1.0}
    groups = [Group(0, ("a", "b"), 0, 0, reward_parts=({"correct": 1.0, "close": 1.0},
                                                       {"correct": 0.0, "close": 0.5})),
              Group(1, ("c",), 0, 0, reward_parts=({"correct": 1.0, "close": 0.0},))]
    record = _component_means(groups)
    assert record == {"reward_components": {"correct": pytest.approx(2 / 3), "close": 0.5}}
    assert _component_means([Group(2, ("d",), 0, 0)]) == {}  # a single function: the record is as before
    scalars = step_scalars({"reward_mean": 0.9, **record})
    assert scalars["reward/correct"] == pytest.approx(2 / 3) and scalars["reward/close"] == 0.5
