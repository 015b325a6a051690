"""Every contract case under each of the named strategies, in one launched job; each replica saves its results.

    loom run --nproc 2 contract_job.py --strategy mirrored,sharded --dir DIR

Strategies that run on the same processes share one launch (a process importing torch costs
seconds). DIR/<strategy>/reference must hold OneDevice's checkpoint; results go to
DIR/<strategy>/results-<replica>.pt.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import loom
from tests.contract.cases import CASES, run_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    for name in args.strategy.split(","):
        run_strategy(name, Path(args.dir) / name)


def run_strategy(strategy_name: str, directory: Path) -> None:
    strategy = loom.get_strategy(strategy_name, timeout=60)

    def make(**options):
        return loom.get_strategy(strategy_name, timeout=60, **options)

    results = {}
    for name in CASES:
        try:
            results[name] = run_case(name, make, directory)
        except Exception as error:  # noqa: BLE001 - a failing case is reported by its test, not by the job
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            strategy.barrier()
    torch.save(whole(results), directory / f"results-{dist.get_rank()}.pt")  # tensor-parallel ranks share a replica


def whole(value):
    """Results with every DTensor (a sharded or tensor-parallel weight) gathered into a plain tensor."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(whole(v) for v in value)
    return value


if __name__ == "__main__":
    main()
