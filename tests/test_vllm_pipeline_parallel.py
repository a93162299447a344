"""vLLM with pipeline parallelism, without vLLM: a replica is tp x pp GPUs,
may span nodes only when pp > 1 (whole tp groups on each node), is shown
in the plan, reserved node by node, and built with the right vllm.LLM
arguments."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.plan_view import render_plan
from rldsl.plan import ExecutionPlan
from rldsl.runtime.engines import vllm as ve
from rldsl.runtime.engines.factory import _vllm_options
from rldsl.runtime.ray_lowering.bundles import LayoutError, actor_slots, layout_bundles

SOURCE = """
pipeline p
cluster { nodes = 2  gpus_per_node = 4  gpu = "H100"  gpu_memory = 80GiB }
model policy { source = "hf:/models/tiny"  params = 1B }
dataset prompts { source = "jsonl:data/train.jsonl" }
stage generate rollout { model = policy  engine = ENGINE  gpus = GPUS  samples_per_prompt = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = torch  gpus = 0  prompts_per_step = 2  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
"""


def compiled(engine: str = "vllm(tp = 4, pp = 2)", gpus: int = 8):
    return compile_source(SOURCE.replace("ENGINE", engine).replace("GPUS", str(gpus)))


def codes(result) -> set[str]:
    return {d.code for d in result.diagnostics if d.severity == "error"}


def test_a_tp4_pp2_replica_spans_two_nodes_and_is_printed():
    result = compiled()
    assert result.ok, [d.message for d in result.diagnostics]
    stage = result.plan.pipeline().stage("rollout")
    assert (stage.tp, stage.pp, stage.dp) == (4, 2, 1)
    (rank,) = stage.ranks  # one actor drives the whole replica
    assert (rank.node, rank.gpus) == (0, [0, 1, 2, 3])
    assert [(r.node, r.gpus) for r in rank.remote] == [(1, [0, 1, 2, 3])]
    shown = render_plan(result)
    assert "rollout      generate  vllm     tp=4 pp=2 dp=1" in shown
    assert "replicas (tp 4 x pp 2 each): [0:0,0:1,0:2,0:3,1:0,1:1,1:2,1:3]" in shown
    assert "node 1\n    gpu 0: rollout[0] tp4 pp2" in shown
    assert "8/8 GPUs" in shown


def test_the_plan_keeps_the_remote_gpus_through_json():
    plan = compiled().plan
    again = ExecutionPlan.from_json(plan.to_json())
    assert again.pipeline().stage("rollout").ranks == plan.pipeline().stage("rollout").ranks


def test_a_replica_crosses_nodes_only_with_whole_tp_groups():
    assert "RLP503" in codes(compiled("vllm(tp = 8)"))  # pp = 1: the replica is one tp group
    assert "RLP503" in codes(compiled("vllm(tp = 8, pp = 1)", gpus=8))
    assert "RLP502" in codes(compiled("vllm(tp = 4, pp = 2)", gpus=4))  # tp x pp does not fit its GPUs
    assert compiled("vllm(tp = 2, pp = 2)").ok  # two replicas, each on one node


def test_a_replica_across_nodes_gets_a_bundle_on_each_node_and_its_actor_on_the_first():
    layout = layout_bundles(actor_slots(compiled().plan), actor_cpus=0.25)
    first, second = layout.nodes[0], layout.nodes[1]
    assert [(b.gpus, [s.name for s in b.residents]) for b in first] == [((0, 1, 2, 3), ["rollout-0"])]
    assert [(b.gpus, b.residents, [s.name for s in b.reserved_for]) for b in second] == [
        ((0, 1, 2, 3), [], ["rollout-0"])]
    assert layout.node_needs() == {0: {"GPU": 4.0, "CPU": 0.25}, 1: {"GPU": 4.0}}


def test_remote_gpus_shared_with_another_actor_are_refused():
    slots = actor_slots(compiled().plan)
    other = replace(slots[0], name="other-0", node=1, gpus=(2,), remote=())
    with pytest.raises(LayoutError, match="needs its GPUs to itself"):
        layout_bundles(slots + [other], actor_cpus=0.25)


@pytest.mark.parametrize("tp, pp, spans, backend", [(1, 1, False, None), (2, 1, False, "mp"),
                                                     (2, 2, False, "mp"), (4, 2, True, "ray")])
def test_llm_arguments_carry_pipeline_parallelism_and_the_executor(tp, pp, spans, backend):
    kwargs = ve.VLLMOptions(tp=tp, pp=pp, spans_nodes=spans).llm_kwargs("/models/m", seed=1)
    assert kwargs["tensor_parallel_size"] == tp and kwargs["pipeline_parallel_size"] == pp
    assert kwargs.get("distributed_executor_backend") == backend


def test_the_factory_reads_pp_and_whether_a_replica_spans_nodes():
    across = _vllm_options(compiled().plan.pipeline().stage("rollout"))
    assert (across.tp, across.pp, across.spans_nodes) == (4, 2, True)
    within = _vllm_options(compiled("vllm(tp = 2, pp = 2)").plan.pipeline().stage("rollout"))
    assert (within.pp, within.spans_nodes) == (2, False)
    assert within.llm_kwargs("/m", 0)["distributed_executor_backend"] == "mp"


def test_run_refuses_a_replica_across_nodes_before_starting_anything():
    from rldsl.runtime.ray_lowering.launch import PreflightError, preflight

    with pytest.raises(PreflightError, match="span nodes"):
        preflight(compiled().plan.pipeline())
