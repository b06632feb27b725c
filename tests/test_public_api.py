"""The public names: all declared, all resolvable, nothing else exported."""

import pkgutil
from pathlib import Path

import accelkit as ak


def test_every_public_name_resolves() -> None:
    for name in ak.__all__:
        assert getattr(ak, name) is not None, name
    assert sorted(ak.__all__) == ak.__all__


def test_unknown_names_raise_attribute_error() -> None:
    try:
        ak.Accelerator  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as err:
        assert "Accelerator" in str(err)
    else:
        raise AssertionError("accelkit.Accelerator should not exist")


def test_the_contract_names_are_all_there() -> None:
    contract = {
        "state", "rank", "world_size", "local_rank", "device", "is_main_process", "is_local_main_process",
        "init", "is_initialized", "reset_state", "distributed", "launch", "wait_for_everyone", "print",
        "on_main_process", "on_local_main_process", "on_process", "main_process_first",
        "local_main_process_first", "split_between_processes", "set_seed", "set_breakpoint", "check_breakpoint",
        "prepare", "backward", "precision", "accumulate", "sync_gradients", "no_sync", "clip_grad_norm_",
        "clip_grad_value_", "unwrap", "skip_first_batches", "gather", "gather_object", "gather_for_metrics",
        "reduce", "broadcast", "broadcast_object", "pad_across_processes", "find_executable_batch_size",
        "free_memory", "get_logger", "DistributedOperationError", "WorkerError", "ProcessState", "write_basic_config",
    }  # fmt: skip
    assert contract <= set(ak.__all__)
    assert set(dir(ak)) >= set(ak.__all__)


def test_the_public_modules_are_exactly_four() -> None:
    # Everything else is an underscored module: its names may change in any release.
    root = Path(ak.__file__).parent
    public = {"accelkit"}
    for info in pkgutil.walk_packages([str(root)], prefix="accelkit."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            public.add(info.name)
    assert public == {"accelkit", "accelkit.errors", "accelkit.logging", "accelkit.testing"}


def test_the_public_names_are_held() -> None:
    # A name added to or dropped from ak.__all__ is a change to the documented API: update this list with it.
    held = (
        "CheckpointError CheckpointInfo ConfigurationError DistributedOperationError NoExecutableBatchSizeError "
        "ProcessState StateError WorkerError __version__ accumulate backward broadcast broadcast_object "
        "check_breakpoint clip_grad_norm_ clip_grad_value_ device distributed end_training "
        "find_executable_batch_size free_memory full_state_dict gather gather_for_metrics gather_object get_logger "
        "get_tracker init init_trackers is_initialized is_local_main_process is_main_process latest_checkpoint "
        "launch load_state local_main_process_first local_rank local_sgd log main_process_first mesh no_sync "
        "on_local_main_process on_main_process on_process pad_across_processes precision prepare print profile "
        "progress rank read_checkpoint reduce reset_state save_model save_state set_breakpoint set_seed "
        "skip_first_batches split_between_processes state strategy sync_gradients unwrap wait_for_checkpoint "
        "wait_for_everyone world_size write_basic_config"
    ).split()
    assert ak.__all__ == held
