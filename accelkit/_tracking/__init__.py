"""Experiment tracking (TensorBoard, CSV, JSONL, W&B, MLflow), progress bars and profiling traces.

``ak.init_trackers`` starts the runs, ``ak.log`` records numbers, ``ak.end_training`` closes
them; ``ak.progress`` draws a bar on the local main process; ``ak.profile`` writes a
``torch.profiler`` trace per rank. No tracker library and no tqdm is imported until it is used.
"""

from ._profile import profile
from ._progress import ProgressBar, progress
from ._registry import KINDS, installed_versions
from ._run import Trackers, end_training, get_tracker, init_trackers, log

__all__ = [
    "KINDS",
    "ProgressBar",
    "Trackers",
    "end_training",
    "get_tracker",
    "init_trackers",
    "installed_versions",
    "log",
    "profile",
    "progress",
]
