"""Reward models as stages: the scoring classifier checked against
transformers by hand, the generating judge with the builtin tiny model, the
timeout, failures and component sums of ``JudgeScoring``, the shipped
parsers, and what the compiler makes of a reward stage with a model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.rewards.judge import JudgeParseError, compact_prompt, first_number, out_of_ten, yes_no
from rldsl.runtime.control.ledger import REWARD_INVALID, REWARD_RAISED, REWARD_TIMEOUT
from rldsl.runtime.protocols import ComponentReward, Prompt, RewardFailure
from rldsl.runtime.ray_lowering.judge import JudgeScoring
from tests.hf_tiny import save_char_llama

GOLDEN_BASE = (Path(__file__).parent / "golden" / "base.rlp").read_text()
REWARD = 'stage reward score { fn = "rldsl.rewards:exact_match" }'


def save_reward_model(path: Path, num_labels: int = 1) -> Path:
    """The tiny character Llama of hf_tiny.py with a classification head."""
    import torch
    import transformers

    save_char_llama(path)
    config = transformers.AutoConfig.from_pretrained(path, num_labels=num_labels)
    torch.manual_seed(1)
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm"))


def test_the_classifier_logit_is_the_reward_as_transformers_computes_it(reward_model):
    import torch
    import transformers

    from rldsl.runtime.engines.judge import ScoreJudge

    pairs = [("12+7=", "19"), ("12+7=", "a much longer wrong answer")]
    judge = ScoreJudge(str(reward_model), rows_per_forward=2)  # both rows in one padded forward
    rewards = judge.score(pairs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    with torch.no_grad():  # one row at a time: no padding to get wrong
        by_hand = [model(**tokenizer(p + r, return_tensors="pt")).logits[0, 0].item() for p, r in pairs]
    assert rewards == pytest.approx(by_hand, abs=1e-5)
    assert rewards[0] != pytest.approx(rewards[1])


def test_a_chat_template_formats_the_pair(reward_model):
    from rldsl.runtime.engines.judge import ScoreJudge

    judge = ScoreJudge(str(reward_model))
    judge.tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert judge.text("2+2=", "4") == "<user>2+2=<assistant>4"


def test_the_generating_judge_answers_greedily_and_its_answer_is_parsed():
    from rldsl.models import load_model
    from rldsl.runtime.engines.judge import GenerativeJudge
    from rldsl.runtime.engines.torch.generate import TorchGenerator

    model = load_model("builtin:tiny-lm", seed=3)
    samples = [("19", "19", "12+7="), ("5", "7", "3+4=")]
    seen = []

    def parse(text: str) -> float:
        seen.append(text)
        return float(len(text))

    scoring = JudgeScoring(GenerativeJudge(model, max_new_tokens=5), "judge", template=compact_prompt, parse=parse)
    values = scoring.values(samples)
    greedy = TorchGenerator(model, max_new_tokens=5, temperature=0.0)
    by_hand = greedy.generate_greedy([Prompt(i, compact_prompt(p, r, a), "") for i, (r, a, p) in enumerate(samples)])
    assert seen == by_hand and values == [float(len(t)) for t in by_hand]


class _Judge:
    """A judge whose answers and delays the test chooses."""

    def __init__(self, answers: dict[str, str] | None = None, hang_on: str = "", raise_on: str = ""):
        self.answers, self.hang_on, self.raise_on = answers or {}, hang_on, raise_on

    def answer(self, texts):
        if any(self.hang_on and self.hang_on in t for t in texts):
            time.sleep(2.0)
        if any(self.raise_on and self.raise_on in t for t in texts):
            raise RuntimeError("CUDA error: out of memory")
        return [self.answers.get(t, "Score: 7") for t in texts]

    def score(self, pairs):
        return [float(len(response)) for _, response in pairs]


def _scoring(judge, **kwargs) -> JudgeScoring:
    template = kwargs.pop("template", lambda prompt, response, answer: response)
    return JudgeScoring(judge, "judge", template=template, parse=kwargs.pop("parse", first_number), **kwargs)


def test_an_unreadable_answer_drops_its_sample_as_invalid_with_the_text():
    values = _scoring(_Judge({"b": "I refuse"})).values([("a", "", ""), ("b", "", "")])
    assert values[0] == 7.0
    assert isinstance(values[1], RewardFailure) and values[1].reason == REWARD_INVALID
    assert "I refuse" in values[1].detail


def test_a_hung_forward_drops_only_its_rows_within_the_timeout():
    scoring = _scoring(_Judge(hang_on="slow"), timeout_s=0.3, micro_batch=1)
    started = time.monotonic()
    values = scoring.values([("slow", "", ""), ("fast", "", "")])
    assert time.monotonic() - started < 1.5  # not the 2 s the hung forward takes
    assert isinstance(values[0], RewardFailure) and values[0].reason == REWARD_TIMEOUT
    assert values[1] == 7.0


def test_a_raising_judge_or_template_drops_only_its_rows():
    values = _scoring(_Judge(raise_on="boom"), micro_batch=1).values([("boom", "", ""), ("ok", "", "")])
    assert isinstance(values[0], RewardFailure) and values[0].reason == REWARD_RAISED
    assert "out of memory" in values[0].detail and values[1] == 7.0

    def template(prompt, response, answer):
        if response == "bad":
            raise KeyError("missing field")
        return response

    values = _scoring(_Judge(), template=template).values([("bad", "", ""), ("good", "", "")])
    assert isinstance(values[0], RewardFailure) and "template raised KeyError" in values[0].detail
    assert values[1] == 7.0


def test_the_score_judge_path_and_a_non_number():
    scoring = JudgeScoring(_Judge(), "rm")
    assert scoring.values([("abc", "", "p")]) == [3.0]

    class NaNJudge:
        def score(self, pairs):
            return [float("nan")] * len(pairs)

    (value,) = JudgeScoring(NaNJudge(), "rm").values([("x", "", "")])
    assert isinstance(value, RewardFailure) and value.reason == REWARD_INVALID


def test_the_model_is_one_weighted_component_among_the_functions():
    scoring = JudgeScoring(_Judge(), "judge", weight=0.5)
    functions = [ComponentReward(1.1, {"correct": 1.0, "format": 1.0}), 0.0,
                 RewardFailure(REWARD_RAISED, "component 'format': ...")]
    rewards = scoring.combine([4.0, 2.0, 1.0], functions)
    assert rewards[0] == pytest.approx(3.1) and rewards[0].parts == {"judge": 4.0, "correct": 1.0, "format": 1.0}
    assert rewards[1] == pytest.approx(1.0) and rewards[1].parts == {"judge": 2.0, "fn": 0.0}
    assert rewards[2] is functions[2]
    alone = scoring.combine([4.0, RewardFailure(REWARD_INVALID, "x")], None)
    assert alone[0] == pytest.approx(2.0) and alone[0].parts == {"judge": 4.0}
    assert isinstance(alone[1], RewardFailure)
    named = scoring.combine([4.0], [1.0], function_name="exact_match")
    assert named[0].parts == {"judge": 4.0, "exact_match": 1.0}


def test_the_shipped_parsers():
    assert first_number("Score: 7/10") == 7.0 and first_number("-0.5 points") == -0.5
    assert out_of_ten("8") == 0.8 and out_of_ten("Score: 12") == 1.0 and out_of_ten("-3") == 0.0
    assert yes_no(" Yes, it is.") == 1.0 and yes_no("no") == 0.0
    for parse, text in ((first_number, "none"), (yes_no, "maybe")):
        with pytest.raises(JudgeParseError):
            parse(text)


# ------------------------------------------------------------------ compiler


def _judge_file(stage: str, models: str = 'model rm { source = "builtin:tiny-lm" }', eval_size: int = 0,
                cluster: int = 5) -> str:
    text = GOLDEN_BASE.replace("gpus_per_node = 4", f"gpus_per_node = {cluster}")
    text = text.replace('dataset prompts { source = "builtin:arith" }',
                        f'{models}\ndataset prompts {{ source = "builtin:arith"  eval_size = {eval_size} }}')
    return text.replace(REWARD, stage)


def _compile(text: str, base_dir: Path | None = None):
    return compile_source(text, str((base_dir or Path(".")) / "judge.rlp"), base_dir=base_dir)


def _codes(result) -> set[str]:
    return {d.code for d in result.diagnostics}


def test_a_reward_model_stage_is_placed_and_planned_like_a_gpu_stage():
    result = _compile(_judge_file("stage reward score { model = rm  judge = generate  gpus = 1  weight = 0.5 }"))
    assert result.ok, result.diagnostics
    stage = result.plan.pipeline().stage("score")
    assert stage.engine.name == "torch" and stage.model == "rm"
    assert [r.gpus for r in stage.ranks] == [[4]]  # after the generate and train stages
    assert stage.settings["judge"] == "generate" and stage.settings["weight"] == 0.5
    assert stage.settings["template"].partition("@")[0] == "rldsl.rewards.judge:judge_prompt"
    assert "score" not in result.plan.pipeline().weight_receivers()  # frozen: no sync reaches it
    memory = {name: bytes_ for gpu in result.memory for name, bytes_ in gpu.by_stage}
    assert memory["demo/score"] > 107_712 * 4  # the judge's weights and its KV cache


def test_a_reward_stage_without_a_model_plans_as_before():
    stage = _compile(GOLDEN_BASE).plan.pipeline().stage("score")
    assert stage.engine is None and stage.model is None and stage.ranks[0].gpus == []
    assert set(stage.settings) == {"fn", "workers", "timeout", "straggler", "processes"}


def test_a_reward_model_colocates_and_counts_in_the_gpus_it_shares():
    result = _compile(_judge_file("stage reward score { model = rm  judge = generate  colocate = actor }",
                                  cluster=4))
    assert result.ok, result.diagnostics
    pipe = result.plan.pipeline()
    assert [r.gpus for r in pipe.stage("score").ranks] == [r.gpus for r in pipe.stage("actor").ranks]
    shared = next(gpu for gpu in result.memory if len(gpu.by_stage) == 2)
    assert not next(d for (name, _), d in zip(shared.by_stage, shared.details) if name == "demo/score").sleeps


def test_a_reward_model_over_the_cluster_is_refused():
    result = _compile(_judge_file("stage reward score { model = rm  judge = generate }", cluster=4))
    assert "RLP501" in _codes(result)


@pytest.mark.parametrize("stage, code", [
    ("stage reward score { workers = 2 }", "RLP107"),
    ('stage reward score { fn = "rldsl.rewards:exact_match"  gpus = 1 }', "RLP113"),
    ("stage reward score { model = rm  parse = \"m:f\" }", "RLP113"),
    ("stage reward score { model = rm  judge = generate  template = \"not a function\" }", "RLP104"),
    ("stage reward score { model = rm  judge = generate  parse = \"m.f\" }", "RLP104"),
    ("stage reward score { model = rm  judge = generate  engine = vllm }", "RLP501"),  # vllm may judge: it fits
    ("stage reward score { model = rm }", "RLP114"),
    ('stage reward score { model = rm  judge = generate  fn = [score("rldsl.rewards:exact_match")] }', "RLP102"),
    ("stage reward score { model = rm  judge = generate  gpus = 1 }\n"
     "stage sync more { from = actor  to = score }", "RLP206"),  # frozen: never synced
])
def test_reward_model_settings_get_coded_findings(stage, code):
    assert code in _codes(_compile(_judge_file(stage, cluster=4)))


def test_evaluation_by_the_reward_needs_no_reward_model():
    result = _compile(_judge_file("stage reward score { model = rm  judge = generate  gpus = 1 }", eval_size=8))
    assert _codes(result) == {"RLP115"}


@pytest.mark.parametrize("labels, judge, refused", [
    (1, "score", False), (2, "score", True), (1, "generate", True)])
def test_a_score_judge_needs_a_one_label_classifier(tmp_path, labels, judge, refused):
    config = {"architectures": ["LlamaForSequenceClassification"], "num_labels": labels}
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    text = _judge_file(f"stage reward score {{ model = rm  judge = {judge}  gpus = 1 }}",
                       models='model rm { source = "hf:rm"  params = 1M }')
    assert ("RLP114" in _codes(_compile(text, tmp_path))) == refused


def test_a_causal_lm_cannot_score(tmp_path):
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    text = _judge_file("stage reward score { model = rm  gpus = 1 }",
                       models='model rm { source = "hf:lm"  params = 1M }')
    found = next(d for d in _compile(text, tmp_path).diagnostics if d.code == "RLP114")
    assert "not a sequence classifier (LlamaForCausalLM" in found.message
