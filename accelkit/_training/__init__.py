"""The training loop: ``prepare``, ``precision``, ``backward``, ``accumulate``, clipping, ``unwrap``, local SGD."""

from ._clip import clip_grad_norm_, clip_grad_value_
from ._local_sgd import LocalSGD, local_sgd
from ._optim import PreparedOptimizer, PreparedScheduler, check_schedules
from ._precision import precision
from ._prepare import prepare
from ._step import accumulate, backward, no_sync, sync_gradients, unwrap

__all__ = [
    "LocalSGD",
    "PreparedOptimizer",
    "PreparedScheduler",
    "accumulate",
    "backward",
    "check_schedules",
    "clip_grad_norm_",
    "clip_grad_value_",
    "local_sgd",
    "no_sync",
    "precision",
    "prepare",
    "sync_gradients",
    "unwrap",
]
