"""Every contract case under one launched strategy; each replica saves its results.

    loom run --nproc 2 contract_job.py --strategy mirrored --dir DIR

DIR/reference must hold OneDevice's checkpoint; results go to DIR/results-<replica>.pt.
"""

import argparse
from pathlib import Path

import torch

import loom
from tests.contract.cases import CASES, run_case
from tests.contract.local_reference import OPTIONS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    directory = Path(args.dir)
    fixed = OPTIONS.get(args.strategy, {})  # local SGD and DiLoCo: a sync within the cases' 3 steps
    strategy = loom.get_strategy(args.strategy, timeout=60, **fixed)

    def make(**options):
        return loom.get_strategy(args.strategy, timeout=60, **fixed, **options)

    results = {}
    for name in CASES:
        try:
            results[name] = run_case(name, make, directory)
        except Exception as error:  # noqa: BLE001 - a failing case is reported by its test, not by the job
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            strategy.barrier()
    torch.save(results, directory / f"results-{strategy.replica_id}.pt")


if __name__ == "__main__":
    main()
