"""A device mesh of 4 gloo processes: memory per rank and step time, ``ak.prepare`` against torch by hand.

The model is a stack of transformer blocks (attention with its heads split under TP, the MLP
column- then row-wise); each layout is built twice in the same workers, on the same mesh: by
``ak.prepare`` (the mesh from the options) and by hand with torch's own calls
(``DistributedDataParallel``; ``fully_shard`` over ``init_device_mesh``; HSDP's 2-D mesh;
``parallelize_module`` then ``fully_shard``).

- Memory: parameters + gradients + Adam's state held by each rank, from the tensors' local
  sizes (exact), for DDP, FSDP, HSDP 2x2 and FSDP x TP 2x2; the rank's figure against torch's.
- Step time (FSDP x TP 2x2 and HSDP 2x2): forward, backward, Adam step, zero_grad, in turn with
  the hand-written loop on the same batches (paired: the machine's load falls on both); the
  per-step medians of rank 0, and their ratio (hand-written / accelkit: >= 1 is accelkit faster),
  which of the two goes first alternating from step to step.

Run alone: ``python bench/mesh.py [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, paired_row

WIDTH, HEADS, BLOCKS, SEQ, BATCH = 256, 8, 4, 32, 4
MB = 1e6
PLAN = {f"blocks.*.{n}": "colwise" for n in ("q", "k", "v", "up")} | {
    "blocks.*.out": "rowwise",
    "blocks.*.down": "rowwise",
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "DDP": {"strategy": "ddp"},
    "FSDP": {"strategy": "fsdp", "fsdp_wrap": ("Block",)},
    "HSDP 2x2": {"dp_replicate": 2, "dp_shard": 2, "fsdp_wrap": ("Block",)},
    "FSDP x TP 2x2": {"dp_shard": 2, "tp": 2, "fsdp_wrap": ("Block",)},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _by_hand(layout: str, mesh: Any) -> nn.Module:
    """The layout with torch's own calls, on ``mesh`` (accelkit's, so that both use the same groups)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _net()
    if layout == "DDP":
        return nn.parallel.DistributedDataParallel(model)
    if layout == "FSDP x TP 2x2":
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {f"blocks.{i}.{k.split('.')[-1]}": styles[v]() for i in range(BLOCKS) for k, v in PLAN.items()}
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh["dp_shard"]
    else:
        dp = mesh["dp_replicate", "dp_shard"] if layout == "HSDP 2x2" else mesh
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _local_mb(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    held = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    held += sum(size(v) for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return held / MB


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, prepared: bool) -> float:
    import accelkit as ak

    start = time.perf_counter()
    loss = model(x).pow(2).mean()
    if prepared:
        ak.backward(loss)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def measure(layout: str, steps: int) -> dict[str, Any]:
    """In each worker: the layout by accelkit and by hand; memory after a step, then ``steps`` paired steps."""
    import accelkit as ak

    ak.init(**LAYOUTS[layout])
    ours = _net()
    opt = torch.optim.Adam(ours.parameters(), lr=1e-4)
    ours, opt = ak.prepare(ours, opt, tp_plan=PLAN)
    mesh = ak.mesh()
    theirs = _by_hand(layout, mesh)
    their_opt = torch.optim.Adam(theirs.parameters(), lr=1e-4)
    dp_rank = ak.rank() // 2 if layout == "FSDP x TP 2x2" else ak.rank()  # a tp group shares its batch
    g = torch.Generator().manual_seed(dp_rank)
    batches = [torch.randn(BATCH, SEQ, WIDTH, generator=g) for _ in range(steps + 1)]
    ours_t, theirs_t = [], []
    for i, x in enumerate(batches):
        if i % 2:  # in turn which goes first: a cache warmed by the other falls on both
            b = _step(theirs, their_opt, x, False)
            a = _step(ours, opt, x, True)
        else:
            a = _step(ours, opt, x, True)
            b = _step(theirs, their_opt, x, False)
        if i == 0:  # after the first step the optimizer's state exists; zero_grad(set_to_none) freed the grads
            memory = (_local_mb(ours, opt), _local_mb(theirs, their_opt))
        else:
            ours_t.append(a)
            theirs_t.append(b)
    return {"memory": memory, "ours": ours_t, "theirs": theirs_t}


def run(quick: bool) -> list[Row]:
    from accelkit.testing import WorkerPool

    steps = 4 if quick else 30
    rows: list[Row] = []
    with WorkerPool(4, task_timeout=900) as pool:
        for layout in LAYOUTS:
            results = pool.run(measure, layout, steps if layout in ("HSDP 2x2", "FSDP x TP 2x2") else 1)
            ours = [r["memory"][0] for r in results]
            theirs = [r["memory"][1] for r in results]
            # The same shards as torch's: within 1 % of its bytes per rank.
            rows.append(paired_row(f"{layout}: params + Adam state per rank", ours, theirs, 0.01 * min(theirs), "MB"))
            if layout in ("HSDP 2x2", "FSDP x TP 2x2"):
                a, b = results[0]["ours"], results[0]["theirs"]
                row = paired_row(f"{layout}: step time, rank 0", a, b, None, "s")
                row["speed"] = statistics.median(b) / statistics.median(a)  # >= 0.97: the goal
                rows.append(row)
    return rows


if __name__ == "__main__":
    for row in run("--quick" in sys.argv):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
