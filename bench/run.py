"""accelkit benchmarks: run each section and print one table of figures against references.

Usage: ``python bench/run.py [--quick] [--only SECTION ...] [--json PATH]``.

A section is a module in bench/ named in ``SECTIONS`` that exposes
``run(quick: bool) -> list[dict]``; each row is a dict with ``name``, ``unit``,
``accelkit`` (our figure), ``reference`` (the baseline's figure, or None), ``diff``
(median paired difference accelkit - reference), ``ratio`` (median paired ratio),
``target`` (the largest acceptable ``diff``, or None), ``ok`` and ``n`` (samples);
``_common.paired_row`` builds one. A section whose module is missing or raises
ImportError is reported as skipped; one that fails while running is reported as failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import Row  # noqa: E402

SECTIONS: list[str] = [
    "import_time", "launch_time", "collectives", "train_step", "checkpoint", "sharding_memory", "tracking",
    "gpu_step", "scale", "mesh",
]  # fmt: skip

COLUMNS = ("section", "name", "accelkit", "reference", "diff", "ratio", "target", "n")


def _fmt(row: Row, key: str) -> str:
    value: Any = row.get(key)
    if value is None:
        return "-"
    unit = row.get("unit", "")
    if key in ("accelkit", "reference"):
        return f"{value:.3f} {unit}"
    if key == "diff":
        return f"{value:+.3f} {unit}"
    if key == "ratio":
        return f"{value:.3f}x"
    if key == "target":
        return f"<= {value:+.3f} {unit} {'ok' if row.get('ok') else 'OVER'}"
    return str(value)


def print_table(rows: list[Row]) -> None:
    cells = [list(COLUMNS)] + [[_fmt(row, key) for key in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    for j, line in enumerate(cells):
        print(
            "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if j == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION", help=f"one of {SECTIONS}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    args = parser.parse_args(argv)

    rows: list[Row] = []
    notes: dict[str, str] = {}
    failed = False
    for section in args.only or SECTIONS:
        try:
            if not os.path.exists(os.path.join(HERE, f"{section}.py")):
                raise ModuleNotFoundError(f"bench/{section}.py does not exist yet")
            module = importlib.import_module(section)
        except ImportError as exc:  # ModuleNotFoundError included
            notes[section] = f"skipped: {exc}"
            print(f"[{section}] skipped: {exc}", flush=True)
            continue
        print(f"[{section}] running...", flush=True)
        start = time.perf_counter()
        try:
            section_rows = module.run(args.quick)
        except Exception as exc:
            failed = True
            notes[section] = f"failed: {type(exc).__name__}: {exc}"
            print(f"[{section}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        for row in section_rows:
            rows.append({"section": section, **row})
        print(f"[{section}] done in {time.perf_counter() - start:.0f} s", flush=True)

    print()
    print_table(rows)
    for section, note in notes.items():
        print(f"{section}: {note}")
    if args.json:
        meta = {"python": platform.python_version(), "platform": platform.platform(), "quick": args.quick}
        try:
            import torch

            meta["torch"] = torch.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "notes": notes}, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
