"""A run directory that fills up, turns read-only or holds a line torn
mid-write: writes fail with one named error and leave whole lines, the
journal mends a torn last line before appending, the audit reads what is
left, and a resume after space is freed merges every segment's accounting.

Where the machine allows it (root, tmpfs) the disk really is full or
read-only: a small tmpfs is mounted for the test; otherwise those tests skip
and the unit tests below simulate the error."""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from rldsl.audit import EXIT_OK, audit_command, audit_journal, journal_totals
from rldsl.runtime import run_files
from rldsl.runtime.control.controller import Controller
from rldsl.runtime.control.journal import JOURNAL_FILE, Journal, JournalFile
from rldsl.runtime.control.settings import RunSettings
from rldsl.runtime.dataplane import InMemoryDataPlane, parse_sample_key
from rldsl.runtime.engines.sim import Latency
from rldsl.runtime.inprocess import SimConfig, SimStages
from rldsl.runtime.protocols import Prompt
from rldsl.runtime.run_files import RunDirectoryError, append_text, repair_torn_tail, write_json_checked

HEADER = {"e": "run", "pipeline": "t", "max_lag": 1, "steps": 2, "resume": None}
KEYS = ["t/p0/s0", "t/p0/s1"]


def line(event: dict) -> str:
    return json.dumps(event, separators=(",", ":")) + "\n"


def course(keys: list[str], prompt: int, step: int) -> list[dict]:
    return [{"e": "dispatched", "keys": keys, "prompt": prompt, "replica": 0},
            {"e": "generated", "keys": keys, "version": step - 1, "field": "behaviour_logprobs"},
            {"e": "trained", "keys": keys, "step": step, "version": step - 1, "lag": 0}]


# -- a torn last line ---------------------------------------------------------------


def test_a_torn_last_line_is_cut_off_before_appending(tmp_path, capsys):
    path = tmp_path / JOURNAL_FILE
    whole = line(HEADER) + "".join(map(line, course(KEYS, 0, 1)))
    path.write_text(whole + '{"e":"dispatched","keys":["t/p1')
    journal_file = JournalFile(path)
    journal_file([{"e": "run", "pipeline": "t", "max_lag": 1, "steps": 2, "resume": {"steps_done": 1, "version": 1}}])
    text = path.read_text()
    assert text.startswith(whole) and text.count("\n") == 5 and text.endswith("\n")
    assert all(json.loads(part) for part in text.splitlines())
    assert "was cut off mid-write" in capsys.readouterr().err and journal_file.repairs


def test_a_whole_last_record_without_its_newline_is_kept():
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "metrics.jsonl"
        path.write_text('{"step":1}\n{"step":2}')
        assert "newline was added" in repair_torn_tail(path)
        assert path.read_text() == '{"step":1}\n{"step":2}\n'
        assert repair_torn_tail(path) is None  # whole lines: nothing to do
        assert repair_torn_tail(Path(directory) / "absent.jsonl") is None


def test_the_audit_reads_a_torn_last_line_and_reports_it(tmp_path, capsys):
    (tmp_path / JOURNAL_FILE).write_text(line(HEADER) + "".join(map(line, course(KEYS, 0, 1))) + '{"e":"disp')
    assert audit_command(tmp_path) == EXIT_OK
    out = capsys.readouterr().out
    assert "line 5 is incomplete" in out and "audit: every proof holds" in out


def test_a_resume_header_glued_to_a_torn_line_keeps_both_segments(tmp_path, capsys):
    """What a resume wrote before the repair existed: its header on the torn line."""
    first = line(HEADER) + "".join(map(line, course(KEYS, 0, 1)))
    resume = {**HEADER, "resume": {"steps_done": 1, "version": 1}}
    second = "".join(map(line, [resume, *course(["t/p1/s0", "t/p1/s1"], 1, 2), {"e": "end", "exit": "finished"}]))
    (tmp_path / JOURNAL_FILE).write_text(first + '{"e":"dispatched","keys":["t/p9/s0"' + second)
    assert audit_command(tmp_path) == EXIT_OK
    out = capsys.readouterr().out
    assert "began with a fragment of a line cut off mid-write" in out
    totals = journal_totals(tmp_path / JOURNAL_FILE)
    assert (totals["trained"], totals["resumes"], totals["exit"]) == (4, 1, "finished")


# -- the checked writer, errors simulated -------------------------------------------


def test_a_failed_append_is_cut_back_to_whole_lines_and_named(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_text(path, '{"step":1}\n')

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_files.os, "fsync", disk_full)  # the data reached the file; the sync says it is lost
    with pytest.raises(RunDirectoryError) as raised:
        append_text(path, '{"step":2}\n{"step":3}\n')
    assert path.read_text() == '{"step":1}\n'
    message = str(raised.value)
    assert message == (f"the run directory {tmp_path} is full: writing metrics.jsonl failed "
                       "(ENOSPC: No space left on device)")
    assert f"rldsl run --resume {tmp_path}" in raised.value.help and "free space" in raised.value.help


def test_the_error_survives_pickling_whole():
    import pickle

    error = RunDirectoryError("/r/journal.jsonl", errno.EROFS, "Read-only file system")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.directory == "/r" and "make it writable" in copy.help


def test_a_failed_json_record_leaves_no_temporary_file(tmp_path, monkeypatch):
    def disk_full(self, text):
        Path.write_bytes(self, text[:5].encode())
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(RunDirectoryError, match="is over its disk quota: writing summary.json failed"):
        write_json_checked(tmp_path / "summary.json", {"exit": "failed"})
    assert list(tmp_path.iterdir()) == []


def test_the_journal_keeps_its_events_while_the_disk_is_full(tmp_path, monkeypatch):
    path = tmp_path / JOURNAL_FILE
    journal = Journal(JournalFile(path))
    journal.run_started("t", 1, 2)
    journal.flush()
    full = [True]
    real_fsync = os.fsync

    def fsync(fd):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(run_files.os, "fsync", fsync)
    journal.dispatched(KEYS, 0, 0)
    with pytest.raises(RunDirectoryError):
        journal.flush()
    assert path.read_text().count("\n") == 1  # the header alone, whole
    full[0] = False
    journal.flush()
    assert [json.loads(part)["e"] for part in path.read_text().splitlines()] == ["run", "dispatched"]


# -- a real full or read-only file system -------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/fs (needs root and a kernel that allows it)."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """Fill the file system of ``directory`` up to ``leave_bytes`` free (page-granular)."""
    filler = directory / "filler"
    with open(filler, "ab") as file:
        try:
            while True:
                stat = os.statvfs(directory)
                free = stat.f_bavail * stat.f_frsize
                if free <= leave_bytes:
                    break
                file.write(b"\0" * min(free - leave_bytes, 1 << 16))
                file.flush()
        except OSError:
            pass
    return filler


def test_a_full_tmpfs_leaves_whole_lines(small_fs):
    path = small_fs / "run" / JOURNAL_FILE
    append_text(path, line(HEADER))
    filler = fill(small_fs, leave_bytes=4096)
    big = "".join(line({"e": "dispatched", "keys": [f"t/p{i}/s{j}" for j in range(8)], "prompt": i, "replica": 0})
                  for i in range(200))  # more than the page left: part of it lands, then ENOSPC
    with pytest.raises(RunDirectoryError, match=f"the run directory {small_fs / 'run'} is full"):
        append_text(path, big)
    assert path.read_text() == line(HEADER)
    filler.unlink()
    append_text(path, big)
    assert path.read_text() == line(HEADER) + big


def test_a_read_only_run_directory_is_named(small_fs):
    path = small_fs / JOURNAL_FILE
    append_text(path, line(HEADER))
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(RunDirectoryError, match="is read-only: writing journal.jsonl failed .EROFS"):
            JournalFile(path)([{"e": "end", "exit": "failed", "error": None}])
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert path.read_text() == line(HEADER)


def settings(steps: int) -> RunSettings:
    return RunSettings(pipeline="t", prompts_per_step=2, samples_per_prompt=2, steps=steps, max_lag=1,
                       reward_stages=("score",), logprob_stages=("reference",), watchdog_timeout_s=5.0)


def segment(path: Path, steps: int, resume: dict | None = None, skip=frozenset(), on_step=None) -> Controller:
    dataplane = InMemoryDataPlane()
    sim = SimStages(settings(steps), dataplane, SimConfig(generate=Latency.uniform(0.001, 0.01)))
    for engine in [*sim.generators, *sim.trainers]:
        engine.version = resume["version"] if resume else 0
    prompts = (Prompt(i, f"q{i}", "a") for i in itertools.count() if i not in skip)
    controller = Controller(settings(steps), sim.handles, dataplane, prompts, on_step=on_step,
                            journal=Journal(JournalFile(path), resume))
    asyncio.run(controller.run())
    return controller


STEPS = 30


def test_a_run_stopped_by_a_full_disk_audits_and_resumes_with_merged_accounting(small_fs):
    run_dir = small_fs / "run"
    path = run_dir / JOURNAL_FILE
    filled: list[Path] = []

    def fill_after_step_two(record: dict) -> None:
        if record["step"] == 2 and not filled:
            filled.append(fill(small_fs))

    with pytest.raises(RunDirectoryError, match="is full: writing journal.jsonl failed"):
        segment(path, steps=STEPS, on_step=fill_after_step_two)  # fails once the journal's last page is full
    lines = path.read_text().splitlines(keepends=True)
    assert lines and all(part.endswith("\n") and json.loads(part) for part in lines)
    first = audit_journal(path)
    done = first.replay.totals()["steps"]
    assert first.ok and 2 <= done < STEPS and first.replay.segments[-1].end is None  # cut off, not clean

    filled[0].unlink()  # space freed: resume from the last step the journal holds
    segment(path, steps=STEPS - done, resume={"steps_done": done, "version": done},
            skip=frozenset(parse_sample_key(k)[1] for k in first.replay.trained_at))
    audit = audit_journal(path)
    assert audit.ok, audit.replay.violations
    totals = audit.replay.totals()
    assert (totals["resumes"], totals["steps"], totals["exit"]) == (1, STEPS, "finished")
    assert totals["trained"] == STEPS * 2 * 2  # both segments' samples, the first's included


def test_a_full_disk_hit_first_by_the_controller_is_said_in_one_line_without_rays_traceback(capsys):
    """The controller's RunDirectoryError reaches the driver as Ray's error (a subclass of both,
    whose text is the remote traceback): what is said is the original's, with its help."""
    from ray.exceptions import RayTaskError

    from rldsl.runtime.ray_lowering.launch import EXIT_FAILED, _run_directory_failed

    cause = RunDirectoryError("/runs/r/journal.jsonl", errno.ENOSPC, "No space left on device")
    remote = RayTaskError("ControllerActor.run", "Traceback (most recent call last):\n  File \"controller.py\"",
                          cause).as_instanceof_cause()
    assert isinstance(remote, RunDirectoryError) and "pid=" in str(remote)  # the remote traceback
    assert _run_directory_failed(remote) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("error: the run stopped: the run directory /runs/r is full: writing journal.jsonl "
                                   "failed (ENOSPC: No space left on device)")
    assert "Traceback" not in err and "pid=" not in err and "= help: free space" in err
