"""The suite's shared pieces: the repository root, one Ray for the session's
runs (tests/runs.py), a one-rank process group, megatron-core on one process,
two xdist workers for the whole suite, and a time budget every test keeps.

A test that takes over ``BUDGET_S`` fails unless it is marked
``@pytest.mark.slow(reason="what it needs the time for")``; the time of the
`slow` tests is totalled at the end of every run, so that the suite's cost
stays visible where it is spent (`-m "not slow"` runs the rest)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

BUDGET_S = 60.0
_slow_seconds: dict[str, float] = {}


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def one_process_group():
    """A one-rank default process group in this process, torn down after (other tests start their own);
    NCCL beside gloo where there is a GPU, which the trainers then use."""
    import torch
    import torch.distributed as dist

    from rldsl.runtime.engines.torch.common import init_one_process_group

    init_one_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron():
    """megatron-core under the CPU shim, with world-size-1 model-parallel groups."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'rldsl[gpu]')")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    created_group = not dist.is_initialized()
    with megatron_on_cpu():
        megatron_model.ensure_model_parallel(tp=1, pp=1, seed=0)
        yield megatron_model
        parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): two workers for the whole suite on
    two cores or more, none when files or tests are named (a worker's start
    would cost more than it saves)."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return 2 if whole_suite and (os.cpu_count() or 1) >= 2 else 0


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests marked `own_ray` (they start or join a Ray of their own in this
    process, after ``tests.runs.release_shared_ray()``) run first: the shared
    Ray then starts once, not once per switch.

    With two workers (``--dist loadgroup``) the tests that start processes
    (Ray runs, vLLM engines, gloo ranks) go to one of them, in this order,
    and the tests that run in the test process alone (the compiler's, the
    control plane's) to the other, which runs them at a lower priority
    (``IN_PROCESS_NICENESS``): they take the CPU the first worker's
    processes leave, and slow those runs little. Two Ray runs at once, or a
    Ray run beside a vLLM engine, each take twice as long on two cores
    (docs/performance.md)."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is None)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(PROCESSES if _starts_processes(item) else IN_PROCESS))


PROCESSES, IN_PROCESS = "processes", "in_process"
IN_PROCESS_NICENESS = 5  # CFS then gives this worker a quarter of a contended core's time, not half
_PROCESS_MARKS = ("ray", "own_ray", "vllm")
_PROCESS_FIXTURES = {"vllm_engine", "torch_run", "sim_run_with_overrides", "rloo_tis_run"}
_PROCESS_HELPERS = {"start_ranks", "spawn_ranks", "rank_context", "rldsl_here", "run_text", "shared_ray",
                    "signalled_here"}  # tests/ports.py and tests/runs.py: a module using one starts processes


def _starts_processes(item) -> bool:
    if any(item.get_closest_marker(name) for name in _PROCESS_MARKS):
        return True
    if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and bool(_PROCESS_HELPERS & set(vars(module)))


_session = []


def pytest_sessionfinish(session, exitstatus):
    from tests.runs import release_shared_ray

    release_shared_ray()
    _session.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with the session's status without finalising the interpreter:
    native threads of the libraries under test (vLLM's engine client, Ray,
    torch) still running then crashed it now and then with a SIGSEGV after
    every test had passed (measured: 1 of 3 full runs), which would turn a
    green run red. Every report (terminal, JUnit) is written by now."""
    if _session and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_session[0].exitstatus))


def _slow_reason(item) -> str | None:
    mark = item.get_closest_marker("slow")
    if mark is None:
        return None
    return mark.kwargs.get("reason") or (mark.args[0] if mark.args else None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("slow") is not None:
        if not _slow_reason(item) and report.when == "setup":
            report.outcome, report.longrepr = "failed", "marked `slow` without a reason: slow(reason=...)"
    elif report.when == "call" and report.passed and report.duration > BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (f"took {report.duration:.0f} s, over the suite's {BUDGET_S:.0f} s budget per test: make it "
                           "faster, or mark it @pytest.mark.slow(reason=...) saying what it needs the time for")


def pytest_runtest_setup(item):
    """The worker of the in-process tests lowers its priority at its first one."""
    worker = getattr(item.config, "workerinput", None)
    if worker is not None and not worker.get("niced") and item.get_closest_marker("xdist_group").args == (IN_PROCESS,):
        worker["niced"] = True
        os.nice(IN_PROCESS_NICENESS)


def pytest_runtest_logreport(report):
    """In the process that reports (xdist's controller, or the only one)."""
    if "slow" in report.keywords:
        _slow_seconds[report.nodeid] = _slow_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if _slow_seconds:
        total = sum(_slow_seconds.values())
        terminalreporter.write_line(f"slow tests: {len(_slow_seconds)}, {total:.0f} s in all "
                                    f"(`-m \"not slow\"` leaves them out)")


from tests.shared_runs import rloo_tis_run, sim_run_with_overrides, torch_run  # noqa: E402,F401  (session fixtures)
from tests.vllm_engines import vllm_engine  # noqa: E402,F401  (the session's real vLLM engine)
