"""Training on a device mesh of 4 gloo CPU processes: HSDP 2x2, FSDP x TP 2x2 and TP alone, against one process.

One pool of 4 workers for the module; each task sets its mesh with ``ak.init`` (a pool task starts
with fresh options). The model is a small transformer (attention with its heads split, the MLP
column- then row-wise, see ``mesh_models.PLAN``); the reference is plain torch on one process with
the global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mesh_models import PLAN, make_net, tokens, train_on_mesh, train_reference
from torch_versions import needs_fsdp2_mean_on_cpu

import accelkit as ak
from accelkit.testing import WorkerPool

pytestmark = [pytest.mark.distributed, needs_fsdp2_mean_on_cpu]

MESHES = {
    "hsdp 2x2": ({"dp_replicate": 2, "dp_shard": 2}, 4),  # the sizes, and the data-parallel size
    "fsdp x tp 2x2": ({"dp_shard": 2, "tp": 2}, 2),
    "tp 4": ({"tp": 4}, 1),
}
BATCH, STEPS, ACCUMULATE = 2, 3, 2


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", list(MESHES))
def test_a_mesh_trains_to_the_one_process_parameters(pool4: WorkerPool, layout: str) -> None:
    sizes, dp = MESHES[layout]
    runs = pool4.run(train_on_mesh, BATCH, STEPS, ACCUMULATE, **sizes)
    ref = train_reference(BATCH * dp * ACCUMULATE, STEPS)
    for run in runs:
        assert_close(run["params"], ref["params"], atol=1e-5)
        torch.testing.assert_close(run["norms"], ref["norms"], atol=1e-5, rtol=0)  # the global norm, unclipped
        micro = run["losses"]  # reduced over the world: the mean of the data-parallel ranks' losses
        pairs = [sum(micro[i : i + ACCUMULATE]) / ACCUMULATE for i in range(0, len(micro), ACCUMULATE)]
        torch.testing.assert_close(pairs, ref["losses"], atol=1e-5, rtol=0)
        assert run["types"] == ["DTensor"] or layout == "tp 4"  # every parameter sharded (TP alone: the plan's)
    assert all(r["mesh"] == runs[0]["mesh"] for r in runs)
    names = {"hsdp 2x2": "(dp_replicate=2, dp_shard=2)", "fsdp x tp 2x2": "(dp_shard=2, tp=2)", "tp 4": "(tp=4)"}
    assert names[layout] in runs[0]["mesh"]
    # Who got which batch: the ranks of a tp group the same, the data-parallel ranks different ones.
    seen = [r["seen"] for r in runs]
    tp = sizes.get("tp", 1)
    for rank in range(4):
        assert seen[rank] == seen[rank - rank % tp], "a tp group shares its batches"
    firsts = [seen[rank] for rank in range(0, 4, tp)]
    assert len({str(s) for s in firsts}) == dp, "the data-parallel ranks see different batches"


def test_tensor_parallelism_splits_the_heads_and_the_mlp(pool4: WorkerPool) -> None:
    shapes = pool4.run(local_shapes)
    assert shapes[0]["blocks.0.attn.q.weight"] == [8, 16] and shapes[0]["blocks.0.attn.out.weight"] == [16, 8]
    assert shapes[0]["blocks.0.mlp.up.weight"] == [32, 16] and shapes[0]["blocks.0.mlp.down.weight"] == [16, 32]
    assert shapes[0]["embed.weight"] == [16, 16], "a module the plan leaves is replicated"


def local_shapes() -> dict[str, list[int]]:
    ak.init(tp=2, dp_replicate=2)  # FSDP2 over (dp_replicate=2, dp_shard=1): replicas, nothing more split
    model = ak.prepare(make_net(), tp_plan=PLAN)
    return {
        n: list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape) for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("layout", ["hsdp 2x2", "fsdp x tp 2x2"])
def test_bf16_on_a_mesh_follows_the_one_process_bf16_run(pool4: WorkerPool, layout: str) -> None:
    sizes, dp = MESHES[layout]
    runs = pool4.run(train_on_mesh, BATCH, 2, 1, "bf16", False, **sizes)
    ref = train_reference(BATCH * dp, 2, "bf16")
    fp32 = train_reference(BATCH * dp, 2)
    moved = max(float((ref["params"][n] - make_net().state_dict()[n]).abs().max()) for n in ref["params"])
    assert moved > 0.05, "training moved the weights"
    for run in runs:
        assert_close(run["params"], ref["params"], atol=2e-2)  # bf16 compute, summed in other orders
        torch.testing.assert_close(run["losses"], ref["losses"], atol=2e-2, rtol=0)
    assert any(not torch.allclose(runs[0]["params"][n], fp32["params"][n], atol=1e-6) for n in fp32["params"]), (
        "bf16 computed in bf16"
    )


def metrics_on_a_mesh(n: int, batch: int) -> dict[str, Any]:
    ak.init(dp_shard=2, tp=2)
    loader = ak.prepare(torch.utils.data.DataLoader(torch.arange(n), batch_size=batch))
    gathered, objects, ragged = [], [], []
    for x in loader:
        gathered.append(ak.gather_for_metrics(x).tolist())
        objects.extend(ak.gather_for_metrics([int(v) for v in x], use_gather_object=True))
        ragged.extend(ak.gather_for_metrics({"x": x, "two": x * 2})["x"].tolist())
    return {"len": len(loader), "gathered": gathered, "objects": objects, "ragged": ragged}


def test_metrics_count_each_sample_once_on_a_mesh(pool4: WorkerPool) -> None:
    for run in pool4.run(metrics_on_a_mesh, 11, 2):  # 11 samples on 2 data-parallel ranks of 2: padding at the end
        assert run["len"] == 3
        assert [x for batch in run["gathered"] for x in batch] == list(range(11))
        assert run["objects"] == list(range(11)) and run["ragged"] == list(range(11))


def reduce_and_gather_on_dp_group() -> tuple[list[float], float]:
    ak.init(dp_shard=2, tp=2)
    group = ak.mesh()["dp_shard"].get_group()  # type: ignore[index]
    x = torch.tensor([float(ak.rank())])
    return ak.gather(x, group=group).tolist(), float(ak.reduce(x, op="sum", group=group))  # type: ignore[call-arg]


def test_collectives_over_the_data_parallel_group(pool4: WorkerPool) -> None:
    results = pool4.run(reduce_and_gather_on_dp_group)
    assert results[0] == ([0.0, 2.0], 2.0) and results[1] == ([1.0, 3.0], 4.0)


def groups_of_the_mesh() -> dict[str, Any]:
    ak.init(dp_replicate=2, dp_shard=2, tp=1)
    import torch.distributed as dist

    mesh = ak.mesh()
    assert mesh is not None
    return {
        "names": mesh.mesh_dim_names,
        "shard": dist.get_process_group_ranks(mesh.get_group("dp_shard")),
        "replicate": dist.get_process_group_ranks(mesh.get_group("dp_replicate")),
        "strategy": ak.strategy(),
    }


def test_the_mesh_names_its_dimensions(pool4: WorkerPool) -> None:
    runs = pool4.run(groups_of_the_mesh)
    assert runs[0] == {"names": ("dp_replicate", "dp_shard"), "shard": [0, 1], "replicate": [0, 2], "strategy": "fsdp"}
    assert runs[3]["shard"] == [2, 3] and runs[3]["replicate"] == [1, 3]


def pickled_state_under_tensor_parallelism() -> list[int]:
    import pickle

    ak.init(tp=4)
    loader = ak.prepare(torch.utils.data.DataLoader(range(6), batch_size=2))  # forms the data-parallel groups
    copy = pickle.loads(pickle.dumps(ak.state()))  # ak.state() pickles, whatever groups its strategy formed
    assert copy.strategy.sizes == ak.state().strategy.sizes  # type: ignore[attr-defined]
    return [x for batch in loader for x in batch.tolist()]


def test_tensor_parallelism_alone_gives_every_rank_every_batch(pool4: WorkerPool) -> None:
    assert pool4.run(pickled_state_under_tensor_parallelism) == [list(range(6))] * 4


def test_one_process_has_no_mesh_and_keeps_the_plan_checked() -> None:
    assert ak.mesh() is None
    model = ak.prepare(make_net(), tp_plan=PLAN, activation_checkpointing=["Block"])
    x, _ = tokens()[:2]
    model(x).sum().backward()  # recomputed blocks still give gradients
    assert all(p.grad is not None for p in model.parameters())


def prepare_without_a_plan() -> str:
    ak.init(dp_shard=2, tp=2)
    try:
        ak.prepare(make_net())
    except ak.ConfigurationError as exc:
        return str(exc)
    return "prepared"


def test_tensor_parallelism_without_a_plan_is_refused_saying_how(pool4: WorkerPool) -> None:
    for message in pool4.run(prepare_without_a_plan):
        assert message.startswith("accelkit.prepare(Net): tp=2 splits each layer over 2 processes, and this model")
        assert "pass tp_plan, e.g. ak.prepare(model, tp_plan=" in message


def test_fp16_on_a_mesh_scales_unscales_and_steps(pool4: WorkerPool) -> None:
    runs = pool4.run(train_on_mesh, BATCH, 2, 1, "fp16", False, dp_shard=2, tp=2)
    ref = train_reference(BATCH * 2, 2)  # fp32: fp16's gradients, unscaled before clipping, come close
    for run in runs:
        assert_close(run["params"], ref["params"], atol=2e-2)
        torch.testing.assert_close(run["norms"], ref["norms"], atol=2e-2, rtol=0)
