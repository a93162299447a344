"""Every sample ends exactly once: trained or dropped with a reason."""

from __future__ import annotations

import pytest

from rldsl.runtime.control.ledger import Ledger, LedgerError


def keys(*indices: int) -> list[str]:
    return [f"t/p{i}/s0" for i in indices]


def test_a_balanced_ledger_summarises_outcomes_and_lags():
    ledger = Ledger()
    ledger.register(keys(0, 1, 2, 3, 4))
    ledger.trained(keys(0, 1), lag=0)
    ledger.trained(keys(2), lag=2)
    ledger.dropped(keys(3), "too_stale")
    ledger.dropped(keys(4), "reward_failed")
    ledger.check()
    assert ledger.summary() == {
        "generated": 5,
        "trained": 3,
        "dropped": {"reward_failed": 1, "too_stale": 1},
        "open": 0,
        "max_lag": 2,
        "lag_histogram": {0: 2, 2: 1},
    }


def test_unaccounted_samples_are_named():
    ledger = Ledger()
    ledger.register(keys(0, 1))
    ledger.trained(keys(0), lag=0)
    with pytest.raises(LedgerError, match=r"1 samples neither trained nor dropped: t/p1/s0"):
        ledger.check()
    assert ledger.open_keys() == keys(1)


def test_double_counting_is_reported():
    ledger = Ledger()
    ledger.register(keys(0, 1))
    ledger.trained(keys(0, 1), lag=1)
    ledger.dropped(keys(1), "step_aborted")
    ledger.trained(keys(0), lag=1)
    with pytest.raises(LedgerError) as error:
        ledger.check()
    assert "t/p1/s0: step_aborted after already trained" in str(error.value)
    assert "t/p0/s0: trained after already trained" in str(error.value)
    assert ledger.trained_count == 2  # the second outcome is not counted


def test_unknown_and_twice_generated_samples_are_reported():
    ledger = Ledger()
    ledger.register(keys(0))
    ledger.register(keys(0))
    ledger.dropped(keys(9), "generation_failed")
    ledger.dropped(keys(0), "generation_failed")
    with pytest.raises(LedgerError) as error:
        ledger.check()
    assert "t/p0/s0: generated twice" in str(error.value)
    assert "t/p9/s0: generation_failed but never generated" in str(error.value)


def test_drop_needs_a_reason():
    ledger = Ledger()
    ledger.register(keys(0))
    with pytest.raises(ValueError):
        ledger.dropped(keys(0), "")
    with pytest.raises(ValueError):
        ledger.dropped(keys(0), "trained")


def test_an_empty_ledger_balances():
    ledger = Ledger()
    ledger.check()
    assert ledger.max_lag is None and ledger.summary()["generated"] == 0
