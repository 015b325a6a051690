"""Input pipeline throughput: loom.data vs torch DataLoader vs tf.data on the same PNG files.

    python bench/input_pipeline.py [--images 20000] [--quick]

Small PNGs (40x40, 10 classes) are generated once into a cache folder. Every contender runs
the same work per image: read the file, decode it, random-crop to 32x32, flip at random,
normalize to float. The training step is a sleep of known length, as if an accelerator were
busy, so the input pipeline has the CPU to itself and the target is well defined: with
prefetching, a step should take max(input time per batch / parallelism, step time), within 5%.
Two step lengths: 0 (pure input throughput) and the balanced one, where input and step take
equally long. Each configuration is warmed by one epoch, then timed over several epochs taken in turns with
the others (median), because this machine is shared and noisy; each timed epoch is the second of
two in a row, as in training, where a pipeline may read the next epoch ahead. "Parallelism" is measured: the
bare per-image work run in as many plain processes as there are cores, against one.

At the balanced step the bare work alone fills every core, so the ideal leaves no CPU for what
a pipeline adds per batch (collating, handing the batch over, the training process's share):
what it adds is exactly what the step exceeds the ideal by, times cores. Since wall times on a
shared machine also measure the neighbours, each contender's CPU time (training process and
its workers) is counted too, against the bare work's CPU time in the same rounds: "CPU/bare"
is the pipeline's own cost, and max(CPU per batch / cores, step) is its step on idle cores.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
import unittest.mock
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from PIL import Image
from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import RESULTS, save  # noqa: E402

import loom.data as ld  # noqa: E402
from loom.data import runner  # noqa: E402
from loom.data.readers import ImageFolderSource  # noqa: E402

SIZE, CROP, CLASSES = 40, 32, 10
MEAN = torch.tensor([0.49, 0.48, 0.45]).view(3, 1, 1)
STD = torch.tensor([0.25, 0.24, 0.26]).view(3, 1, 1)
TF_PYTHON = Path(__file__).resolve().parent.parent / ".venv-tf" / "bin" / "python"


def make_images(root: Path, count: int) -> Path:
    """``count`` PNGs in root/<class>/, made once: smooth noise, so they compress like photos."""
    folder = root / f"pngs-{count}"
    if (folder / ".complete").exists():
        return folder
    rng = np.random.default_rng(0)
    for c in range(CLASSES):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in track(range(count), description=f"writing {count} PNGs to {folder}"):
        coarse = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((SIZE, SIZE), Image.BILINEAR).save(folder / f"class{i % CLASSES}" / f"{i:06d}.png")
    (folder / ".complete").touch()
    return folder


def augment(sample: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
    """Decode, random crop, random flip, normalize: the per-image work every contender does."""
    data, label = sample
    image = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    top, left = np.random.randint(0, SIZE - CROP + 1, 2)
    image = image[:, top : top + CROP, left : left + CROP]
    if np.random.rand() < 0.5:
        image = image.flip(2)
    return (image.float() / 255 - MEAN) / STD, label


class AugmentedImages(torch.utils.data.Dataset):
    """The DataLoader's dataset: the same files, read and augmented the same way."""

    def __init__(self, folder: Path) -> None:
        self.source = ImageFolderSource(folder, decode=False)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return augment(self.source.read(0, i))


def _children() -> list[list[str]]:
    """The /proc stat fields (after the name) of this process's live children."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.append(fields)
    return found


def cpu_seconds() -> float:
    """CPU time of this process and its live children (persistent workers are never reaped)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    ticks = sum(int(fields[11]) + int(fields[12]) for fields in _children())
    return usage.ru_utime + usage.ru_stime + ticks / os.sysconf("SC_CLK_TCK")


def _wait_for_children(before: int, timeout: float = 10.0) -> None:
    """Until a dropped loader's workers are gone: a loom loader's receiver thread lets go of
    them within a batch's time, not at once, and CPU counted from live children would lose theirs."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while len(_children()) > before and time.monotonic() < deadline:
        time.sleep(0.01)


def timed_epoch(batches: Iterable[Any], step_seconds: float) -> tuple[float, int]:
    """Seconds and samples of one pass, each batch followed by a step of known length."""
    start, samples = time.perf_counter(), 0
    for _, labels in batches:
        samples += len(labels)
        if step_seconds:
            time.sleep(step_seconds)
    return time.perf_counter() - start, samples


def measure(
    contenders: dict[str, Callable[[], Iterable[Any]]], step_seconds: float, batch: int, rounds: int, bare: Callable[[], None]
) -> list[dict[str, Any]]:
    """Each contender warmed by one epoch, then timed over ``rounds`` epochs taken in turns (median),
    each the second of two in a row.

    ``bare`` measures the machine's bare rates in every round too, so the ideal is of the same moments.
    """
    loaders = {name: make() for name, make in contenders.items()}
    for loader in loaders.values():
        timed_epoch(loader, step_seconds)  # workers start, caches fill
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    cpu: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):  # in turns, so the machine's slow spells hit every contender
        bare()
        for name, loader in loaders.items():
            # An untimed pass first: the timed one follows a pass, as in training, and what a
            # contender read ahead while the others ran its turns is not counted to its credit.
            timed_epoch(loader, step_seconds)
            used = cpu_seconds()
            elapsed, samples = timed_epoch(loader, step_seconds)
            cpu[name].append(cpu_seconds() - used)
            seconds[name].append(elapsed)
    results = []
    for name, loader in loaders.items():
        elapsed, steps = statistics.median(seconds[name]), math.ceil(samples / batch)
        result = {
            "name": name,
            "samples_per_sec": samples / elapsed,
            "step_ms": elapsed / steps * 1e3,
            "cpu_ms_per_batch": statistics.median(cpu[name]) / steps * 1e3,
            "spread": [samples / s for s in sorted(seconds[name], reverse=True)],
        }
        if isinstance(loader, ld.PipelineLoader):
            result["report"] = loader.stats.summary()
        print(
            f"  {name:<48} {result['samples_per_sec']:8,.0f} samples/s   {result['step_ms']:6.1f} ms/step"
            f"   CPU {result['cpu_ms_per_batch']:5.1f} ms/batch",
            flush=True,
        )
        results.append(result)
    return results


def _augment_slice(dataset: AugmentedImages, indices: range, rates: Any) -> None:
    torch.set_num_threads(1)
    for i in indices[:64]:  # warm, as the contenders' persistent workers are
        dataset[i]
    start, used = time.perf_counter(), time.process_time()
    for i in indices:
        dataset[i]
    rates.put((len(indices) / (time.perf_counter() - start), (time.process_time() - used) / len(indices)))


def raw_rate(dataset: AugmentedImages, processes: int, per_process: int = 1_000) -> tuple[float, float]:
    """Samples/s of the bare per-image work in ``processes`` plain processes (what the machine can
    give), and its CPU seconds per sample."""
    context = multiprocessing.get_context("fork")
    rates = context.Queue()
    workers = [
        context.Process(target=_augment_slice, args=(dataset, range(p * per_process, (p + 1) * per_process), rates))
        for p in range(processes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done = [rates.get() for _ in workers]
    return sum(rate for rate, _ in done), statistics.mean(cpu for _, cpu in done)


def tf_data(folder: Path, batch: int, step_seconds: float) -> dict[str, Any]:
    """The same work in tf.data, in TensorFlow's own virtual environment (.venv-tf)."""
    if not TF_PYTHON.exists():
        return {"name": "tf.data", "skipped": f"TensorFlow is not installed in {TF_PYTHON.parent.parent} (make bench-tf)"}
    script = Path(__file__).with_name("tf_input_pipeline.py")
    args = [str(TF_PYTHON), str(script), str(folder), str(batch), str(step_seconds), str(CROP)]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if done.returncode:
        return {"name": "tf.data", "skipped": f"tf.data run failed: {done.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  {result['name']:<48} {result['samples_per_sec']:8,.0f} samples/s   {result['step_ms']:6.1f} ms/step"
        f"   CPU {result['cpu_ms_per_batch']:5.1f} ms/batch"
    )
    return result


def copied(make: Callable[[], ld.PipelineLoader]) -> Callable[[], Iterable[Any]]:
    """Process workers + prefetch as before shared batch buffers: each batch crosses in a new shared-memory file."""

    def make_copied() -> Iterable[Any]:
        loader = make()
        with unittest.mock.patch.object(runner, "BatchBuffers", lambda count: None):
            loader._workers = loader._start_workers()
        return loader

    return make_copied


def _as_is(sample: Any) -> Any:
    return sample


def machinery(batch: int, cores: int, batches: int = 60, rounds: int = 3) -> dict[str, float]:
    """CPU ms per batch the process contenders spend besides the per-image work: the same loaders
    over images already in memory, with nothing to do per image (least of ``rounds`` epochs).
    Short and CPU-timed, so it holds on a busy machine; at the balanced step a pipeline needs
    (bare work + this) / cores per step."""
    images, labels = torch.randn(batches * batch, 3, CROP, CROP), torch.arange(batches * batch) % CLASSES
    pipeline = ld.from_tensors(images, labels).shuffle(seed=0).map(_as_is, num_parallel=cores, method="process")
    made = pipeline.batch(batch).prefetch().loader
    dataset = torch.utils.data.TensorDataset(images, labels)
    makers: dict[str, Callable[[], Iterable[Any]]] = {
        f"loom map(num_parallel={cores}) processes + prefetch": made,
        f"loom map(num_parallel={cores}) processes + prefetch, batches copied (no shared buffers)": copied(made),
        f"DataLoader(num_workers={cores}, prefetch_factor=2)": lambda: torch.utils.data.DataLoader(
            dataset, batch, shuffle=True, num_workers=cores, prefetch_factor=2, persistent_workers=True
        ),
    }
    costs = {}
    for name, make in makers.items():
        children = len(_children())
        loader = make()
        timed_epoch(loader, 0.0)
        spent = []
        for _ in range(rounds):
            used = cpu_seconds()
            timed_epoch(loader, 0.0)
            spent.append((cpu_seconds() - used) / batches * 1e3)
        costs[name] = min(spent)
        del loader
        _wait_for_children(before=children)  # its workers end before the next contender's are timed
    return costs


def contenders(folder: Path, batch: int, cores: int) -> dict[str, Callable[[], Iterable[Any]]]:
    images = ld.image_folder(folder, decode=False).shuffle(seed=0)
    dataset = AugmentedImages(folder)

    def loom(num_parallel: int | None, method: str = "thread", prefetch: bool = False) -> Callable[[], Iterable[Any]]:
        pipeline = images.map(augment, num_parallel=num_parallel, method=method).batch(batch)
        return (pipeline.prefetch() if prefetch else pipeline).loader

    def dataloader(factor: int) -> Callable[[], Iterable[Any]]:
        return lambda: torch.utils.data.DataLoader(
            dataset, batch, shuffle=True, num_workers=cores, prefetch_factor=factor, persistent_workers=True
        )

    return {
        "loom sequential": loom(None),
        f"loom map(num_parallel={cores}) threads": loom(cores),
        f"loom map(num_parallel={cores}) threads + prefetch": loom(cores, prefetch=True),
        f"loom map(num_parallel={cores}) processes": loom(cores, "process"),
        f"loom map(num_parallel={cores}) processes + prefetch": loom(cores, "process", True),
        f"loom map(num_parallel={cores}) processes + prefetch, batches copied (no shared buffers)": copied(loom(cores, "process", True)),
        **{f"DataLoader(num_workers={cores}, prefetch_factor={f})": dataloader(f) for f in (2, 4, 8)},
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["runs"]), figsize=(7 * len(results["runs"]), 5), sharey=True)
    for ax, run_ in zip(np.atleast_1d(axes), results["runs"]):
        rows = [r for r in run_["results"] if "samples_per_sec" in r]
        names = [r["name"] for r in rows]
        colors = ["tab:blue" if n.startswith("loom") else "tab:orange" if n.startswith("Data") else "tab:green" for n in names]
        ax.barh(names, [r["samples_per_sec"] for r in rows], color=colors)
        ax.axvline(run_["ideal_samples_per_sec"], color="black", linestyle="--", label="max(input / measured parallelism, step)")
        ax.set_title(f"step {run_['step_ms']:.1f} ms")
        ax.set_xlabel("samples/s")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
    fig.suptitle(f"{results['images']} PNGs, batch {results['batch']}, {results['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("LOOM_BENCH_DATA", Path.home() / ".cache" / "loom-bench")))
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per configuration (median)")
    parser.add_argument("--quick", action="store_true", help="4,000 images, one round: a smoke test")
    parser.add_argument("--balanced", action="store_true", help="only the step as long as the input (not step 0)")
    parser.add_argument("--only", nargs="+", help="only the contenders whose names contain one of these")
    args = parser.parse_args()
    images = 4_000 if args.quick else args.images
    args.rounds = 1 if args.quick else args.rounds
    folder = make_images(args.data, images)
    cores = len(os.sched_getaffinity(0))

    dataset = AugmentedImages(folder)
    rates: dict[int, list[float]] = {1: [], cores: []}
    bare_cpu: list[float] = []  # seconds per sample

    def bare() -> None:
        for processes in rates:
            rate, cpu = raw_rate(dataset, processes)
            rates[processes].append(rate)
            bare_cpu.append(cpu)

    for _ in range(2):
        bare()
    step_seconds = args.batch / statistics.median(rates[1]) / cores  # balanced: input / cores
    runs = []
    for step in (step_seconds,) if args.balanced else (0.0, step_seconds):
        print(f"\nstep {step * 1e3:.1f} ms:")
        chosen = {n: c for n, c in contenders(folder, args.batch, cores).items() if not args.only or any(o in n for o in args.only)}
        results = measure(chosen, step, args.batch, args.rounds, bare)
        results.append(tf_data(folder, args.batch, step) if not args.only else {"name": "tf.data", "skipped": "not chosen (--only)"})
        if "skipped" in results[-1]:
            print(f"  tf.data: skipped: {results[-1]['skipped']}")
        one, many = statistics.median(rates[1]), statistics.median(rates[cores])
        input_seconds, parallel_seconds = args.batch / one, args.batch / many
        ideal, nominal = max(parallel_seconds, step), max(input_seconds / cores, step)
        bare_batch_cpu = statistics.median(bare_cpu) * args.batch
        print(f"  bare per-image work: {one:,.0f} samples/s in 1 process, {many:,.0f} in {cores} ({many / one:.2f}x)")
        print(f"  ideal step max(input / parallelism, step): {ideal * 1e3:.1f} ms with the measured parallelism, {nominal * 1e3:.1f} ms with {cores}")
        print(f"  bare work's CPU: {bare_batch_cpu * 1e3:.1f} ms per batch; on idle cores max(CPU / {cores}, step) is {max(bare_batch_cpu / cores, step) * 1e3:.1f} ms")
        timed = [r for r in results if "samples_per_sec" in r]
        best = {kind: max((r for r in timed if r["name"].startswith(kind)), key=lambda r: r["samples_per_sec"]) for kind in ("loom", "DataLoader")}
        ratio = best["loom"]["samples_per_sec"] / best["DataLoader"]["samples_per_sec"]
        best_prefetched = min((r for r in timed if r["name"].startswith("loom") and "prefetch" in r["name"] and "copied" not in r["name"]), key=lambda r: r["step_ms"])
        off_ideal, off_nominal = best_prefetched["step_ms"] / (ideal * 1e3), best_prefetched["step_ms"] / (nominal * 1e3)
        for r in timed:
            if "cpu_ms_per_batch" in r:
                r["cpu_over_bare"] = r["cpu_ms_per_batch"] / (bare_batch_cpu * 1e3)
                r["idle_cores_step_ms"] = max(r["cpu_ms_per_batch"] / cores, step * 1e3)
        idle_ideal = max(bare_batch_cpu / cores, step) * 1e3
        off_idle = best_prefetched["idle_cores_step_ms"] / idle_ideal
        print(f"  best loom / best DataLoader: {ratio:.3f}x  ({best['loom']['name']} vs {best['DataLoader']['name']})")
        print(f"  best prefetched loom step / ideal: {off_ideal:.3f} (measured parallelism), {off_nominal:.3f} (nominal); target <= 1.05")
        print("  CPU per batch / bare work's: " + ", ".join(f"{r['name']} {r['cpu_over_bare']:.3f}" for r in timed if "cpu_over_bare" in r))
        print(f"  {best_prefetched['name']}: step on idle cores / ideal there: {off_idle:.3f}")
        runs.append({
            "step_ms": step * 1e3,
            "bare_samples_per_sec": {"1": one, str(cores): many},
            "input_ms_per_batch": input_seconds * 1e3,
            "bare_cpu_ms_per_batch": bare_batch_cpu * 1e3,
            "idle_cores_ideal_step_ms": idle_ideal,
            "prefetched_idle_cores_step_vs_ideal": off_idle,
            "ideal_step_ms": ideal * 1e3,
            "nominal_ideal_step_ms": nominal * 1e3,
            "ideal_samples_per_sec": args.batch / ideal,
            "loom_vs_dataloader": ratio,
            "prefetched_step_vs_ideal": off_ideal,
            "prefetched_step_vs_nominal_ideal": off_nominal,
            "results": results,
        })
    print("\nwhat the process contenders add per batch (CPU, images in memory, nothing to do per image):")
    added = machinery(args.batch, cores)
    balanced = runs[-1]
    for name, cost in added.items():
        projected = (balanced["bare_cpu_ms_per_batch"] + cost) / balanced["bare_cpu_ms_per_batch"]
        balanced.setdefault("balanced_on_idle_cores_vs_ideal", {})[name] = projected
        print(f"  {name:<48} {cost:5.2f} ms/batch: at the balanced step on idle cores, (bare + that) / bare = {projected:.3f}")
    summary = {
        "images": images, "batch": args.batch, "cores": cores, "rounds": args.rounds, "runs": runs,
        "machinery_cpu_ms_per_batch": added,
    }
    name = "input_pipeline" if not (args.only or args.balanced) else "input_pipeline_some"  # a partial run keeps the full one
    print(f"\nsaved {save(name, summary)}")
    plot(summary, RESULTS / f"{name}.png")
    print(f"plot  {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
