"""Writes the tuning table the package ships for 2 H200s, from committed results.

    python3 scripts/make_tuning_table.py    # -> jax_flashoverlap/tables/nvidia_h200_x2.json

Later files win for the same op and shape. The sources are the last run of
each op with the defaults impl="cuda" has today: the six benchmark shapes
(peer waits on the side stream, chunks by shape), matmul_all_reduce with its
parts aligned to 256 rows, the small-row shapes, and the all-reduce with the
Lamport kernel up to 2 MiB (unrolled loops, as in a model).
"""

import json
import pathlib

from jax_flashoverlap import tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ["collective_matmul_xla_waits_2xh200.json", "collective_matmul_mar_auto_2xh200.json",
           "collective_matmul_small_rows_auto_2xh200.json",
           "all_reduce_lamport_auto_2xh200.json"]

if __name__ == "__main__":
    table = tuning.Table()
    for name in SOURCES:
        table = table.merged(tuning.table_from_results([ROOT / "benchmarks/results" / name]))
    out = ROOT / "jax_flashoverlap/tables/nvidia_h200_x2.json"
    out.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    print(f"{len(table.entries)} entries -> {out}")
