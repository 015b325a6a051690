"""Every contract case under each of the named strategies, in one launched job; each replica saves its results.

    loom run --nproc 2 contract_job.py --strategy mirrored,sharded --dir DIR
    loom run --groups 2 --nproc 1 contract_job.py --strategy fault_tolerant,fault_tolerant_sharded --dir DIR

Strategies that run on the same processes share one launch (a process importing torch costs
seconds). DIR/<strategy>/reference must hold OneDevice's checkpoint; results go to
DIR/<strategy>/results-<replica>.pt. Replica groups' strategies each train one model: a case's
strategy leaves the groups before the next one is made, in every group at the same point.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import loom
from loom.comm.groups import GROUP_ENV
from tests.contract.cases import CASES, run_case
from tests.contract.local_reference import OPTIONS as LOCAL_OPTIONS
from tests.contract.local_reference import EPOCH_ROUNDS, OUTER, REGISTERED, resume


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    for name in args.strategy.split(","):
        run_strategy(name, Path(args.dir) / name)


# What a strategy needs to run on the contract's two processes: Hybrid's mesh (tensor parallel, then FSDP over a replica of one).
OPTIONS = {"hybrid": {"mesh": {"dp": 1, "tp": 2}}, **LOCAL_OPTIONS}  # and local SGD/DiLoCo: a sync within the cases' 3 steps


def run_strategy(strategy_name: str, directory: Path) -> None:
    registered = REGISTERED.get(strategy_name, strategy_name)
    strategy = loom.get_strategy(registered, timeout=60, **OPTIONS.get(strategy_name, {}))

    made = [strategy]  # the last one made

    def make(**options):
        if hasattr(made[0], "leave"):  # replica groups: one strategy at a time
            made[0].leave()
        made[0] = loom.get_strategy(registered, timeout=60, **OPTIONS.get(strategy_name, {}), **options)
        return made[0]

    results = {}
    for name in CASES:
        try:
            results[name] = run_case(name, make, directory)
        except Exception as error:  # noqa: BLE001 - a failing case is reported by its test, not by the job
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            strategy.barrier()
    if strategy_name in OUTER and strategy_name not in EPOCH_ROUNDS:  # DiLoCo's outer momentum goes on from a checkpoint (replica groups': their own test)
        results["resume"] = resume(make, directory / "resume")
    if not dist.is_initialized():  # one process driving every device (TPUStrategy)
        torch.save(results, directory / "results-0.pt")
        return
    if hasattr(made[0], "leave"):
        made[0].leave()
    replica = int(os.environ.get(GROUP_ENV, 0)) * dist.get_world_size() + dist.get_rank()  # a pipeline's processes share replica 0
    torch.save(complete(_full(results)), directory / f"results-{replica}.pt")


def complete(results: dict) -> dict:
    """Each process's results with the tensors it does not hold (meta: another pipeline stage's) from the one that does."""
    held = {case: {key: {n: t for n, t in v.items() if not t.is_meta} for key, v in got.items() if _tensors(v)} for case, got in results.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    for case, got in results.items():
        for key, value in got.items():
            if _tensors(value):
                got[key] = {n: next(o[case][key][n] for o in everyone if n in o[case][key]) if t.is_meta else t for n, t in value.items()}
    return results


def _tensors(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(t, torch.Tensor) for t in value.values())


def _full(value):
    """Sharded strategies' tensors (DTensors) gathered whole, as every replica's results hold them."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value


if __name__ == "__main__":
    main()
