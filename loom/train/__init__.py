"""The training loop, its callbacks and metrics."""

from loom.train.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    FitState,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    ReduceLROnPlateau,
    TensorBoard,
)
from loom.train.fit import evaluate, fit
from loom.train.metrics import METRICS, accuracy
from loom.train.predict import predict

__all__ = [
    "METRICS",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "FitState",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgressBar",
    "ReduceLROnPlateau",
    "TensorBoard",
    "accuracy",
    "evaluate",
    "fit",
    "predict",
]
