"""Every ratio the README quotes is the current row of docs/benchmarks.md, with its goal.

A README row names its section (the link's anchor) and the start of the
benchmark row's text. Its ratio must be in the row's headline: the ratio
cell before any parenthesis, where earlier or better runs are told, so the
README cannot quote those. Its goal must be the row's goal, misses included.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def benchmark_rows(text: str) -> dict[str, list[dict]]:
    """Each section's table rows as {column: cell}, by the section's anchor."""
    sections: dict[str, list[dict]] = {}
    header, rows = None, []
    for line in text.splitlines():
        if line.startswith("## "):
            rows = sections.setdefault(_anchor(line[3:]), [])
            header = None
        elif line.startswith("|") and not line.startswith("|---"):
            cells = _cells(line)
            if header is None:
                header = cells
            else:
                rows.append(dict(zip(header, cells)))
        elif not line.startswith("|"):
            header = None
    return sections


def readme_rows(text: str) -> list[tuple[str, str, str, str]]:
    """(section anchor, row start, ratio, goal) of the README's numbers table."""
    found = []
    for line in text.split("## Numbers", 1)[1].split("\n## ", 1)[0].splitlines():
        match = re.match(r"\| \[[^\]]+\]\(docs/benchmarks\.md#([^)]+)\): (.+?) \| (.+?) \| (.+?) \|$", line)
        if match:
            found.append(match.groups())
    return found


def headline(cell: str) -> str:
    return cell.split(" (", 1)[0]


def check(readme: str, benchmarks: str) -> list[str]:
    sections, problems = benchmark_rows(benchmarks), []
    rows = readme_rows(readme)
    if not rows:
        return ["the README has no numbers table"]
    for anchor, start, ratio, goal in rows:
        # Tables headed otherwise (a section's rounds, its instantiations) hold no quotable row.
        matches = [r for r in sections.get(anchor, []) if r.get("row", "").startswith(start)]
        if len(matches) != 1:
            problems.append(f"{anchor}: {len(matches)} rows start with {start!r}")
            continue
        row = matches[0]
        current = headline(row.get("ratio") or row["result"])
        if ratio not in current:
            problems.append(f"{anchor}: {start!r} quotes {ratio}, the row reads {current!r}")
        if goal != row["goal"]:
            problems.append(f"{anchor}: {start!r} quotes goal {goal!r}, the row's is {row['goal']!r}")
    return problems


def test_every_readme_ratio_is_its_current_row():
    assert check((ROOT / "README.md").read_text(), (ROOT / "docs/benchmarks.md").read_text()) == []


BENCH = """## engine

| row | ours | baseline | ratio | goal | date |
|---|---|---|---|---|---|
| decode at 2k / mlx-lm | 14 | 14 | 1.018x (earlier run 1.14x) | >= 0.95 | today |
| hybrid second turn / cold | | | 0.114x | <= 0.10, **missed** | today |
"""


def _readme(ratio: str, goal: str = ">= 0.95", start: str = "decode at 2k") -> str:
    return f"## Numbers\n\n| row | ratio | goal |\n|---|---|---|\n| [engine](docs/benchmarks.md#engine): {start} | {ratio} | {goal} |\n"


def test_a_better_earlier_run_is_not_the_current_row():
    assert check(_readme("1.018x"), BENCH) == []
    assert check(_readme("1.14x"), BENCH)  # quoted from the parenthesis: an earlier run


def test_a_missed_goal_must_say_so():
    assert check(_readme("0.114x", "<= 0.10", "hybrid second turn"), BENCH)
    assert check(_readme("0.114x", "<= 0.10, **missed**", "hybrid second turn"), BENCH) == []


def test_a_sections_tables_of_other_columns_are_passed_over():
    rounds = BENCH + "\nRounds:\n\n| round | before | after |\n|---|---|---|\n| 1 | 0.99x | 1.05x |\n"
    assert check(_readme("1.018x"), rounds) == []
    assert check(_readme("1.14x"), rounds)


def test_a_row_that_is_not_there_is_named():
    assert "0 rows" in check(_readme("1.0x", start="prefill"), BENCH)[0]


def test_the_readme_stays_short():
    """The README is for users (200 lines at most); the rest belongs in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
