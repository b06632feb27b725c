"""The config file: accelkit's YAML, Accelerate's config.yaml, precedence, errors and `accelkit config`."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import accelkit as ak
from accelkit._cli import main as cli
from accelkit._config import _file as _config
from accelkit._config import config_in_effect, resolve
from accelkit._options import DEFAULT_TIMEOUT
from accelkit.errors import ConfigurationError


def _file(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def _answers(monkeypatch: pytest.MonkeyPatch, answers: list[str]) -> list[str]:
    """Feeds ``input()``; returns the prompts it was given. Past the last answer: end of input."""
    pending: Iterator[str] = iter(answers)
    prompts: list[str] = []

    def fake_input(prompt: object = "") -> str:
        prompts.append(str(prompt))
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    return prompts


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELKIT_", "PYTEST_"))}
    env.update(ACCELKIT_CONFIG_FILE="", **extra)
    return env


# --- accelkit's own file ------------------------------------------------------------------------


def test_written_file_loads_back_the_same(tmp_path: Path) -> None:
    values = {
        "num_processes": 4, "num_nodes": 2, "node_rank": 1, "main_process_ip": "10.0.0.1",
        "main_process_port": 29501, "max_restarts": 3, "rdzv_backend": "c10d", "rdzv_timeout": 120,
        "mpirun": True, "hostfile": "/etc/hosts.mpi", "gpu_ids": "0,1", "precision": "no",
        "gradient_accumulation_steps": 4, "debug": True, "cpu": False, "backend": "gloo", "timeout": 30,
        "strategy": "fsdp", "fsdp_wrap": ["Block", "Head"], "fsdp_min_params": 1000,
        "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True,
    }  # fmt: skip
    path = _config.write_config(values, tmp_path / "deep" / "er" / "accelkit.yaml")
    assert path == tmp_path / "deep" / "er" / "accelkit.yaml"
    text = path.read_text()
    assert text.startswith("# accelkit ") and "precision: 'no'" in text  # a bare `no` would read as false
    loaded = _config.load_config(path)
    assert loaded.kind == "accelkit" and loaded.ignored == () and loaded.path == path
    assert loaded.launch == {
        "num_processes": 4, "num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29501,
        "max_restarts": 3, "rdzv_backend": "c10d", "rdzv_timeout": 120.0, "mpirun": True,
        "hostfile": "/etc/hosts.mpi", "gpu_ids": "0,1",
    }  # fmt: skip
    assert loaded.state == {
        "precision": "no", "gradient_accumulation_steps": 4, "debug": True, "cpu": False, "backend": "gloo",
        "timeout": 30.0, "strategy": "fsdp", "fsdp_wrap": ("Block", "Head"), "fsdp_min_params": 1000,
        "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True,
    }  # fmt: skip
    assert loaded.lines["num_processes"] == 2  # line 1 is the comment saying what wrote the file
    assert [p.name for p in path.parent.iterdir()] == ["accelkit.yaml"]  # no temporary file left


def test_deepspeed_mapping_is_stored_as_json_text(tmp_path: Path) -> None:
    path = _file(tmp_path, "strategy: deepspeed\ndeepspeed_config:\n  zero_optimization:\n    stage: 2\n")
    state = _config.load_config(path).state
    assert state["strategy"] == "deepspeed"
    assert json.loads(str(state["deepspeed_config"])) == {"zero_optimization": {"stage": 2}}


def test_a_bare_no_means_the_string(tmp_path: Path) -> None:
    assert _config.load_config(_file(tmp_path, "precision: no\n")).state == {"precision": "no"}


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = _config.write_config({"precision": "bf16"}, tmp_path / "c.yaml")
    before = path.read_text()
    with pytest.raises(ConfigurationError, match=r"write_config\(\): precision: expected one of .*found 'fp32'"):
        _config.write_config({"precision": "fp32"}, path)
    assert path.read_text() == before
    with pytest.raises(ConfigurationError, match=r"write_config\(\): epochs: unknown key; valid keys: "):
        _config.write_config({"epochs": 3}, path)


# --- which file, and precedence -----------------------------------------------------------------


def test_config_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCELKIT_CONFIG_FILE")
    default = _config.default_config_path()
    assert default == tmp_path / "xdg" / "accelkit" / "default_config.yaml"
    assert _config.config_path() is None  # no default file yet
    _config.write_config({"debug": True}, default)
    assert _config.config_path() == default
    other = _config.write_config({"debug": False}, tmp_path / "other.yaml")
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(other))
    assert _config.config_path() == other
    explicit = _config.write_config({"cpu": True}, tmp_path / "explicit.yaml")
    assert _config.config_path(explicit) == explicit
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", "")
    assert _config.config_path() is None  # empty: no config file, even though the default exists
    assert _state_options() == {}


def test_missing_config_files_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigurationError, match=rf"'{missing}' \(from --config-file.*\) does not exist; write one"):
        _config.config_path(missing)
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(missing))
    with pytest.raises(ConfigurationError, match=r"from environment variable ACCELKIT_CONFIG_FILE\) does not exist"):
        _config.config_path()
    with pytest.raises(ConfigurationError, match="is a directory"):
        _config.config_path(tmp_path)


def test_precedence_explicit_over_environment_over_file_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config.write_config({"precision": "bf16", "gradient_accumulation_steps": 4, "debug": True}, tmp_path / "c")
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(path))
    from_file = resolve(call="test").options
    assert (from_file.precision, from_file.gradient_accumulation_steps, from_file.debug) == ("bf16", 4, True)
    assert from_file.timeout == DEFAULT_TIMEOUT  # not in the file: the default
    assert ak.state().options.gradient_accumulation_steps == 4  # the process state reads it too
    ak.reset_state()
    monkeypatch.setenv("ACCELKIT_PRECISION", "fp16")
    monkeypatch.setenv("ACCELKIT_DEBUG", "0")
    from_env = resolve(call="test").options
    assert (from_env.precision, from_env.gradient_accumulation_steps, from_env.debug) == ("fp16", 4, False)
    explicit = resolve({"precision": "no", "gradient_accumulation_steps": 2}, call="test").options
    assert (explicit.precision, explicit.gradient_accumulation_steps, explicit.debug) == ("no", 2, False)


def _state_options() -> dict[str, object]:
    config = config_in_effect()
    return config.state if config is not None else {}


def test_state_options_follow_edits_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _config.write_config({"precision": "bf16"}, tmp_path / "c.yaml")
    monkeypatch.setenv("ACCELKIT_CONFIG_FILE", str(path))
    assert _state_options() == {"precision": "bf16"}
    path.write_text("precision: fp16\ndebug: true\n")
    assert _state_options() == {"precision": "fp16", "debug": True}
    path.write_text("precision: fp61\n")
    with pytest.raises(ConfigurationError, match=rf"{path}:1: precision: .*did you mean 'fp16'\?"):
        resolve(call="test")


def test_without_a_config_file_yaml_is_not_imported(tmp_path: Path) -> None:
    probe = "import sys, accelkit._config as c; print(c.config_in_effect(), 'yaml' in sys.modules)"
    for extra in ({}, {"ACCELKIT_CONFIG_FILE": "x"}):
        env = _subprocess_env(XDG_CONFIG_HOME=str(tmp_path))
        env.pop("ACCELKIT_CONFIG_FILE") if extra else None  # unset: the default path, which does not exist
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["None", "False"]


def test_missing_pyyaml_names_the_file_and_the_install_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "debug: true\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed (a broken install)
    with pytest.raises(ConfigurationError, match=rf"reading the config file {path} needs PyYAML.*pip install pyyaml"):
        _config.load_config(path)


def test_pyyaml_is_a_dependency() -> None:
    """A config file written in one environment is read in every other: PyYAML comes with accelkit."""
    from importlib.metadata import requires

    assert any(r.split(">")[0].strip().lower() == "pyyaml" and "extra" not in r for r in requires("accelkit") or [])


UNREADABLE = {
    "no PyYAML": ("num_processes: 2\n", "needs PyYAML, which is not installed here"),
    "bad syntax": ("num_processes: 2\nprecision: [bf16\n", ":3: not valid YAML"),
    "unknown key": ("num_processes: 2\nprecisoin: bf16\n", ":2: precisoin: unknown key; did you mean 'precision'?"),
}
COMMANDS = {
    "python train.py": ["train.py"],
    "accelkit launch": ["-m", "accelkit", "launch", "--num-processes", "1", "train.py"],
    "accelkit env": ["-m", "accelkit", "env"],
    "accelkit test": ["-m", "accelkit", "test"],
}


@pytest.mark.parametrize("case", UNREADABLE)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_default_config_that_cannot_be_read_names_itself(tmp_path: Path, case: str, command: str) -> None:
    """The default file (written by `accelkit config`, maybe in another environment) stops every entry point
    with an error naming it, where it came from and the fix; `accelkit env` reports it."""
    text, problem = UNREADABLE[case]
    config = tmp_path / "home" / "accelkit" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    (tmp_path / "train.py").write_text("import accelkit as ak\nprint(ak.state().world_size)\n")
    env = _subprocess_env(XDG_CONFIG_HOME=str(tmp_path / "home"), ACCELKIT_CPU="1")
    del env["ACCELKIT_CONFIG_FILE"]  # the default path is read
    if case == "no PyYAML":  # a module named yaml that cannot be imported, first on the path
        (tmp_path / "hidden").mkdir()
        (tmp_path / "hidden" / "yaml.py").write_text("raise ImportError('No module named yaml')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hidden"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, *COMMANDS[command]], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    said = done.stdout + done.stderr
    assert (done.returncode == 0) == (command == "accelkit env"), said  # env reports it, and goes on
    assert f"{config}" in said and problem in said, said
    assert "This is the default config file, written by `accelkit config`" in said, said


# --- Accelerate's config.yaml -------------------------------------------------------------------

ACCELERATE_MULTI_GPU = """
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_multi_gpu(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, ACCELERATE_MULTI_GPU))
    assert config.kind == "accelerate"
    assert config.state == {"precision": "bf16", "debug": False, "cpu": False, "strategy": "ddp"}
    assert config.launch == {"num_processes": 2, "num_nodes": 1, "node_rank": 0, "rdzv_backend": "static",
                             "gpu_ids": "all"}  # fmt: skip
    assert set(config.ignored) == {"downcast_bf16", "enable_cpu_affinity", "main_training_function", "same_network",
                                   "tpu_env", "tpu_use_cluster", "tpu_use_sudo"}  # fmt: skip
    assert config.notes == {}  # nothing ignored asked for anything
    message = config.ignored_message()
    assert message is not None and message.startswith(f"{config.path}: keys with no effect") and "tpu_env" in message


def test_accelerate_multi_cpu_with_mpirun_divides_processes_over_machines(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: MULTI_CPU
        downcast_bf16: 'no'
        ipex_config:
          ipex: false
        machine_rank: 1
        main_process_ip: 10.0.0.1
        main_process_port: 29500
        main_training_function: main
        mixed_precision: 'no'
        mpirun_config:
          mpirun_ccl: '1'
          mpirun_hostfile: /home/user/hostfile
        num_machines: 2
        num_processes: 8
        rdzv_backend: static
        same_network: true
        use_cpu: true
    """))  # fmt: skip
    assert config.launch == {
        "num_processes": 4, "num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29500,
        "rdzv_backend": "static", "hostfile": "/home/user/hostfile", "mpirun": True,
    }  # fmt: skip
    assert config.state == {"precision": "no", "debug": False, "cpu": True, "strategy": "ddp"}
    assert "ipex_config" in config.ignored and "mpirun_config.mpirun_ccl" in config.ignored
    assert config.notes == {"mpirun_config.mpirun_ccl": "not applied; CPU runs use gloo"}


def test_accelerate_fsdp2(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: FSDP
        downcast_bf16: 'no'
        enable_cpu_affinity: false
        fsdp_config:
          fsdp_activation_checkpointing: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_cpu_ram_efficient_loading: true
          fsdp_offload_params: true
          fsdp_reshard_after_forward: false
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,LlamaMLP
          fsdp_version: 2
        machine_rank: 0
        main_training_function: main
        mixed_precision: bf16
        num_machines: 1
        num_processes: 8
        rdzv_backend: static
        same_network: true
        use_cpu: false
    """))  # fmt: skip
    assert config.state == {
        "precision": "bf16", "debug": False, "cpu": False, "strategy": "fsdp",
        "fsdp_wrap": ("LlamaDecoderLayer", "LlamaMLP"), "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True,
        "activation_checkpointing": ("LlamaDecoderLayer", "LlamaMLP"),  # the wrapped layers are recomputed
    }  # fmt: skip
    assert config.launch["num_processes"] == 8
    assert {"fsdp_config.fsdp_version", "fsdp_config.fsdp_state_dict_type"} <= set(config.ignored)
    assert "fsdp_config.fsdp_activation_checkpointing" not in config.ignored
    assert config.lines["fsdp_config.fsdp_offload_params"] == 10


def test_accelerate_fsdp1_size_based_with_sharding_strategy(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config:
          fsdp_auto_wrap_policy: SIZE_BASED_WRAP
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_forward_prefetch: false
          fsdp_min_num_params: 1000000
          fsdp_offload_params: false
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_state_dict_type: FULL_STATE_DICT
          fsdp_sync_module_states: true
          fsdp_use_orig_params: true
          fsdp_version: 1
        mixed_precision: fp16
        num_machines: 1
        num_processes: 2
    """))  # fmt: skip
    assert config.state == {"precision": "fp16", "strategy": "fsdp", "fsdp_min_params": 1_000_000,
                            "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": False}  # fmt: skip
    assert "FSDP2" in config.notes["fsdp_config.fsdp_version"]
    no_shard = _file(tmp_path, "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: NO_SHARD\n", "n")
    assert _config.load_config(no_shard).state == {"strategy": "ddp"}  # replicated: plain data parallelism


def test_accelerate_deepspeed_inline_becomes_json(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        debug: false
        deepspeed_config:
          gradient_accumulation_steps: 4
          gradient_clipping: 1.0
          offload_optimizer_device: cpu
          offload_param_device: none
          zero3_init_flag: true
          zero3_save_16bit_model: true
          zero_stage: 3
        distributed_type: DEEPSPEED
        downcast_bf16: 'no'
        machine_rank: 0
        main_training_function: main
        mixed_precision: bf16
        num_machines: 1
        num_processes: 2
        rdzv_backend: static
        same_network: true
        use_cpu: false
    """))  # fmt: skip
    assert config.state["strategy"] == "deepspeed" and config.state["gradient_accumulation_steps"] == 4
    assert json.loads(str(config.state["deepspeed_config"])) == {
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True,
        },
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    }  # fmt: skip
    assert "deepspeed_config.zero3_init_flag" in config.notes


def test_accelerate_deepspeed_config_file_next_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "ds_zero2.json").write_text('{"zero_optimization": {"stage": 2}}')
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        deepspeed_config:
          deepspeed_config_file: ds_zero2.json
          deepspeed_multinode_launcher: standard
          zero3_init_flag: false
        distributed_type: DEEPSPEED
        num_processes: 2
    """))  # fmt: skip
    assert config.state == {"strategy": "deepspeed", "deepspeed_config": str(tmp_path / "ds_zero2.json")}
    assert config.notes == {} and "deepspeed_config.deepspeed_multinode_launcher" in config.ignored


def test_accelerate_single_process(tmp_path: Path) -> None:
    config = _config.load_config(_file(tmp_path, """
        compute_environment: LOCAL_MACHINE
        debug: true
        distributed_type: 'NO'
        downcast_bf16: 'no'
        dynamo_config:
          dynamo_backend: INDUCTOR
        gpu_ids: '0'
        machine_rank: 0
        main_training_function: main
        mixed_precision: fp16
        num_machines: 1
        num_processes: 1
        use_cpu: false
    """))  # fmt: skip
    assert config.state == {"precision": "fp16", "debug": True, "cpu": False}
    assert config.launch == {"num_processes": 1, "num_nodes": 1, "node_rank": 0, "gpu_ids": "0"}
    assert "torch.compile" in config.notes["dynamo_config"]


# --- bad files: each names file:line, the key, what was expected and a fix ----------------------

BAD = {
    "unknown accelerate key": (
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_GPU\nmixed_precison: bf16\n",
        ":4: mixed_precison: unknown key; did you mean 'mixed_precision'?",
    ),
    "unknown accelkit key": ("precision: bf16\nnum_proceses: 2\n", ":2: num_proceses: unknown key; did you mean"),
    "unknown fsdp key": (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_ofload_params: true\n",
        ":3: fsdp_config.fsdp_ofload_params: unknown key; did you mean 'fsdp_offload_params'?",
    ),
    "wrong type": ("debug: false\nnum_processes: two\n", ":2: num_processes: expected an integer >= 1, found 'two'"),
    "wrong type bool": ("cpu: 'yes'\n", ":1: cpu: expected true or false, found 'yes'; e.g. `cpu: true`"),
    "wrong type mapping": ("distributed_type: FSDP\nfsdp_config: full\n", ":2: fsdp_config: expected a mapping"),
    "bad value": ("precision: fp32\n", ":1: precision: expected one of 'no', 'fp16', 'bf16', found 'fp32'"),
    "fp8 from accelerate": (
        "compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nmixed_precision: fp8\n",
        ":3: mixed_precision: expected one of 'no', 'fp16', 'bf16', found 'fp8'; fp8 needs an NVIDIA GPU",
    ),
    "fp8": ("precision: fp8\n", ":1: precision: expected one of 'no', 'fp16', 'bf16', found 'fp8'; fp8 needs an"),
    "bad port": ("main_process_port: 70000\n", ":1: main_process_port: expected an integer from 1 to 65535"),
    "bad rdzv": ("rdzv_backend: etcd\n", ":1: rdzv_backend: expected one of 'static', 'c10d', found 'etcd'"),
    "bad gpu ids": ("gpu_ids: first\n", ":1: gpu_ids: expected `all` or device indices like `0,1`"),
    "invalid yaml": (
        "precision: bf16\ndebug: [true\ncpu: false\n",
        ":3: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence, which starts on line 2)",
    ),
    "invalid yaml colon": ("precision: bf16\ndebug: true: false\n", ":2: not valid YAML: mapping values"),
    "duplicate": (
        "precision: bf16\ndebug: true\nprecision: fp16\n",
        ":3: precision: duplicate key (first set on line 1)",
    ),
    "nested duplicate": (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_version: 1\n",
        ":4: fsdp_config.fsdp_version: duplicate key (first set on line 3)",
    ),
    "empty": ("# only a comment\n", ": the config file is empty; write one with `accelkit config`"),
    "not a mapping": ("- precision\n- bf16\n", ":1: expected `key: value` lines at the top level, found a sequence"),
    "unsupported distributed_type": (
        "compute_environment: LOCAL_MACHINE\ndistributed_type: XLA\n",
        ":2: distributed_type: XLA is not supported; accelkit runs NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED",
    ),
    "sagemaker": ("compute_environment: AMAZON_SAGEMAKER\n", ":1: compute_environment: AMAZON_SAGEMAKER is not"),
    "not divisible": (
        "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n",
        ":3: num_processes: 3 processes in total do not divide evenly over num_machines: 2",
    ),
    "bad sharding": (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: FULL_SHRAD\n",
        ":3: fsdp_config.fsdp_reshard_after_forward: expected one of 'true', 'false', 'FULL_SHARD'",
    ),
    "deepspeed file missing": (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: gone.json\n",
        ":3: deepspeed_config.deepspeed_config_file: 'gone.json' does not exist",
    ),
    "deepspeed file and inline": (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 3\n",
        ":4: deepspeed_config.zero_stage: is set in the DeepSpeed JSON file when deepspeed_config_file is given",
    ),
    "deepspeed accumulation twice": (
        "distributed_type: DEEPSPEED\ngradient_accumulation_steps: 2\n"
        "deepspeed_config:\n  gradient_accumulation_steps: 4\n",
        ":4: deepspeed_config.gradient_accumulation_steps: 4 differs from the top-level 2; keep one of them",
    ),
    "deepspeed nvme without path": (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: nvme\n",
        ":3: deepspeed_config.offload_param_device: nvme needs offload_param_nvme_path",
    ),
    "deepspeed stage": (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
        ":3: deepspeed_config.zero_stage: expected an integer from 0 to 3, found 4",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_files_name_file_line_key_and_fix(tmp_path: Path, case: str) -> None:
    text, expected = BAD[case]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigurationError) as err:
        _config.load_config(path)
    assert str(err.value).startswith(f"{path}{expected}"), str(err.value)


def test_suggestion_for_a_mistyped_value(tmp_path: Path) -> None:
    path = _file(tmp_path, "strategy: fdsp\n")
    with pytest.raises(ConfigurationError, match=r":1: strategy: .*found 'fdsp'; did you mean 'fsdp'\?"):
        _config.load_config(path)


# --- ak.write_basic_config and `accelkit config default` ----------------------------------------


def test_write_basic_config(tmp_path: Path) -> None:
    path = ak.write_basic_config("bf16", tmp_path / "basic.yaml", num_processes=3, cpu=True)
    config = _config.load_config(path)
    assert config.launch == {"num_processes": 3, "num_nodes": 1}
    assert config.state == {"precision": "bf16", "cpu": True, "gradient_accumulation_steps": 1}
    assert "ak.write_basic_config" in path.read_text().splitlines()[0]
    with pytest.raises(ConfigurationError, match=rf"'{path}' already exists; pass overwrite=True"):
        ak.write_basic_config("no", path)
    ak.write_basic_config("no", path, cpu=True, overwrite=True)
    assert _config.load_config(path).state["precision"] == "no"
    assert _config.load_config(path).launch["num_processes"] == 2  # cpu: two processes, as the examples start


# What the examples start (examples/digits.py's default): every GPU, else 2 CPU processes.
EXAMPLES_PROCESSES = torch.cuda.device_count() or 2


def test_config_default_proposes_what_the_examples_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `accelkit config default`, then `accelkit test` (the README's next line) checks this many processes.
    assert cli(["config", "default", "--config-file", str(tmp_path / "default.yaml")]) == 0
    assert _config.load_config(tmp_path / "default.yaml").launch["num_processes"] == EXAMPLES_PROCESSES
    assert cli(["config", "default", "--config-file", str(tmp_path / "cpu.yaml"), "--cpu"]) == 0
    assert _config.load_config(tmp_path / "cpu.yaml").launch["num_processes"] == 2
    # Interactive, every default taken (Enter): the same number, shown in brackets.
    prompts = _answers(monkeypatch, [""] * 7)
    assert cli(["config", "--config-file", str(tmp_path / "asked.yaml")]) == 0
    assert prompts[1].endswith(f"[{EXAMPLES_PROCESSES}]: "), prompts[1]
    assert _config.load_config(tmp_path / "asked.yaml").launch["num_processes"] == EXAMPLES_PROCESSES


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"precision": "fp32"}, r"write_basic_config\(precision='fp32'\): expected one of"),
        ({"num_processes": 0}, r"write_basic_config\(num_processes=0\): expected an integer >= 1"),
        ({"cpu": "yes"}, r"write_basic_config\(cpu='yes'\): expected True or False"),
    ],
)
def test_write_basic_config_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigurationError, match=expected):
        ak.write_basic_config(config_file=tmp_path / "c.yaml", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "c.yaml").exists()


def test_cli_config_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cli.yaml"
    assert cli(["config", "default", "--config-file", str(path), "--precision", "fp16", "--cpu"]) == 0
    assert f"accelkit config written to {path}" in capsys.readouterr().out
    config = _config.load_config(path)
    assert config.state == {"precision": "fp16", "cpu": True, "gradient_accumulation_steps": 1}
    assert "`accelkit config default`" in path.read_text().splitlines()[0]
    assert cli(["config", "--config-file", str(path), "default", "--cpu"]) == 2  # exists, no --force
    assert "already exists; pass overwrite=True (`accelkit config default --force`)" in capsys.readouterr().err
    assert cli(["config", "default", "--config-file", str(path), "--cpu", "--force"]) == 0
    assert _config.load_config(path).state["precision"] == "no"


def test_cli_config_default_uses_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert cli(["config", "default", "--cpu"]) == 0
    assert (tmp_path / "accelkit" / "default_config.yaml").is_file()


# --- interactive `accelkit config` --------------------------------------------------------------


def test_interactive_one_machine_fsdp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "asked.yaml"
    # where, processes (invalid, then 2), precision (invalid, then bf16), cpu, strategy, FSDP questions,
    # accumulation, debug
    prompts = _answers(monkeypatch, ["", "three", "2", "bf17", "bf16", "n", "fsdp", "Block, Head", "no", "yes",
                                     "2", "yes"])  # fmt: skip
    assert cli(["config", "--config-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "'three' is not a whole number >= 1; try again" in out and "'bf17' is not one of no, fp16" in out
    assert prompts[0].endswith("(this/several) [this]: ") and "[no]" in prompts[3]
    assert f"accelkit config written to {path}" in out
    config = _config.load_config(path)
    assert config.launch == {"num_processes": 2, "num_nodes": 1}
    assert config.state == {
        "precision": "bf16", "cpu": False, "strategy": "fsdp", "fsdp_wrap": ("Block", "Head"),
        "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True, "gradient_accumulation_steps": 2,
        "debug": True,
    }  # fmt: skip


def test_interactive_several_machines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nodes.yaml"
    # where, processes, machines, rank (out of range, then 1), main host (needed: no default on rank 1),
    # port, precision, cpu, strategy, accumulation, debug
    _answers(monkeypatch, ["several", "4", "3", "5", "1", "", "node0", "29501", "", "yes", "", "", ""])
    assert cli(["config", "--config-file", str(path)]) == 0
    config = _config.load_config(path)
    assert config.launch == {"num_processes": 4, "num_nodes": 3, "node_rank": 1, "master_addr": "node0",
                             "master_port": 29501}  # fmt: skip
    assert config.state == {"precision": "no", "cpu": True, "strategy": "ddp", "gradient_accumulation_steps": 1,
                            "debug": False}  # fmt: skip


def test_interactive_end_of_input_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "never.yaml"
    _answers(monkeypatch, ["", "2"])
    assert cli(["config", "--config-file", str(path)]) == 1
    assert "input ended before the last question; nothing was written" in capsys.readouterr().err
    assert not path.exists()


def test_interactive_over_a_real_stdin(tmp_path: Path) -> None:
    path = tmp_path / "stdin.yaml"
    answers = "\n2\nfp16\nyes\nddp\n1\nno\n"
    code = "import sys; from accelkit._cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", code, "config", "--config-file", str(path)],
        input=answers, env=_subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"accelkit config written to {path}" in done.stdout
    assert _config.load_config(path).state == {"precision": "fp16", "cpu": True, "strategy": "ddp",
                                               "gradient_accumulation_steps": 1, "debug": False}  # fmt: skip
    ended = subprocess.run(
        [sys.executable, "-c", code, "config", "--config-file", str(tmp_path / "x.yaml")],
        input="\n", env=_subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ended.returncode == 1 and "nothing was written" in ended.stderr and "Traceback" not in ended.stderr


@pytest.mark.parametrize("argv", [["--help"], ["config", "--help"], ["config", "default", "--help"]])
def test_help_imports_neither_torch_nor_yaml(argv: list[str]) -> None:
    probe = (
        f"import sys\nfrom accelkit._cli import main\ntry: main({argv!r})\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules, 'yaml' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=_subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage: accelkit" in done.stdout
    assert done.stdout.strip().endswith("False False"), done.stdout
