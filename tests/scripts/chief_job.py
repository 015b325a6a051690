"""``loom run --nproc 2 chief_job.py KIND``: each rank says whether it is the chief, after the
strategy has shown the job's first line (its replicas and model-parallel degrees)."""

import sys

import torch
from torch.utils.data import TensorDataset

import loom


def main() -> None:
    kind = sys.argv[1]
    strategy = {"tensor": loom.TensorParallelStrategy, "pipeline": loom.PipelineStrategy}[kind]()
    strategy.distribute(TensorDataset(torch.zeros(8, 2)), batch_size=4)
    strategy.print("printed once")
    print(f"is_chief={strategy.is_chief}", flush=True)


if __name__ == "__main__":
    main()
