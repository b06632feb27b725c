"""A small transformer and its tensor-parallel plan, for the device-mesh tests, with a one-process reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import accelkit as ak

VOCAB, WIDTH, HEADS, SEQ = 16, 16, 4, 6

# Attention with its heads split (q, k, v column-wise, out row-wise), the MLP column- then row-wise.
PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = WIDTH // HEADS  # the heads this rank holds: -1 (all of them on one process, HEADS / tp on a mesh)
        q, k, v = (p(x).view(b, s, -1, head).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def tokens(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole (DTensors all-gathered: every rank must call it), detached, fp32."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in ak.unwrap(model).named_parameters()}


def train_on_mesh(
    batch: int,
    steps: int,
    accumulate: int,
    precision: str = "no",
    checkpointed: bool = True,
    params: Callable[[nn.Module], dict[str, Any]] = full_params,
    **mesh: Any,
) -> dict[str, Any]:
    """Trains ``Net`` on the mesh ``mesh`` (ak.init's sizes) with accelkit: the loader sharded, the
    gradients accumulated and clipped, the loss reduced; every rank's view (``params`` reads the
    parameters: whole by default)."""
    ak.init(precision=precision, fsdp_wrap=("Block",), **mesh)  # type: ignore[arg-type]
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = torch.utils.data.DataLoader(tokens(), batch_size=batch)
    model, opt, loader = ak.prepare(
        model, opt, loader, tp_plan=PLAN, activation_checkpointing=("Block",) if checkpointed else ()
    )
    norms, losses, seen = [], [], []
    for step, (x, y) in enumerate(loader):
        if step == steps * accumulate:
            break
        seen.append(x[:, 0].tolist())
        with ak.accumulate(model, steps=accumulate):
            loss = loss_of(model, x, y)
            ak.backward(loss)
            if ak.sync_gradients():
                norms.append(float(ak.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        losses.append(float(ak.reduce(loss.detach(), op="mean")))
    return {
        "params": params(model),
        "norms": norms,
        "losses": losses,
        "seen": seen,
        "types": sorted({type(p).__name__ for p in ak.unwrap(model).parameters()}),
        "mesh": str(ak.mesh()),
    }


def train_reference(batch: int, steps: int, precision: str = "no") -> dict[str, Any]:
    """The independent reference: one process, plain torch, the global batch (``batch`` = per-rank x dp x steps)."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    norms, losses = [], []
    for step, (x, y) in enumerate(torch.utils.data.DataLoader(tokens(), batch_size=batch)):
        if step == steps:
            break
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(model, x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms, "losses": losses}
