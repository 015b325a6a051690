"""Tokens/s of the small GPT's training step under every strategy, beside a plain PyTorch loop.

Each strategy is its own job on the processes ``examples/gpt.py`` gives it (one thread each),
timing ``train_step`` (forward, backward, sync, clip, AdamW; the median step after a
warm-up); the reference is a hand-written PyTorch loop, the same model, batch and clipping,
timed the same way in a job of one process of one thread.

    python bench/gpt.py [--steps 10] [--batch 32] [--strategies mirrored tensor_parallel ...]

On a CPU machine the model-parallel strategies pay for communication that buys them
nothing (every process already holds the whole model easily): the figures measure loom's
and torch's overhead for each parallelism, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from examples.gpt import SETUPS  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, next_byte_loss, splits  # noqa: E402
from loom.launch import LaunchOptions, run_job  # noqa: E402
from workloads import RESULTS, machine, save  # noqa: E402


def windows(batch: int, count: int) -> torch.utils.data.Dataset:
    """``count`` batches' worth of the standard library's text."""
    train, _ = splits(GPTConfig.context, max_bytes=GPTConfig.context * batch * count + 1, val_fraction=0.0)
    return train


def batches(batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train = windows(batch, count)
    pairs = [train[i] for i in range(len(train))]
    return [(torch.stack([x for x, _ in pairs[i : i + batch]]), torch.stack([y for _, y in pairs[i : i + batch]])) for i in range(0, len(pairs), batch)]


def settle(device: torch.device) -> None:
    """Start each timed step on an idle device, on both sides: a one-process job times no barrier,
    whose NCCL all-reduce would cost more than a small model's step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_pytorch(batch: int, steps: int, warmup: int) -> float:
    """Tokens/s of the loop a person writes by hand on one process (median step, as for the strategies)."""
    torch.set_num_threads(1)  # as loom gives each process under LOOM_THREADS=1
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where loom's one process runs too
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    times = []
    for i, (x, y) in enumerate(batches(batch, warmup + steps)):
        x, y = x.to(device), y.to(device)
        settle(device)
        start = time.perf_counter()
        loss = next_byte_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return batch * GPTConfig.context / statistics.median(times)


def worker(name: str, batch: int, steps: int, warmup: int, out: str) -> None:
    """One process's part: time the strategy's train_step (or the hand-written loop); the chief writes tokens/s."""
    if name == "raw":
        Path(out).write_text(json.dumps({"tokens_per_sec": raw_pytorch(batch, steps, warmup)}))
        return
    strategy = loom.get_strategy(name, **SETUPS[name][1])
    torch.manual_seed(0)
    model, opt = strategy.prepare(GPT(), lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1))
    step = strategy.train_step(model, next_byte_loss, opt, max_grad_norm=1.0)
    loader = strategy.distribute(windows(batch, warmup + steps), batch_size=batch, shuffle=False)
    times = []
    wait = strategy.barrier if strategy.num_replicas_in_sync > 1 else lambda: settle(strategy.device)
    for i, (x, y) in enumerate(loader):
        wait()
        start = time.perf_counter()
        float(step(x, y))
        wait()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if strategy.is_chief:
        Path(out).write_text(json.dumps({"tokens_per_sec": batch * GPTConfig.context / statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--strategies", nargs="*", default=[s for s in SETUPS if s != "one_device"])
    parser.add_argument("--worker", nargs=2, metavar=("STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.batch, args.steps, args.warmup, args.worker[1])
    results: dict = {"machine": machine(), "batch": args.batch, "context": GPTConfig.context, "steps": args.steps, "strategies": {}}
    for name in ["raw", "one_device", *args.strategies]:
        nproc = 1 if name == "raw" else SETUPS[name][0]
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            entry = [__file__, "--worker", name, out.name, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
            if run_job(entry, LaunchOptions(nproc=nproc, threads=1)):
                print(f"{name}: the run failed", flush=True)
                continue
            tokens = json.loads(Path(out.name).read_text())["tokens_per_sec"]
        if name == "raw":
            results["raw_pytorch_one_process"] = tokens
            print(f"raw PyTorch, 1 process: {tokens:,.0f} tokens/s", flush=True)
            continue
        ratio = tokens / results["raw_pytorch_one_process"]
        results["strategies"][name] = {"processes": nproc, "options": SETUPS[name][1], "tokens_per_sec": tokens, "vs_raw_pytorch": ratio}
        print(f"{name} ({nproc} process(es)): {tokens:,.0f} tokens/s, {ratio:.2f}x raw PyTorch on one process", flush=True)
    path = save("gpt", results)
    plot(results, RESULTS / "gpt.png")
    print(f"saved {path} and {RESULTS / 'gpt.png'}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["raw PyTorch (1)"] + [f"{n} ({r['processes']})" for n, r in results["strategies"].items()]
    values = [results["raw_pytorch_one_process"]] + [r["tokens_per_sec"] for r in results["strategies"].values()]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, values, color=["grey"] + ["C0"] * (len(values) - 1))
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (training step, one thread per process)")
    ax.set_title(f"Small GPT, global batch {results['batch']} x {results['context']} bytes (processes in brackets)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
