"""benchmarks/results holds exactly what docs/performance.md cites, each file indexed."""

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def result_files() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")


def test_every_result_is_cited_and_indexed() -> None:
    performance = (ROOT / "docs" / "performance.md").read_text()
    index = (RESULTS / "README.md").read_text()
    uncited = [name for name in result_files() if name not in performance]
    unindexed = [name for name in result_files() if name not in index]
    assert uncited == [], f"not cited in docs/performance.md: {uncited}"
    assert unindexed == [], f"not in benchmarks/results/README.md: {unindexed}"


def test_result_names_carry_date_and_commit() -> None:
    for name in result_files():
        date, time, commit = name.split("-")[:3], name.split("-")[3], name.split("-")[4]
        assert all(part.isdigit() for part in date), name
        assert time.isdigit() and len(time) == 4, name
        assert len(commit) >= 7 and all(c in "0123456789abcdef" for c in commit), name


def device_run_parts() -> list[str]:
    """The case patterns of benchmarks/device_run.sh's part loop (its last ``case``)."""
    script = (ROOT / "benchmarks" / "device_run.sh").read_text()
    loop = script[script.rindex('case $part in'):]
    patterns = re.findall(r"^\s+([A-Za-z0-9.*|-]+)\)", loop, re.MULTILINE)
    return [pattern for alternatives in patterns for pattern in alternatives.split("|")
            if pattern != "*"]


def test_every_device_run_part_the_docs_name_exists() -> None:
    """A part a doc tells the next session to run is one the script knows: device time
    is scarce, and an unknown part costs a call to find out."""
    parts = device_run_parts()
    assert "moe-tune" in parts and "decode-*" in parts
    unknown = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                ROOT / "benchmarks" / "device_run.sh"]:
        commands = re.findall(r"bash benchmarks/device_run\.sh((?: [a-z0-9.*-]+)+)",
                              doc.read_text())
        for line in commands:
            unknown += [f"{doc.name}: {name}" for name in line.split()
                        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in parts)]
    assert unknown == []


def test_no_part_is_shadowed_by_an_earlier_pattern() -> None:
    """bash takes a part's first matching case: a pattern listed after a wider one (a
    ``decode-tiles`` after ``decode-*``) never runs, and the wider one runs in its place."""
    parts = device_run_parts()
    shadowed = [f"{part} (by {earlier})" for index, part in enumerate(parts)
                for earlier in parts[:index]
                if fnmatch.fnmatchcase(part.replace("*", "x"), earlier)]
    assert shadowed == []
