"""Runners: each strategy runs every contract case once, in one launched job, shared by the tests."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import loom
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.contract import cases
from tests.contract.cases import CASES, run_case, save_reference
from tests.helpers import SCRIPTS, free_port, job_env, loom_run, run, start_nodes, wait_all

SCRIPT = str(SCRIPTS / "contract_job.py")
STRATEGIES = ["one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "sharded", "pipeline", "tensor_parallel", "hybrid", "local_sgd", "diloco", "diloco_overlap"]
if importlib.util.find_spec("torchax") is not None:  # the xla extra
    STRATEGIES.append("tpu")
# Strategies run by one `loom run --nproc 2` job, one after another in the same two processes.
ON_TWO_LOCAL_PROCESSES = ["mirrored", "sharded", "pipeline", "tensor_parallel", "hybrid", "local_sgd", "diloco", "diloco_overlap"]
# Replica groups' strategies, run by `loom run --groups 2 --nproc 1` jobs: two groups of one process. DiLoCo's job
# runs beside the others' (each case starts a new job of the groups, which waits out the last one's heartbeats).
ON_TWO_GROUPS = ["fault_tolerant", "fault_tolerant_sharded"]
ON_TWO_GROUPS_DILOCO = ["fault_tolerant_diloco"]
if importlib.util.find_spec("torchft") is not None:  # the ft extra
    STRATEGIES += ON_TWO_GROUPS + ON_TWO_GROUPS_DILOCO
JOBS = {"two_local_processes": ON_TWO_LOCAL_PROCESSES, "two_groups": ON_TWO_GROUPS, "two_groups_diloco": ON_TWO_GROUPS_DILOCO}


def _job(strategy: str) -> str:
    """The launched job that runs ``strategy``'s cases."""
    return next((job for job, names in JOBS.items() if strategy in names), strategy)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of one job share one xdist worker, which runs the job once; other jobs run beside it."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            strategy = item.callspec.params.get("strategy", "one_device") if hasattr(item, "callspec") else "one_device"
            item.add_marker(pytest.mark.xdist_group(f"contract_{_job(strategy)}"))


def _one_device(directory: Path) -> list[dict[str, Any]]:
    make = lambda **options: loom.OneDeviceStrategy(**options)  # noqa: E731
    results = {}
    for name in CASES:
        try:
            results[name] = run_case(name, make, directory)
        except Exception as error:  # noqa: BLE001 - reported by the case's tests, as a launched job's are
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return [results]


def _launched(root: Path, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every strategy in ``names`` in one job; ``root/<name>`` holds each one's results."""
    job = [SCRIPT, "--strategy", ",".join(names), "--dir", str(root)]
    if names == ["multi_worker_mirrored"]:  # two nodes of one process each
        for code, _, err in wait_all(start_nodes(2, 1, job), timeout=240):
            assert code == 0, err[-3000:]
    else:
        processes = ["--groups", "2", "--nproc", "1"] if names[0].startswith("fault_tolerant") else ["--nproc", "2"]
        done = loom_run(["run", *processes, "--timeout", "60", *job], timeout=120 + 120 * len(names))
        assert done.returncode == 0, done.stderr[-3000:]
    return {name: [torch.load(root / name / f"results-{r}.pt", weights_only=True) for r in range(2)] for name in names}


def _parameter_servers(directory: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Two synchronous workers (threads) on two fresh in-process servers for each case.

    The threads share torch's global generator: each model is seeded and built under a lock,
    or their draws interleave and the workers start from other weights than OneDevice's; and a
    case builds its models before it loads data (the loader seeds that generator per batch).
    """
    build, seeded, lock = cases.mlp, cases._seeded_per_rank, threading.Lock()

    def seeded_mlp() -> torch.nn.Module:
        with lock:
            return build()

    def seeded_per_rank(model: Any) -> torch.nn.Module:
        with lock:
            return seeded(model)

    monkeypatch.setattr(cases, "mlp", seeded_mlp)
    monkeypatch.setattr(cases, "_seeded_per_rank", seeded_per_rank)
    results: list[dict[str, Any]] = [{}, {}]
    for name in CASES:
        servers = [ParameterServer("contract") for _ in range(2)]
        addresses = [f"127.0.0.1:{s.serve(free_port())}" for s in servers]

        def work(worker: int, name: str = name, addresses: list[str] = addresses) -> None:
            make = lambda **o: ParameterServerStrategy(addresses, token="contract", worker=worker, num_workers=2, synchronous=True, **o)  # noqa: E731
            try:
                results[worker][name] = run_case(name, make, directory)
            except Exception as error:  # noqa: BLE001 - reported by the case's test
                results[worker][name] = {"error": f"{type(error).__name__}: {error}"}

        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(2)]
        for t in threads:
            t.start()
        for w, t in enumerate(threads):
            t.join(timeout=30)
            results[w].setdefault(name, {"error": "TimeoutError: the case did not finish within 30 s"})
        for s in servers:
            s.stop()
    return results


def _tpu(directory: Path) -> list[dict[str, Any]]:
    """TPUStrategy in one process driving 8 virtual XLA CPU devices (set before JAX is imported)."""
    done = run([sys.executable, SCRIPT, "--strategy", "tpu", "--dir", str(directory.parent)], timeout=600,
               env=job_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}))
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(directory / "results-0.pt", weights_only=True)]


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("contract")
    return root, save_reference(root / "reference")


@pytest.fixture(scope="session")
def contract_results(reference_checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> Any:
    """``contract_results(strategy)``: every replica's results, each strategy run once per session."""
    root, _ = reference_checkpoint
    cache: dict[str, list[dict[str, Any]]] = {}

    def directory(name: str) -> Path:
        path = root / name
        path.mkdir()
        (path / "reference").symlink_to(root / "reference")
        return path

    def get(name: str) -> list[dict[str, Any]]:
        if name not in cache:
            if name == "one_device":
                cache[name] = _one_device(directory(name))
            elif name == "tpu":
                cache[name] = _tpu(directory(name))
            elif name == "parameter_server":
                with pytest.MonkeyPatch.context() as patch:
                    cache[name] = _parameter_servers(directory(name), patch)
            else:
                together = JOBS.get(_job(name), [name])
                for each in together:
                    directory(each)
                cache.update(_launched(root, together))
        return cache[name]

    return get
