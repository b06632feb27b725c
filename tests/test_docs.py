"""Every code block of the README and of the documentation site runs as written; the site is whole.

Each fenced block of ``README.md`` and ``docs/**/*.md`` runs, in a fresh directory, with a timeout:
a ```` ```python ```` block saved as ``train.py`` (as the README says to save its first one) and run
with this Python; a ```` ```bash ```` block run by ``bash``, where ``python`` and ``accelkit`` are this
Python and this checkout's command line, and the config file is the directory's own. Identical blocks
run once. A block that is not meant to run says so on the line before it, with the reason:
``<!-- not run: a fragment of a training loop -->`` (a fragment, a GPU, several machines, a cluster,
an install, minutes of work that another test does). ```` ```text ```` blocks show output: never run.

The site: ``mkdocs.yml``'s navigation lists every page of ``docs/``, and the API reference documents
every public name (``ak.__all__``, ``accelkit.testing``, ``accelkit.errors``, ``accelkit.logging``).
``.ci/docs`` builds it with ``mkdocs build --strict``, which checks every link, anchor and docstring.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from processes import subprocess_env

import accelkit as ak

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUN = ("python", "bash")  # the languages of blocks that run
OUTPUT = ("text",)  # what a command prints: shown, not run
# An opening fence, its attributes after the language (```python title="train.py" hl_lines="2 3"); ```` is inline code.
_FENCE = re.compile(r"(?P<indent>\s*)```(?P<lang>[\w+-]*)(?P<attrs>(?:\s+[^`\s][^`]*)?)\s*")
_NOT_RUN = re.compile(r"<!-- not run(?::\s*(?P<reason>.*?))?\s*-->")


class Block(NamedTuple):
    """A fenced block of a page: where it starts, its language, its code, why it does not run (None: it runs),
    and the fence's attributes (``hl_lines="2 3"``)."""

    where: str
    lang: str
    code: str
    not_run: str | None
    attrs: str = ""


def fenced_blocks(text: str, name: str = "page") -> list[Block]:
    """Each fenced block of ``text``, its indentation (a list item's) removed; the marker read from the line before."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.fullmatch(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = fence["indent"]
        code = "".join(f"{row.removeprefix(indent)}\n" for row in lines[i + 1 : end])
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _NOT_RUN.fullmatch(before)
        not_run = None if marker is None else (marker["reason"] or "")
        blocks.append(Block(f"{name}:{i + 1}", fence["lang"], code, not_run, fence["attrs"].strip()))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def runnable() -> list[Block]:
    """The blocks that run, each distinct code once (the README's first example is the site's too)."""
    seen: dict[tuple[str, str], Block] = {}
    for block in all_blocks():
        if block.lang in RUN and block.not_run is None:
            seen.setdefault((block.lang, block.code), block)
    return list(seen.values())


def test_the_marker_leaves_a_block_out_with_its_reason() -> None:
    text = (
        "<!-- not run: a fragment -->\n```python\nfragment(x)\n```\n\n- a list item:\n\n  ```bash\n  echo 1\n  ```\n"
        "\nInline: ```` ```python ```` is no fence.\n\n<!-- not run -->\n```python\ny = 2\n```\n"
        '\n```python title="a.py" hl_lines="1"\nz = 3\n```\n'
    )
    assert fenced_blocks(text) == [
        Block("page:2", "python", "fragment(x)\n", "a fragment"),
        Block("page:8", "bash", "echo 1\n", None),
        Block("page:15", "python", "y = 2\n", ""),
        Block("page:19", "python", "z = 3\n", None, 'title="a.py" hl_lines="1"'),
    ]


def test_every_block_runs_or_says_why_not() -> None:
    blocks = all_blocks()
    assert len(runnable()) >= 8, "the README and the guides have runnable examples"
    unnamed = [b.where for b in blocks if not b.lang]
    assert not unnamed, f"a fenced block names its language (```python, ```bash, ```text): {unnamed}"
    silent = [b.where for b in blocks if b.lang not in RUN + OUTPUT and b.not_run is None]
    assert not silent, f"blocks of other languages run nowhere; mark them <!-- not run: REASON -->: {silent}"
    bare = [b.where for b in blocks if b.not_run == ""]
    assert not bare, f"<!-- not run --> needs its reason, <!-- not run: REASON -->: {bare}"


@pytest.mark.distributed
@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in runnable()])
def test_a_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    env = subprocess_env()
    if block.lang == "python":
        script = tmp_path / "train.py"  # as the README says to save its first block
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    else:
        # `python` and `accelkit` are this interpreter and this checkout's command line (wrappers, not links:
        # a link to a virtual environment's python leaves the environment); the config file is this directory's.
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, command in (("python", ""), ("accelkit", " -m accelkit")):
            (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
            (bin_dir / name).chmod(0o755)
        del env["ACCELKIT_CONFIG_FILE"]
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", XDG_CONFIG_HOME=str(tmp_path / "config"))
        argv = ["bash", "-c", f"set -euo pipefail\n{block.code}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.where}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if "print(train(" in block.code:  # the first example: rank 0's loss, once, on a task it learns
        assert re.fullmatch(r"\d+\.\d+(e-\d+)?\n", done.stdout), done.stdout
        assert float(done.stdout) < 0.5


def _nav_pages(entries: object) -> list[str]:
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in _nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in _nav_pages(value)]
    return []


def test_the_site_lists_every_page_once() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, "mkdocs.yml's nav and the pages of docs/ differ"
    assert config["strict"] is True


def test_the_api_reference_documents_every_public_name() -> None:
    reference = "\n".join(p.read_text() for p in sorted((DOCS / "reference").glob("*.md")))
    documented = set(re.findall(r"^::: (\S+)$", reference, re.MULTILINE))
    missing = {f"accelkit.{name}" for name in ak.__all__} - documented
    assert not missing, f"docs/reference/accelkit.md lacks `::: NAME` for {sorted(missing)}"
    assert {"accelkit.testing", "accelkit.errors", "accelkit.logging"} <= documented


def _documented_parameters(doc: str) -> set[str]:
    """The names an ``Args:``, ``Attributes:`` or ``Other Parameters:`` section of ``doc`` documents."""
    names: set[str] = set()
    for section in re.finditer(r"^( *)(?:Args|Attributes|Other Parameters):\n((?:\1 +\S.*\n|\n)+)", doc + "\n", re.M):
        entry = len(section[1]) + 4  # an entry's indent; deeper lines continue it
        names.update(re.findall(rf"^ {{{entry}}}(\**\w+)(?: \([^)]*\))?:", section[2], re.M))
    return names


def _public_callables() -> list[tuple[str, object]]:
    import accelkit.logging
    import accelkit.testing

    found = []
    for module in (ak, accelkit.testing, accelkit.logging):
        for name in module.__all__:
            obj = getattr(module, name)
            if type(obj).__module__ == "typing":  # a type alias (accelkit.testing.WorkerDevice)
                continue
            if callable(obj) and not (isinstance(obj, type) and issubclass(obj, BaseException)):
                found.append((f"{module.__name__}.{name}", obj))
    return found


def test_every_public_function_documents_each_parameter() -> None:
    """The API reference shows each function's parameters as a table, from its docstring's ``Args:``."""
    import inspect

    missing = {}
    for name, obj in _public_callables():
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):  # no signature to document
            continue
        stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        wanted = {stars.get(p.kind, "") + p.name for p in params if p.name != "self"}
        lacking = wanted - _documented_parameters(inspect.getdoc(obj) or "")
        if lacking:
            missing[name] = sorted(lacking)
    assert not missing, f"docstrings lack an Args: entry for these parameters: {missing}"
    assert _documented_parameters("Args:\n    x: one.\n        more.\n    **kw (int): two.\n") == {"x", "**kw"}


WIDTH = 80  # the characters a code block of the site shows before it scrolls (Material, a desktop window)


def test_code_fits_the_page_width() -> None:
    """Examples read without scrolling sideways: the pages' code blocks and the docstrings' examples."""
    import inspect

    wide = [f"{b.where}: {line}" for b in all_blocks() if b.lang in RUN for line in b.code.splitlines()]
    for name, obj in _public_callables():
        example = re.split(r"^Examples?:\n", inspect.getdoc(obj) or "", maxsplit=1, flags=re.M)[1:]
        wide += [f"{name}: {line.strip()}" for text in example for line in text.splitlines()]
    too_wide = [line for line in wide if len(line.split(": ", 1)[1]) > WIDTH]
    assert not too_wide, f"code lines longer than {WIDTH} characters (shorten the comment): {too_wide}"


# --- the quick tour: an Accelerate script and its port, run side by side ------------------------

TOUR = DOCS / "quick-tour.md"


def _tour() -> dict[str, Block]:
    """The quick tour's blocks: the port, the Accelerate script and their diff."""
    blocks = fenced_blocks(TOUR.read_text(), "docs/quick-tour.md")
    found = {
        "accelkit": [b for b in blocks if b.lang == "python" and "import accelkit as ak" in b.code],
        "accelerate": [b for b in blocks if b.lang == "python" and "from accelerate import" in b.code],
        "diff": [b for b in blocks if b.lang == "diff"],
    }
    assert all(len(v) == 1 for v in found.values()), {k: [b.where for b in v] for k, v in found.items()}
    return {k: v[0] for k, v in found.items()}


def _highlighted(block: Block) -> set[int]:
    spec = re.search(r'hl_lines="([^"]*)"', block.attrs)
    assert spec is not None, f'{block.where}: the fence names the changed lines, hl_lines="..."'
    lines: set[int] = set()
    for part in spec[1].split():
        first, _, last = part.partition("-")
        lines.update(range(int(first), int(last or first) + 1))
    return lines


def test_the_quick_tour_highlights_exactly_the_lines_that_change() -> None:
    import difflib

    tour = _tour()
    ours, theirs = tour["accelkit"].code.splitlines(), tour["accelerate"].code.splitlines()
    changed: dict[str, set[int]] = {"accelkit": set(), "accelerate": set()}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=theirs, b=ours, autojunk=False).get_opcodes():
        if tag != "equal":
            changed["accelerate"].update(range(i1 + 1, i2 + 1))
            changed["accelkit"].update(range(j1 + 1, j2 + 1))
    for name in changed:
        assert _highlighted(tour[name]) == changed[name], f"{tour[name].where}: hl_lines"
    diff = difflib.unified_diff(
        tour["accelerate"].code.splitlines(True), tour["accelkit"].code.splitlines(True),
        "accelerate/train.py", "accelkit/train.py", n=1,
    )  # fmt: skip
    assert tour["diff"].code == "".join(diff), "the diff tab is not the diff of the two scripts"
    assert f"({len(changed['accelkit'])} of {len(ours)})" in TOUR.read_text()


def _epochs(output: str) -> list[str]:
    return re.findall(r"^epoch \d+: accuracy .*$", output, re.MULTILINE)


@pytest.fixture(scope="module")
def tour_port(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The port, run as the page says (python train.py): its directory and the lines it printed."""
    where = tmp_path_factory.mktemp("tour-accelkit")
    (where / "train.py").write_text(_tour()["accelkit"].code)
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=where, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return where, _epochs(done.stdout)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_quick_tour_port_prints_what_the_page_shows_and_resumes_to_the_bit(
    tour_port: tuple[Path, list[str]],
) -> None:
    where, printed = tour_port
    shown = re.search(r"```text\n\$ python train.py\n(.*?)```", TOUR.read_text(), re.DOTALL)
    assert shown is not None and printed == _epochs(shown[1])
    assert sorted(p.name for p in (where / "checkpoints").iterdir()) == ["epoch_0", "epoch_1", "epoch_2"]
    assert list((where / "runs" / "tour").iterdir()), "TensorBoard wrote nothing"
    shutil.rmtree(where / "checkpoints" / "epoch_2")  # as the page says: rm -r checkpoints/epoch_2
    again = subprocess.run(
        [sys.executable, "train.py"], cwd=where, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert _epochs(again.stdout) == printed[-1:], "the resumed epoch differs from the uninterrupted run's"


@pytest.mark.distributed
@pytest.mark.slow
def test_the_quick_tour_accelerate_script_prints_the_same_as_its_port(
    tour_port: tuple[Path, list[str]], tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")
    (tmp_path / "train.py").write_text(_tour()["accelerate"].code)
    env = subprocess_env(ACCELERATE_USE_CPU="1")  # as the page says: two CPU processes over gloo
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _epochs(done.stdout) == tour_port[1]


# --- one source for the figures the pages quote: docs/figures.yml -------------------------------


def _figures() -> dict[str, Any]:
    return yaml.safe_load((DOCS / "figures.yml").read_text())  # type: ignore[no-any-return]


def test_the_pages_quote_the_figures_as_figures_yml_has_them() -> None:
    figures, readme = _figures(), (ROOT / "README.md").read_text()
    performance = (DOCS / "performance.md").read_text()
    for row in figures["glance"]:
        dash = {k: row[k] or "—" for k in ("accelerate", "fabric")}
        assert f"| {row['what']} | {row['accelkit']} | {dash['accelerate']} | {dash['fabric']} |" in performance
        assert f"| {row['what']} | {row['accelkit']} |" in readme
        assert row["from"] is None or row["from"] in performance, f"the lab notes no longer say {row['from']!r}"
    shown = re.findall(r"^\| `?(?:import|a |`save)[^\n]*\|$", readme, re.MULTILINE)
    assert len(shown) == len(figures["glance"]), "the README's figures are figures.yml's glance rows, no others"
    for page in ("README.md", "docs/getting-started.md", "docs/development.md"):
        said = re.findall(r"about (\d+) minutes", (ROOT / page).read_text())
        assert said == [str(figures["suite_minutes"])], f"{page} says the suite takes {said} minutes"


def test_the_collectives_table_and_its_summary_are_figures_yml() -> None:
    figures, performance = _figures(), (DOCS / "performance.md").read_text()
    cells: dict[str, list[float]] = {"accelkit": [], "accelerate": []}
    for row in figures["collectives"]:
        sizes = [row[size] for size in ("1e3", "1e5", "1e6", "tree")]
        text = "".join(f" {s['accelkit']} / {s['accelerate']} |" if s else " |" for s in sizes)
        assert f"| `{row['call']}`: accelkit / Accelerate |{text}" in performance
        for who in cells:
            cells[who] += [float(x) for x in row["1e3"][who].rstrip("x").split("-")]
    glance = next(r for r in figures["glance"] if r["what"].startswith("a checked collective"))
    span = {who: f"{min(v):.2f}-{max(v):.2f}x" for who, v in cells.items()}
    assert glance["accelkit"].startswith(span["accelkit"]) and glance["accelerate"].startswith(span["accelerate"])
