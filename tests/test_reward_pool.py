"""Rewards run in killable child processes: a reward that hangs, raises,
crashes or returns a non-number costs its own sample only, with a reason."""

import threading
import time
from pathlib import Path

import pytest

from rldsl.rewards import RewardLoadError
from rldsl.runtime.control.ledger import REWARD_INVALID, REWARD_RAISED, REWARD_STRAGGLER, REWARD_TIMEOUT
from rldsl.runtime.protocols import RewardFailure
from rldsl.runtime.reward_pool import STRAGGLER_AFTER_SAMPLES, STRAGGLER_FLOOR_S, RewardPool

ROOT = Path(__file__).resolve().parent.parent
SLACK_S = 1.0  # process replacement and a loaded 2-core machine


@pytest.fixture
def make_pool():
    pools = []

    def make(fn: str, processes: int = 2, timeout_s: float | None = None, straggler: float = 0.0) -> RewardPool:
        pool = RewardPool(fn, processes, timeout_s, straggler)
        pools.append(pool)
        pool.wait_ready()
        return pool

    yield make
    for pool in pools:
        pool.close()


def samples(*responses: str, answer: str = "a") -> list[tuple[str, str, str]]:
    return [(response, answer, "prompt") for response in responses]


def test_scores_every_sample_in_order(make_pool):
    pool = make_pool("rldsl.rewards:exact_match")
    assert pool.score(samples("a", "b", " a ", "c", "a")) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert pool.score([]) == []


def test_a_hang_costs_only_its_sample_and_about_the_timeout(make_pool):
    pool = make_pool("tests.reward_fns:hang_on_hang", timeout_s=0.5)
    before = set(pool.process_ids())
    started = time.monotonic()
    results = pool.score(samples("a", "b", "hang", "a", "a", "b"))
    assert time.monotonic() - started < 0.5 + SLACK_S
    assert results[:2] + results[3:] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert results[2] == RewardFailure(REWARD_TIMEOUT, "no result within the 0.5s timeout; its process was killed")
    after = set(pool.process_ids())
    assert len(after) == 2 and len(before - after) == 1  # the hung process was replaced
    assert pool.score(samples("a", "b")) == [1.0, 0.0]



def test_a_sample_far_slower_than_usual_is_dropped_as_a_straggler_long_before_its_timeout(make_pool):
    """`straggler = 8` with a 30 s timeout: once 16 quick samples set the usual
    time, a hang is dropped at the floor (0.1 s), mid-chunk or last in it, with
    its own reason; before that, only the timeout applies."""
    pool = make_pool("tests.reward_fns:hang_on_hang", timeout_s=30.0, straggler=8.0)
    assert pool.sample_limit()[0] == 30.0  # nothing timed yet
    assert pool.score(samples(*["a"] * STRAGGLER_AFTER_SAMPLES)) == [1.0] * STRAGGLER_AFTER_SAMPLES
    limit, failure = pool.sample_limit()
    assert limit == STRAGGLER_FLOOR_S and failure.reason == REWARD_STRAGGLER
    spare = pool._spare.process.pid  # kept ready: the first slot that loses its process takes it
    started = time.monotonic()
    results = pool.score(samples("a", "hang", "b", "a", "hang", "a"))  # one hang per chunk: in line, then last
    assert time.monotonic() - started < 2 * STRAGGLER_FLOOR_S + 2 * SLACK_S
    assert [getattr(r, "reason", r) for r in results] == [1.0, REWARD_STRAGGLER, 0.0, 1.0, REWARD_STRAGGLER, 1.0]
    assert "8 times the reward's usual time per sample" in results[1].detail
    assert spare in pool.process_ids() and pool._spare.process.pid not in pool.process_ids()  # and a new spare
    assert pool.score(samples("a", "b")) == [1.0, 0.0]

def test_hangs_in_different_processes_overlap(make_pool):
    pool = make_pool("tests.reward_fns:hang_on_hang", timeout_s=0.5)
    started = time.monotonic()
    results = pool.score(samples("hang", "a", "a", "hang", "a", "a"))  # one chunk per process, a hang in each
    assert time.monotonic() - started < 2 * 0.5 + 0.3
    assert [getattr(r, "reason", r) for r in results] == [REWARD_TIMEOUT, 1.0, 1.0, REWARD_TIMEOUT, 1.0, 1.0]


def test_a_hung_sample_frees_its_slot_long_before_its_timeout(make_pool):
    """One process, a hang in the first call: the next call is scored at
    once by a new process while the hung one waits out its deadline apart;
    the hang costs its own sample only and its process dies at the timeout."""
    timeout_s = 4.0
    pool = make_pool("tests.reward_fns:hang_on_hang", processes=1, timeout_s=timeout_s)
    hung_pid = pool.process_ids()[0]
    results, started = {}, time.monotonic()
    first = threading.Thread(target=lambda: results.setdefault("first", pool.score(samples("hang", "a", "b"))))
    first.start()
    time.sleep(0.1)  # the hang is running when the second call comes
    assert pool.score(samples("a", "b", "a")) == [1.0, 0.0, 1.0]
    assert time.monotonic() - started < timeout_s / 2  # not behind the hang
    assert pool.handed_off_count() == 1 and hung_pid not in pool.process_ids()
    first.join(timeout=timeout_s + 10 * SLACK_S)
    assert [getattr(r, "reason", r) for r in results["first"]] == [REWARD_TIMEOUT, 1.0, 0.0]
    assert time.monotonic() - started < timeout_s + 2 * SLACK_S
    deadline = time.monotonic() + 5 * SLACK_S
    while pool.handed_off_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.handed_off_count() == 0 and not _alive(hung_pid)  # killed at its deadline, reaped


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_each_sample_gets_its_own_deadline(make_pool):
    """Three samples of 0.3 s in one chunk take 0.9 s together, each within 0.5 s."""
    pool = make_pool("tests.reward_fns:slow", processes=1, timeout_s=0.5)
    assert pool.score(samples("0.3", "0.3", "0.3")) == [1.0, 1.0, 1.0]


def test_a_raising_reward_gives_reward_raised(make_pool):
    pool = make_pool("tests.reward_fns:raise_on_bad", timeout_s=5)
    assert pool.score(samples("good", "bad", "good")) == [
        1.0, RewardFailure(REWARD_RAISED, "ValueError: bad response"), 1.0]


def test_a_non_number_gives_reward_invalid(make_pool):
    pool = make_pool("tests.reward_fns:nan_or_text")
    assert pool.score(samples("nan", "text", "fine")) == [
        RewardFailure(REWARD_INVALID, "reward returned nan"),
        RewardFailure(REWARD_INVALID, "reward returned str, not a number"), 0.5]


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_crashing_process_drops_only_its_sample(make_pool, timeout_s):
    pool = make_pool("tests.reward_fns:crash_on_crash", timeout_s=timeout_s)
    results = pool.score(samples("a", "crash", "b", "segfault", "c"))
    assert results[0] == results[2] == results[4] == 1.0
    assert results[1].reason == results[3].reason == REWARD_RAISED
    assert "process died (exit code 7)" in results[1].detail
    assert "process died (killed by SIGSEGV)" in results[3].detail
    assert pool.score(samples("a", "b", "c", "d")) == [1.0] * 4  # replaced, working


def test_processes_are_reused_not_started_per_call(make_pool):
    pool = make_pool("tests.reward_fns:pid", processes=2)
    started = set(pool.process_ids())
    seen = {value for _ in range(20) for value in pool.score(samples(*"abcdefgh"))}
    # Which of the two takes each chunk is the scheduler's choice (a loaded
    # machine may hand both chunks to one); that no call starts a process is not.
    assert seen <= {float(pid) for pid in started}
    assert set(pool.process_ids()) == started and len(started) == 2


def test_concurrent_calls_are_served_together(make_pool):
    pool = make_pool("tests.reward_fns:slow_echo", processes=4, timeout_s=5)
    results = {}

    def call(value: int) -> None:
        results[value] = pool.score(samples(f"{value}"))

    started = time.monotonic()
    threads = [threading.Thread(target=call, args=(value,)) for value in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started < 4 * 0.3  # one at a time would take 1.2 s
    assert results == {value: [float(value)] for value in range(4)}


def test_a_function_that_does_not_import_fails_loudly(make_pool):
    with pytest.raises(RewardLoadError, match="has no function 'nope'"):
        make_pool("tests.reward_fns:nope")
    pool = RewardPool("tests.reward_fns:nope", 1)
    try:
        with pytest.raises(RewardLoadError, match="has no function 'nope'"):
            pool.score(samples("a"))
    finally:
        pool.close()


def test_closing_stops_the_processes(make_pool):
    pool = make_pool("rldsl.rewards:exact_match")
    processes = [slot.child.process for slot in pool._slots]
    pool.close()
    assert all(process.poll() is not None for process in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(samples("a"))


def test_reward_worker_returns_failures_with_reasons():
    """The worker without Ray: a data-plane get, the pool, one result per key."""
    import torch

    from rldsl.compiler.driver import compile_source
    from rldsl.runtime import protocols as p
    from rldsl.runtime.ray_lowering.workers import ANSWER_IDS, ANSWER_MASK, RewardWorker

    source = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        '"rldsl.rewards:exact_match"  workers = 1  timeout = 5s',
        '"tests.reward_fns:hang_on_hang"  workers = 1  timeout = 0.5s  processes = 2')
    result = compile_source(source, "grpo_async.rlp")
    assert result.ok, result.diagnostics
    pipe = result.plan.pipeline()
    stage = next(s for s in pipe.stages if s.kind == "reward")
    assert stage.settings["processes"] == 2
    worker = RewardWorker(pipe, stage, 0, {"backend": "memory"})
    try:
        assert worker.ready()
        responses = ["12", "hang", "7"]

        def ids(texts):
            rows = [worker.tokenizer.encode(text) for text in texts]
            return torch.tensor([row + [0] * (8 - len(row)) for row in rows])

        def mask(texts):
            return torch.tensor([[1] * len(worker.tokenizer.encode(t)) + [0] * (8 - len(worker.tokenizer.encode(t)))
                                 for t in texts])

        keys = ["k0", "k1", "k2"]
        answers = ["12", "12", "12"]
        worker.dataplane.put(keys, worker.partition, {p.FIELD_RESPONSE_IDS: ids(responses),
                                                      p.FIELD_RESPONSE_MASK: mask(responses),
                                                      p.FIELD_PROMPT_IDS: ids(["5+7="] * 3),
                                                      p.FIELD_PROMPT_MASK: mask(["5+7="] * 3),
                                                      ANSWER_IDS: ids(answers), ANSWER_MASK: mask(answers)})
        rewards = worker.reward(keys)
        assert rewards[0] == 1.0 and rewards[2] == 0.0
        assert rewards[1].reason == REWARD_TIMEOUT
    finally:
        worker.pool.close()


def test_token_id_zero_is_decoded_where_the_mask_says_it_is_a_token():
    """Padding is told by the masks, not by id 0, which is a real token in
    Llama-3's and Qwen's vocabularies (there, "!")."""
    import torch

    from rldsl.runtime import protocols as p
    from rldsl.runtime.ray_lowering.workers import ANSWER_IDS, ANSWER_MASK, RewardWorker

    class ZeroIsBang:
        def decode(self, ids, stop_at_eos=True):
            return "".join("!" if i == 0 else chr(ord("a") + i - 1) for i in ids)

    worker = RewardWorker.__new__(RewardWorker)
    worker.tokenizer = ZeroIsBang()
    fields = {p.FIELD_RESPONSE_IDS: torch.tensor([[1, 0, 2, 0, 0]]),
              p.FIELD_RESPONSE_MASK: torch.tensor([[1, 1, 1, 0, 0]]),
              ANSWER_IDS: torch.tensor([[0, 0]]), ANSWER_MASK: torch.tensor([[1, 0]])}
    assert worker._decode(fields, p.FIELD_RESPONSE_IDS, p.FIELD_RESPONSE_MASK, 0) == "a!b"
    assert worker._decode(fields, ANSWER_IDS, ANSWER_MASK, 0) == "!"
