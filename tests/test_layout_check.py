"""A plan that checks is a plan that launches: `check` runs the launcher's
own bundle layout (rldsl.layout) and refuses what Ray cannot place (RLP512)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_file
from rldsl.layout import actor_slots, layout_bundles

ROOT = Path(__file__).resolve().parent.parent
CLEAN = sorted((ROOT / "pipelines").glob("*.rlp")) + [ROOT / "tests" / "golden" / "base.rlp"]


@pytest.mark.parametrize("path", CLEAN, ids=lambda p: p.name)
def test_every_shipped_pipeline_lays_out_as_the_launcher_lays_it_out(path):
    result = compile_file(path)
    assert result.ok and result.plan is not None, [d.message for d in result.diagnostics if d.is_error]
    # the launcher's two calls: on a cluster (one group per node) and folded onto a local Ray
    layout_bundles(actor_slots(result.plan), 0.25)
    layout_bundles(actor_slots(result.plan), 0.25, result.plan.cluster.gpus_per_node)


def test_a_multi_gpu_replica_sharing_its_gpus_is_refused_by_check():
    result = compile_file(ROOT / "tests" / "golden" / "RLP512.rlp", want_plan=False)
    (finding,) = result.diagnostics
    assert finding.code == "RLP512" and "`rollout-0` drives GPUs 0, 1" in finding.message
    assert compile_file(ROOT / "tests" / "golden" / "RLP512.rlp").plan is None  # no plan to run either


def test_a_vllm_replica_on_shared_gpus_leaves_them_to_its_engines_workers():
    """verl's colocated layout: a tp-2 vLLM replica on its trainer's two GPUs. The GPUs keep a bundle each; the
    replica's actor asks none in the first, its engine's Ray workers take its share of each (the variables vLLM's
    Ray executor reads); the factory picks that executor from the same plan."""
    from rldsl.compiler.driver import compile_source
    from rldsl.runtime.engines.factory import _vllm_options
    from rldsl.runtime.ray_lowering.placement import engine_worker_env

    text = (ROOT / "tests" / "golden" / "RLP512.rlp").read_text().replace("sglang(tp = 2)", "vllm(tp = 2)")
    result = compile_source(text)
    assert result.ok, [d.message for d in result.diagnostics]
    layout = layout_bundles(actor_slots(result.plan), 0.25, 4)
    assert [(b.gpus, sorted(s.name for s in b.residents)) for b in layout.nodes[0]] == [
        ((0,), ["actor-0", "rollout-0"]), ((1,), ["actor-1"]), ((2,), []), ((3,), [])]
    replica, trainer = layout.slot("rollout-0"), layout.slot("actor-0")
    assert layout.workers == {"rollout-0": (0, 1)} and [b.gpus for b in layout.worker_bundles(replica)] == [(0,), (1,)]
    # the second rank is its bundle's only resident, but the replica's worker shares its GPU
    assert (layout.num_gpus(replica), layout.worker_gpus(replica), layout.num_gpus(trainer),
            layout.num_gpus(layout.slot("actor-1"))) == (0.0, 0.5, 0.5, 0.5)
    assert engine_worker_env(layout, replica) == {"VLLM_RAY_BUNDLE_INDICES": "0,1", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    options = _vllm_options(result.plan.pipelines[0].stage("rollout"))
    assert options.shares_gpus and options.executor_backend() == "ray"
    apart = compile_source(text.replace("colocate = rollout", "gpus = [2, 3]"))
    assert apart.ok and not _vllm_options(apart.plan.pipelines[0].stage("rollout")).shares_gpus  # "mp", as before
    assert layout_bundles(actor_slots(apart.plan), 0.25).workers == {}
