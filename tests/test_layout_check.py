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
