"""``make gpu-check``: the contract's equivalence on CUDA with NCCL, and the GPT benchmark.

    python -m tests.gpu_check [--out bench/results/gpu_check.json]

1. Every contract case under OneDeviceStrategy on the GPU equals the same case on the CPU
   (TF32 off, so float32 matmuls are float32 on both sides).
2. With two GPUs or more, the contract suite's equivalence rows, whose launched jobs then run
   one process per GPU over NCCL; with one GPU, Mirrored, Sharded and local SGD in a
   one-process NCCL job against OneDevice on the CPU
3. ``bench/gpt.py`` with the strategies that fit the GPUs present.

On a machine without CUDA it says so in one line and exits 0, so the target is safe anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # cuBLAS and the CPU sum in other orders; 1e-5 is the CPU contract's bound between processes
ONE_PROCESS = ["mirrored", "sharded", "local_sgd"]  # one process equals one device (DiLoCo's outer step does not)
EQUIVALENCE_ROWS = "equals_one_device or eager_loop_and_accumulation or mixed_precision or moves_between_strategies"


def one_device_results(directory: Path) -> dict[str, Any]:
    """Every contract case under OneDevice in this process (on the GPU unless CUDA is hidden)."""
    import loom
    from tests.contract.cases import CASES, run_case, save_reference

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    save_reference(directory / "reference")
    make = lambda **options: loom.OneDeviceStrategy(**options)  # noqa: E731
    results = {}
    for name in CASES:
        try:
            results[name] = _cpu(run_case(name, make, directory))
        except Exception as error:  # one failing case must not hide the others' figures
            traceback.print_exc()
            results[name] = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    return results


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu(v) for v in value]
    return value


def difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between two cases' weights (0 for cases without weights)."""
    if "weights" not in a or "weights" not in b:
        return 0.0
    return max((a["weights"][k].double() - b["weights"][k].double()).abs().max().item() for k in a["weights"])


def _env() -> dict[str, str]:
    """This environment with the repository first on the path (and whatever the path held kept)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cpu_reference(directory: Path) -> dict[str, Any]:
    """The same cases with CUDA hidden, in a process of their own."""
    out = directory / "cpu.pt"
    code = f"import torch; from pathlib import Path; from tests.gpu_check import one_device_results; torch.save(one_device_results(Path({str(directory)!r})), {str(out)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**_env(), "CUDA_VISIBLE_DEVICES": ""})
    return torch.load(out, weights_only=True)


def check_one_device(work: Path) -> dict[str, float]:
    (work / "gpu").mkdir()
    (work / "cpu").mkdir()
    gpu, cpu = one_device_results(work / "gpu"), cpu_reference(work / "cpu")
    return {name: gpu[name].get("failed") or difference(gpu[name], cpu[name]) for name in gpu if "error" not in gpu[name]}


def check_launched(work: Path, gpus: int) -> dict[str, Any]:
    env = _env()
    if gpus >= 2:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/contract", "-k", EQUIVALENCE_ROWS], cwd=ROOT, env=env)
        return {"contract_rows_on_2_gpus": "passed" if done.returncode == 0 else f"failed (pytest exit {done.returncode})"}
    from tests.contract.cases import save_reference

    for name in ONE_PROCESS:
        (work / name).mkdir(parents=True)
        save_reference(work / name / "reference")
    job = [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", "1", "--timeout", "120",
           str(ROOT / "tests/scripts/contract_job.py"), "--strategy", ",".join(ONE_PROCESS), "--dir", str(work)]  # fmt: skip
    subprocess.run(job, check=True, cwd=ROOT, env=env)
    reference = torch.load(work / "cpu" / "cpu.pt", weights_only=True)
    found = {}
    for name in ONE_PROCESS:
        got = torch.load(work / name / "results-0.pt", weights_only=True, map_location="cpu")
        found[name] = {case: got[case].get("error") or difference(got[case], reference[case]) for case in ("sgd_momentum", "adamw_weight_decay", "clipping")}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results/gpu_check.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}", flush=True)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        one = check_one_device(work)
        print("OneDevice on CUDA against the CPU, largest weight difference per case:", json.dumps(one, indent=1), flush=True)
        failures += [f"one_device {case}: {d if isinstance(d, str) else f'{d:.2e}'}" for case, d in one.items() if isinstance(d, str) or d > TOLERANCE]
        try:
            launched = check_launched(work, gpus)
        except Exception as error:  # still run the benchmark
            traceback.print_exc()
            launched = {"launch": f"failed: {type(error).__name__}: {error}"}
        print("launched on NCCL:", json.dumps(launched, indent=1), flush=True)
        for name, got in launched.items():
            if isinstance(got, str):
                failures += [] if got == "passed" else [f"{name}: {got}"]
            else:
                failures += [f"{name} {case}: {d if isinstance(d, str) else f'{d:.2e}'}" for case, d in got.items() if isinstance(d, str) or d > TOLERANCE]
    strategies = ["mirrored", "sharded", "pipeline", "tensor_parallel"] if gpus >= 2 else []
    start = time.perf_counter()
    bench = subprocess.run([sys.executable, "bench/gpt.py", "--strategies", *strategies], cwd=ROOT)  # raw PyTorch and OneDevice always
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                          "nccl": ".".join(map(str, torch.cuda.nccl.version())), "one_device_vs_cpu": one,
                                          "launched": launched, "bench_gpt_exit": bench.returncode, "bench_gpt_s": time.perf_counter() - start,
                                          "failures": failures}, indent=1))  # fmt: skip
    for failure in failures:
        print(f"gpu-check: FAILED {failure} (tolerance {TOLERANCE})")
    print(f"gpu-check: {'passed' if not failures and bench.returncode == 0 else 'failed'}; results in {args.out}")
    return 1 if failures or bench.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
