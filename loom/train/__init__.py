"""The training loop, its callbacks and metrics."""

from loom.train.callbacks import Callback, EarlyStopping, FitState, ProgressBar, TensorBoard
from loom.train.fit import evaluate, fit
from loom.train.metrics import METRICS, accuracy

__all__ = ["METRICS", "Callback", "EarlyStopping", "FitState", "ProgressBar", "TensorBoard", "accuracy", "evaluate", "fit"]
