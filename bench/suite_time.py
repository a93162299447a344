"""The test suite's time per test file, from pytest's JUnit XML reports
(`python -m pytest -q --junitxml=FILE`), side by side for several runs:

    python bench/suite_time.py before.xml after.xml [--top 25]

Prints a Markdown table (docs/performance.md keeps one), files ordered by
their time in the last report, and each report's total."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def seconds_per_file(report: Path) -> dict[str, float]:
    per_file: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        name = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("classname", "?")
        per_file[name] += float(case.get("time", 0))
    return dict(per_file)


def table(reports: list[Path], top: int) -> str:
    runs = [seconds_per_file(r) for r in reports]
    files = sorted(set().union(*runs), key=lambda f: -max(run.get(f, 0.0) for run in runs))
    head = "| file | " + " | ".join(r.stem if r.stem != "junit" else r.parent.name for r in reports) + " |"
    lines = [head, "|---|" + "---:|" * len(reports)]
    for name in files[:top]:
        lines.append(f"| `{name}` | " + " | ".join(f"{run.get(name, 0.0):.0f} s" for run in runs) + " |")
    rest = files[top:]
    if rest:
        lines.append(f"| {len(rest)} other files | "
                     + " | ".join(f"{sum(run.get(f, 0.0) for f in rest):.0f} s" for run in runs) + " |")
    lines.append("| **all tests** | " + " | ".join(f"**{sum(run.values()) / 60:.1f} min**" for run in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(table(args.reports, args.top))


if __name__ == "__main__":
    main()
