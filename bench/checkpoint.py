"""Checkpoint speed: loom's DCP-based save and restore against torch.save / torch.load.

    python bench/checkpoint.py [--mb 500] [--repeats 5] [--verify-only]

About 500 MB of state: an MLP's parameters plus Adam's two moments (three times the
parameters). Measured in one process, and in two (MirroredStrategy: each rank writes half,
against torch.save from rank 0, the usual DDP practice). ``durable`` saves fsync every file
before the commit (loom's default); torch.save does not fsync, so both are shown with and
without it. Contenders run in turns, median of the repeats. Also: how much slower training steps run while an asynchronous save is being
written, the time from process start to the first step when resuming, and what checking the
files' SHA-256 digests costs: a restore against the same checkpoint with its digests left out
of ``COMMITTED`` (read as one saved before digests: sizes checked only), and the hashing a
commit does against the whole save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import save  # noqa: E402

import loom  # noqa: E402
from loom import compat  # noqa: E402
from loom.checkpoint import Checkpointer, layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_state(megabytes: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose parameters and Adam moments add up to ``megabytes``, with Adam's state filled."""
    width = int((megabytes * 2**20 / 4 / 3 / 4) ** 0.5)  # four width x width layers, x3 for Adam
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turns so the machine's slow spells hit all of them."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            os.sync()  # earlier runs' dirty pages are not this run's work
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def one_process(megabytes: float, repeats: int, work: Path) -> dict[str, Any]:
    model, opt = make_state(megabytes)
    size = state_bytes(model, opt)
    plain = work / "torch.pt"

    def torch_save(sync: bool) -> None:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, plain)
        if sync:
            fsync_tree(plain)

    def loom_save(durable: bool) -> None:
        Checkpointer("OneDeviceStrategy").save(work / "loom", 1, {"model": model, "optimizer": opt}, keep=1, durable=durable)

    def torch_load() -> None:
        state = torch.load(plain, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    rows = timed({
        "torch.save": lambda: torch_save(False),
        "loom save (durable=False)": lambda: loom_save(False),
        "torch.save + fsync": lambda: torch_save(True),
        "loom save (durable, default)": lambda: loom_save(True),
        "torch.load + load_state_dict": torch_load,
        "loom restore": lambda: Checkpointer().restore(work / "loom", {"model": model, "optimizer": opt}),
    }, repeats)  # fmt: skip
    result = {name: {"seconds": s, "MB_per_s": size / 2**20 / s} for name, s in rows.items()}
    result["state_MB"] = size / 2**20
    result["save_vs_torch"] = rows["torch.save"] / rows["loom save (durable=False)"]
    result["durable_save_vs_torch_fsync"] = rows["torch.save + fsync"] / rows["loom save (durable, default)"]
    result["restore_vs_torch"] = rows["torch.load + load_state_dict"] / rows["loom restore"]
    result["async"] = async_slowdown(model, opt, work)
    return result


def verification_cost(megabytes: float, repeats: int, work: Path) -> dict[str, Any]:
    """Restore with every block's digest checked against restore without (sizes only), and the
    commit's hashing against the save it belongs to; wall and CPU seconds (all threads)."""
    model, opt = make_state(megabytes)
    size = state_bytes(model, opt)
    state = {"model": model, "optimizer": opt}
    checked = Checkpointer("OneDeviceStrategy").save(work / "verified", 1, state, keep=1)
    unchecked = work / "unverified" / checked.name
    shutil.copytree(checked, unchecked)
    listing = json.loads((unchecked / layout.MARKER).read_text())
    (unchecked / layout.MARKER).write_text(json.dumps({"files": listing["files"]}))
    cpu: dict[str, list[float]] = {}

    def measured(name: str, fn: Callable[[], Any]) -> tuple[str, Callable[[], Any]]:
        def run() -> None:
            start = time.process_time()
            fn()
            cpu.setdefault(name, []).append(time.process_time() - start)

        return name, run

    restore_sizes, restore_checked = "loom restore, sizes only", f"loom restore, {layout.DIGEST} checked (default)"
    saving, hashing = "loom save (durable, default)", f"{layout.DIGEST} of the saved files (part of the save)"
    rows = timed(dict([
        measured(restore_sizes, lambda: Checkpointer().restore(unchecked, state)),
        measured(restore_checked, lambda: Checkpointer().restore(checked, state)),
        measured(saving, lambda: Checkpointer("OneDeviceStrategy").save(work / "saved", 1, state, keep=1)),
        measured(hashing, lambda: layout.digests(checked, listing["files"])),
    ]), repeats)  # fmt: skip
    result: dict[str, Any] = {
        name: {"seconds": s, "cpu_seconds": statistics.median(cpu[name]), "MB_per_s": size / 2**20 / s} for name, s in rows.items()
    }
    result["state_MB"] = size / 2**20
    result["files"] = len(listing["files"])
    result["restore_checked_vs_sizes_only"] = rows[restore_checked] / rows[restore_sizes]
    result["restore_cpu_checked_vs_sizes_only"] = result[restore_checked]["cpu_seconds"] / result[restore_sizes]["cpu_seconds"]
    result["hashing_share_of_save"] = rows[hashing] / rows[saving]
    result["cores"] = len(os.sched_getaffinity(0))
    result["load_average"] = os.getloadavg()[0]
    return result


def print_verification(v: dict[str, Any]) -> None:
    for name, row in v.items():
        if isinstance(row, dict):
            print(f"  {name:<48} {row['seconds']:6.2f} s  {row['MB_per_s']:7.0f} MB/s  {row['cpu_seconds']:6.2f} s CPU")
    print(f"  restore with digests checked: {v['restore_checked_vs_sizes_only']:.2f}x the time of sizes only "
          f"({v['restore_cpu_checked_vs_sizes_only']:.2f}x the CPU); hashing is {v['hashing_share_of_save']:.0%} of a durable save "
          f"({v['files']} files, {v['cores']} cores, load average {v['load_average']:.1f})")  # fmt: skip


def async_slowdown(model: nn.Module, opt: torch.optim.Optimizer, work: Path, repeats: int = 3) -> dict[str, Any]:
    """Training steps while an async save is written, against steps with no save going on.

    The first save starts DCP's checkpoint process (reported apart); then quiet steps and
    steps during a save alternate, so the machine's slow spells hit both.
    """
    width = model[0].in_features
    batch = torch.randn(64, width)

    def step() -> float:
        start = time.perf_counter()
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    checkpointer = Checkpointer("OneDeviceStrategy")
    start = time.perf_counter()
    checkpointer.save(work / "async", 0, {"model": model, "optimizer": opt}, keep=1, async_save=True)
    first_blocking = time.perf_counter() - start
    checkpointer.wait()
    quiet, runs = [], []
    for i in range(repeats):
        quiet += [step() for _ in range(10)]
        start = time.perf_counter()
        checkpointer.save(work / "async", i + 1, {"model": model, "optimizer": opt}, keep=1, async_save=True)
        blocked = time.perf_counter() - start
        during = []
        while checkpointer._pending is not None and not checkpointer._pending.done():
            during.append(step())
        checkpointer.wait()
        runs.append((blocked, time.perf_counter() - start, during))
    during = [t for _, _, steps in runs for t in steps]
    return {
        "writer": "DCP checkpoint process" if compat.checkpoint_process() is not None else "thread",
        "step_seconds": statistics.median(quiet),
        "step_seconds_during_async_save": statistics.median(during) if during else None,
        "steps_during_save": len(during),
        "slowdown": statistics.median(during) / statistics.median(quiet) if during else float("nan"),
        "first_save_blocking_seconds": first_blocking,
        "blocking_seconds": statistics.median(b for b, _, _ in runs),
        "seconds_until_committed": statistics.median(c for _, c, _ in runs),
    }


def two_processes(megabytes: float, repeats: int, work: Path) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", "2", __file__, "--worker", "--mb", str(megabytes),
         "--repeats", str(repeats), "--work", str(work)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def worker(megabytes: float, repeats: int, work: Path) -> None:
    """One of two replicas: loom (each rank writes its share) vs torch.save on rank 0."""
    strategy = loom.MirroredStrategy()
    model, opt = make_state(megabytes)
    prepared, opt = strategy.prepare(model, opt)
    size = state_bytes(model, opt.optimizer)

    def torch_save() -> None:
        if strategy.is_chief:
            torch.save({"model": model.state_dict(), "optim": opt.optimizer.state_dict()}, work / "torch2.pt")
        strategy.barrier()

    def loom_save() -> None:
        strategy.save(work / "loom2", step=1, keep=1, model=prepared, optimizer=opt)

    rows = timed({
        "torch.save on rank 0": torch_save,
        "loom save, 2 ranks": loom_save,
        "loom restore, 2 ranks": lambda: strategy.restore(work / "loom2", model=prepared, optimizer=opt),
    }, repeats)  # fmt: skip
    if strategy.is_chief:
        result = {name: {"seconds": s, "MB_per_s": size / 2**20 / s} for name, s in rows.items()}
        result["save_vs_torch"] = rows["torch.save on rank 0"] / rows["loom save, 2 ranks"]
        print(json.dumps(result), flush=True)
    strategy.shutdown()


def start_to_first_step(megabytes: float, work: Path) -> dict[str, float]:
    """Seconds from launching a process to its first training step, fresh and resuming."""
    code = (
        "import sys, time, torch; sys.path.insert(0, sys.argv[1]); from bench.checkpoint import make_state;"
        "from loom.checkpoint import Checkpointer; model, opt = make_state(float(sys.argv[2]));"
        "sys.argv[3] == 'resume' and Checkpointer().restore(sys.argv[4], {'model': model, 'optimizer': opt});"
        "model(torch.randn(8, model[0].in_features)).sum().backward(); opt.step(); print('stepped')"
    )
    times = {}
    for mode in ("fresh", "resume"):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code, str(ROOT), str(megabytes), mode, str(work / "loom")], check=True, capture_output=True)
        times[mode] = time.perf_counter() - start
    return times


def print_async(a: dict[str, Any], megabytes: float) -> None:
    print(f"  async save of {megabytes:.0f} MB ({a['writer']}): the first blocks {a['first_save_blocking_seconds']:.2f} s (starting the writer), "
          f"later ones {a['blocking_seconds']:.2f} s, committed after {a['seconds_until_committed']:.2f} s; "
          f"{a['steps_during_save']} steps meanwhile at {a['slowdown']:.3f}x the quiet step time ({a['step_seconds'] * 1e3:.0f} ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-only", action="store_true", help="only the steps during an asynchronous save")
    parser.add_argument("--verify-only", action="store_true", help="only what checking the digests costs, on restore and on save")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.mb, args.repeats, args.work)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("LOOM_BENCH_TMP")) as tmp:
        work = Path(tmp)
        if args.verify_only:
            print(f"digests, about {args.mb:.0f} MB of model and Adam state, median of {args.repeats}:")
            v = verification_cost(args.mb, args.repeats, work)
            print_verification(v)
            print(f"saved {save('checkpoint_verify', v)}")
            return
        if args.async_only:
            model, opt = make_state(args.mb)
            a = async_slowdown(model, opt, work, args.repeats)
            print_async(a, state_bytes(model, opt) / 2**20)
            print(f"saved {save('checkpoint_async', a)}")
            return
        print(f"one process, about {args.mb:.0f} MB of model and Adam state, median of {args.repeats}:")
        one = one_process(args.mb, args.repeats, work)
        for name, row in one.items():
            if isinstance(row, dict) and "MB_per_s" in row:
                print(f"  {name:<32} {row['seconds']:6.2f} s  {row['MB_per_s']:7.0f} MB/s")
        print(f"  save vs torch.save: {one['save_vs_torch']:.2f}x; durable save vs torch.save+fsync: {one['durable_save_vs_torch_fsync']:.2f}x; restore vs torch.load: {one['restore_vs_torch']:.2f}x")
        print_async(one["async"], one["state_MB"])
        verified = verification_cost(args.mb, args.repeats, work)
        print_verification(verified)
        startup = start_to_first_step(args.mb, work)
        print(f"  process start to first step: {startup['fresh']:.2f} s fresh, {startup['resume']:.2f} s resuming")
        print("two processes (MirroredStrategy):")
        two = two_processes(args.mb, args.repeats, work)
        for name, row in two.items():
            if isinstance(row, dict):
                print(f"  {name:<32} {row['seconds']:6.2f} s  {row['MB_per_s']:7.0f} MB/s")
        print(f"  save vs torch.save on rank 0: {two['save_vs_torch']:.2f}x")
    print(f"saved {save('checkpoint', {'one_process': one, 'verification': verified, 'start_to_first_step': startup, 'two_processes': two})}")


if __name__ == "__main__":
    main()
