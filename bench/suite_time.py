"""The test suite's time per test family, from pytest's JUnit reports: the table
docs/performance.md shows.

    python bench/suite_time.py COLD.xml [WARM.xml] [--top 9]

One column per report (cold: a new empty compilation cache; warm: every program a cache read).
A family is a test file; the `--top` costliest of the first report are named, the others summed
as "the rest". Worker-seconds are the tests' own times summed over the pytest-xdist workers
(setup and teardown included); "wall" is the run's, as pytest reported it. No JAX.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def family(classname: str, file: str | None) -> str:
    """The test file a JUnit testcase belongs to: `tests/test_cli.py`."""
    if file:
        return file if file.startswith("tests/") else f"tests/{Path(file).name}"
    module = classname.split(".")
    stem = next((m for m in module if m.startswith("test_")), module[-1])
    return f"tests/{stem}.py"


def read(report: Path) -> tuple[dict[str, float], float]:
    """Seconds per family, and the run's wall seconds (the testsuite's `time`)."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    seconds: dict[str, float] = collections.Counter()
    wall = 0.0
    for suite in suites:
        wall = max(wall, float(suite.get("time", 0.0)))
        for case in suite.iter("testcase"):
            name = family(case.get("classname", ""), case.get("file"))
            seconds[name] += float(case.get("time", 0.0))
    return dict(seconds), wall


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def table(reports: list[Path], top: int) -> str:
    read_ = [read(r) for r in reports]
    first = read_[0][0]
    named = sorted(first, key=first.get, reverse=True)[:top]
    header = "| test family | " + " | ".join(f"{r.stem}, worker-s" for r in reports) + " |"
    lines = [header, "| --- |" + " ---: |" * len(reports)]
    for name in named:
        cells = [f"{seconds.get(name, 0.0):.0f}" for seconds, _ in read_]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    rest = [sum(v for k, v in seconds.items() if k not in named) for seconds, _ in read_]
    lines.append("| the rest | " + " | ".join(f"{v:.0f}" for v in rest) + " |")
    totals = [sum(seconds.values()) for seconds, _ in read_]
    lines.append("| **total** | " + " | ".join(f"**{v:.0f}**" for v in totals) + " |")
    walls = [f"**{wall:.0f} s ({minutes(wall)})**" for _, wall in read_]
    lines.append("| **wall** | " + " | ".join(walls) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files (cold, warm)")
    parser.add_argument("--top", type=int, default=9, help="families named (the rest summed)")
    args = parser.parse_args()
    print(table(args.reports, args.top))


if __name__ == "__main__":
    main()
