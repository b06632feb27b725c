"""Experiment tracking (TensorBoard, CSV, JSONL, W&B, MLflow) and progress bars, written by the main process.

``ak.init_trackers`` starts the runs, ``ak.log`` records numbers, ``ak.end_training`` closes
them; ``ak.progress`` draws a bar on the local main process. No tracker library and no tqdm is
imported until it is used.
"""

from ._api import Trackers, end_training, get_tracker, init_trackers, log
from ._progress import ProgressBar, progress

__all__ = ["ProgressBar", "Trackers", "end_training", "get_tracker", "init_trackers", "log", "progress"]
