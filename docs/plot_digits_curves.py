"""Draw docs/digits_curves.png from the digits example's CSV: its last run (the ``run`` column).

Needs matplotlib, which the ``docs`` extra installs (``.ci/docs`` runs this script on a small file):

    pip install -e ".[docs]"
    python examples/digits.py --num-processes 2 && python docs/plot_digits_curves.py runs/digits/metrics.csv

A second argument names another target than ``docs/digits_curves.png``.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def main(source: str, target: str = str(Path(__file__).with_name("digits_curves.png"))) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('plot_digits_curves.py needs matplotlib: pip install -e ".[docs]"') from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    last = rows[-1].get("run") if rows else None  # a file holds every run of the project; draw the last
    rows = [r for r in rows if r.get("run") == last]

    def series(name: str) -> tuple[list[int], list[float]]:
        kept = [r for r in rows if r.get(name)]
        return [int(r["step"]) for r in kept], [float(r[name]) for r in kept]

    fig, axes = plt.subplots(1, 3, figsize=(10, 2.8), dpi=90)
    for ax, (name, title) in zip(
        axes,
        [("train/loss", "training loss"), ("train/lr", "learning rate"), ("eval/accuracy", "test accuracy")],
        strict=True,
    ):
        steps, values = series(name)
        ax.plot(steps, values, marker="o" if name == "eval/accuracy" else None, markersize=3, linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("examples/digits.py on 2 CPU processes (rank 0's metrics.csv)", fontsize=10)
    fig.tight_layout()
    fig.savefig(target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main(*sys.argv[1:])
