"""CoalescedStage: at most `slots` calls at once, waiting groups merged, each answered with its own slice."""

import asyncio

import pytest

from rldsl.runtime.control.coalesce import CoalescedStage


class Recorder:
    """A stage that answers each key with its own name and records every call."""

    def __init__(self, delay: float = 0.01, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.running = self.most_running = 0
        self.delay, self.fail_on = delay, fail_on

    async def __call__(self, keys: list[str]):
        self.calls.append(keys)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_on in keys:
                raise RuntimeError(f"stage failed on {self.fail_on}")
            return [f"r:{key}" for key in keys]
        finally:
            self.running -= 1


def groups(count: int, size: int = 2) -> list[list[str]]:
    return [[f"g{g}s{s}" for s in range(size)] for g in range(count)]


def test_a_lone_group_is_sent_at_once():
    async def main():
        stage = Recorder()
        coalesced = CoalescedStage(stage, slots=1, max_keys=64)
        assert await coalesced(["a", "b"]) == ["r:a", "r:b"]
        return stage.calls

    assert asyncio.run(main()) == [["a", "b"]]


def test_groups_arriving_while_the_slot_is_busy_go_in_one_call_with_their_own_results():
    async def main():
        stage = Recorder()
        coalesced = CoalescedStage(stage, slots=1, max_keys=64)
        results = await asyncio.gather(*(coalesced(keys) for keys in groups(5)))
        return stage, results

    stage, results = asyncio.run(main())
    assert [len(call) for call in stage.calls] == [2, 8]  # the first alone, the four that waited together
    assert results == [[f"r:{key}" for key in keys] for keys in groups(5)]


def test_never_more_calls_than_slots_and_max_keys_bounds_a_call():
    async def main():
        stage = Recorder()
        coalesced = CoalescedStage(stage, slots=2, max_keys=4)
        await asyncio.gather(*(coalesced(keys) for keys in groups(9)))
        return stage

    stage = asyncio.run(main())
    assert stage.most_running == 2
    assert all(len(call) <= 4 for call in stage.calls)
    assert sorted(key for call in stage.calls for key in call) == sorted(k for keys in groups(9) for k in keys)
    assert len(stage.calls) < 9


def test_a_failed_call_fails_every_group_it_carried_and_no_other():
    async def main():
        stage = Recorder(fail_on="g2s0")
        coalesced = CoalescedStage(stage, slots=1, max_keys=64)
        first = asyncio.create_task(coalesced(groups(1)[0]))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(coalesced(keys)) for keys in groups(4)[1:]]
        ok = await first
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        return ok, outcomes

    ok, outcomes = asyncio.run(main())
    assert ok == ["r:g0s0", "r:g0s1"]
    assert all(isinstance(o, RuntimeError) and "g2s0" in str(o) for o in outcomes)


def test_a_stage_without_results_answers_none():
    async def main():
        async def logprob(keys):
            await asyncio.sleep(0)

        coalesced = CoalescedStage(logprob, slots=1, max_keys=8)
        return await asyncio.gather(*(coalesced(keys) for keys in groups(3)))

    assert asyncio.run(main()) == [None, None, None]


def test_a_wrong_number_of_results_is_an_error_for_every_request():
    async def main():
        async def short(keys):
            return [0.0]

        coalesced = CoalescedStage(short, slots=1, max_keys=8)
        return await asyncio.gather(coalesced(["a", "b"]), return_exceptions=True)

    (outcome,) = asyncio.run(main())
    assert isinstance(outcome, ValueError) and "1 results for 2 samples" in str(outcome)


def test_slots_and_max_keys_must_be_positive():
    with pytest.raises(ValueError, match="slots >= 1"):
        CoalescedStage(Recorder(), slots=0, max_keys=8)


def test_logprobs_written_by_a_merged_call_line_up_with_one_groups_responses():
    import torch

    from rldsl.runtime import protocols as p
    from rldsl.runtime.dataplane.base import align_to_responses

    fields = {p.FIELD_RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 0, 0]]),
              p.FIELD_REF_LOGPROBS: torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]]),
              p.FIELD_BEHAVIOUR_LOGPROBS: torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])}
    aligned = align_to_responses(fields)
    assert aligned[p.FIELD_REF_LOGPROBS].tolist() == [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]
    assert aligned[p.FIELD_BEHAVIOUR_LOGPROBS].tolist() == [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]
