"""The process state on one process: lazy creation, init, reset, fork, env, adoption."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

import accelkit as ak


def test_state_is_lazy_and_single_process() -> None:
    assert not ak.is_initialized()
    st = ak.state()
    assert ak.is_initialized()
    assert (st.rank, st.world_size, st.local_rank, st.local_world_size) == (0, 1, 0, 1)
    assert (st.node_rank, st.num_nodes) == (0, 1)
    assert st.is_main_process and st.is_local_main_process and not st.distributed
    assert st.device == ak.device() == torch.device("cpu")
    assert st.backend == "gloo"
    assert ak.state() is st
    assert not dist.is_initialized()  # one process: no group


def test_state_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ak.state().rank = 3  # type: ignore[misc]


def test_init_same_options_is_a_noop_and_conflicts_name_both_places() -> None:
    st = ak.init(precision="bf16", gradient_accumulation_steps=2)
    assert ak.init(precision="bf16") is st
    assert st.options.precision == "bf16" and st.options.gradient_accumulation_steps == 2
    with pytest.raises(ak.StateError) as err:
        ak.init(precision="fp16")
    message = str(err.value)
    assert "precision='fp16' here, 'bf16' set by accelkit.init at " in message
    assert message.count(__file__) == 2  # where each value was set
    assert "set it in one place only" in message and "reset_state" not in message


def test_init_after_first_use_sets_the_options_that_were_defaults() -> None:
    first = ak.state()  # e.g. ak.print, ak.rank before the user's ak.init
    assert first.options.debug is False
    st = ak.init(debug=True, precision="bf16", gradient_accumulation_steps=3)
    assert (st.options.debug, st.options.precision, st.options.gradient_accumulation_steps) == (True, "bf16", 3)
    assert ak.state() is st and (st.rank, st.device) == (first.rank, first.device)


def test_init_in_code_overrides_the_environment_but_not_a_launch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_PRECISION", "fp16")
    assert ak.state().options.precision == "fp16"
    assert ak.init(precision="bf16").options.precision == "bf16"  # code > ACCELKIT_*
    ak.reset_state()
    monkeypatch.setenv("ACCELKIT_LAUNCH_FLAGS", "precision")  # as `accelkit launch --precision fp16` sets it
    ak.state()
    with pytest.raises(ak.ConfigurationError, match=r"'bf16' in code.*'fp16' by `accelkit launch --precision`"):
        ak.init(precision="bf16")


def test_reset_state_forgets() -> None:
    first = ak.init(precision="fp16")
    ak.reset_state()
    assert not ak.is_initialized()
    assert ak.init(precision="bf16") is not first


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"precision": "fp64"}, "precision='fp64'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
        ({"timeout": -1}, "timeout=-1"),
        ({"backend": "tcp"}, "backend='tcp'"),
        ({"debug": "yes"}, "debug='yes'"),
    ],
)
def test_init_rejects_bad_values(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ak.ConfigurationError, match="expected") as err:
        ak.init(**options)
    assert fragment in str(err.value)
    assert not ak.is_initialized()


def test_init_unknown_option_suggests_the_close_one() -> None:
    with pytest.raises(TypeError, match="did you mean 'precision'"):
        ak.init(precison="bf16")


def test_init_refuses_launch_only_options() -> None:
    with pytest.raises(TypeError, match="does not start processes"):
        ak.init(max_restarts=2)
    with pytest.raises(ak.StateError, match="num_processes=4"):
        ak.init(num_processes=4)


def test_options_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_PRECISION", "bf16")
    monkeypatch.setenv("ACCELKIT_DEBUG", "1")
    monkeypatch.setenv("ACCELKIT_GRADIENT_ACCUMULATION_STEPS", "8")
    monkeypatch.setenv("ACCELKIT_TIMEOUT", "30")
    options = ak.state().options
    assert (options.precision, options.debug, options.gradient_accumulation_steps, options.timeout) == (
        "bf16", True, 8, 30.0,
    )  # fmt: skip
    ak.reset_state()
    assert ak.init(precision="fp16").options.precision == "fp16"  # explicit beats the environment


@pytest.mark.parametrize(
    ("name", "value"),
    [("ACCELKIT_PRECISION", "half"), ("ACCELKIT_DEBUG", "maybe"), ("RANK", "one"), ("ACCELKIT_TIMEOUT", "soon")],
)
def test_bad_environment_values_are_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(name, value)
    with pytest.raises(ak.ConfigurationError) as err:
        ak.state()
    assert name in str(err.value) and repr(value) in str(err.value)


def test_rank_outside_world_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ak.ConfigurationError, match="rank 5 of world size 2"):
        ak.state()


def test_a_launcher_world_of_one_is_still_a_launched_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    st = ak.state()
    assert st.launcher == "torchrun" and st.world_size == 1 and not dist.is_initialized()


def test_one_reset_keeps_the_records_and_says_what_survives() -> None:
    # The step path and the collectives read _state.training and _state.group: the same objects, always.
    from accelkit import _state

    training, group, this = _state.training, _state.group, _state.this_process
    ak.init(precision="bf16")
    training.micro_step, group.channels = 3, object()
    this.warned.add("a warning given once per process")
    generation = this.generation
    ak.set_breakpoint()
    ak.reset_state()
    assert _state.training is training is this.training and _state.group is group is this.group
    assert training.micro_step == 0 and group.channels is None and this.state is None
    assert "a warning given once per process" in this.warned and this.generation == generation
    assert not ak.check_breakpoint()


def test_a_new_task_forgets_the_training_and_the_code_options_but_keeps_the_state() -> None:
    from accelkit import _state

    first = ak.init(precision="bf16")
    _state.training.micro_step = 3
    ak.set_breakpoint()
    _state.new_task()
    st = ak.state()
    assert st.options.precision == "no" and st.pid == first.pid and st.device == first.device
    assert _state.training.micro_step == 0 and _state.training.strategy is st.strategy
    assert not ak.check_breakpoint()


def test_fork_never_reuses_the_parents_state() -> None:
    from accelkit import _state

    parent = ak.init(precision="bf16")
    _state.training.micro_step = 5  # the child must not inherit it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            forgot = _state.this_process.state is None and _state.training.micro_step == 0
            fresh = ak.state()
            ok = forgot and fresh is not parent and fresh.options.precision == "no" and fresh.pid == os.getpid()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1" and status == 0
    os.close(read)
    assert ak.state() is parent


def test_adopts_a_group_the_user_created() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        st = ak.state()
        assert st.backend == "gloo" and st.launcher == "user" and st.world_size == 1
        ak.reset_state()
        assert dist.is_initialized(), "a group accelkit did not create is the user's to destroy"
    finally:
        dist.destroy_process_group()


def test_unsupported_accelerator_says_what_is_missing(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")  # the accelerator is looked for only when the CPU is not asked for
    from accelkit._backends.cuda import CUDABackend

    monkeypatch.setattr(CUDABackend, "is_available", lambda self: False)  # a GPU machine, too, looks further
    fake = os.path.join(str(tmp_path), "torch_xla")
    os.makedirs(fake)
    open(os.path.join(fake, "__init__.py"), "w").close()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ak.ConfigurationError, match=r"xla.*not wired up.*cpu=True"):
        ak.state()
    assert ak.init(cpu=True).device == torch.device("cpu")
    assert "torch_xla" not in sys.modules


def test_counting_the_gpus_for_a_launch_leaves_the_cuda_driver_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.is_available() initialises the driver (unless PYTORCH_NVML_BASED_CUDA_CHECK=1), and a notebook
    # process that did cannot fork workers that use CUDA; device_count() asks NVML.
    from accelkit._backends import local_device_count

    def initialises_the_driver() -> bool:
        raise AssertionError("torch.cuda.is_available() was called")

    monkeypatch.setattr(torch.cuda, "is_available", initialises_the_driver)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_device_count() == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELKIT_CPU")  # the suite pins the CPU; this test is about the GPU
    st = ak.state()
    assert st.device == torch.device("cuda", 0) and st.backend == "nccl"
