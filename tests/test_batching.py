"""The continuous batcher: one generator replica decoding many prompt groups at once.

Groups are submitted from threads, as a threaded generation actor does. With
the torch engine they join the running batch between decode steps; a
request's result must equal what it gets decoded alone, and no result may mix
two weight versions.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.sim import Latency, SimGenerator
from rldsl.runtime.engines.torch import TorchGenerator
from rldsl.runtime.engines.torch.common import state_buckets
from rldsl.runtime.protocols import GenerationEngine, Prompt

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48"), Prompt(2, "reverse abcdef:", "fedcba"),
           Prompt(3, "9*9=", "81"), Prompt(4, "reverse xy:", "yx"), Prompt(5, "100-1=", "99")]
REQUESTS = [([PROMPTS[0]], 3, 10), ([PROMPTS[1], PROMPTS[2]], 2, 11), ([PROMPTS[3]], 4, 12),
            ([PROMPTS[4]], 3, 13), ([PROMPTS[5], PROMPTS[0]], 2, 14), ([PROMPTS[2]], 1, 15)]
TIMEOUT = 30


def small_model(seed=0):
    """A tiny model that never emits EOS greedily, so rows run to max_new_tokens
    and the steps at which groups join are known."""
    model = build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    with torch.no_grad():
        model.module.token_embedding.weight[model.eos_id] = 0  # its logit is 0: never the greedy maximum
    return model


class HookedGenerator(TorchGenerator):
    """Calls ``on_step(step)`` before each decode step; records engine calls."""

    def __init__(self, model, on_step=None, **options):
        super().__init__(model, **options)
        self.on_step, self.steps, self.events = on_step, 0, []

    def decode_step(self):
        self.steps += 1
        if self.on_step:
            self.on_step(self.steps)
        self.events.append("step")
        return super().decode_step()

    def update_weights(self, bucket, version, last):
        self.events.append(("update", version))
        super().update_weights(bucket, version, last)

    def sleep(self):
        self.events.append("sleep")
        super().sleep()

    def wake(self):
        self.events.append("wake")
        super().wake()


class Submission:
    """``batcher.submit`` on a thread of its own."""

    def __init__(self, batcher, request):
        self.value, self.finished_at = None, None
        self.thread = threading.Thread(target=self._run, args=(batcher, request), daemon=True)
        self.thread.start()

    def _run(self, batcher, request):
        try:
            self.value = batcher.submit(*request)
        except Exception as error:
            self.value = error
        self.finished_at = time.perf_counter()

    def result(self):
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "submit did not return"
        return self.value


def submit_concurrently(batcher, requests):
    return [submission.result() for submission in [Submission(batcher, request) for request in requests]]


def wait_until(predicate, what="condition"):
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def assert_same_batch(actual, expected):
    assert set(actual) == set(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def reference(model_seed, request, **options):
    """What the request gets decoded alone, on a fresh engine."""
    return TorchGenerator(small_model(model_seed), **options).generate(*request)


def push(batcher, model_seed, version, bucket_bytes=4096):
    buckets = list(state_buckets(small_model(model_seed).module, bucket_bytes))
    for index, bucket in enumerate(buckets):
        batcher.update_weights(bucket, version, index == len(buckets) - 1)


# -- the torch engine: joining, equality with one-request decoding ------------------------


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}])
def test_concurrent_groups_equal_their_one_request_results(options):
    generator = TorchGenerator(small_model(), max_new_tokens=6, **options)
    batcher = ContinuousBatcher(generator)
    results = submit_concurrently(batcher, REQUESTS)
    for request, result in zip(REQUESTS, results):
        assert_same_batch(result, generator.generate(*request))
        assert result["version"].tolist() == [0] * len(result["version"])
    stats = batcher.stats()
    assert stats["requests"] == len(REQUESTS) and stats["rows_decoded"] == sum(len(p) * n for p, n, _ in REQUESTS)
    assert isinstance(batcher, GenerationEngine) and generator.rows_in_flight == 0
    batcher.close()


def test_requests_arriving_mid_decode_join_and_leave_one_by_one():
    first, second = REQUESTS[0], REQUESTS[1]
    batcher = None

    def on_step(step):
        if step == 3:  # the first group is decoding: the second arrives now
            submissions.append(Submission(batcher, second))
            wait_until(lambda: batcher.stats()["queued"] == 1, "the second request to queue")
        if step == 9:  # the first group ended at step 8: its caller has it while the second decodes
            wait_until(lambda: submissions[0].value is not None, "the first result")

    generator = HookedGenerator(small_model(), on_step, max_new_tokens=8, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    submissions = [Submission(batcher, first)]
    early = submissions[0].result()
    assert len(submissions) == 2, f"the first request ended before the second arrived: {early!r}"
    late = submissions[1].result()
    assert submissions[0].finished_at < submissions[1].finished_at
    assert_same_batch(early, reference(0, first, max_new_tokens=8, temperature=0.0))
    assert_same_batch(late, reference(0, second, max_new_tokens=8, temperature=0.0))
    stats = batcher.stats()
    assert stats["max_rows"] == 3 + 4  # both groups decoded together
    assert stats["batches"] == 3 + 8 < 2 * 8  # the second joined before step 4: 11 steps, not 16
    batcher.close()


def test_a_local_hugging_face_model_batches_the_same(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from rldsl.models import load_model
    from tests.hf_tiny import save_char_llama

    save_char_llama(tmp_path)
    generator = TorchGenerator(load_model(f"hf:{tmp_path}"), max_new_tokens=5, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    batcher.sleep()  # queue every request first: they are all admitted in one prefill
    submissions = [Submission(batcher, request) for request in REQUESTS[:3]]
    wait_until(lambda: batcher.stats()["queued"] == 3, "three queued requests")
    batcher.wake()
    late = Submission(batcher, REQUESTS[3])  # joins a running batch with a longer cache
    results = [submission.result() for submission in [*submissions, late]]
    for request, result in zip(REQUESTS, results):
        assert_same_batch(result, generator.generate(*request))
    assert batcher.stats()["max_rows"] >= 3 + 4 + 4
    batcher.close()


# -- weights: staged while decoding, swapped between requests -------------------------------


def test_weights_pushed_mid_decode_apply_after_the_rows_in_flight():
    first, second = REQUESTS[2], REQUESTS[3]
    batcher = None

    def on_step(step):
        if step == 2:
            push(batcher, model_seed=1, version=1)  # returns at once: staged, not applied
            assert generator.version == 0 and batcher.staged_version == 1
            submissions.append(Submission(batcher, second))
            wait_until(lambda: batcher.stats()["queued"] == 1, "the second request to queue")

    generator = HookedGenerator(small_model(0), on_step, max_new_tokens=6, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    submissions = [Submission(batcher, first)]
    old, new = submissions[0].result(), submissions[1].result()
    assert old["version"].unique().tolist() == [0] and new["version"].unique().tolist() == [1]
    assert_same_batch(old, reference(0, first, max_new_tokens=6, temperature=0.0))  # unswapped tokens
    new_reference = reference(1, second, max_new_tokens=6, temperature=0.0)
    new_reference["version"] = torch.ones_like(new_reference["version"])
    assert_same_batch(new, new_reference)
    first_update = generator.events.index(("update", 1))
    assert generator.events[:first_update] == ["step"] * 6  # the whole first group, then the swap
    assert batcher.stats()["max_rows"] == 4 and batcher.stats()["weight_swaps"] == 1
    for name, tensor in small_model(1).module.state_dict().items():
        assert torch.equal(generator.model.module.state_dict()[name], tensor), name
    batcher.close()


def test_only_the_newest_complete_version_is_applied():
    batcher = None

    def on_step(step):
        if step == 1:
            push(batcher, model_seed=1, version=1)
            push(batcher, model_seed=2, version=2)
            assert batcher.staged_version == 2

    generator = HookedGenerator(small_model(0), on_step, max_new_tokens=3, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    assert batcher.submit(*REQUESTS[0])["version"].unique().tolist() == [0]
    assert batcher.submit(*REQUESTS[0])["version"].unique().tolist() == [2]
    assert {event[1] for event in generator.events if isinstance(event, tuple)} == {2}
    assert batcher.version == 2 and batcher.staged_version is None
    bucket = next(state_buckets(small_model(3).module, 4096))
    batcher.update_weights(bucket, 3, last=False)
    with pytest.raises(RuntimeError, match="half staged"):
        batcher.update_weights(bucket, 4, last=True)
    batcher.close()


def test_a_staged_version_that_fails_to_apply_is_reported_to_every_request_and_the_next_push():
    """Never sampling on the weights a push failed to replace: an on-policy run would otherwise
    drop every sample as too stale, waiting for a version that never comes."""
    generator = TorchGenerator(small_model(), max_new_tokens=2)
    batcher = ContinuousBatcher(generator)
    batcher.update_weights({"no.such.weight": torch.zeros(1)}, 1, last=True)
    wait_until(lambda: batcher._weight_error is not None, "the failed apply")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="could not apply its last weight push.*no.such.weight"):
            batcher.submit(*REQUESTS[0])
    with pytest.raises(RuntimeError, match="not in this engine"):
        push(batcher, model_seed=1, version=2)
    push(batcher, model_seed=1, version=2)
    assert batcher.submit(*REQUESTS[0])["version"].unique().tolist() == [2]
    batcher.close()


# -- failures, sleep, refresh ----------------------------------------------------------------


def test_an_engine_error_fails_only_its_own_callers():
    generator = HookedGenerator(small_model(), max_new_tokens=4, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    too_long = ([Prompt(9, "1+1=" * 20, "2")], 2, 0)  # beyond tiny-lm's 64 positions: its prefill raises
    batcher.sleep()  # queue all three: admitted together, the bad one is isolated
    submissions = [Submission(batcher, request) for request in (REQUESTS[0], too_long, REQUESTS[1])]
    wait_until(lambda: batcher.stats()["queued"] == 3, "three queued requests")
    batcher.wake()
    good, bad, other = (submission.result() for submission in submissions)
    assert isinstance(bad, ValueError) and "max_positions" in str(bad)
    assert_same_batch(good, reference(0, REQUESTS[0], max_new_tokens=4, temperature=0.0))
    assert_same_batch(other, reference(0, REQUESTS[1], max_new_tokens=4, temperature=0.0))

    def fail_once(step):
        generator.on_step = None
        raise RuntimeError("decode step failed")

    generator.on_step = fail_once
    with pytest.raises(RuntimeError, match="decode step failed"):
        batcher.submit(*REQUESTS[2])
    assert generator.rows_in_flight == 0
    assert_same_batch(batcher.submit(*REQUESTS[2]), reference(0, REQUESTS[2], max_new_tokens=4, temperature=0.0))
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(*REQUESTS[0])


def test_sleep_waits_for_the_rows_in_flight_and_wake_releases_queued_requests():
    batcher = None

    def on_step(step):
        if step == 2:
            sleepers.append(threading.Thread(target=batcher.sleep))
            sleepers[0].start()

    sleepers = []
    generator = HookedGenerator(small_model(), on_step, max_new_tokens=5, temperature=0.0)
    batcher = ContinuousBatcher(generator)
    batcher.submit(*REQUESTS[0])
    sleepers[0].join(TIMEOUT)
    assert generator.events == ["step"] * 5 + ["sleep"]
    waiting = Submission(batcher, REQUESTS[1])
    push(batcher, model_seed=1, version=1)  # staged: a sleeping replica applies it when it wakes
    time.sleep(0.1)
    assert waiting.value is None and batcher.stats()["queued"] == 1 and batcher.staged_version == 1
    batcher.wake()
    assert waiting.result()["version"].unique().tolist() == [1]
    assert generator.events[6] == "wake" and generator.events[7] == ("update", 1)
    buckets = list(state_buckets(small_model(2).module, 4096))
    batcher.refresh(buckets, 5)
    assert batcher.version == generator.version == 5
    assert torch.equal(generator.model.module.token_embedding.weight, small_model(2).module.token_embedding.weight)
    assert batcher.run_idle(lambda engine: engine.generate_greedy(PROMPTS[:2])) == generator.generate_greedy(
        PROMPTS[:2])
    batcher.close()


# -- whole-batch engines: sim and vLLM ---------------------------------------------------------


def test_sim_generate_groups_costs_one_latency_plus_a_term_per_group():
    engine = SimGenerator(Latency.constant(0.05), max_new_tokens=4)
    assert engine.per_group == pytest.approx(0.005)
    started = time.perf_counter()
    batches = engine.generate_groups(REQUESTS[:4])
    elapsed = time.perf_counter() - started
    assert 0.05 + 3 * 0.005 <= elapsed < 4 * 0.05  # far cheaper than four calls
    assert [len(batch["version"]) for batch in batches] == [len(p) * n for p, n, _ in REQUESTS[:4]]
    assert torch.equal(batches[1]["response_ids"], engine.generate(*REQUESTS[1])["response_ids"])

    async def timed_async():
        loop = asyncio.get_running_loop()
        began = loop.time()
        await SimGenerator(Latency.constant(0.02), per_group=0.01).generate_groups_async(REQUESTS)
        return loop.time() - began

    assert asyncio.run(timed_async()) >= 0.02 + 5 * 0.01 - 0.005  # the event loop may wake a hair early


def test_a_whole_batch_engine_serves_queued_requests_in_one_call_and_swaps_between_calls():
    engine = SimGenerator(Latency.constant(0.3), max_new_tokens=4)  # long enough to queue during the call
    batcher = ContinuousBatcher(engine)
    first = Submission(batcher, REQUESTS[0])
    wait_until(lambda: engine.generating, "the first call")
    later = [Submission(batcher, request) for request in REQUESTS[1:]]
    wait_until(lambda: batcher.stats()["queued"] == len(later), "queued requests")
    push(batcher, model_seed=1, version=1)  # the sim engine raises if weights change mid-call
    results = [first.result()] + [submission.result() for submission in later]
    assert results[0]["version"].unique().tolist() == [0]
    assert all(result["version"].unique().tolist() == [1] for result in results[1:])
    stats = batcher.stats()
    assert stats["batches"] == 2 and stats["weight_swaps"] == 1
    assert stats["max_rows"] == sum(len(p) * n for p, n, _ in REQUESTS[1:])
    batcher.close()


def test_the_batcher_streams_each_group_to_real_vllm_and_each_comes_back_whole(vllm_engine):
    generator = vllm_engine.generator
    batcher = ContinuousBatcher(generator)
    requests = [([PROMPTS[0], PROMPTS[1]], 3, 3), ([PROMPTS[2]], 2, 4), ([PROMPTS[3]], 4, 5)]
    submissions = [Submission(batcher, request) for request in requests]
    results = [submission.result() for submission in submissions]
    for (prompts, n, _), result in zip(requests, results):
        assert len(result["response_ids"]) == len(prompts) * n
        assert result["version"].unique().tolist() == [generator.llm.current_version()]
    assert batcher.stats()["requests"] == 3
    batcher.close()
