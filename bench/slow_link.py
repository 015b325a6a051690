"""Two hosts joined by a 1 Gbit/s link: raw DDP against loom's bucket sizing, compression and DiLoCo.

    python bench/slow_link.py [--rounds 3] [--steps 4] [--sync-every 16] [--quality-steps 300]

Makes two network namespaces on a bridge (``tests/netns.py``), shapes each host's egress to
1 Gbit/s with ``tc ... tbf``, runs one two-node job (one process per host, one thread each)
and removes the hosts afterwards. W1 (the MLP, 38 MiB of gradients) at 256 samples per host.
Every contender runs in the same two processes, in interleaved blocks of steps whose order
rotates per round, so the machine's noise hits all alike; ratios to raw DDP are what count:

- raw DDP: ``DistributedDataParallel`` as written by hand (25 MB buckets, fp32), and with
  torch's ``powerSGD_hook`` (rank 2, error feedback, one bucket);
- loom fp32 with DDP's 25 MB buckets, and with the bucket size chosen from the model;
- loom bf16 and PowerSGD (rank 2, error feedback) gradient compression;
- DiLoCoStrategy (``--sync-every`` inner steps per sync; a block is one sync period).

The ceiling of a synchronous step is max(compute, communication) plus the last bucket's
all-reduce, which nothing overlaps; each is timed apart, in the same rounds as the contenders.
Each row also gives the CPU time a step costs the process (all its threads): on a loaded
machine that, not the wall time, shows what a contender adds. Quality: a small
transformer trained on two local processes (no shaping: only the loss matters) for the same
samples, synchronous fp32 against bf16, PowerSGD and DiLoCo; the validation loss is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.workloads import RESULTS, WORKLOADS, endless, machine, save  # noqa: E402

HOSTS = {"a": "10.78.0.1", "b": "10.78.0.2"}
RATE = "1gbit"
PER_HOST = 256
CONTENDERS = ("raw DDP", "loom fp32 25MB buckets", "loom fp32", "loom bf16", "loom powersgd", "loom diloco")


# ---- throughput, in each host's process -----------------------------------------------------------
def throughput_worker(rounds: int, steps: int, sync_every: int, out: str) -> None:
    import loom
    from loom.comm import PowerSGD

    workload = WORKLOADS["W1"]
    strategies = {
        "loom fp32 25MB buckets": loom.MultiWorkerMirroredStrategy(bucket_cap_mb=25, timeout=600),
        "loom fp32": loom.MultiWorkerMirroredStrategy(timeout=600),
        "loom bf16": loom.MultiWorkerMirroredStrategy(compression="bf16", timeout=600),
        "loom powersgd": loom.MultiWorkerMirroredStrategy(compression=PowerSGD(rank=2, start_iter=2), timeout=600),
        "loom diloco": loom.DiLoCoStrategy(sync_every=sync_every, timeout=600),
    }
    data = workload.data(batches=4)
    makers: dict[str, Callable[[], None]] = {"raw DDP": raw_ddp_step(workload, data), "raw DDP + torch powerSGD_hook": raw_ddp_step(workload, data, powersgd=True)}
    for name, strategy in strategies.items():
        makers[name] = loom_step(strategy, workload, data)
    makers.update(ceiling_steps(workload, data))
    for step in makers.values():  # warm-up: buckets rebuilt, PowerSGD past its uncompressed start
        for _ in range(3):
            step()
    load_at_start = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in makers}
    cpu: dict[str, list[float]] = {name: [] for name in makers}
    slowest: dict[str, list[float]] = {name: [] for name in makers}
    order = list(makers)
    for r in range(rounds):  # every contender and every ceiling in each round, in a rotating order
        for name in order[r % len(order):] + order[: r % len(order)]:
            n = sync_every if name == "loom diloco" else steps  # one sync period per block
            dist.barrier()
            start, start_cpu, each = time.perf_counter(), time.process_time(), []
            for _ in range(n):
                begin = time.perf_counter()
                makers[name]()
                each.append(time.perf_counter() - begin)
            cpu[name].append((time.process_time() - start_cpu) / n)  # this process's every thread: compute, casts, gloo
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / n)
            slowest[name].append(max(each))
    if dist.get_rank() == 0:
        load = [load_at_start, os.getloadavg()[0]]
        Path(out).write_text(json.dumps({"seconds": seconds, "cpu": cpu, "slowest": slowest, "load": load, "machine": machine()}))


def raw_ddp_step(workload, data, powersgd: bool = False) -> Callable[[], None]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = workload.build()
    if powersgd:  # torch's own hook, as the same rank and start; one bucket (two would deadlock gloo)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        model = DistributedDataParallel(model, bucket_cap_mb=64, gradient_as_bucket_view=True)
        state = psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        model = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    return plain_step(model, data)


def plain_step(model: nn.Module, data) -> Callable[[], None]:
    """A hand-written step on this host's slice of each global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank = dist.get_rank()
    batches = endless([(x[rank * PER_HOST:(rank + 1) * PER_HOST], y[rank * PER_HOST:(rank + 1) * PER_HOST]) for x, y in _global_batches(data)])

    def step() -> None:
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def loom_step(strategy, workload, data) -> Callable[[], None]:
    torch.manual_seed(0)
    model, opt = strategy.prepare(workload.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    batches = endless(strategy.distribute(data, batch_size=2 * PER_HOST))
    train = strategy.train_step(model, F.cross_entropy, opt)
    return lambda: train(*next(batches))


def _global_batches(data):
    x, y = data.tensors
    return [(x[i:i + 2 * PER_HOST], y[i:i + 2 * PER_HOST]) for i in range(0, len(x), 2 * PER_HOST)]


CEILINGS = ("compute alone", "all-reduce of every gradient", "all-reduce of the first layer")


def ceiling_steps(workload, data) -> dict[str, Callable[[], None]]:
    """Compute with no communication, the fp32 all-reduce of every gradient, and of the first layer's alone
    (DDP's last bucket, which nothing overlaps), timed in the same rounds as the contenders."""
    torch.manual_seed(0)
    model = workload.build()
    grads = sum(p.numel() for p in model.parameters())
    first = sum(p.numel() for p in model[0].parameters())
    every, last = torch.zeros(grads), torch.zeros(first)
    return dict(zip(CEILINGS, (plain_step(model, data), lambda: dist.all_reduce(every), lambda: dist.all_reduce(last))))


# ---- quality, on two local processes ---------------------------------------------------------------
VOCAB, SEQ, QUALITY_BATCH = 16, 32, 32


class TinyGPT(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.position = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.body(self.embed(tokens) + self.position, mask=mask, is_causal=True))


def markov_tokens(n: int, seed: int) -> torch.Tensor:
    """Sequences from a fixed random Markov chain: each token has 3 likely successors."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3
    probs = torch.softmax(logits, dim=1)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, SEQ + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        out[:, t + 1] = torch.multinomial(probs[out[:, t]], 1, generator=g).squeeze(1)
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def quality_worker(steps: int, sync_every: int, out: str) -> None:
    import loom
    from loom.comm import PowerSGD

    train_tokens, val_tokens = markov_tokens(steps * QUALITY_BATCH, 1), markov_tokens(256, 2)
    data = torch.utils.data.TensorDataset(train_tokens[:, :-1], train_tokens[:, 1:])
    configs = {
        "sync fp32": lambda: loom.MirroredStrategy(timeout=600),
        "bf16": lambda: loom.MirroredStrategy(compression="bf16", timeout=600),
        "powersgd": lambda: loom.MirroredStrategy(compression=PowerSGD(rank=2, start_iter=10), timeout=600),
        "diloco": lambda: loom.DiLoCoStrategy(sync_every=sync_every, timeout=600),
    }
    results = {}
    for name, make in configs.items():
        strategy = make()
        torch.manual_seed(0)
        model, opt = strategy.prepare(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=3e-3))
        step = strategy.train_step(model, lm_loss, opt)
        for x, y in strategy.distribute(data, batch_size=QUALITY_BATCH, shuffle=True, seed=0):
            step(x, y)
        if isinstance(strategy, loom.LocalSGDStrategy):
            strategy.sync()
        with torch.no_grad():
            results[name] = float(lm_loss(model(val_tokens[:, :-1]), val_tokens[:, 1:]))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


# ---- the driver, as root ---------------------------------------------------------------------------
def run_hosts(args: argparse.Namespace, out: Path) -> None:
    from tests.netns import TAG, namespace, network, on_host, sh

    port = 29_641
    command = [sys.executable, "-m", "loom.launch.cli", "run", "--nnodes", "2", "--master", f"{HOSTS['a']}:{port}",
               "--nproc", "1", "--threads", "1", "--timeout", "600"]  # fmt: skip
    worker = [__file__, "--worker", "throughput", "--rounds", str(args.rounds), "--steps", str(args.steps),
              "--sync-every", str(args.sync_every), "--out", str(out)]  # fmt: skip
    # A host whose one thread is busy with a 38 MB all-reduce on a saturated link is late with its heartbeats.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_HEARTBEAT_TIMEOUT": "120"}
    with network(HOSTS, prefix="s"):
        for host in HOSTS:  # each host's egress at the link's rate
            sh("ip", "netns", "exec", namespace(host, "s"), "tc", "qdisc", "add", "dev", f"s{host}i{TAG}", "root",
               "tbf", "rate", RATE, "burst", "256kb", "latency", "50ms")  # fmt: skip
        agents = [
            subprocess.Popen(on_host(host, [*command[:6], "--node-rank", str(rank), *command[6:], *worker], prefix="s"),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            for rank, host in enumerate(HOSTS)
        ]
        for agent in agents:
            _, err = agent.communicate(timeout=1800)
            if agent.returncode:
                raise RuntimeError(f"the two-host job failed: {err[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per block (DiLoCo: --sync-every)")
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--quality-steps", type=int, default=300)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "throughput":
        return throughput_worker(args.rounds, args.steps, args.sync_every, args.out)
    if args.worker == "quality":
        return quality_worker(args.quality_steps, args.sync_every, args.out)
    if os.geteuid() != 0:
        sys.exit("bench/slow_link.py makes network namespaces and shapes their links: it needs root and iproute2")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        run_hosts(args, out)
        measured = json.loads(out.read_text())
        quality = None
        if not args.skip_quality:
            qout = Path(tmp) / "quality.json"
            done = subprocess.run([sys.executable, "-m", "loom.launch.cli", "run", "--nproc", "2", "--threads", "1", __file__,
                                   "--worker", "quality", "--quality-steps", str(args.quality_steps), "--sync-every", str(args.sync_every),
                                   "--out", str(qout)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"the quality job failed: {done.stderr[-3000:]}")
            quality = json.loads(qout.read_text())
    report(measured, quality, args)


def report(measured: dict, quality: dict | None, args: argparse.Namespace) -> None:
    median = {name: statistics.median(s) for name, s in measured["seconds"].items()}
    cpu = {name: statistics.median(s) for name, s in measured["cpu"].items()}
    compute, every, last = (median.pop(name) for name in CEILINGS)
    ceiling = max(compute, every) + last
    raw = median["raw DDP"]
    rows = {}
    for name, s in median.items():
        rows[name] = {"step_seconds": s, "samples_per_sec": 2 * PER_HOST / s, "vs_raw_ddp": raw / s, "vs_ceiling": s / ceiling,
                      "cpu_seconds_per_step": cpu[name], "blocks": measured["seconds"][name],
                      "slowest_step_seconds": statistics.median(measured["slowest"][name])}  # fmt: skip
        print(f"{name:<30} {s * 1e3:7.1f} ms/step  {2 * PER_HOST / s:6.0f} samples/s  {raw / s:5.2f}x raw DDP  "
              f"{s / ceiling:5.2f}x the synchronous ceiling  {cpu[name] * 1e3:6.1f} CPU ms/step")  # fmt: skip
    sync = rows["loom diloco"]["slowest_step_seconds"]
    print(f"diloco: its slowest step (the one that syncs) {sync * 1e3:.0f} ms, every {args.sync_every} steps")
    print(f"ceiling: compute alone {compute * 1e3:.0f} ms ({cpu['compute alone'] * 1e3:.0f} CPU ms), all-reduce of every "
          f"gradient {every * 1e3:.0f} ms, of the first layer (the last bucket) {last * 1e3:.0f} ms: "
          f"max(compute, all-reduce) + last bucket = {ceiling * 1e3:.0f} ms")  # fmt: skip
    print(f"no contender can beat raw DDP by more than raw DDP / compute alone = {raw / compute:.2f}x on this machine now")
    print(f"load average during the run: {measured['load'][0]:.1f} at the start, {measured['load'][1]:.1f} at the end (2 cores)")
    if quality:
        base = quality["sync fp32"]
        for name, loss in quality.items():
            print(f"quality {name:<10} validation loss {loss:.4f} ({loss / base - 1:+.1%} vs synchronous fp32)")
    ceilings = {"compute": compute, "all_reduce": every, "last_bucket": last}
    results = {"machine": measured["machine"], "link": RATE, "per_host_batch": PER_HOST, "sync_every": args.sync_every,
               "ceilings": ceilings, "compute_bound_vs_raw_ddp": raw / compute, "ceiling_seconds": ceiling, "contenders": rows, "quality": quality,
               "quality_steps": args.quality_steps, "load_average": measured["load"],
               "note": "2-core machine shared with other jobs, both hosts on it: figures taken under load"}  # fmt: skip
    print(f"saved {save('slow_link', results)}")
    plot(rows, quality, RESULTS / "slow_link.png")


def plot(rows: dict, quality: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = list(rows)
    left.barh(names, [rows[n]["vs_raw_ddp"] for n in names], color="tab:blue")
    left.axvline(1.0, color="gray", lw=1)
    left.set(xlabel="throughput / raw DDP (higher is better)", title="W1 on two hosts at 1 Gbit/s")
    for i, n in enumerate(names):
        left.text(rows[n]["vs_raw_ddp"], i, f" {rows[n]['vs_raw_ddp']:.2f}x", va="center")
    if quality:
        right.bar(list(quality), list(quality.values()), color="tab:green")
        right.set(ylabel="validation loss", title="tiny GPT, same samples")
        right.set_ylim(min(quality.values()) * 0.95, max(quality.values()) * 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
