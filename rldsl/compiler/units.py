"""Units of the language: sizes, durations, percentages, counts."""

from __future__ import annotations

SIZE_UNITS = {
    "B": 1,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
PERCENT_UNITS = {"%": 0.01}


def format_bytes(n: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= SIZE_UNITS[unit]:
            return f"{n / SIZE_UNITS[unit]:.1f}{unit}"
    return f"{int(n)}B"


def format_count(n: float) -> str:
    for unit in ("T", "B", "M", "K"):
        if n >= COUNT_UNITS[unit]:
            return f"{n / COUNT_UNITS[unit]:.3g}{unit}"
    return str(int(n))


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"
