"""The README's main job runs on CPU devices, checks every impl, and says what ran."""

import json
import math

import pytest

from jax_flashoverlap.cli import demo


def test_demo_runs_every_op_and_reports_the_impl(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert demo.main(["--reps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and result["devices"] == 8
    ops = {r["op"] for r in result["rows"]}
    assert ops == {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                   "all_reduce"}
    for row in result["rows"]:
        assert row["rel_err_vs_xla"] < 1e-4
        assert math.isfinite(row["us"])  # CPU timings are noise; the sign is not checked
        if row["impl"] == "auto":
            assert row["runs"] == "xla"  # no GPU: "auto" is XLA's collectives
    printed = capsys.readouterr().out
    assert "no GPU found" in printed
    # The table shows each impl's error against xla and spread, and no ratio
    # between two runs of xla's own program.
    assert "err vs xla" in printed and "spread" in printed
    auto_lines = [line for line in printed.splitlines()
                  if line.startswith(("all_reduce ", "matmul_all_reduce ")) and " auto " in line]
    assert auto_lines and all(line.rstrip().endswith("same") for line in auto_lines)


def test_no_repetitions_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--reps", "0"])
    assert exit_info.value.code == 2
    assert "--reps must be at least 1 (the median of the timings), got 0" in capsys.readouterr().err
