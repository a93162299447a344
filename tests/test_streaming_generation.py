"""Generation that streams: groups that finish independently within one
replica (sim and torch), weights applied mid-generation with per-token
versions (`update = interrupt`), their journal records and their audit."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rldsl.audit import audit_journal
from rldsl.audit.replay import LAG
from rldsl.compiler.driver import compile_source
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.control.journal import JOURNAL_FILE, Journal
from rldsl.runtime.engines.batch_requests import token_version_runs
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.sim import Latency, SimGenerator
from rldsl.runtime.engines.torch import TorchGenerator
from rldsl.runtime.engines.torch.common import response_logprobs, state_buckets
from rldsl.runtime.protocols import Prompt
from tests.test_batching import HookedGenerator, Submission, wait_until

LONG = ([Prompt(1, "reverse abcdef:", "fedcba")], 8, 100)  # tiny model, seed 0: every row runs to 24 tokens
SHORT = ([Prompt(0, "12+7=", "19")], 1, 4)  # ... ends in EOS after 3 tokens


def push(batcher, model, version):
    buckets = list(state_buckets(model.module, 4096))
    for index, bucket in enumerate(buckets):
        batcher.update_weights(bucket, version, index == len(buckets) - 1)


def finish_order(batcher, first, second, started):
    """Submit ``first``, once it is decoding ``second``; the requests in the order they were answered."""
    a = Submission(batcher, first)
    wait_until(started, "the first request in flight")
    b = Submission(batcher, second)
    results = a.result(), b.result()
    assert not any(isinstance(r, Exception) for r in results), results
    return ["first", "second"] if a.finished_at <= b.finished_at else ["second", "first"]


# -- groups finish independently within one replica ----------------------------------------


def sim_engine(streaming, draws):
    engine = SimGenerator(Latency.constant(0.0), max_new_tokens=4, per_group=0.0, streaming=streaming,
                          longest_in_wave=True)
    engine._draw = iter(draws).__next__  # the decode time of each group, in order
    return engine


def test_sim_streaming_groups_finish_out_of_order_within_one_replica():
    engine = sim_engine(True, [0.6, 0.05])
    batcher = ContinuousBatcher(engine)
    order = finish_order(batcher, SHORT, LONG, lambda: engine.generating)
    assert order == ["second", "first"]  # the short group did not wait for the long one
    assert batcher.stats()["requests"] == 2
    batcher.close()


def test_sim_waves_hold_a_short_group_behind_the_long_one():
    """The contrast: a whole-batch engine answers a group only when its call ends."""
    engine = sim_engine(False, [0.3, 0.3, 0.01])
    batcher = ContinuousBatcher(engine)
    first = Submission(batcher, LONG)
    wait_until(lambda: engine.generating, "the first call")
    second = Submission(batcher, SHORT)
    first.result(), second.result()
    assert second.finished_at > first.finished_at


def test_sim_streaming_swaps_weights_between_requests():
    engine = sim_engine(True, [0.3, 0.02, 0.02])
    batcher = ContinuousBatcher(engine)
    first = Submission(batcher, LONG)
    wait_until(lambda: engine.generating, "the first group")
    push(batcher, build_tiny_lm(1, d_model=32, n_layers=2, n_heads=2, d_ff=64), 1)  # sim raises if mid-group
    later = Submission(batcher, SHORT)
    assert first.result()["version"].unique().tolist() == [0]
    assert later.result()["version"].unique().tolist() == [1]
    assert later.finished_at > first.finished_at  # it waited for the group in flight, then the swap
    assert batcher.stats()["weight_swaps"] == 1
    batcher.close()


def test_a_streamed_group_that_fails_fails_alone():
    class Failing(SimGenerator):
        def start_group(self, request):
            if request[2] == SHORT[2]:
                raise RuntimeError("engine refused the group")
            return super().start_group(request)

    engine = Failing(Latency.constant(0.05), max_new_tokens=4, streaming=True)
    batcher = ContinuousBatcher(engine)
    good, bad = Submission(batcher, LONG), Submission(batcher, SHORT)
    assert isinstance(bad.result(), RuntimeError)
    assert good.result()["version"].shape == (8,)
    batcher.close()


def test_torch_groups_finish_out_of_order_within_one_replica():
    engine = TorchGenerator(build_tiny_lm(0, d_model=32, n_layers=2, n_heads=2, d_ff=64), max_new_tokens=24)
    batcher = ContinuousBatcher(engine)
    admits, admit, decode_step = [], engine.admit, engine.decode_step

    def counted_admit(requests):
        admits.append(len(requests))
        return admit(requests)

    def gated_decode_step():  # the long group's 24 steps take ~20 ms: wait for the short one to be queued
        deadline = time.monotonic() + 10
        while len(admits) < 2 and not batcher.stats()["queued"] and time.monotonic() < deadline:
            time.sleep(0.001)
        return decode_step()

    engine.admit, engine.decode_step = counted_admit, gated_decode_step
    order = finish_order(batcher, LONG, SHORT, lambda: engine.rows_in_flight > 0)
    assert order == ["second", "first"]  # admitted later, answered first, from the one running batch
    assert batcher.stats()["max_rows"] == 9  # they were decoded together
    batcher.close()


# -- update = interrupt ------------------------------------------------------------------


def tiny(seed):
    return build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def test_interrupt_applies_weights_mid_group_with_per_token_versions_and_logprobs():
    new_model = tiny(1)
    holder = {}
    engine = HookedGenerator(tiny(0), on_step=lambda step: step == 5 and push(holder["b"], new_model, 1),
                             max_new_tokens=24)
    batcher = holder["b"] = ContinuousBatcher(engine, update="interrupt")
    batch = batcher.submit(*LONG)
    assert set(token_version_runs(batch["token_versions"])) == {((0, 5), (1, 19))}  # swapped after the 5th step
    assert batch["version"].unique().tolist() == [0]  # the oldest token's: the lag the trainer uses
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        old = response_logprobs(TorchGenerator(tiny(0)).model, batch)
        new = response_logprobs(TorchGenerator(tiny(1)).model, batch)
    behaviour = batch["behaviour_logprobs"]
    before, after = mask.clone(), mask.clone()
    before[:, 5:], after[:, :5] = False, False
    assert torch.allclose(behaviour[before], old[before], atol=1e-4)  # each token under the weights that drew it
    assert torch.allclose(behaviour[after], new[after], atol=1e-4)
    assert not torch.allclose(behaviour[after], old[after], atol=1e-2)
    assert batcher.stats()["interrupts"] == 1
    batcher.close()


def test_between_requests_keeps_one_version_per_sample():
    new_model = tiny(1)
    holder = {}
    engine = HookedGenerator(tiny(0), on_step=lambda step: step == 5 and push(holder["b"], new_model, 1),
                             max_new_tokens=24)
    batcher = holder["b"] = ContinuousBatcher(engine)
    batch = batcher.submit(*LONG)
    assert "token_versions" not in batch and batch["version"].unique().tolist() == [0]
    wait_until(lambda: engine.version == 1, "the swap after the request")
    assert batcher.stats()["interrupts"] == 0
    batcher.close()


def test_interrupt_is_refused_for_an_engine_that_cannot_resume_its_rows():
    with pytest.raises(ValueError, match="update = interrupt needs an engine"):
        ContinuousBatcher(SimGenerator(streaming=True), update="interrupt")
    with pytest.raises(ValueError, match="expected one of between_requests, interrupt"):
        ContinuousBatcher(SimGenerator(), update="sometimes")


# -- the journal and the audit -------------------------------------------------------------

KEYS = ["t/p0/s0", "t/p0/s1"]


def journal_of(runs, trained_version, lag, max_lag=1, generated=None):
    journal = Journal()
    journal.run_started("t", max_lag, 1)
    journal.dispatched(KEYS, 0, 0)
    journal.generated(KEYS, min(v for v, _ in runs) if generated is None else generated, "behaviour_logprobs",
                      [runs] * len(KEYS))
    journal.trained(KEYS, 1, trained_version, lag)
    journal.ended("finished")
    return journal.drain()


def audit(tmp_path, events):
    (tmp_path / JOURNAL_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    return audit_journal(tmp_path / JOURNAL_FILE)


def test_the_journal_records_per_token_versions_as_runs():
    events = journal_of([(3, 4), (4, 12)], 4, 1)
    assert events[2] == {"e": "generated", "keys": KEYS, "version": 3, "field": "behaviour_logprobs",
                         "tokens": [[3, 4], [4, 12]]}
    plain = Journal()
    plain.generated(KEYS, 3, "behaviour_logprobs")
    assert "tokens" not in plain.drain()[0]  # one version: the record stays as it was
    each = Journal()  # samples of a group swapped at different tokens (vLLM's children): a record per runs
    each.generated(KEYS, 3, "behaviour_logprobs", [[(3, 4), (4, 2)], [(3, 5), (4, 1)]])
    assert [(e["keys"], e["tokens"]) for e in each.drain()] == [([KEYS[0]], [[3, 4], [4, 2]]),
                                                               ([KEYS[1]], [[3, 5], [4, 1]])]


def test_a_sample_whose_tokens_start_after_its_groups_version_passes_the_audit(tmp_path):
    """The group's version is its oldest token's; a sample of it drawn wholly
    later only has its lag overstated, never understated."""
    result = audit(tmp_path, journal_of([(4, 12)], 4, 1, generated=3))
    assert result.ok, result.replay.violations


def test_the_audit_proves_every_tokens_lag(tmp_path):
    result = audit(tmp_path, journal_of([(3, 4), (4, 12)], 4, 1))
    assert result.ok, result.replay.violations
    assert result.replay.totals()["token_lag_histogram"] == {0: 24, 1: 8}


def test_the_audit_fails_a_token_past_max_lag(tmp_path):
    result = audit(tmp_path, journal_of([(2, 4), (4, 12)], 4, 2, max_lag=1))
    whats = {v.what for v in result.replay.violations if v.proof == LAG}
    assert "4 token(s) at lag 2 > max_lag 1 (step 1)" in whats


def test_the_audit_fails_a_version_that_is_not_the_oldest_tokens(tmp_path):
    result = audit(tmp_path, journal_of([(3, 4), (4, 12)], 4, 0, generated=4))
    whats = {v.what for v in result.replay.violations if v.proof == LAG}
    assert "generated at version 4, but its oldest token is version 3" in whats


# -- the check ---------------------------------------------------------------------------

PIPELINE = """
pipeline demo
cluster {{ nodes = 1  gpus_per_node = 2 }}
model policy {{ source = "builtin:tiny-lm" }}
dataset prompts {{ source = "builtin:arith" }}
stage generate rollout {{ model = policy  gpus = 1  samples_per_prompt = 4  {update} }}
stage reward score {{ fn = "rldsl.rewards:exact_match" }}
{extra}
stage train actor {{ model = policy  gpus = 1  prompts_per_step = 8 }}
stage sync weights {{ from = actor  to = rollout }}
flow prompts -> rollout -> score -> {flow}actor
staleness {{ max_lag = 1 }}
"""


def codes(update="", extra="", flow=""):
    result = compile_source(PIPELINE.format(update=update, extra=extra, flow=flow), "demo.rlp")
    return result, [d.code for d in result.diagnostics]


def test_check_accepts_interrupt_on_torch_and_plans_it():
    result, found = codes("update = interrupt")
    assert "RLP110" not in found and result.plan is not None
    rollout = next(s for s in result.plan.pipelines[0].stages if s.name == "rollout")
    assert rollout.settings["update"] == "interrupt"
    default, _ = codes()
    assert next(s for s in default.plan.pipelines[0].stages if s.name == "rollout").settings["update"] \
        == "between_requests"


def test_check_refuses_interrupt_with_a_policy_logprob_stage():
    _, found = codes("update = interrupt", "stage logprob behaviour { model = policy  colocate = actor }",
                     "behaviour -> ")
    assert "RLP110" in found
    _, found = codes("update = interrupt", "stage logprob behaviour { model = policy  colocate = actor  "
                     "recompute = batch_start }", "behaviour -> ")
    assert "RLP110" not in found  # it scores with the trainer's batch-start weights, not per sample


# -- vLLM's AsyncLLM, the real one (its CPU build) ----------------------------------------


def test_on_real_vllm_a_push_between_requests_waits_for_the_group_in_flight(vllm_engine):
    """`update = between_requests`: a group decoding when a version is staged
    finishes on its weights; the next group is sampled with the new ones."""
    engine = vllm_engine.generator
    batcher = ContinuousBatcher(engine)
    batcher.engine = vllm_engine.long_generator(40)
    group = ([Prompt(0, "12+7=", "19")], 4, 1)
    try:
        first = Submission(batcher, group)
        vllm_engine.wait_for_tokens(4)  # the group is decoding
        before = engine.llm.current_version()
        vllm_engine.version += 1
        batcher.update_weights(vllm_engine.reference().module.state_dict(), vllm_engine.version, last=True)
        later = Submission(batcher, group)
        assert first.result()["version"].tolist() == [before] * 4
        assert later.result()["version"].tolist() == [vllm_engine.version] * 4
        assert later.finished_at > first.finished_at and batcher.stats()["interrupts"] == 0
    finally:
        batcher.close()


@pytest.mark.ray
def test_a_generation_bound_run_with_interrupt_journals_per_token_versions_and_the_audit_proves_them(tmp_path):
    """Two groups in flight (one decodes while the next is dispatched), every
    response 48 tokens long (EOS held back) and 2 samples a prompt:
    generation is the bottleneck, so the generator decodes whenever a version
    arrives and groups change weights mid-generation."""
    from tests.runs import rldsl_here

    run_dir = tmp_path / "run"
    overrides = ["rollout.update=interrupt", "rollout.concurrency=2", "rollout.max_new_tokens=48",
                 "rollout.min_new_tokens=48", "rollout.samples_per_prompt=2", "actor.micro_batch=16",
                 "actor.prompts_per_step=8", "prompts.eval_size=0"]  # no evaluation: not what this run is about
    args = [a for o in overrides for a in ("--set", o)]
    # 5 pushes; measured, the generator is busy 96-99% of the run and the trainer 38-55%; 4 or 5 of the
    # pushes land mid-group, idle or beside a process spinning a core (with one group in flight: 1 of 5
    # beside it, as the next group's dispatch leaves the generator idle)
    run = rldsl_here("run", "pipelines/grpo_async.rlp", "--steps", "6", *args, "--run-dir", str(run_dir))
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / JOURNAL_FILE).read_text().splitlines()]
    mixed = [r for r in records if r.get("e") == "generated" and r.get("tokens")]
    assert mixed, "no group changed weights mid-generation"
    assert all(len({v for v, _ in r["tokens"]}) > 1 for r in mixed)
    audit = rldsl_here("audit", str(run_dir))
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "token lag" in audit.stdout and "every proof holds" in audit.stdout
