"""The cluster GPU lease scheduler (control/leases.py) and pipelines that
shrink and expand under it (control/lease_pump.py), in one process."""

import asyncio

import pytest

from rldsl.runtime.control.leases import GENERATE, TRAIN, LeaseError, LeaseScheduler, LeaseWithdrawn
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import GpuBoard, SimConfig
from rldsl.runtime.inprocess.sharing import SharingPipeline, run_sharing


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def scheduler(gpus=("0:0", "0:1"), **kwargs):
    book = LeaseScheduler(gpus, tick_s=0.01, **kwargs)
    for name in ("a", "b"):
        book.register(name)
    return book


async def pending(coroutine):
    """Start an acquire and let it register its request."""
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(0.02)
    return task


def test_a_free_gpu_is_granted_and_acquire_is_idempotent():
    async def scenario():
        book = scheduler()
        await book.acquire("a", "rollout[0]", ["0:0"], GENERATE)
        await book.acquire("a", "rollout[0]", ["0:0"], GENERATE)  # a retry: already held
        assert book.stats("a")["holding"] == ["rollout[0]"]
        book.release("a", "rollout[0]")
        book.release("a", "rollout[0]")  # a retried release does nothing
        assert not book.holder_of

    asyncio.run(scenario())


def test_a_train_request_asks_a_busy_generation_lease_back_and_waits_for_it():
    async def scenario():
        book = scheduler()
        await book.acquire("b", "rollout[0]", ["0:0"], GENERATE)
        train = await pending(book.acquire("a", "trainer", ["0:0", "0:1"], TRAIN))
        assert not train.done()
        seq, revoked = await book.revoked("b", 0)
        assert revoked == ["rollout[0]"]
        book.release("b", "rollout[0]")  # the replica slept: now its GPU goes
        await asyncio.wait_for(train, 1)
        assert book.holder_of["0:0"].holder == "trainer" and book.holder_of["0:1"].holder == "trainer"
        assert (await book.revoked("b", seq))[1] == []

    asyncio.run(scenario())


def test_train_leases_are_never_asked_back():
    async def scenario():
        book = scheduler()
        await book.acquire("a", "trainer", ["0:0"], TRAIN)
        waiting = await pending(book.acquire("b", "trainer", ["0:0"], TRAIN))
        assert not book.shares["a"].revoked and not waiting.done()
        book.release("a", "trainer")
        await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


def test_an_idle_holder_is_asked_back_at_once_a_busy_one_only_after_its_quantum_and_when_ahead():
    async def scenario():
        clock = Clock()
        book = scheduler(quantum_s=5.0, clock=clock)
        await book.acquire("a", "rollout[0]", ["0:0"], GENERATE)
        clock.now = 1.0
        waiting = await pending(book.acquire("b", "rollout[0]", ["0:0"], GENERATE))
        assert not book.shares["a"].revoked  # busy and within its quantum
        clock.now = 6.0
        book.schedule()
        assert book.shares["a"].revoked == {"rollout[0]"}  # a held 6 GPU-s, b none: b is ahead
        book.release("a", "rollout[0]")
        await asyncio.wait_for(waiting, 1)
        book.set_idle("b", "rollout[0]", True)
        again = await pending(book.acquire("a", "rollout[0]", ["0:0"], GENERATE))
        assert book.shares["b"].revoked == {"rollout[0]"}  # idle: asked back whatever the shares
        book.release("b", "rollout[0]")
        await asyncio.wait_for(again, 1)

    asyncio.run(scenario())


def test_order_trains_first_then_priority_then_fewest_gpu_seconds_per_weight():
    async def scenario():
        clock = Clock()
        book = LeaseScheduler(["0:0"], clock=clock, tick_s=0.01)
        book.register("heavy", weight=1.0)
        book.register("light", weight=4.0)
        book.register("urgent", priority=1)
        book.shares["heavy"].used = book.shares["light"].used = 10.0
        await book.acquire("heavy", "blocker", ["0:0"], TRAIN)
        order = []

        async def ask(pipeline, holder, kind):
            await book.acquire(pipeline, holder, ["0:0"], kind)
            order.append(f"{pipeline}/{holder}")
            book.release(pipeline, holder)

        tasks = [await pending(ask("heavy", "r", GENERATE)), await pending(ask("light", "r", GENERATE)),
                 await pending(ask("urgent", "r", GENERATE)), await pending(ask("heavy", "trainer", TRAIN))]
        book.release("heavy", "blocker")
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert order == ["heavy/trainer", "urgent/r", "light/r", "heavy/r"]

    asyncio.run(scenario())


def test_a_gpu_wanted_by_an_earlier_request_is_not_given_to_a_later_one():
    async def scenario():
        book = scheduler()
        await book.acquire("b", "trainer", ["0:1"], TRAIN)
        trainer = await pending(book.acquire("a", "trainer", ["0:0", "0:1"], TRAIN))
        replica = await pending(book.acquire("b", "rollout[0]", ["0:0"], GENERATE))
        assert not replica.done()  # 0:0 is free, but the trainer before it in line needs it
        book.release("b", "trainer")
        await asyncio.wait_for(trainer, 1)
        book.release("a", "trainer")
        await asyncio.wait_for(replica, 1)

    asyncio.run(scenario())


def test_a_withdrawn_request_raises_for_its_waiter_and_finish_releases_everything():
    async def scenario():
        book = scheduler()
        await book.acquire("a", "trainer", ["0:0"], TRAIN)
        await book.acquire("a", "rollout[1]", ["0:1"], GENERATE)
        waiting = await pending(book.acquire("b", "rollout[0]", ["0:0"], GENERATE))
        book.release("b", "rollout[0]")
        with pytest.raises(LeaseWithdrawn):
            await waiting
        book.finish("a")
        assert not book.holder_of and book.stats("a")["holding"] == []
        with pytest.raises(LeaseError, match="not registered"):
            await book.acquire("a", "trainer", ["0:0"], TRAIN)
        with pytest.raises(LeaseError, match="not governed"):
            await book.acquire("b", "trainer", ["0:7"], TRAIN)

    asyncio.run(scenario())


def test_gpu_seconds_used_and_waited_are_counted_per_pipeline():
    async def scenario():
        clock = Clock()
        book = scheduler(clock=clock)
        await book.acquire("a", "trainer", ["0:0", "0:1"], TRAIN)
        waiting = await pending(book.acquire("b", "trainer", ["0:0"], TRAIN))
        clock.now = 3.0
        book.release("a", "trainer")
        await asyncio.wait_for(waiting, 1)
        clock.now = 4.0
        assert book.stats("a")["gpu_seconds_used"] == 6.0
        b = book.stats("b")
        assert (b["gpu_seconds_used"], b["gpu_seconds_waited"], b["lease_waits"]) == (1.0, 3.0, 1)

    asyncio.run(scenario())


# -- pipelines taking turns ---------------------------------------------------------------------------


def sharing_pipeline(name: str, trainer_gpus: tuple[int, ...], steps: int = 4, max_lag: int = 0,
                     generate_fail_prob: float = 0.0) -> SharingPipeline:
    settings = RunSettings(pipeline=name, prompts_per_step=4, samples_per_prompt=2, steps=steps, max_lag=max_lag,
                           reward_stages=("score",), watchdog_timeout_s=20, sleeping_replicas=trainer_gpus,
                           replica_leases=tuple((f"0:{gpu}",) for gpu in range(4)),
                           trainer_lease=tuple(f"0:{gpu}" for gpu in trainer_gpus))
    config = SimConfig(generate=Latency.jittered(0.02, 0.5), generate_per_group=0.01, generators=4,
                       reward=Latency.jittered(0.02, 0.5), reward_workers=4, microbatch=Latency.constant(0.005),
                       finish=Latency.constant(0.005), train_replicas=len(trainer_gpus),
                       generate_fail_prob=generate_fail_prob)
    return SharingPipeline(settings, config)


@pytest.mark.parametrize("max_lag", [0, 1])
def test_pipelines_sharing_every_gpu_never_hold_one_at_once_and_balance_their_ledgers(max_lag):
    """The GpuBoard raises the moment a phase wakes onto a GPU another holds;
    every ledger must balance and every lease come back."""
    pipelines = [sharing_pipeline("a", (0, 1), max_lag=max_lag), sharing_pipeline("b", (2, 3), max_lag=max_lag),
                 sharing_pipeline("c", (1,), max_lag=max_lag)]
    summaries, board = asyncio.run(run_sharing(pipelines, quantum_s=0.05))
    assert not board.resident and board.moves > 12
    for name, summary in summaries.items():
        assert summary["steps"] == 4, name
        ledger = summary["ledger"]
        assert ledger["open"] == 0 and ledger["trained"] == 4 * 4 * 2
        assert summary["max_lag"] <= max_lag
        sharing = summary["gpu_sharing"]
        assert sharing["holding"] == [] and sharing["grants"] >= 4 and sharing["gpu_seconds_used"] > 0


def test_a_failing_pipeline_gives_its_leases_back_and_the_others_finish():
    failing = sharing_pipeline("a", (0, 1), steps=50, generate_fail_prob=1.0)  # every generate call fails
    failing = SharingPipeline(RunSettings(**{**vars(failing.settings), "watchdog_timeout_s": 1.0}), failing.config)

    book = LeaseScheduler([f"0:{gpu}" for gpu in range(4)], quantum_s=0.05)

    async def scenario():
        with pytest.raises(Exception, match="no progress"):
            await run_sharing([failing, sharing_pipeline("b", (2, 3))], scheduler=book)

    asyncio.run(scenario())
    assert book.stats("b")["grants"] >= 4 and not book.holder_of  # b ran on; a's shrink to zero freed all


def test_the_board_catches_two_residents():
    board = GpuBoard()
    board.occupy(["0:0"], "a/trainer")
    with pytest.raises(Exception, match="while a/trainer is resident"):
        board.occupy(["0:0"], "b/rollout[0]")


# -- the language and the plan ------------------------------------------------------------------------


def test_weight_and_priority_reach_the_plan_and_plan_shows_the_sharing(tmp_path):
    from pathlib import Path

    from rldsl.compiler.driver import compile_file
    from rldsl.compiler.plan_view import render_plan
    from rldsl.plan import ExecutionPlan
    from rldsl.runtime.control.settings import settings_from_plan

    source = Path(__file__).resolve().parent.parent / "pipelines" / "sim_shared_gpus.rlp"
    text = source.read_text().replace("weight = 2", "weight = 2  priority = 1")
    (tmp_path / "shared.rlp").write_text(text)
    result = compile_file(tmp_path / "shared.rlp")
    plan = ExecutionPlan.from_json(result.plan.to_json())  # the sharing survives the plan file
    assert (plan.pipeline("b").sharing.weight, plan.pipeline("b").sharing.priority) == (2.0, 1)
    assert (plan.pipeline("a").sharing.weight, plan.pipeline("a").sharing.priority) == (1.0, 0)
    shown = render_plan(result)
    assert "a: takes turns on GPUs 0:0, 0:1, 0:2, 0:3 (node:gpu); weight 1, priority 0" in shown
    assert "b: takes turns on GPUs 0:0, 0:1, 0:2, 0:3 (node:gpu); weight 2, priority 1" in shown
    settings = settings_from_plan(plan.pipeline("a"), shared_gpus=plan.shared_gpus_of("a"))
    assert settings.trainer_lease == ("0:0", "0:1") and settings.takes_turns
    assert settings.replica_leases == (("0:0",), ("0:1",), ("0:2",), ("0:3",))
    alone = settings_from_plan(plan.pipeline("a"))  # no pipeline to share with: no leases
    assert not alone.leased and alone.replica_leases == ((), (), (), ())
