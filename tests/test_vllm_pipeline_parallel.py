"""vLLM with pipeline parallelism, without vLLM: a replica is tp x pp GPUs,
may span nodes only when pp > 1 (whole tp groups on each node), is shown
in the plan, reserved in a placement group of its own when it spans nodes
(tests/test_multinode.py places one on simulated Ray nodes), and
built with the right vllm.LLM arguments."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.compiler.plan_view import render_plan
from rldsl.plan import ExecutionPlan
from rldsl.runtime.engines import vllm as ve
from rldsl.runtime.engines import vllm_launch
from rldsl.runtime.engines.factory import _vllm_options
from rldsl.layout import LayoutError, actor_slots, layout_bundles

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


PP2_ON_TWO_NODES = """
pipeline p
cluster { nodes = 2  gpus_per_node = GPN }
model policy { source = "builtin:tiny-gpt2" }
dataset prompts { source = "builtin:arith" }
stage generate rollout { model = policy  engine = vllm(tp = 1, pp = 2)  gpus = ROLLOUT  samples_per_prompt = 4 }
stage reward score { fn = "rldsl.rewards:exact_match" }
stage train actor { model = policy  engine = sim  gpus = TRAIN  prompts_per_step = 2  micro_batch = 4 }
stage sync weights { from = actor  to = rollout }
flow prompts -> rollout -> score -> actor
"""


def pp2_plan(gpus_per_node: int = 1, rollout: str = "[0, 1]", train: str = "0"):
    result = compile_source(PP2_ON_TWO_NODES.replace("GPN", str(gpus_per_node)).replace("ROLLOUT", rollout)
                            .replace("TRAIN", train))
    assert result.ok, [d.message for d in result.diagnostics]
    return result.plan


def test_a_replica_across_nodes_gets_a_group_of_its_own_with_a_gpu_bundle_on_each_node():
    layout = layout_bundles(actor_slots(pp2_plan()), actor_cpus=0.25)
    group = layout.spanning["rollout-0"]
    assert [(b.index, b.node, b.gpus, b.resources(0.25)) for b in group.bundles] == [
        (0, 0, (0,), {"GPU": 1.0}), (1, 1, (0,), {"GPU": 1.0}), (2, 0, (), {"CPU": 0.25})]
    assert group.actor_bundle.residents == [layout.slot("rollout-0")] and layout.num_gpus(group.slot) == 0.0
    assert layout.nodes == {}  # no GPU left for a per-node group
    assert layout.node_needs() == {0: {"GPU": 1.0, "CPU": 0.25}, 1: {"GPU": 1.0}}


def test_per_node_groups_leave_out_the_gpus_of_a_replica_across_nodes():
    plan = pp2_plan(gpus_per_node=3, rollout="[1, 4]", train="[2, 5]")
    layout = layout_bundles(actor_slots(plan), actor_cpus=0.25)
    assert [(b.node, b.gpus) for b in layout.spanning["rollout-0"].gpu_bundles] == [(0, (1,)), (1, (1,))]
    for node in (0, 1):  # GPU 0 a filler, GPU 1 the replica's, GPU 2 the trainer rank's
        assert [(b.gpus, [s.name for s in b.residents]) for b in layout.nodes[node]] == [
            ((0,), []), ((2,), [f"actor-{node}"])]
    assert layout.node_needs()[0] == {"GPU": 3.0, "CPU": 0.5}
    folded = layout_bundles(actor_slots(plan), actor_cpus=0.25, gpus_per_node=3)
    assert [b.gpus for b in folded.nodes[1]] == [(0,), (2,)]


def test_a_tp4_pp2_replica_gets_eight_one_gpu_bundles_its_first_node_first():
    group = layout_bundles(actor_slots(compiled().plan), actor_cpus=0.25).spanning["rollout-0"]
    assert [(b.node, b.gpus) for b in group.gpu_bundles] == [(n, (g,)) for n in (0, 1) for g in range(4)]
    assert (group.actor_bundle.node, group.actor_bundle.index) == (0, 8)


def test_gpus_of_a_replica_across_nodes_shared_with_another_actor_are_refused():
    slots = actor_slots(compiled().plan)
    for node, gpu in ((1, 2), (0, 3)):  # a GPU its engine drives remotely, and one on its own node
        other = replace(slots[0], name="other-0", node=node, gpus=(gpu,), remote=())
        with pytest.raises(LayoutError, match=rf"`rollout-0` spans nodes and shares GPU\(s\) {node}:{gpu} with "
                                              "other-0: a replica across nodes needs its GPUs to itself"):
            layout_bundles(slots + [other], actor_cpus=0.25)


@pytest.mark.parametrize("tp, pp, spans, backend", [(1, 1, False, None), (2, 1, False, "mp"),
                                                     (2, 2, False, "mp"), (4, 2, True, "ray")])
def test_llm_arguments_carry_pipeline_parallelism_and_the_executor(tp, pp, spans, backend):
    kwargs = ve.VLLMOptions(tp=tp, pp=pp, spans_nodes=spans).engine_args("/models/m", seed=1)
    assert kwargs["tensor_parallel_size"] == tp and kwargs["pipeline_parallel_size"] == pp
    assert kwargs.get("distributed_executor_backend") == backend


def test_the_factory_reads_pp_and_whether_a_replica_spans_nodes():
    across = _vllm_options(compiled().plan.pipeline().stage("rollout"))
    assert (across.tp, across.pp, across.spans_nodes) == (4, 2, True)
    within = _vllm_options(compiled("vllm(tp = 2, pp = 2)").plan.pipeline().stage("rollout"))
    assert (within.pp, within.spans_nodes) == (2, False)
    assert within.engine_args("/m", 0)["distributed_executor_backend"] == "mp"


def test_run_no_longer_refuses_a_replica_across_nodes(tmp_path, monkeypatch):
    import importlib.util

    from rldsl.runtime.ray_lowering import launch

    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    model.mkdir()
    data.write_text("")
    text = SOURCE.replace("ENGINE", "vllm(tp = 4, pp = 2)").replace("GPUS", "8")
    pipe = compile_source(text.replace("/models/tiny", str(model)).replace("data/train.jsonl", str(data))).plan
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name))
    monkeypatch.setattr(launch, "has_cuda", lambda: True)  # as on a GPU machine with vLLM
    launch.preflight(pipe.pipeline())


def test_the_engine_process_of_a_replica_across_nodes_joins_the_actors_ray(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": "10.0.0.1:6379"}))
    vllm_launch._share_ray_address()
    assert os.environ["RAY_ADDRESS"] == "10.0.0.1:6379"
