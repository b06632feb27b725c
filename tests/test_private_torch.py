"""Every private or undocumented torch name accelkit touches is listed, with its reason, in one module.

A scan of accelkit's source finds each underscored name that accelkit does not define itself
(attributes, imports, getattr's names, dotted torch paths in strings) and each undocumented
torch attribute on the watch list; all of them must sit in ``accelkit/_torch_private.py``, whose
``NAMES`` says why. A new one anywhere else fails this test.
"""

from __future__ import annotations

import ast
import io
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

import accelkit
from accelkit import _torch_private

PACKAGE = Path(accelkit.__file__).parent
HOME = PACKAGE / "_torch_private.py"
# Private names of the standard library (and wrapt) that are documented there, or stable for years.
NOT_TORCH = {
    "_exit", "_getframe", "_current_frames", "_asdict", "_replace", "_fields", "_make",  # os, sys, namedtuple
    "_SubParsersAction", "_actions", "_fmt", "_style", "_args_from_interpreter_flags",  # argparse, logging, subprocess
    "_self_instance",  # wrapt's bound function wrapper
    "_inheriting",  # multiprocessing's mark of a process importing the main module (spawn's, Python 3.10 to 3.13)
}  # fmt: skip
# torch attributes without an underscore that torch does not document (DDP's internals, DCP's storage info).
WATCHED = {"require_backward_grad_sync", "reducer", "relative_path", "transform_descriptors"}


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _defined(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name accelkit defines: modules, functions, classes, variables, attributes of its own objects, arguments."""
    names = {path.stem for path in trees} | {path.parent.name for path in trees}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_own(node.value):
                names.add(node.attr)  # an attribute of accelkit's own objects (a torch object's is torch's name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return names


def _on_own(target: ast.expr) -> bool:
    """``self.x = ...`` / ``cls.x = ...`` (accelkit's own classes), or a module global (``module.x = ...`` is not)."""
    return isinstance(target, ast.Name) and target.id in ("self", "cls")


def _private_uses(tree: ast.Module, defined: set[str]) -> set[str]:
    found = set()
    pieces = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")):  # type: ignore[union-attr]
                found.add(node.module)  # type: ignore[arg-type]
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torch.") and "._" in a.name}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in defined and node.attr not in NOT_TORCH:
                found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
            if re.fullmatch(r"torch(\.\w+)*\._[A-Za-z]\w*(\.\w+)*", node.value):
                found.add(node.value)
            elif re.fullmatch(r"_[A-Za-z]\w*", node.value) and node.value not in defined | NOT_TORCH:
                found.add(node.value)  # getattr(obj, "_name"), a tuple of names to look up
        field = {ast.Attribute: "attr", ast.keyword: "arg", ast.Constant: "value"}.get(type(node))
        if field and getattr(node, field) in WATCHED:
            found.add(str(getattr(node, field)))
    return found


def test_private_torch_names_are_used_only_in_their_module() -> None:
    trees = _sources()
    defined = _defined(trees)
    elsewhere = {}
    for path, tree in trees.items():
        if path != HOME:
            uses = _private_uses(tree, defined)
            if uses:
                elsewhere[str(path.relative_to(PACKAGE))] = sorted(uses)
    assert elsewhere == {}, f"private torch names outside _torch_private.py (move them there, with why): {elsewhere}"


def test_the_module_lists_each_name_it_uses() -> None:
    trees = _sources()
    uses = _private_uses(trees[HOME], _defined({p: t for p, t in trees.items() if p != HOME}))
    listed = " ".join(_torch_private.NAMES)
    unlisted = sorted(name for name in uses if name.rsplit(".", 1)[-1] not in listed)
    assert unlisted == [], f"used in _torch_private.py without a line in NAMES: {unlisted}"
    assert TorchVersion(_torch_private.CHECKED[0]) <= TorchVersion(torch.__version__), "the oldest checked is the floor"


@pytest.mark.smoke
def test_each_private_name_exists_on_this_torch() -> None:
    # On every torch of the smoke set: a torch that renamed one fails here, not in a user's run.
    from torch.distributed import distributed_c10d
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.distributed.checkpoint import filesystem

    scaler = torch.amp.GradScaler("cpu")
    fused = torch.optim.SGD([torch.zeros(1, requires_grad=True)], fused=True)
    assert callable(scaler._get_scale_async) and callable(scaler._found_inf_per_device)
    assert getattr(fused, "_step_supports_amp_scaling", None) is True
    assert callable(distributed_c10d._get_default_store) and callable(powerSGD_hook._orthogonalize)
    assert hasattr(filesystem, "_StorageInfo")
    # DCP's reader and writer do their file work through .fs under .path; an item's place is in _StorageInfo.
    for io_class in (filesystem.FileSystemWriter, filesystem.FileSystemReader):
        made = io_class("unused")
        assert isinstance(made.fs, filesystem.FileSystemBase) and hasattr(made, "path")
    metadata = type("Metadata", (), {"storage_data": {"item": filesystem._StorageInfo("__0_0.distcp", 7, 11)}})
    assert _torch_private.storage_item(metadata, "item") == ("__0_0.distcp", 7, 11, ())
    # A pickled layout still names the lookup the metadata unpickler answers from torch's public layouts.
    from accelkit._checkpoint._sharded_load import _MetadataUnpickler

    for layout in (torch.strided, torch.sparse_coo):
        assert _MetadataUnpickler(io.BytesIO(pickle.dumps(layout))).load() is layout
    compiled = torch.compile(torch.nn.Linear(1, 1))
    assert _torch_private.compiled_inner(compiled) is compiled._orig_mod
    assert isinstance(compiled, _torch_private.compiled_type())  # type: ignore[arg-type]
    assert _torch_private.SCALER and isinstance(_torch_private.scale_on_device(scaler), (torch.Tensor, type(None)))
    assert _torch_private.batched_power_sgd_runs() in (True, False)
