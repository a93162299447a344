"""Several LoRA pipelines on one base (`served_by`): one generator engine
holds the base once and serves each pipeline's adapters, pushed by that
pipeline's own trainer; `check` refuses what one engine cannot serve
(RLP514); the plan and the memory model count the base once."""

from pathlib import Path

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.compiler.plan_view import render_plan
from rldsl.layout import actor_slots
from rldsl.models.lora import is_adapter, share_base, trained_state
from rldsl.runtime.engines.factory import build_generator, build_trainer
from rldsl.runtime.engines.torch.common import response_logprobs
from tests.test_lora import batch_for, trained

PIPELINE = Path(__file__).parent.parent / "pipelines" / "lora_many.rlp"
TEXT = PIPELINE.read_text()


def compiled(text: str = TEXT):
    return compile_source(text, str(PIPELINE), base_dir=PIPELINE.parent)


def planned(text: str = TEXT):
    result = compiled(text)
    assert result.ok, [d.message for d in result.diagnostics if d.is_error]
    return result


def stage(pipe, kind):
    return next(s for s in pipe.stages if s.kind == kind)


def test_served_stages_run_on_the_serving_generator_and_the_plan_counts_the_base_once():
    result = planned()
    exact, chars, rloo = result.plan.pipelines
    server = stage(exact, "generate")
    for tenant in (chars, rloo):
        served = stage(tenant, "generate")
        assert served.served_by == "exact/rollout" and served.own_ranks == [] and served.ranks == server.ranks
        assert served.engine == server.engine and served.settings["max_new_tokens"] == 8
        assert served.settings["samples_per_prompt"] == 8
    assert [s.name for s in actor_slots(result.plan) if "rollout" in s.name] == ["exact/rollout-0"]
    text = render_plan(result)
    assert "gpu 0: exact/rollout[0] (serves chars, rloo)" in text
    assert text.count("served by exact/rollout") == 2
    # one base, three adapter sets and three decode batches on the generator's GPU
    alone = render_plan(planned(_alone()))
    assert "exact/rollout  generation 2.0MiB: params 420.8KiB, adapters 72.0KiB, kv cache 1.5MiB" in text
    assert "rollout  generation 956.8KiB: params 420.8KiB, adapters 24.0KiB, kv cache 512.0KiB" in alone


def _alone() -> str:
    """The file without the pipelines `exact` serves."""
    return TEXT[:TEXT.index("pipeline chars")]


def test_a_served_engine_shares_the_base_tensors_and_samples_with_its_own_adapters():
    plan = planned().plan
    exact, chars = plan.pipelines[:2]
    server = build_generator(stage(exact, "generate"), exact, seed=0)
    tenant = build_generator(stage(chars, "generate"), chars, seed=0, base=server)
    mine = {n: t for n, t in tenant.model.module.state_dict().items() if not is_adapter(n)}
    theirs = server.model.module.state_dict()
    assert mine and all(mine[n].data_ptr() == theirs[n].data_ptr() for n in mine)  # held once
    assert all(a.data_ptr() != theirs[n].data_ptr() for n, a in trained_state(tenant.model.module).items())

    trainer = build_trainer(stage(chars, "train"), chars, seed=0)
    result = trained(trainer)
    batch = batch_for(trainer.model)
    before = response_logprobs(server.model, batch)
    for index, bucket in enumerate(buckets := list(trainer.weight_buckets(1 << 20))):
        tenant.update_weights(bucket, result.version, index == len(buckets) - 1)
    assert torch.equal(response_logprobs(tenant.model, batch), response_logprobs(trainer.model, batch))
    assert torch.equal(response_logprobs(server.model, batch), before)  # the other pipeline's adapters stay
    assert not torch.allclose(response_logprobs(tenant.model, batch), before)
    assert (tenant.version, server.version) == (2, 0)


def test_models_that_do_not_share_a_base_are_refused_when_the_engine_starts():
    plan = planned().plan
    exact, chars = plan.pipelines[:2]
    server = build_generator(stage(exact, "generate"), exact, seed=0)
    with torch.no_grad():
        next(p for n, p in server.model.module.named_parameters() if not is_adapter(n)).add_(1.0)
    with pytest.raises(ValueError, match="do not share one base"):
        build_generator(stage(chars, "generate"), chars, seed=0, base=server)
    with pytest.raises(ValueError, match="do not share one base"):
        share_base(torch.nn.Linear(2, 2), torch.nn.Linear(3, 2))


CHARS = TEXT[TEXT.index("pipeline chars"):TEXT.index("pipeline rloo")]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('"builtin:tiny-lm"  lora_rank = 8 }\n  dataset prompts { source = "builtin:arith"  eval_size '
                         '= 64 }\n\n  stage generate rollout { model = policy  served_by',
                         '"builtin:tiny-lm" }\n  dataset prompts { source = "builtin:arith"  eval_size = 64 }\n\n'
                         '  stage generate rollout { model = policy  served_by', 1),
     "model `policy` of pipeline `chars` has no `lora_rank`"),
    (lambda t: t.replace("served_by = exact  samples_per_prompt = 8 }",
                         "served_by = exact  samples_per_prompt = 8  max_new_tokens = 4 }", 1),
     "is served by `exact`'s generator but sets `max_new_tokens`"),
    (lambda t: t.replace("served_by = exact", "served_by = chars", 1), "a pipeline does not serve itself"),
    (lambda t: t.replace(CHARS, CHARS.replace("builtin:arith", "builtin:reverse")),
     "warm start per builtin task"),
    (lambda t: t.replace(CHARS, CHARS.replace("run { steps = 20 }", "run { steps = 20  seed = 3 }")),
     "seeds differ"),
    (lambda t: t.replace("engine = torch  gpus = [0]", "engine = sim  gpus = [0]", 1), "uses engine `sim`"),
    (lambda t: t.replace("gpus = [0]  samples_per_prompt = 8  max_new_tokens = 8 }",
                         "gpus = [1]  samples_per_prompt = 8  max_new_tokens = 8 }", 1),
     "serves chars, rloo but shares its GPUs with"),
])
def test_check_refuses_what_one_generator_cannot_serve(edit, message):
    text = edit(TEXT)
    assert text != TEXT
    found = [d for d in compiled(text).diagnostics if d.code == "RLP514"]
    assert any(message in d.message for d in found), [d.message for d in compiled(text).diagnostics]


def test_served_by_names_a_pipeline_of_the_file():
    found = compiled(TEXT.replace("served_by = exact", "served_by = exactly", 1)).diagnostics
    assert [d.message for d in found if d.code == "RLP101"] == ["no pipeline named `exactly`"]
