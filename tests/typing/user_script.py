"""A user's training script, as the README writes them: ``mypy --strict`` must accept every line.

Checked by ``tests/test_typing.py``; never run. ``assert_type`` pins what the API returns.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import assert_type

import accelkit as ak
from accelkit.testing import WorkerPool, run_distributed


@ak.distributed(num_processes=2)
def train(epochs: int = 3) -> float:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    # Each object comes back as its own type: a prepared optimizer is still an AdamW to the type checker.
    assert_type(
        ak.prepare(model, optimizer, loader, scheduler),
        tuple[nn.Linear, torch.optim.AdamW, DataLoader[tuple[torch.Tensor, ...]], torch.optim.lr_scheduler.StepLR],
    )
    assert_type(ak.prepare(model), nn.Linear)
    assert_type(ak.prepare(model, optimizer, even_batches=False), tuple[nn.Linear, torch.optim.AdamW])
    model, optimizer, loader, scheduler = ak.prepare(model, optimizer, loader, scheduler)
    loss = torch.zeros(())
    for _ in range(epochs):
        for x, y in loader:
            with ak.accumulate(model), ak.precision("bf16"):
                loss = nn.functional.mse_loss(model(x), y)
                ak.backward(loss)
                if ak.sync_gradients():
                    ak.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    ak.save_state("ckpt", model=model, optimizer=optimizer, step=epochs)
    values = ak.load_state("ckpt", model=model, optimizer=optimizer)
    assert_type(values, dict[str, Any])
    ak.save_model(ak.unwrap(model), "export", safe_serialization=True)
    assert_type(ak.unwrap(model, keep_precision=True), nn.Module)
    ctx = ak.precision("bf16")  # kept and entered again
    for _ in range(4):  # a micro-step loop, then the step
        with ak.accumulate(model, steps=4), ctx:
            ak.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    return float(ak.reduce(loss, op="mean").item())


@ak.distributed
def plain() -> int:
    return ak.rank()


@ak.distributed(2, cpu=True, precision="fp16", gradient_accumulation_steps=4, debug=True, timeout=60.0)
def positional() -> str:
    return str(ak.device())


@ak.distributed(
    num_processes=2,
    num_nodes=1,
    node_rank=0,
    master_addr="127.0.0.1",
    master_port=29500,
    max_restarts=1,
    start_method="spawn",
    backend="gloo",
    strategy="fsdp",
    fsdp_wrap=["Linear"],
    fsdp_min_params=1000,
    fsdp_reshard_after_forward=False,
    fsdp_cpu_offload=True,
    timeout=datetime.timedelta(seconds=30),
)
def sharded(scale: float) -> list[int]:
    return [ak.world_size()]


@ak.distributed(strategy="deepspeed", deepspeed_config={"zero_optimization": {"stage": 2}})
def with_deepspeed() -> None:
    pass


@ak.find_executable_batch_size(starting_batch_size=64)
def fit(batch_size: int, epochs: int) -> int:
    return batch_size * epochs


@ak.on_main_process
def report(value: float) -> str:
    return f"{value:.3f}"


@ak.on_local_main_process
def download() -> bool:
    return True


@ak.on_process(1)
def only_one() -> int:
    return 1


def everything_else() -> None:
    state = ak.init(precision="bf16", gradient_accumulation_steps=2, sync_each_batch=True, cpu=True, num_processes=1)
    assert_type(state, ak.ProcessState)
    assert_type(train(3), float)
    assert_type(plain(), int)
    assert_type(sharded(1.0), list[int])
    assert_type(fit(epochs=2), int)
    assert_type(report(0.5), str | None)
    assert_type(ak.launch(fit, kwargs={"epochs": 2}, num_processes=2, cpu=True), int)
    assert_type(ak.launch(positional, num_processes=1), str)
    assert_type(ak.rank(), int)
    assert_type(ak.world_size(), int)
    assert_type(ak.local_rank(), int)
    assert_type(ak.device(), torch.device)
    assert_type(ak.is_main_process(), bool)
    assert_type(ak.is_local_main_process(), bool)
    assert_type(ak.is_initialized(), bool)
    ak.wait_for_everyone()
    ak.print("hello", flush=True)
    with ak.main_process_first():
        pass
    with ak.local_main_process_first():
        pass
    with ak.split_between_processes([1, 2, 3], apply_padding=True) as mine:
        assert_type(mine, list[int])
    ak.set_seed(42, device_specific=True, deterministic=False)
    ak.set_breakpoint()
    assert_type(ak.check_breakpoint(), bool)
    t = torch.ones(3)
    assert_type(ak.gather(t), torch.Tensor)
    assert_type(ak.gather({"loss": t}), dict[str, torch.Tensor])
    assert_type(ak.gather_for_metrics(t), torch.Tensor)
    assert_type(ak.gather_object({"rank": 0}), list[Any])
    assert_type(ak.reduce(t, op="sum"), torch.Tensor)
    assert_type(ak.broadcast(t, src=0), torch.Tensor)
    assert_type(ak.broadcast_object("seed", src=0), str)
    assert_type(ak.pad_across_processes(t, dim=0, pad_index=0, pad_first=False), torch.Tensor)
    model = nn.Linear(2, 1)
    with ak.no_sync(model):
        pass
    ak.clip_grad_value_(model.parameters(), 1.0)
    ak.free_memory(model)
    logger = ak.get_logger(__name__, log_level="INFO")
    logger.info("on rank 0", main_process_only=True)
    logger.warning("every rank in turn", in_order=True)
    logger.warning_once("once")
    ak.latest_checkpoint("ckpt")
    ak.save_state("ckpt", blocking=False, full_state=True, keep_last=2, model=model, best=torch.tensor(0.5))
    ak.wait_for_checkpoint()
    info = ak.read_checkpoint("ckpt")
    assert_type(info, ak.CheckpointInfo)
    assert_type(info.step, int | None)
    assert_type(ak.full_state_dict(model), dict[str, Any])
    ak.write_basic_config(precision="bf16", config_file="accelkit.yaml", num_processes=2, cpu=True)
    ak.skip_first_batches(DataLoader(TensorDataset(torch.ones(4))), 1)
    assert_type(run_distributed(ak.world_size, num_processes=2, debug=True, timeout=30.0), list[Any])
    with WorkerPool(2, task_timeout=30.0, precision="bf16") as pool:
        pool.run(ak.rank)
    ak.init(log_with=["tensorboard", "csv"], project_dir="runs")
    with ak.init_trackers("proj", {"lr": 0.1}, log_with="csv", init_kwargs={"csv": {}}) as trackers:
        ak.log({"loss": torch.tensor(0.5), "eval": {"acc": 0.9}}, step=1)
        assert_type(trackers.names, tuple[str, ...])
        ak.get_tracker("csv")
    bar = ak.progress(range(3), desc="epoch 1")
    for item in bar:
        assert_type(item, int)
        bar.set_postfix(loss=0.5)
    ak.end_training()
    ak.reset_state()
    try:
        pass
    except ak.WorkerError as exc:
        assert_type(exc.ranks, list[int])
    except (ak.DistributedOperationError, ak.ConfigurationError, ak.StateError, ak.CheckpointError):
        pass


def less_communication() -> None:
    ak.init(comm_hook="power_sgd", comm_wrapper="fp16", comm_hook_options={"matrix_approximation_rank": 2})
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ak.prepare(model, optimizer, comm_hook="fp16")
    with ak.local_sgd(model, steps=8, enabled=True) as sync:
        optimizer.step()
        sync.step()
    assert_type(sync.num_steps, int)
    schedule = {"wait": 1, "warmup": 1, "active": 2, "repeat": 1}
    with ak.profile(activities=["cpu"], schedule_option=schedule, record_shapes=True, output_trace_dir="t") as prof:
        prof.step()
    assert_type(prof, torch.profiler.profile)
    assert_type(ak.strategy(), Literal["single", "ddp", "fsdp", "deepspeed"])
