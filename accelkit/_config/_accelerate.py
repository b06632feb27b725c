"""An Accelerate ``config.yaml`` in accelkit's terms: each key mapped, ignored (with a note), or an error.

Accelerate counts ``num_processes`` over all machines; accelkit starts the same number on
each node, so the total is divided by ``num_machines``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._options import PRECISIONS, RDZV_BACKENDS, REFUSED
from ._fields import NO_ALIAS, Fields, json_text

_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED")
_UNSUPPORTED = (
    "MULTI_XPU",
    "XLA",
    "TPU",
    "MEGATRON_LM",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_HPU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "TP",
)
_MAPPED = (
    "compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank", "main_process_ip",
    "main_process_port", "mixed_precision", "debug", "use_cpu", "rdzv_backend", "gpu_ids", "mpirun_config",
    "fsdp_config", "deepspeed_config", "gradient_accumulation_steps", "parallelism_config",
)  # fmt: skip
# key -> a note, shown only when the value asks for something accelkit does not do
_IGNORED: dict[str, str | None] = {
    "same_network": None,
    "main_training_function": None,
    "downcast_bf16": None,
    "megatron_lm_config": None,
    "command_file": None,
    "commands": None,
    "enable_cpu_affinity": "not applied; pin threads with numactl or taskset",
    "num_cpu_threads_per_process": "not applied; set OMP_NUM_THREADS",
    "dynamo_config": "accelkit does not compile models; call torch.compile(model) in the script",
    "dynamo_backend": "accelkit does not compile models; call torch.compile(model) in the script",
    "ipex_config": "not applied; accelkit does not use IPEX",
    "fp8_config": "fp8 follows torch's own recipe; the fp8 backend settings are not applied",
}
_FSDP_IGNORED: dict[str, str | None] = {
    "fsdp_version": None,
    "fsdp_state_dict_type": None,
    "fsdp_cpu_ram_efficient_loading": None,
    "fsdp_sync_module_states": None,
    "fsdp_use_orig_params": None,
    "fsdp_backward_prefetch": None,
    "fsdp_backward_prefetch_policy": None,
    "fsdp_forward_prefetch": None,
}
_FSDP_MAPPED = (
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "fsdp_reshard_after_forward",
    "fsdp_sharding_strategy",
    "fsdp_offload_params",
    "fsdp_activation_checkpointing",
)
_HYBRID = "HSDP: replicated across the machines, sharded within each (dp_replicate=num_machines)"
# sharding strategy (name or FSDP1's enum number) -> reshard after forward, note
_SHARDING: dict[object, tuple[bool | None, str | None]] = {
    "FULL_SHARD": (True, None),
    "SHARD_GRAD_OP": (False, None),
    "NO_SHARD": (None, "NO_SHARD replicates the model: the run uses DDP"),
    "HYBRID_SHARD": (True, _HYBRID),
    "HYBRID_SHARD_ZERO2": (False, _HYBRID),
}
_SHARDING.update({i + 1: v for i, v in enumerate(list(_SHARDING.values()))})
_DS_INLINE = (
    "zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model",
)  # fmt: skip
_DS_IGNORED: dict[str, str | None] = {
    "zero3_init_flag": "not applied; the model is built normally, then sharded by ak.prepare",
    "deepspeed_multinode_launcher": None,
    "deepspeed_hostfile": None,
    "deepspeed_exclusion_filter": None,
    "deepspeed_inclusion_filter": None,
    "deepspeed_moe_layer_cls_names": None,
}


def from_accelerate(f: Fields, file: Path) -> tuple[dict[str, object], dict[str, object]]:
    """State options and launch settings of an Accelerate config (launch keys in accelkit's file names)."""
    f.check_known((*_MAPPED, *_IGNORED, *(k for k in f.values if k.startswith("tpu_"))))
    if f.choice("compute_environment", ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")) == "AMAZON_SAGEMAKER":
        raise f.error(
            "compute_environment",
            "AMAZON_SAGEMAKER is not supported: accelkit does not start "
            "SageMaker jobs; run `accelkit launch` inside the job, or write a local config with "
            "`accelkit config`",
        )
    machines = f.integer("num_machines", 1, example=1)
    total = f.integer("num_processes", 1, example=2)
    kind = f.choice("distributed_type", (*_SUPPORTED, *_UNSUPPORTED), {False: "NO"})  # a bare NO reads as false
    if kind is None:
        kind = "MULTI_GPU" if (total or 1) > 1 else "NO"
    if kind in _UNSUPPORTED:
        raise f.error(
            "distributed_type",
            f"{kind} is not supported; accelkit runs {', '.join(_SUPPORTED)}. "
            "Use MULTI_GPU (DDP), FSDP or DEEPSPEED, or run this job with `accelerate launch`",
        )
    launch: dict[str, object] = {"num_nodes": machines, "node_rank": f.integer("machine_rank", 0, example=0)}
    if total is not None:
        per_node, extra = divmod(total, machines or 1)
        if extra:
            raise f.error(
                "num_processes",
                f"{total} processes in total do not divide evenly over num_machines: "
                f"{machines} (Accelerate counts the processes of all machines, accelkit starts as many "
                f"on each); use a multiple of {machines}, e.g. {(machines or 1) * max(per_node, 1)}",
            )
        launch["num_processes"] = per_node
    launch["main_process_ip"] = f.text("main_process_ip", "10.0.0.1")
    launch["main_process_port"] = f.integer("main_process_port", 1, 65535, example=29500)
    launch["rdzv_backend"] = f.choice("rdzv_backend", RDZV_BACKENDS)
    launch["gpu_ids"] = f.gpu_ids("gpu_ids")

    precision = f.choice("mixed_precision", PRECISIONS, NO_ALIAS, REFUSED["precision"])
    use_cpu = f.flag("use_cpu")
    state: dict[str, object] = {
        "precision": precision,
        "debug": f.flag("debug"),
        "cpu": True if kind == "MULTI_CPU" else use_cpu,
        "gradient_accumulation_steps": f.integer("gradient_accumulation_steps", 1),
        "strategy": {"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(kind),
    }
    for key, note in _IGNORED.items():
        f.ignore(key, note if _asks(f.values.get(key)) else None)
    for key in f.values:
        if key.startswith("tpu_"):
            f.ignore(key)
    for key, wanted in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED"), ("mpirun_config", "MULTI_CPU")):
        if kind != wanted:
            f.ignore(key, f"used only with distributed_type: {wanted}" if _asks(f.values.get(key)) else None)
    if kind == "FSDP":
        state.update(_fsdp(f.nested("fsdp_config")))
        if _HYBRID in f.notes.values() and (machines or 1) > 1:
            state["dp_replicate"] = machines  # dp_shard: the processes of a machine
        elif _HYBRID in f.notes.values():
            key = next(k for k, v in f.notes.items() if v == _HYBRID)
            f.notes[key] = "one machine: sharded over all its processes (HSDP replicates across machines)"
    state.update(_parallelism(f.nested("parallelism_config")))
    if kind == "DEEPSPEED":
        state.update(_deepspeed(f, f.nested("deepspeed_config"), file))
    if kind == "MULTI_CPU":
        mpi = f.nested("mpirun_config")
        mpi.check_known(("mpirun_hostfile", "mpirun_ccl"))
        mpi.ignore("mpirun_ccl", "not applied; CPU runs use gloo" if _asks(mpi.values.get("mpirun_ccl")) else None)
        hostfile = mpi.text("mpirun_hostfile", "/etc/mpi/hostfile")
        if hostfile:
            launch.update(hostfile=hostfile, mpirun=True)
    return f.state({k: v for k, v in state.items() if v is not None}), {
        k: v for k, v in launch.items() if v is not None
    }


def _fsdp(f: Fields) -> dict[str, object]:
    f.check_known((*_FSDP_MAPPED, *_FSDP_IGNORED))
    for key, note in _FSDP_IGNORED.items():
        f.ignore(key, note if _asks(f.values.get(key)) else None)
    if f.values.get("fsdp_version") == 1:
        f.notes[f.prefix + "fsdp_version"] = "accelkit always uses FSDP2 (fully_shard); the settings were mapped to it"
    out: dict[str, object] = {}
    policy = f.choice("fsdp_auto_wrap_policy", ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"))
    classes = f.get(
        "fsdp_transformer_layer_cls_to_wrap", (str, list), "class names, comma-separated", "LlamaDecoderLayer"
    )
    if policy == "SIZE_BASED_WRAP":
        out["fsdp_min_params"] = f.integer("fsdp_min_num_params", 0, example=100_000_000) or 100_000_000
        f.ignore("fsdp_transformer_layer_cls_to_wrap")
    elif policy == "NO_WRAP":
        out.update(fsdp_wrap=(), fsdp_min_params=0)
        f.ignore("fsdp_transformer_layer_cls_to_wrap")
        f.ignore("fsdp_min_num_params")
    else:
        f.ignore("fsdp_min_num_params")
        if classes:
            out["fsdp_wrap"] = classes
        elif policy == "TRANSFORMER_BASED_WRAP":
            f.ignored.append(f.prefix + "fsdp_auto_wrap_policy")
            f.notes[f.prefix + "fsdp_auto_wrap_policy"] = (
                "without fsdp_transformer_layer_cls_to_wrap the whole model is one FSDP unit; "
                "name the layer classes, e.g. `fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer`"
            )
    key = "fsdp_reshard_after_forward" if "fsdp_reshard_after_forward" in f.values else "fsdp_sharding_strategy"
    value = f.values.get(key)
    if isinstance(value, bool):
        out["fsdp_reshard_after_forward"] = value
    elif value is not None:
        if not isinstance(value, (str, int)) or value not in _SHARDING:
            names = [k for k in _SHARDING if isinstance(k, str)]
            f.choice(key, ["true", "false", *names])  # raises, with a suggestion
        reshard, note = _SHARDING[value]
        if reshard is None:
            out["strategy"] = "ddp"
        else:
            out["fsdp_reshard_after_forward"] = reshard
        if note:
            f.notes[f.prefix + key] = note
    out["fsdp_cpu_offload"] = f.flag("fsdp_offload_params")
    if f.flag("fsdp_activation_checkpointing"):
        if classes:
            out["activation_checkpointing"] = classes
        else:
            f.ignored.append(f.prefix + "fsdp_activation_checkpointing")
            f.notes[f.prefix + "fsdp_activation_checkpointing"] = (
                "accelkit recomputes the layers it is told: name them in fsdp_transformer_layer_cls_to_wrap, "
                "or pass ak.prepare(model, activation_checkpointing=['Block'])"
            )
    return {k: v for k, v in out.items() if v is not None}


_MESH_KEYS = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard", "tp_size": "tp", "cp_size": "cp"}
# parallelism_config keys of DeepSpeed's sequence parallelism and of context parallelism's settings.
_PARALLELISM_IGNORED = (
    "cp_backend", "cp_comm_strategy", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable",
    "sp_attn_implementation",
)  # fmt: skip


def _parallelism(f: Fields) -> dict[str, object]:
    """Accelerate's ``parallelism_config`` (``parallelism_config_tp_size: 2``, ...) as the mesh's sizes.

    Accelerate's unset sizes are 1 (not "the rest"); all of them 1 is no mesh.
    """
    prefix = "parallelism_config_"
    f.check_known([prefix + k for k in (*_MESH_KEYS, "sp_size", *_PARALLELISM_IGNORED)])
    for key in _PARALLELISM_IGNORED:
        f.ignore(prefix + key)
    sp = f.integer(prefix + "sp_size", 1, example=1)
    if sp is not None and sp > 1:
        raise f.error(
            prefix + "sp_size",
            f"{sp}: DeepSpeed's sequence parallelism (Ulysses) is not supported by accelkit; set it to 1, and use "
            f"parallelism_config_tp_size to split the layers, or run this job with `accelerate launch`",
        )
    f.ignore(prefix + "sp_size")
    sizes = {name: f.integer(prefix + key, 1, example=2) for key, name in _MESH_KEYS.items()}
    if all(size in (None, 1) for size in sizes.values()):
        return {}
    return {name: 1 if size is None else size for name, size in sizes.items()}


def _deepspeed(top: Fields, f: Fields, file: Path) -> dict[str, object]:
    f.check_known(("deepspeed_config_file", *_DS_INLINE, *_DS_IGNORED))
    for key, note in _DS_IGNORED.items():
        f.ignore(key, note if _asks(f.values.get(key)) else None)
    path = f.text("deepspeed_config_file", "ds_config.json")
    if path:
        inline = [k for k in _DS_INLINE if k in f.values]
        if inline:
            raise f.error(
                inline[0],
                "is set in the DeepSpeed JSON file when deepspeed_config_file is given; "
                "remove it here, or drop deepspeed_config_file",
            )
        found = Path(path).expanduser()
        if not found.is_absolute() and not found.exists() and (file.parent / found).exists():
            found = file.parent / found
        if not found.is_file():
            raise f.error("deepspeed_config_file", f"{path!r} does not exist; give the path of a DeepSpeed JSON file")
        return {"deepspeed_config": str(found)}
    zero: dict[str, Any] = {"stage": f.integer("zero_stage", 0, 3, example=2)}
    zero["stage"] = 2 if zero["stage"] is None else zero["stage"]  # Accelerate's default
    for what in ("optimizer", "param"):
        device = f.choice(f"offload_{what}_device", ("none", "cpu", "nvme"))
        if device in ("cpu", "nvme"):
            zero[f"offload_{what}"] = {"device": device}
        if device == "nvme":
            nvme = f.text(f"offload_{what}_nvme_path", "/nvme")
            if not nvme:
                raise f.error(f"offload_{what}_device", f"nvme needs offload_{what}_nvme_path; add it, or use cpu")
            zero[f"offload_{what}"]["nvme_path"] = nvme
    save16 = f.flag("zero3_save_16bit_model")
    if save16 is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = save16
    steps = f.integer("gradient_accumulation_steps", 1)
    outer = top.values.get("gradient_accumulation_steps")
    if steps is not None and outer is not None and steps != outer:
        raise f.error("gradient_accumulation_steps", f"{steps} differs from the top-level {outer}; keep one of them")
    # "auto": ak.prepare fills these from accelkit's options and the DataLoader, so overrides stay consistent.
    config: dict[str, Any] = {
        "zero_optimization": zero,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
    clip = f.get("gradient_clipping", (int, float), "a number", "1.0")
    if clip is not None:
        config["gradient_clipping"] = clip
    out: dict[str, object] = {"deepspeed_config": json_text(config)}
    if steps is not None:
        out["gradient_accumulation_steps"] = steps
    return out


def _asks(value: object) -> bool:
    """Whether a value of an ignored key asks for something (not off, empty or a default)."""
    if isinstance(value, dict):
        return any(_asks(v) for v in value.values())
    if isinstance(value, bool):
        return value
    return value not in (None, 0, 1, "", "no", "NO", "default", "main", [])
