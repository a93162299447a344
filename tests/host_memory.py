"""A process's peak resident memory, resettable (Linux): what a step of it
holds beyond what it held before, measured from inside the process; or
another process's peak, read from outside."""

from __future__ import annotations


def peak_rss_reset() -> int:
    """Reset this process's peak resident memory to now (``clear_refs`` 5); returns it."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    return peak_rss()


def peak_rss(pid: int | str = "self") -> int:
    """The peak resident memory of this process, or of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
