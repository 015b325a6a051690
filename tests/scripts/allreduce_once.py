"""The smallest whole job: join, one all-reduce, leave. Used to check clean teardown."""

import torch

import loom


def main() -> None:
    strategy = loom.MirroredStrategy()
    total = strategy.reduce(torch.ones(1), "sum")
    assert int(total) == strategy.num_replicas_in_sync, total


if __name__ == "__main__":
    loom.launch(main)
