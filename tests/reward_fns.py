"""Reward functions for the reward-isolation tests. Reward processes import
them by ``module:function``, so they live in a module of their own. Each
misbehaves only on the response that names its trouble."""

import ctypes
import os
import time


def hang_on_hang(response, answer, prompt):
    """Spins (holding the CPU, as a real hang does) on the response "hang"."""
    if response == "hang":
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
    return 1.0 if response == answer else 0.0


def raise_on_bad(response, answer, prompt):
    if response == "bad":
        raise ValueError("bad response")
    return 1.0


def nan_or_text(response, answer, prompt):
    return {"nan": float("nan"), "text": "high"}.get(response, 0.5)


def crash_on_crash(response, answer, prompt):
    if response == "crash":
        os._exit(7)
    if response == "segfault":
        ctypes.string_at(0)
    return 1.0


def slow(response, answer, prompt):
    time.sleep(float(response))
    return 1.0


def pid(response, answer, prompt):
    return float(os.getpid())


def slow_echo(response, answer, prompt):
    time.sleep(0.3)
    return float(response)
