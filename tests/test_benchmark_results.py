"""benchmarks/results holds exactly what docs/performance.md cites, each file indexed."""

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
