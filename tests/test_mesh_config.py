"""The device mesh's options: every way to set them, and every bad layout refused before any work.

No process group here: the launchers refuse before they start a worker, ``ak.init`` before it
forms a group, ``ak.prepare`` before it touches the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from mesh_models import PLAN, make_net

import accelkit as ak
from accelkit._config import load_config
from accelkit._options import Options
from accelkit._strategies import mesh_sizes, torch_version_refusal
from accelkit.errors import ConfigurationError


def test_the_sizes_resolve_with_dp_shard_taking_the_rest() -> None:
    assert mesh_sizes(Options(), 4) is None, "no size set: no mesh (DDP or FSDP as before)"
    assert mesh_sizes(Options(tp=2), 8) == (1, 4, 1, 2)
    sizes = mesh_sizes(Options(dp_replicate=2, dp_shard=2), 4)
    assert sizes is not None and sizes.dp == 4 and sizes.dims() == (("dp_replicate", 2), ("dp_shard", 2))
    only_tp = mesh_sizes(Options(tp=4), 4)
    assert only_tp is not None and only_tp.dims() == (("tp", 4),) and only_tp.dp == 1


@pytest.mark.parametrize(
    ("options", "world", "local", "words"),
    [
        (Options(dp_shard=2, tp=2), 8, None, "product dp_replicate x dp_shard x tp x cp is 4, but the job has 8"),
        (Options(tp=3), 4, None, "dp_shard=-1 takes the processes the other sizes leave"),
        (Options(tp=4), 8, 2, "tp=4 with 2 process(es) per node: a tensor-parallel group"),
        (Options(cp=2), 4, None, "cp=2: context parallelism is not supported. On the CPU torch has none"),
        (Options(tp=2, strategy="deepspeed"), 4, None, "strategy='deepspeed': DeepSpeed forms its own groups"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_with_its_fix(
    options: Options, world: int, local: int | None, words: str
) -> None:
    with pytest.raises(ConfigurationError, match=_escaped(words)):
        mesh_sizes(options, world, local)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_a_torch_too_old_for_a_mesh_is_named() -> None:
    assert "needs PyTorch >= 2.9 on the CPU" in (torch_version_refusal(True, "2.8.0+cpu") or "")
    assert "this is PyTorch 2.5.1" in (torch_version_refusal(False, "2.5.1") or "")
    assert torch_version_refusal(False, "2.6.0") is None and torch_version_refusal(True, "2.13.0") is None


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"dp_shard": 0}, "ak.init(dp_shard=0): expected an integer >= -1, not 0"),
        ({"tp": 0}, "ak.init(tp=0): expected an integer >= 1"),
        ({"activation_checkpointing": "Block,not a name"}, "activation_checkpointing="),
    ],
)
def test_bad_sizes_name_the_value(options: dict[str, object], words: str) -> None:
    from accelkit._options import validate

    with pytest.raises(ConfigurationError, match=_escaped(words)):
        validate(options, "ak.init")


def test_one_process_refuses_a_mesh_before_anything_starts() -> None:
    with pytest.raises(ConfigurationError, match=r"^accelkit\.init: dp_replicate=1, dp_shard=-1, tp=2, cp=1: dp_shard"):
        ak.init(tp=2)
    assert not ak.is_initialized()


def marker_writer(path: str) -> None:
    Path(path).write_text("ran")


def test_ak_launch_refuses_a_bad_mesh_before_starting_workers(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(ConfigurationError, match=r"accelkit\.launch: .*product dp_replicate x dp_shard x tp x cp is 6"):
        ak.launch(marker_writer, args=(str(marker),), num_processes=4, dp_shard=3, tp=2)
    with pytest.raises(ConfigurationError, match=r"cp=2: context parallelism is not supported"):
        ak.launch(marker_writer, args=(str(marker),), num_processes=4, cp=2)
    assert not marker.exists()


def test_accelkit_launch_refuses_a_bad_mesh_before_starting_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    for flags, words in (
        (["--tp", "3"], "dp_shard=-1 takes the processes the other sizes leave"),
        (["--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "4"], "is 8, but the job has 4"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "accelkit", "launch", "-n", "4", *flags, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("accelkit launch: error: ") and words in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


def test_accelkits_config_file_and_variables_set_the_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("dp_replicate: 2\ndp_shard: 2\ntp: 1\nactivation_checkpointing: [Block]\n")
    assert load_config(file).state == {
        "dp_replicate": 2, "dp_shard": 2, "tp": 1, "activation_checkpointing": ("Block",)
    }  # fmt: skip
    file.write_text("dp_shard: 0\n")
    with pytest.raises(ConfigurationError, match=r"c\.yaml:1: dp_shard: expected an integer >= -1, not 0"):
        load_config(file)
    from accelkit._options import env_overrides

    assert env_overrides({"ACCELKIT_TP": "2", "ACCELKIT_DP_SHARD": "-1"}) == {"dp_shard": -1, "tp": 2}


ACCELERATE = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 4
fsdp_config:
  fsdp_version: 2
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_activation_checkpointing: true
parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
"""


def test_accelerates_parallelism_config_is_read_as_it_is(tmp_path: Path) -> None:
    file = tmp_path / "accelerate.yaml"
    file.write_text(ACCELERATE)
    state = load_config(file).state
    assert {k: state[k] for k in ("strategy", "dp_replicate", "dp_shard", "tp", "cp")} == {
        "strategy": "fsdp", "dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1
    }  # fmt: skip
    assert state["activation_checkpointing"] == ("Block",) and state["fsdp_wrap"] == ("Block",)
    file.write_text(ACCELERATE.replace("tp_size: 2", "tp_size: 1").replace("shard_size: 2", "shard_size: 1"))
    assert "tp" not in load_config(file).state, "every size 1: no mesh (Accelerate's DDP)"
    file.write_text(ACCELERATE + "  parallelism_config_sp_size: 2\n")
    with pytest.raises(ConfigurationError, match=r"parallelism_config_sp_size: 2: DeepSpeed's sequence parallelism"):
        load_config(file)


def test_prepare_checks_the_plan_and_the_checkpointing_on_one_process() -> None:
    cases = [
        ({"tp_plan": {"blocks.*.atn.q": "colwise"}}, r"'blocks\.\*\.atn\.q' names no module of Net; did you mean"),
        ({"tp_plan": {"blocks.*.attn.q": "colwize"}}, r"expected a torch ParallelStyle .*; did you mean 'colwise'"),
        ({"tp_plan": "auto"}, r"tp_plan='auto'\): Net carries no tensor-parallel plan"),
        ({"tp_plan": 3}, r"tp_plan=3\): expected a mapping of module-name patterns"),
        ({"activation_checkpointing": ["Blok"]}, r"no submodule of class 'Blok'; did you mean 'Block'"),
    ]
    for options, words in cases:
        model = make_net()
        before = [p.clone() for p in model.parameters()]
        with pytest.raises(ConfigurationError, match=words):
            ak.prepare(model, **options)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    carried = make_net()
    carried.tp_plan = PLAN  # type: ignore[assignment]  # as a transformers model carries it
    assert ak.prepare(carried, tp_plan="auto") is carried


def test_a_mesh_is_written_by_accelkit_config_default_keys(tmp_path: Path) -> None:
    # accelkit's own file takes the mesh's keys as Options names them: write one, read it back.
    from accelkit._config import write_config

    path = write_config({"tp": 2, "dp_shard": -1}, tmp_path / "w.yaml")
    assert load_config(path).state == {"tp": 2, "dp_shard": -1}
    assert "tp: 2" in textwrap.dedent(path.read_text())


def test_accelerates_hybrid_shard_is_hsdp_across_the_machines(tmp_path: Path) -> None:
    file = tmp_path / "hybrid.yaml"
    head = "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 8\n"
    file.write_text(head + "num_machines: 2\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n")
    config = load_config(file)
    assert config.state["dp_replicate"] == 2 and config.launch["num_processes"] == 4
    assert mesh_sizes(Options()._replace(**config.state), 8, 4) == (2, 4, 1, 1)
    file.write_text(head + "num_machines: 1\nfsdp_config:\n  fsdp_sharding_strategy: 4\n")  # FSDP1's number
    assert "dp_replicate" not in load_config(file).state, "one machine: FSDP over all its processes"


def test_auto_reads_a_transformers_configs_base_plan_under_its_prefix() -> None:
    class Config:
        base_model_tp_plan: ClassVar[dict[str, str]] = {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}

    class ForLM(torch.nn.Module):  # as transformers builds one: the base model under base_model_prefix
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.config, self.model = Config(), make_net()

    lm = ForLM()
    assert ak.prepare(lm, tp_plan="auto") is lm  # its patterns, under "model.", name modules that exist
    Config.base_model_tp_plan = {"blocks.*.mlp.upp": "colwise"}
    with pytest.raises(ConfigurationError, match=r"'model\.blocks\.\*\.mlp\.upp' names no module of ForLM"):
        ak.prepare(ForLM(), tp_plan="auto")
