"""One JSON and a table from the probe processes of ``scripts/decode_ab.sh run``.

    python3 scripts/decode_ab_summary.py OUT ROUNDS BUILD_DIR NAME ...

Reads OUT/NAME_ROUND.json (a ``transformer_decode_probe.py --json`` each)
and BUILD_DIR/pkg_NAME/AB_BUILD.txt (what ``decode_ab.sh build`` built),
writes OUT/decode_ab.json (every row with its build, round and order;
``meta.builds`` and each build's probe settings in ``meta.settings_by_build``)
and prints each round's step per build against the first NAME's row.
"""

import json
import os
import sys

SETTINGS = ("options", "chunk_bytes", "ring_slots")


def collect(out: str, rounds: int, build_dir: str, names: list[str]) -> dict:
    """The processes' rows as one results JSON (``{"meta", "rows"}``)."""
    rows, meta, order, settings_by_build, missing = [], None, 0, {}, []
    for r in range(1, rounds + 1):
        for name in names:
            path = os.path.join(out, f"{name}_{r}.json")
            if not os.path.exists(path):
                print(f"{name}, round {r}: no rows")
                missing.append(f"{name} in round {r}")
                continue
            with open(path) as f:
                result = json.load(f)
            meta = meta or result["meta"]
            settings_by_build.setdefault(name, result["meta"]["settings"])
            for row in result["rows"]:
                order += 1
                rows.append({**row, "build": name, "round": r, "order": order})
    if meta is None:
        raise SystemExit("no probe wrote rows")
    for settings in (meta["settings"], *settings_by_build.values()):
        settings.pop("json", None)
    meta["settings_by_build"] = settings_by_build
    meta["builds"] = {}
    for name in names:
        with open(os.path.join(build_dir, f"pkg_{name}", "AB_BUILD.txt")) as f:
            meta["builds"][name] = f.read().strip()
    meta["note"] = (f"{rounds} rounds on one device, a process per build in the order "
                    f"{', '.join(names)}; each row checked against the float32 reference first")
    if missing:
        meta["note"] += f"; no rows from {', '.join(missing)}"
    return {"meta": meta, "rows": rows}


def table(rows: list[dict], names: list[str]) -> str:
    """Markdown: a line per round and settings, each build's step µs (x the
    first build's row with the same settings; for settings the first build
    lacks, its only row of that round, chunk size and ring)."""
    step = {(row["build"], row["round"], *(row[k] for k in SETTINGS)): row["per_step_us"]
            for row in rows}
    # Numerically, a setting left to the kernel (None) after the numbers.
    keys = sorted({(row["round"], *(row[k] for k in SETTINGS)) for row in rows},
                  key=lambda key: (key[0], [(v is None, v or 0) for v in key[1:]]))

    def baseline(key):
        if (names[0], *key) in step:
            return step[(names[0], *key)]
        same = [us for (name, r, _, chunk, ring), us in step.items()
                if name == names[0] and (r, chunk, ring) == (key[0], *key[2:])]
        return same[0] if len(same) == 1 else None

    lines = ["| round | options, chunk bytes, ring slots | "
             + " | ".join(f"{n} µs (x {names[0]})" for n in names) + " |",
             "|---" * (len(names) + 2) + "|"]
    for key in keys:
        base = baseline(key)
        cells = []
        for name in names:
            us = step.get((name, *key))
            ratio = f" ({us / base:.3f})" if us is not None and base else ""
            cells.append("-" if us is None else f"{us:.1f}{ratio}")
        lines.append(f"| {key[0]} | {', '.join(str(v) for v in key[1:])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out, rounds, build_dir, names = argv[0], int(argv[1]), argv[2], argv[3:]
    result = collect(out, rounds, build_dir, names)
    with open(os.path.join(out, "decode_ab.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result["rows"], names))


if __name__ == "__main__":
    main(sys.argv[1:])
