"""Every committed result says where it came from."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def test_there_are_results():
    assert len(RESULTS) >= 50


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
