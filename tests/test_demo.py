"""The README's main job runs on CPU devices, checks every impl, and says what ran."""

import json
import math

from jax_flashoverlap import demo


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
    assert "no GPU found" in capsys.readouterr().out
