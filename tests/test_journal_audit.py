"""The per-sample journal and `rldsl audit`: the journal's events, each proof
failing on a hand-written journal that breaks it, and in-process controller
runs (sim stages) whose journals pass, across a stop and a resume too."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import pytest

from rldsl.audit import EXIT_OK, EXIT_UNREADABLE, EXIT_VIOLATIONS, audit_command, audit_journal
from rldsl.audit.replay import ENDED_ONCE, LAG, LOGPROBS, TRAINED_ONCE
from rldsl.cli import main
from rldsl.runtime.control.controller import Controller, PipelineStalled
from rldsl.runtime.control.journal import JOURNAL_FILE, Journal, JournalFile
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane, parse_sample_key
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig, SimStages
from rldsl.runtime.protocols import Prompt

# -- hand-written journals ------------------------------------------------------------

A, B = ["t/p0/s0", "t/p0/s1"], ["t/p1/s0", "t/p1/s1"]


def header(resume=None, max_lag=1):
    return {"e": "run", "pipeline": "t", "max_lag": max_lag, "steps": 2, "resume": resume}


def course(keys, prompt, version=0, step=1, lag=0, behaviour=None):
    """A group dispatched, generated at ``version`` and trained at ``version + lag``;
    ``behaviour``: a policy logprob stage's write in between."""
    events = [{"e": "dispatched", "keys": keys, "prompt": prompt, "replica": 0},
              {"e": "generated", "keys": keys, "version": version, "field": "behaviour_logprobs"},
              {"e": "logprob", "keys": keys, "stage": "reference", "field": "ref_logprobs", "version": None,
               "frozen": True}]
    if behaviour is not None:
        events.append({"e": "logprob", "keys": keys, "stage": "behaviour", "field": "behaviour_logprobs",
                       **behaviour})
    return events + [{"e": "trained", "keys": keys, "step": step, "version": version + lag, "lag": lag}]


def end(exit="finished", error=None):
    return {"e": "end", "exit": exit, "error": error}


def write(tmp_path, events) -> None:
    (tmp_path / JOURNAL_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))


def violations(tmp_path, events) -> dict[str, list]:
    write(tmp_path, events)
    audit = audit_journal(tmp_path / JOURNAL_FILE)
    found: dict[str, list] = {}
    for v in audit.replay.violations:
        found.setdefault(v.proof, []).append((v.what, v.keys))
    return found


def test_a_clean_journal_passes_and_says_so(tmp_path, capsys):
    write(tmp_path, [header(), *course(A, 0), *course(B, 1, step=2, lag=1), end()])
    assert audit_command(tmp_path) == EXIT_OK
    out = capsys.readouterr().out
    assert "samples: 4 dispatched, 4 trained, 0 dropped, 0 left open" in out
    assert "lag: max 1 (max_lag 1); 0:2 1:2" in out
    assert "end: finished" in out and "audit: every proof holds" in out


def test_a_key_ended_twice(tmp_path):
    found = violations(tmp_path, [header(), *course(A, 0), {"e": "dropped", "keys": A[:1], "reason": "too_stale"},
                                  end()])
    assert found == {ENDED_ONCE: [("too_stale after already trained", A[:1])]}


def test_an_outcome_for_a_key_never_dispatched(tmp_path):
    found = violations(tmp_path, [header(), *course(A, 0), {"e": "dropped", "keys": B, "reason": "too_stale"},
                                  end()])
    assert found == {ENDED_ONCE: [("dropped but never dispatched in this segment", B)]}


def test_trained_twice_across_a_resume(tmp_path):
    """The resume is from after step 1, which trained A: A must not come back."""
    found = violations(tmp_path, [header(), *course(A, 0), end("stopped"),
                                  header(resume={"steps_done": 1, "version": 1}), *course(A, 0, version=1, step=2),
                                  end()])
    assert [what for what, _ in found[TRAINED_ONCE]] == [
        "generated again after a resume although already trained (segment 1)",
        "trained twice: segment 1 step 1, then segment 2 step 2"]
    assert set(found) == {TRAINED_ONCE}


def test_training_after_the_resumed_checkpoint_is_rolled_back_not_trained_twice(tmp_path):
    """Step 2 trained B, then the run died before checkpointing it: the
    resume from step 1 discards that training, so B may be trained again."""
    write(tmp_path, [header(), *course(A, 0), *course(B, 1, step=2),
                     header(resume={"steps_done": 1, "version": 1}), *course(B, 1, version=1, step=2), end()])
    audit = audit_journal(tmp_path / JOURNAL_FILE)
    assert audit.ok
    totals = audit.replay.totals()
    assert (totals["trained"], totals["rolled_back"], totals["resumes"]) == (4, 2, 1)


def test_a_lag_over_the_bound(tmp_path):
    found = violations(tmp_path, [header(max_lag=1), *course(A, 0, lag=2), end()])
    assert found == {LAG: [("lag 2 > max_lag 1 (step 1)", A)]}


def test_a_lag_that_does_not_match_the_versions(tmp_path):
    events = [header(), *course(A, 0), end()]
    events[-2]["version"] = 1  # trained at version 1 but recorded with lag 0
    assert violations(tmp_path, events) == {LAG: [("lag 0 recorded, but generated at version 0 and trained at "
                                                   "version 1", A)]}


def test_behaviour_logprobs_from_another_version(tmp_path):
    found = violations(tmp_path, [header(), *course(A, 0, version=3, behaviour={"version": 4}), end()])
    assert found == {LOGPROBS: [("behaviour_logprobs by stage `behaviour` at version 4, generated at version 3", A)]}


def test_behaviour_logprobs_at_an_uncertain_version_are_not_proved(tmp_path):
    uncertain = {"version": None, "between": [3, 4]}
    found = violations(tmp_path, [header(), *course(A, 0, version=3, behaviour=uncertain), end()])
    assert found == {LOGPROBS: [("behaviour_logprobs by stage `behaviour` between versions 3 and 4: not "
                                 "provably the generating version 3", A)]}


def test_a_reference_that_is_not_frozen(tmp_path):
    events = [header(), *course(A, 0), end()]
    events[3] = {**events[3], "frozen": False, "version": 0}
    assert set(violations(tmp_path, events)) == {LOGPROBS}


def test_an_open_key_in_a_finished_run(tmp_path):
    found = violations(tmp_path, [header(), *course(A, 0), {"e": "dispatched", "keys": B, "prompt": 1}, end()])
    assert found == {ENDED_ONCE: [("left open although the segment ended `finished`", B)]}


def test_open_keys_of_a_failed_run_are_reported_not_violations(tmp_path, capsys):
    write(tmp_path, [header(), *course(A, 0), {"e": "dispatched", "keys": B, "prompt": 1},
                     end("failed", "PipelineStalled: no progress for 5.0s")])
    assert audit_command(tmp_path) == EXIT_OK
    out = capsys.readouterr().out
    assert "end: failed: PipelineStalled: no progress for 5.0s; the journal shows the run did not finish" in out
    assert "segment 1 (failed) left 2 samples open: t/p1/s0, t/p1/s1" in out


def test_a_journal_cut_off_mid_line_is_read_up_to_the_cut(tmp_path, capsys):
    write(tmp_path, [header(), *course(A, 0)])
    with open(tmp_path / JOURNAL_FILE, "a") as f:
        f.write('{"e":"dispatched","keys":["t/p1')
    assert audit_command(tmp_path) == EXIT_OK
    out = capsys.readouterr().out
    assert "no end record (the process writing the journal died)" in out and "line 6 is incomplete" in out


def test_violations_exit_1_and_json_lists_them(tmp_path, capsys):
    write(tmp_path, [header(max_lag=0), *course(A, 0, lag=1), end()])
    assert main(["audit", str(tmp_path), "--format", "json"]) == EXIT_VIOLATIONS
    report = json.loads(capsys.readouterr().out)
    lag = next(p for p in report["pipelines"][0]["proofs"] if p["proof"] == LAG)
    assert not report["ok"] and lag["violations"] == [{"segment": 1, "what": "lag 1 > max_lag 0 (step 1)",
                                                       "keys": A}]


def test_max_lag_comes_from_the_plan_when_the_header_lacks_it(tmp_path):
    first = header()
    del first["max_lag"]
    (tmp_path / "plan.json").write_text(json.dumps({"pipelines": [{"name": "t", "staleness": {"max_lag": 0}}]}))
    assert violations(tmp_path, [first, *course(A, 0, lag=1), end()]) == {LAG: [("lag 1 > max_lag 0 (step 1)", A)]}


def test_a_run_of_several_pipelines_audits_each_journal(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"pipelines": ["t", "u"]}))
    for name, lag in (("t", 0), ("u", 2)):
        (tmp_path / name).mkdir()
        write(tmp_path / name, [header(), *course(A, 0, lag=lag), end()])
    assert audit_command(tmp_path) == EXIT_VIOLATIONS
    out = capsys.readouterr().out
    assert "t/journal.jsonl" in out and "u/journal.jsonl" in out and "lag 2 > max_lag 1" in out


@pytest.mark.parametrize("content,message", [
    (None, "has no journal.jsonl"),
    ("", "the journal is empty"),
    ('{"e":"run"}\nnot json\n{"e":"end"}\n', "journal.jsonl:2"),
    ('{"e":"dispatched","keys":[]}\n', "does not start with a `run` header"),
])
def test_an_unreadable_journal_is_exit_2_with_where_and_how(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / JOURNAL_FILE).write_text(content)
    assert main(["audit", str(tmp_path)]) == EXIT_UNREADABLE
    err = capsys.readouterr().err
    assert message in err and "= help:" in err and "Traceback" not in err


# -- the journal itself ---------------------------------------------------------------


def test_the_journal_buffers_until_flushed_and_keeps_events_a_writer_refused():
    written, fail = [], [True]

    def writer(events):
        if fail[0]:
            raise OSError("disk full")
        written.extend(events)

    journal = Journal(writer, resume={"steps_done": 3, "version": 3})
    journal.trained(A, step=1, version=3, lag=0)
    journal.dropped([], "too_stale")  # nothing happened: no event
    with pytest.raises(OSError):
        journal.flush()
    fail[0] = False
    journal.flush()
    assert written == [{"e": "trained", "keys": A, "step": 4, "version": 3, "lag": 0}]
    journal.logprob(A, "behaviour", "behaviour_logprobs", (2, 3))
    assert journal.drain() == [{"e": "logprob", "keys": A, "stage": "behaviour", "field": "behaviour_logprobs",
                                "version": None, "between": [2, 3]}]


# -- in-process controller runs -------------------------------------------------------


def settings(**overrides) -> RunSettings:
    values = dict(pipeline="t", prompts_per_step=2, samples_per_prompt=2, steps=4, max_lag=1,
                  reward_stages=("score",), logprob_stages=("reference",), watchdog_timeout_s=5.0)
    return RunSettings(**{**values, **overrides})


def run(run_settings, path, config=SimConfig(generate=Latency.uniform(0.001, 0.01)), *, skip=frozenset(),
        resume=None, stop_at_step=None):
    """One segment in process, journaled to ``path``; returns the controller."""
    dataplane = InMemoryDataPlane()
    sim = SimStages(run_settings, dataplane, config)
    for engine in [*sim.generators, *sim.trainers]:
        engine.version = resume["version"] if resume else 0
    handles = sim.handles
    if stop_at_step is not None:
        async def stop_then_train(step, keys, replica):
            if sim.trainer.version == stop_at_step:
                controller.request_stop()
            return await sim.handles.train_microbatch(step, keys, replica)

        handles = dataclasses.replace(sim.handles, train_microbatch=stop_then_train)
    prompts = (Prompt(i, f"q{i}", "a") for i in itertools.count() if i not in skip)
    controller = Controller(run_settings, handles, dataplane, prompts, journal=Journal(JournalFile(path), resume))
    asyncio.run(controller.run())
    return controller


def test_an_in_process_run_with_failures_passes_the_audit(tmp_path):
    config = SimConfig(generate=Latency.uniform(0.001, 0.01), generators=2, reward_fail_prob=0.2,
                       generate_fail_prob=0.1, trainer_fail_on=(("finish_train_step", 1),))
    controller = run(settings(steps=5), tmp_path / JOURNAL_FILE, config)
    audit = audit_journal(tmp_path / JOURNAL_FILE)
    assert audit.ok, audit.replay.violations
    totals, ledger = audit.replay.totals(), controller.summary()["ledger"]
    assert {k: totals[k] for k in ledger} == ledger  # the journal tells what the ledger counted
    assert totals["exit"] == "finished" and totals["steps"] == 5


def test_a_policy_logprob_stage_is_journaled_at_the_receivers_version(tmp_path):
    on_policy = settings(max_lag=0, logprob_stages=("behaviour",), policy_logprob_stages=("behaviour",))
    config = SimConfig(generate=Latency.uniform(0.001, 0.01), logprob_fields={"behaviour": "behaviour_logprobs"})
    run(on_policy, tmp_path / JOURNAL_FILE, config)
    events = [json.loads(line) for line in (tmp_path / JOURNAL_FILE).read_text().splitlines()]
    writes = [e for e in events if e["e"] == "logprob"]
    assert writes and all(e["field"] == "behaviour_logprobs" and "frozen" not in e for e in writes)
    assert audit_journal(tmp_path / JOURNAL_FILE).ok  # on-policy: no push overlaps a group's course


def test_a_stall_leaves_a_journal_that_says_the_run_failed(tmp_path):
    stalled = settings(prompts_per_step=4, buffer_capacity=3, watchdog_timeout_s=0.3)  # cannot hold a step
    with pytest.raises(PipelineStalled):
        run(stalled, tmp_path / JOURNAL_FILE)
    audit = audit_journal(tmp_path / JOURNAL_FILE)
    assert audit.ok and audit.replay.segments[-1].exit == "failed"
    assert "PipelineStalled" in audit.replay.segments[-1].end["error"]
    assert audit.replay.totals()["open"] == 3 * 2  # the groups consumed by the step that never filled


def test_a_stopped_and_resumed_run_trains_no_sample_twice(tmp_path):
    path = tmp_path / JOURNAL_FILE
    first = run(settings(steps=50), path, stop_at_step=2)
    assert first.exit == "stopped" and first.state.finished_steps == 2
    trained = frozenset(parse_sample_key(k)[1] for k in first.state.ledger.trained_keys())
    resume = {"steps_done": 2, "version": 2}
    run(settings(steps=2), path, skip=trained, resume=resume)
    audit = audit_journal(path)
    assert audit.ok, audit.replay.violations
    totals = audit.replay.totals()
    assert (totals["resumes"], totals["steps"], totals["trained"]) == (1, 4, 4 * 2 * 2)
    # the same resume without skipping the trained prompts is caught
    run(settings(steps=2), path, resume=resume)
    assert {v.proof for v in audit_journal(path).replay.violations} == {TRAINED_ONCE}


def test_audit_imports_neither_torch_nor_ray(tmp_path):
    import subprocess
    import sys

    write(tmp_path, [header(), *course(A, 0), end()])
    code = (f"import sys; from rldsl.cli import main; code = main(['audit', {str(tmp_path)!r}]); "
            "heavy = [m for m in ('torch', 'ray', 'transfer_queue', 'vllm', 'megatron', 'rich') if m in sys.modules]; "
            "sys.exit(10 + code if heavy else code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
