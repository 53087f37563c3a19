"""Every committed result says where it came from."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def test_there_are_results():
    assert RESULTS


def test_every_cited_result_is_committed():
    """A results file named in the docs, the library, the kernels, the
    benchmarks or the scripts is in benchmarks/results/."""
    name = re.compile(r"\b[a-z][a-z0-9_]*_\d+xh[12]00\.(?:json|png|txt)\b")
    sources = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "docs").glob("*.py"), *(ROOT / "jax_flashoverlap").rglob("*.py"),
               *(ROOT / "jax_flashoverlap" / "tables").glob("*.json"),
               *(ROOT / "models").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
               *(ROOT / "scripts").iterdir(),
               *(p for p in (ROOT / "ffi" / "src").rglob("*") if p.is_file())]
    missing = sorted({f"{p.relative_to(ROOT)}: {m}" for p in sources if p.is_file()
                      for m in name.findall(p.read_text())
                      if not (ROOT / "benchmarks" / "results" / m).exists()})
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_result_carries_commit_date_and_protocol(path):
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "rows"}, sorted(doc)
    meta = doc["meta"]
    assert isinstance(meta.get("commit"), str) and len(meta["commit"]) >= 7, meta.get("commit")
    assert isinstance(meta.get("date"), str) and meta["date"][:4] == "2026", meta.get("date")
    protocol = meta.get("protocol")
    assert isinstance(protocol, str) and "DESIGN.md" not in protocol, protocol
    named = protocol.split()[0]
    if "/" in named:  # a path inside the project
        assert (ROOT / named).exists(), named
    assert doc["rows"], "no rows"
