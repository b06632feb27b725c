"""Accelerate's names that accelkit spells otherwise: the hint of ``ak.<name>``'s ``AttributeError``.

Imported only when a name is missing from the module (``accelkit.__getattr__``); torch-free.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["missing_name"]

# Accelerate's name (an Accelerator member, or a name of the accelerate package) -> accelkit's spelling.
SPELLINGS: dict[str, str] = {
    "Accelerator": (
        "accelkit's functions (ak.prepare, ak.backward, ...): there is no Accelerator object; "
        "ak.init(precision=..., gradient_accumulation_steps=...) goes where Accelerator(...) was"
    ),
    "PartialState": "ak.state() (a frozen snapshot: rank, world_size, device, options, ...)",
    "AcceleratorState": "ak.state() (a frozen snapshot: rank, world_size, device, options, ...)",
    "unwrap_model": "ak.unwrap(model) (keep_fp32_wrapper=True is ak.unwrap(model, keep_precision=True))",
    "process_index": "ak.rank()",
    "local_process_index": "ak.local_rank()",
    "num_processes": "ak.world_size()",
    "is_last_process": "ak.rank() == ak.world_size() - 1",
    "on_last_process": "`if ak.rank() == ak.world_size() - 1:` (or @ak.on_process(rank))",
    "on_local_process": "`if ak.local_rank() == i:` (@ak.on_process(rank) takes a global rank)",
    "autocast": "with ak.precision(): (or ak.precision('bf16'))",
    "set_trigger": "ak.set_breakpoint()",
    "check_trigger": "ak.check_breakpoint()",
    "prepare_model": "ak.prepare(model)",
    "prepare_optimizer": "ak.prepare(optimizer)",
    "prepare_data_loader": "ak.prepare(loader)",
    "prepare_scheduler": "ak.prepare(scheduler)",
    "unscale_gradients": "ak.clip_grad_norm_ / ak.clip_grad_value_: they unscale fp16 gradients first, once per step",
    "optimizer_step_was_skipped": "optimizer.step_was_skipped (on the prepared optimizer)",
    "gradient_accumulation_steps": "ak.state().options.gradient_accumulation_steps (set it with ak.init(...))",
    "mixed_precision": "ak.state().options.precision (set it with ak.init(precision=...))",
    "use_distributed": "ak.state().distributed",
    "project_dir": "ak.state().options.project_dir (set it with ak.init(project_dir=...))",
    "save": "torch.save(obj, path) under `if ak.is_main_process():` (ak.save_model(model, dir) for a model)",
    "clear": "ak.free_memory()",
    "register_for_checkpointing": "ak.save_state(dir, name=obj) / ak.load_state(dir, name=obj) (named there)",
    "join_uneven_inputs": "ak.prepare(model, optimizer, loader, even_batches=False, join_uneven_inputs=True)",
    "notebook_launcher": "ak.launch(fn, args, num_processes=2)",
    "debug_launcher": "accelkit.testing.run_distributed(fn, args, num_processes=2)",
    "DistributedDataParallelKwargs": "DDP's options on ak.prepare: ak.prepare(model, find_unused_parameters=True)",
    "GradientAccumulationPlugin": "ak.init(gradient_accumulation_steps=2, sync_each_batch=False)",
    "DataLoaderConfiguration": "ak.prepare(loader, even_batches=..., split_batches=..., data_seed=...)",
    "ProjectConfiguration": "ak.init(project_dir=...) and ak.save_state(directory, ...)",
    "InitProcessGroupKwargs": "ak.init(timeout=..., backend=...)",
    "FullyShardedDataParallelPlugin": 'ak.init(strategy="fsdp", fsdp_wrap=[...])',
    "DeepSpeedPlugin": 'ak.init(strategy="deepspeed", deepspeed_config="ds.json")',
    "distributed_type": 'ak.strategy() ("single", "ddp", "fsdp", "deepspeed"; the device: ak.device().type)',
    "DistributedType": 'ak.strategy() ("single", "ddp", "fsdp", "deepspeed"; the device: ak.device().type)',
    "is_xpu_available": "torch.xpu.is_available()",
    "is_npu_available": 'hasattr(torch, "npu") and torch.npu.is_available() (torch_npu installed)',
    "is_schedulefree_available": 'importlib.util.find_spec("schedulefree") is not None',
}


def missing_name(name: str, public: Iterable[str]) -> str:
    """The message of ``AttributeError`` for ``accelkit.<name>``: accelkit's spelling, or a close name.

    Example:
        >>> missing_name("process_index", [])
        "module 'accelkit' has no attribute 'process_index'; for Accelerate's process_index, use ak.rank()"
    """
    message = f"module 'accelkit' has no attribute {name!r}"
    spelling = SPELLINGS.get(name)
    if spelling is not None:
        return f"{message}; for Accelerate's {name}, use {spelling}"
    if name.startswith("__"):
        return message
    close = difflib.get_close_matches(name, list(public), n=1, cutoff=0.75)
    return f"{message}; did you mean {close[0]!r}?" if close else message
