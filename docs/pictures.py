"""The site's pictures, drawn with matplotlib each time mkdocs builds the site (a hook: mkdocs.yml's ``hooks:``).

Each ``draw_*`` function returns one picture as SVG text; :func:`on_files` adds them to the site as
``pictures/NAME.svg``, so that pages show them as files of their own (``![...](pictures/job-start.svg)``)
and nothing drawn is committed. The performance plot reads ``docs/figures.yml``, the figures the pages
quote. ``python docs/pictures.py DIR`` writes them all to DIR, to look at them without building the site.

Needs matplotlib and PyYAML, which the ``docs`` extra installs. What each picture shows is drawn from
the code it describes (the launcher, the loaders' sharding, the checked collectives, the checkpoint's
commit); tests/test_docs.py runs the blocks beside them, which check the same facts on real processes.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
INK, GREY, LINE = "#263238", "#78909c", "#b0bec5"
RANK = [("#e8eaf6", "#3f51b5"), ("#fff3e0", "#ef6c00")]  # fill, edge: rank 0 indigo, rank 1 orange
LAUNCHER, OK, BAD, PAD = ("#eceff1", "#546e7a"), ("#e8f5e9", "#2e7d32"), ("#ffebee", "#c62828"), ("#f5f5f5", "#9e9e9e")


class Canvas:
    """A figure in units of its own (x right, y down), with boxes, arrows and text."""

    def __init__(self, width: float, height: float, scale: float = 0.078) -> None:
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(width * scale, height * scale))
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(height, 0)
        self.ax.axis("off")

    def box(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        text: str = "",
        colors: tuple[str, str] = LAUNCHER,
        size: float = 9,
        bold: bool = False,
        hatch: str | None = None,
        align: str = "center",
    ) -> None:
        from matplotlib.patches import FancyBboxPatch

        fill, edge = colors
        self.ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0,rounding_size=0.8",
                facecolor=fill,
                edgecolor=edge,
                linewidth=1.1,
                hatch=hatch,
            )
        )
        if text:
            tx = x + w / 2 if align == "center" else x + 1.2
            self.text(tx, y + h / 2, text, size=size, bold=bold, align=align)

    def text(
        self,
        x: float,
        y: float,
        text: str,
        size: float = 9,
        bold: bool = False,
        color: str = INK,
        align: str = "center",
        mono: bool = False,
        va: str = "center",
    ) -> None:
        self.ax.text(
            x,
            y,
            text,
            ha=align,
            va=va,
            fontsize=size,
            color=color,
            linespacing=1.35,
            fontweight="bold" if bold else "normal",
            family="monospace" if mono else "sans-serif",
        )

    def arrow(
        self,
        start: tuple[float, float],
        end: tuple[float, float],
        text: str = "",
        color: str = INK,
        dashed: bool = False,
        size: float = 8.5,
        both: bool = False,
    ) -> None:
        self.ax.annotate(
            "",
            xy=end,
            xytext=start,
            arrowprops={
                "arrowstyle": "<|-|>" if both else "-|>",
                "color": color,
                "lw": 1.1,
                "shrinkA": 0,
                "shrinkB": 0,
                "linestyle": (0, (4, 3)) if dashed else "-",
                "mutation_scale": 10,
            },
        )
        if text:
            (x0, y0), (x1, y1) = start, end
            self.text((x0 + x1) / 2, (y0 + y1) / 2 - 0.8, text, size=size, color=color, va="bottom")

    def line(self, xs: Sequence[float], ys: Sequence[float], color: str = LINE, dashed: bool = True) -> None:
        self.ax.plot(xs, ys, color=color, lw=1, linestyle=(0, (3, 3)) if dashed else "-", zorder=0)

    def svg(self) -> str:
        return _svg(self.fig)


def _svg(fig: Any) -> str:
    import matplotlib

    out = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "accelkit", "svg.fonttype": "path"}):  # the same bytes each build
        fig.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()


def draw_job_start() -> str:
    """``python train.py`` with ``@ak.distributed(num_processes=2)``: the launcher, the workers, rank 0's value."""
    c = Canvas(100, 84)
    lanes = {"launch": 17, 0: 55, 1: 85}
    c.box(3, 1, 28, 7, "python train.py\n(the launching process)", LAUNCHER, bold=True)
    c.box(43, 1, 24, 7, "worker: rank 0", RANK[0], bold=True)
    c.box(73, 1, 24, 7, "worker: rank 1", RANK[1], bold=True)
    for x in lanes.values():
        c.line([x, x], [8, 74])
    c.box(2, 11, 30, 8, "train(3): no launcher's variables\nhere, so @ak.distributed\nstarts the job", LAUNCHER)
    c.box(2, 21, 30, 8, "hosts the job's store (TCPStore,\n127.0.0.1) and runs torch's\nelastic agent", LAUNCHER)
    c.arrow((32, 25), (lanes[0], 25), "starts: python -c BOOT job")
    c.arrow((32, 27.5), (lanes[1], 27.5))
    for rank, x in ((0, lanes[0]), (1, lanes[1])):
        c.box(
            x - 12.5, 29.5, 25, 12, "parent-death signal\narmed; train.py\nimported again;\ntrain(3) called", RANK[rank]
        )
    c.box(
        43,
        43,
        54,
        12,
        "the first accelkit call forms the group: joins the store,\n"
        "init_process_group (gloo, NCCL), the handshake (the same\n"
        "versions and options as rank 0), a heartbeat thread",
        OK,
        size=8.5,
    )
    c.arrow((lanes[0] + 1, 62), (lanes[1] - 1, 62), "training: DDP's all-reduces,\nchecked collectives", both=True)
    for rank, y in ((0, 67), (1, 71.5)):
        c.arrow((lanes[rank], y), (lanes["launch"] + 15, y), color=RANK[rank][1])
        c.text(
            lanes[rank] - 2,
            y - 2,
            f"return value → results/rank{rank}.pickle",
            size=7.5,
            color=RANK[rank][1],
            align="right",
        )
    c.box(2, 73, 30, 9, "train(3) returns rank 0's value;\na failed rank raises WorkerError,\nroot cause first", OK)
    c.text(
        65,
        79,
        "Under torchrun, accelkit launch, srun or mpirun\nthe launcher starts the workers: train(3) runs in each",
        size=8,
        color=GREY,
    )
    return c.svg()


def draw_batches() -> str:
    """10 samples, ``batch_size=2``, 2 processes: rounds, each rank's batches, the padding and its removal."""
    c = Canvas(100, 60)
    c.text(1, 3, "the epoch's order, in rounds of world size x batch size = 4 samples", size=9, align="left", bold=True)
    order = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]

    def cell(x: float, y: float, label: str, rank: int, padding: bool, w: float = 5.6) -> None:
        c.box(x, y, w, 5.6, label, PAD if padding else RANK[rank], size=9.5, hatch="///" if padding else None)

    for i, sample in enumerate(order):
        cell(2 + i * 6.4 + (i // 4) * 3, 6, str(sample), (i // 2) % 2, i >= 10)
    for k in range(3):
        c.text(2 + k * 28.6 + 12.5, 14.2, f"round {k}", size=8, color=GREY)
    c.text(86.5, 8.5, "padding: the\nlast round,\ncompleted from\nthe start", size=7.5, color=GREY, align="left")
    c.text(1, 20, "each rank takes its slice of every round: its batches", size=9, align="left", bold=True)
    for rank in (0, 1):
        y = 23.5 + rank * 8
        c.box(2, y, 12, 5.6, f"rank {rank}", RANK[rank], bold=True, size=9)
        for b in range(3):
            samples = order[b * 4 + rank * 2 : b * 4 + rank * 2 + 2]
            cell(17 + b * 17, y, str(samples), rank, b == 2 and rank == 1, w=14.5)
    c.text(69, 30.5, "3 batches each:\nthe ranks stay in step", size=8, color=GREY, align="left")
    c.text(1, 43, "ak.gather_for_metrics at the last batch", size=9, align="left", bold=True)
    for i, label in enumerate(("8", "9", "0", "1")):
        cell(2 + i * 6.4, 46.5, label, 0, i >= 2)
    c.arrow((29, 49.3), (41, 49.3), "drops the padding")
    for i, label in enumerate(("8", "9")):
        cell(43 + i * 6.4, 46.5, label, 0, False)
    c.text(59, 49.3, "every sample counted once:\nthe 10 samples over the epoch", size=8, color=GREY, align="left")
    return c.svg()


def draw_checked_collective() -> str:
    """A planned ``ak.reduce(x)`` on 2 ranks: one message of data and token bits, one all-reduce, the verdict."""
    c = Canvas(100, 70)
    c.text(
        1,
        3,
        "ak.reduce(x), a later call at its point of the program: one message per rank",
        size=9,
        align="left",
        bold=True,
    )
    for rank in (0, 1):
        y = 7 + rank * 9
        c.text(1, y + 3.2, f"rank {rank}", size=9, align="left", bold=True, color=RANK[rank][1])
        c.box(11, y, 44, 6.4, f"x on rank {rank}: the data (n floats)", RANK[rank], size=8.5)
        c.box(56, y, 27, 6.4, "the call's token: 64 bits,\nas 64 floats of 0 or 1", RANK[rank], size=7.5)
    c.text(
        85,
        14,
        "token: a 64-bit\nfingerprint of the\noperation, arguments,\ndtypes, shapes and\nthe call's number",
        size=7,
        color=GREY,
        align="left",
    )
    c.arrow((48, 23.5), (48, 31), "")
    c.text(50, 27.2, "one all_reduce (sum): the backend call raw code makes", size=8.5, align="left")
    c.text(1, 35.2, "result", size=9, align="left", bold=True)
    c.box(11, 32, 44, 6.4, "the sum: the result (the message itself)", OK, size=8.5)
    c.box(56, 32, 27, 6.4, "each bit's sum: 0 or 2", OK, size=8.5)
    c.box(
        3,
        43,
        45,
        12,
        "every bit 0 or 2: every rank made\nthe same call; the result is returned\n(on a GPU: read at the next call)",
        OK,
        size=8.5,
    )
    c.box(
        52,
        43,
        45,
        12,
        "a bit summed to 1: the calls differ;\nevery rank describes its call and raises\n"
        "DistributedOperationError, with a table",
        BAD,
        size=8.5,
    )
    c.arrow((40, 38.4), (25, 43))
    c.arrow((72, 38.4), (74, 43))
    c.text(
        1,
        61,
        "The first call at a point: a 256-byte all-reduce of the tokens alone, then the data.\n"
        "gather, broadcast: the call's 64-byte header after the data, compared as bytes.",
        size=8,
        color=GREY,
        align="left",
    )
    return c.svg()


def draw_checkpoint() -> str:
    """``ak.save_state``: a temporary directory, every rank's files, the manifest last, one rename; then loading."""
    c = Canvas(100, 92)
    c.text(1, 3, 'ak.save_state("checkpoints/epoch_2", ...): every rank calls it', size=9, align="left", bold=True)
    steps = [
        ("1", "the ranks agree on the directory; rank 0 creates\n.accelkit-tmp-epoch_2-<id>/ beside it", LAUNCHER),
        (
            "2",
            "each rank writes and fsyncs its files into it:\nmodel.pt, optimizer.pt (rank 0), NAME.dcp/ shards,\n"
            "rank-N.json (its RNG, scaler, loader positions)",
            LAUNCHER,
        ),
        (
            "3",
            "the ranks agree that every write succeeded\n(if not: the directory is removed, nothing changed)",
            LAUNCHER,
        ),
        ("4", "rank 0 writes manifest.json last: each file's size\nand the XXH3-128 of each 64 MiB piece; fsync", OK),
        ("5", "one rename: tmp → epoch_2 (an atomic exchange when\nit exists): the commit", OK),
        ("6", "the ranks agree again; keep_last prunes older\ncheckpoints only now", LAUNCHER),
    ]
    for i, (n, text, colors) in enumerate(steps):
        y = 6 + i * 10.5
        c.box(2, y, 5.5, 8.5, n, colors, bold=True)
        c.box(9, y, 50, 8.5, text, colors, size=8, align="left")
    c.text(63, 8, "on disk", size=9, bold=True, align="left")
    tree = [
        ("checkpoints/", INK),
        ("  epoch_1/   committed", INK),
        ("  .accelkit-tmp-epoch_2-3f9a/", GREY),
        ("    model.pt  optimizer.pt", GREY),
        ("    rank-0.json  rank-1.json", GREY),
        ("    manifest.json   ← last", OK[1]),
        ("", INK),
        ("after the rename:", INK),
        ("  epoch_1/  epoch_2/", OK[1]),
    ]
    for i, (line, color) in enumerate(tree):
        c.text(63, 14 + i * 3.2, line, size=7.5, color=color, align="left", mono=True)
    c.text(
        63,
        50,
        "a crash at any moment leaves\nthe old checkpoint or the new\none, whole: a directory without\n"
        "its manifest is no checkpoint",
        size=8,
        color=GREY,
        align="left",
    )
    c.text(1, 73, 'ak.load_state("checkpoints/epoch_2", ...)', size=9, align="left", bold=True)
    loads = [
        "open each file once;\ncheck its size and each\npiece's checksum",
        "read it without\nrunning code (JSON,\nweights_only=True)",
        "only then restore\nthe objects, the RNG,\nthe scaler, the loaders",
    ]
    for i, text in enumerate(loads):
        x = 2 + i * 33
        c.box(x, 77, 30, 12, text, OK if i == 0 else LAUNCHER, size=7.5)
        if i:
            c.arrow((x - 3, 83), (x, 83))
    return c.svg()


def _range(cell: str) -> tuple[float, float]:
    """``"1.24-1.25x"`` -> (1.24, 1.25); ``"1.34x"`` -> (1.34, 1.34)."""
    low, _, high = cell.rstrip("x").partition("-")
    return float(low), float(high or low)


def draw_collective_costs(figures: dict[str, Any] | None = None) -> str:
    """The checked collectives' time over raw ``torch.distributed``, accelkit beside Accelerate (figures.yml)."""
    import yaml
    from matplotlib.figure import Figure

    rows = (figures or yaml.safe_load((HERE / "figures.yml").read_text()))["collectives"]
    sizes = ["1e3", "1e6", "tree"]
    fig = Figure(figsize=(7.2, 3.1))
    axes = fig.subplots(1, len(sizes), sharey=True)
    names = [r["call"] for r in rows]
    for ax, size in zip(axes, sizes, strict=True):
        for k, (who, colors) in enumerate((("accelkit", RANK[0]), ("accelerate", RANK[1]))):
            for i, row in enumerate(rows):
                cell = row[size][who] if row.get(size) else None
                if cell is None:
                    continue
                low, high = _range(cell)
                y = i + (k - 0.5) * 0.36
                ax.barh(y, (low + high) / 2, height=0.34, color=colors[0], edgecolor=colors[1], linewidth=1)
                if high > low:
                    ax.plot([low, high], [y, y], color=colors[1], lw=2.4, solid_capstyle="butt")
        ax.axvline(1.0, color=INK, lw=1)
        ax.set_title({"1e3": "1e3 floats", "1e6": "1e6 floats", "tree": "a dict of 3 tensors"}[size], fontsize=9.5)
        ax.set_xlim(0, 1.6)
        ax.set_xticks([0, 0.5, 1, 1.5])
        ax.tick_params(labelsize=8.5)
        ax.grid(axis="x", color=LINE, lw=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_yticks(range(len(names)), names, fontsize=8.5)
    axes[0].invert_yaxis()
    axes[1].set_xlabel("the call's time / raw torch.distributed's (lower is faster)", fontsize=8.5)
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(facecolor=RANK[0][0], edgecolor=RANK[0][1], label="accelkit (every call checked)"),
            Patch(facecolor=RANK[1][0], edgecolor=RANK[1][1], label="Accelerate 1.15 (unchecked)"),
        ],
        loc="upper center",
        ncol=2,
        fontsize=8.5,
        frameon=False,
    )
    fig.subplots_adjust(left=0.2, right=0.98, top=0.8, bottom=0.17, wspace=0.1)
    return _svg(fig)


PICTURES: dict[str, Callable[[], str]] = {
    "job-start": draw_job_start,
    "batches": draw_batches,
    "checked-collective": draw_checked_collective,
    "checkpoint": draw_checkpoint,
    "collective-costs": draw_collective_costs,
}


def on_files(files: Any, config: Any) -> Any:
    """mkdocs' hook: each picture becomes the site's file ``pictures/NAME.svg``."""
    from mkdocs.structure.files import File

    for name, draw in PICTURES.items():
        files.append(File.generated(config, f"pictures/{name}.svg", content=draw()))
    return files


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    target.mkdir(parents=True, exist_ok=True)
    for name, draw in PICTURES.items():
        (target / f"{name}.svg").write_text(draw())
        print(target / f"{name}.svg")
