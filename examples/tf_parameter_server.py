"""TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial, custom loop, ported to loom.

https://www.tensorflow.org/tutorials/distribute/parameter_server_training: the chief builds
the model under ``strategy.scope()``, a ``ClusterCoordinator`` gives each worker its own
dataset (``create_per_worker_dataset``), schedules ``step_fn`` on the workers with the
per-worker iterator, joins at each epoch's end and fetches the final loss. The data is the
tutorial's own synthetic one (three words of seven; the label says whether "avenger" is
among them), and the model its embedding of 16,384 per word, averaged, then a sigmoid unit.

Differences, each one line: every process runs this script (loom is SPMD; the chief
coordinates, the workers run the scheduled steps); the accuracy lives on the coordinator,
so a step returns its counts and the coordinator adds what it fetches (a metric updated on
a worker stays on that worker); the tutorial's RMSprop(0.1) is Adagrad(0.001), which loom's
servers run exactly (a first step of 0.1 per weight moves the 16,384-wide unit's output by
hundreds, so a run can saturate the sigmoid and stall).

One machine: the chief and two workers, two servers:

    loom run --ps 2 --workers 3 examples/tf_parameter_server.py

Or TF's cluster: each task its own ``loom run`` with the same LOOM_PS_TOKEN and its TF_CONFIG:

    export TF_CONFIG='{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                       "ps": ["host3:2222"]}, "task": {"type": "chief", "index": 0}}'
    loom run examples/tf_parameter_server.py
"""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F
from torch import nn

import loom

NUM_EPOCHS = int(os.environ.get("TF_EXAMPLE_EPOCHS", "4"))
STEPS_PER_EPOCH = int(os.environ.get("TF_EXAMPLE_STEPS", "5"))
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]


def feature_and_label_gen(num_examples: int = 200) -> dict[str, list[list[str]]]:
    examples: dict[str, list[list[str]]] = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


def feature_preprocess_stage(words: list[list[str]]) -> torch.Tensor:
    """Keras' StringLookup(vocabulary=feature_vocab): index 0 for a word out of the vocabulary."""
    return torch.tensor([[feature_vocab.index(w) + 1 if w in feature_vocab else 0 for w in row] for row in words])


def label_preprocess_stage(labels: list[list[str]]) -> torch.Tensor:
    """Keras' StringLookup(vocabulary=label_vocab, num_oov_indices=0)."""
    return torch.tensor([float(label_vocab.index(row[0])) for row in labels])


def dataset_fn(_):
    """``from_tensor_slices(examples).map(...).shuffle(200).batch(32).repeat()``."""
    features, labels = feature_preprocess_stage(examples["features"]), label_preprocess_stage(examples["label"])
    while True:
        order = torch.randperm(len(labels))
        for start in range(0, len(order), 32):
            batch = order[start : start + 32]
            yield {"features": features[batch]}, labels[batch]


class Model(nn.Module):
    """``Input(shape=(3,))`` -> ``Embedding(8, 16384)`` -> mean over the words -> ``Dense(1, "sigmoid", L2(1e-4))``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb_layer = nn.Embedding(len(feature_vocab) + 1, 16384)
        self.dense = nn.Linear(16384, 1)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.dense(self.emb_layer(inputs["features"]).mean(1))).squeeze(1)

    @property
    def losses(self) -> list[torch.Tensor]:
        return [1e-4 * self.dense.weight.square().sum()]  # the Dense layer's kernel_regularizer


class Accuracy:
    """``tf.keras.metrics.Accuracy`` on the coordinator: ``update_state`` takes the counts a step returned."""

    def __init__(self) -> None:
        self.reset_states()

    @staticmethod
    def counts(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float((labels == predictions).sum()), float(len(labels))])

    def update_state(self, counts: torch.Tensor) -> None:
        self.total += counts

    def result(self) -> float:
        return float(self.total[0] / self.total[1]) if self.total[1] else 0.0

    def reset_states(self) -> None:
        self.total = torch.zeros(2)


random.seed(0)
examples = feature_and_label_gen()
strategy = loom.ParameterServerStrategy()
with strategy.scope():
    model = Model()
model, optimizer = strategy.prepare(model, lambda params: torch.optim.Adagrad(params, lr=0.001))
accuracy = Accuracy()


def step_fn(iterator):
    def replica_fn(batch_data, labels):
        pred = model(batch_data)
        per_example_loss = F.binary_cross_entropy(pred, labels, reduction="none")
        loss = loom.compute_average_loss(per_example_loss)
        model_losses = model.losses
        if model_losses:
            loss += sum(model_losses)  # tf.nn.scale_regularization_loss: one replica a step, as in TF here
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        actual_pred = (pred > 0.5).float()
        return loss.detach(), Accuracy.counts(labels, actual_pred)

    batch_data, labels = next(iterator)
    losses, counts = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(loom.ReduceOp.SUM, losses, axis=None), counts


coordinator = loom.ClusterCoordinator(strategy)


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

for i in range(NUM_EPOCHS):
    accuracy.reset_states()
    scheduled = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(STEPS_PER_EPOCH)]
    # Wait at epoch boundaries.
    coordinator.join()
    for _, counts in coordinator.fetch(scheduled):
        accuracy.update_state(counts)
    strategy.print("Finished epoch %d, accuracy is %f." % (i, accuracy.result()))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
strategy.print("Final loss is %f" % loss.fetch()[0])
