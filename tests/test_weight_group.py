"""The controller's side of a weight group: which rank each member joins as.
A member stands for one rank, or for one per worker where its engine's
workers join the group themselves (a vLLM replica's: tests/test_vllm_run.py
runs a tp 2 one). The members' calls are recorded, as the controller makes
them (its ``call`` is given)."""

from __future__ import annotations

import asyncio

from rldsl.runtime.ray_lowering.weight_group import CollectiveSync, WeightGroupMember


def test_each_member_joins_at_its_first_rank_and_the_group_counts_every_worker():
    ranks = {("rollout", 0): 2, ("rollout", 1): 1, ("eval", 0): 2}  # two tp 2 vLLM replicas and a torch one
    joins = []

    async def call(stage, rank, method, *args):
        if method == "weight_group_ranks":
            return ranks[(stage, rank)]
        if method == "join_weight_group":
            joins.append((stage, rank, *args[1:3]))  # (stage, rank, its first rank in the group, size)
        return True

    sync = CollectiveSync("weights", list(ranks), store_dir=None)
    asyncio.run(sync._form(call, "actor"))
    assert sorted(joins) == sorted([("actor", 0, 0, 6), ("rollout", 0, 1, 6), ("rollout", 1, 3, 6),
                                    ("eval", 0, 4, 6)])
    assert sync.formed


class _Engine:
    joins_weight_groups, weight_group_ranks = True, 4


def test_a_member_stands_for_its_engines_workers_when_they_join_themselves():
    member = WeightGroupMember()
    assert member.weight_group_ranks() == 1  # no engine, or one that does not join: the member's own rank
    member.engine = _Engine()
    assert member.weight_group_ranks() == 4
    member.engine.joins_weight_groups = False
    assert member.weight_group_ranks() == 1
