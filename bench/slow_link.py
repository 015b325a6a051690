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
- DiLoCoStrategy (``--sync-every`` inner steps per sync; a block is one sync period), and with
  ``overlap_sync=True`` (and ``outer_lr=0.5``, which its quality needs; 0.7 is measured too):
  a block is two periods and then ``sync()``, which waits for the second period's all-reduce,
  so each block pays one all-reduce that nothing overlaps (pessimistic); its steady state is
  the second period alone, all of whose steps ran beside the first's all-reduce;
- DiLoCo and PowerSGD again with ``precision="bf16-mixed"``, against compute alone in bf16-mixed.

The issue's ceiling of a synchronous step is max(compute, communication) plus the last bucket's
all-reduce, which nothing overlaps; each is timed apart, in the same rounds as the contenders.
The measured floor: hooks time when each gradient is ready in the backward pass (compute alone),
every run of consecutive gradients (in the order they are ready) is all-reduced alone on the link,
and the best bucketing of those runs gives the earliest the last all-reduce can end; the floor is
max(that, the end of backward) plus the optimizer step, the best any schedule that reduces the
gradients before the next forward can do. loom's own buckets give the same with its partition.
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
OVERLAPPED = ("loom diloco overlapped", "loom diloco overlapped bf16-mixed")


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
        "loom diloco overlapped": loom.DiLoCoStrategy(sync_every=sync_every, overlap_sync=True, outer_lr=0.5, timeout=600),
        "loom powersgd bf16-mixed": loom.MultiWorkerMirroredStrategy(compression=PowerSGD(rank=2, start_iter=2), precision="bf16-mixed", timeout=600),
        "loom diloco bf16-mixed": loom.DiLoCoStrategy(sync_every=sync_every, precision="bf16-mixed", timeout=600),
        "loom diloco overlapped bf16-mixed": loom.DiLoCoStrategy(sync_every=sync_every, overlap_sync=True, outer_lr=0.5, precision="bf16-mixed", timeout=600),
    }
    data = workload.data(batches=4)
    makers: dict[str, Callable[[], None]] = {"raw DDP": raw_ddp_step(workload, data), "raw DDP + torch powerSGD_hook": raw_ddp_step(workload, data, powersgd=True)}
    models = {}
    for name, strategy in strategies.items():
        makers[name], models[name] = loom_step(strategy, workload, data)
    ready = GradientClock()
    makers.update(ceiling_steps(workload, data, ready))
    for name, step in makers.items():  # warm-up: buckets rebuilt, PowerSGD past its uncompressed start
        for _ in range(3):
            step()
        if name in OVERLAPPED:
            strategies[name].sync()
    ready.clear()
    load_at_start = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in makers}
    cpu: dict[str, list[float]] = {name: [] for name in makers}
    slowest: dict[str, list[float]] = {name: [] for name in makers}
    steady: dict[str, list[float]] = {name: [] for name in OVERLAPPED}
    order = list(makers)
    for r in range(rounds):  # every contender and every ceiling in each round, in a rotating order
        for name in order[r % len(order):] + order[: r % len(order)]:
            n = (2 if name in OVERLAPPED else 1) * sync_every if "diloco" in name else steps  # whole sync periods per block
            dist.barrier()
            start, start_cpu, each = time.perf_counter(), time.process_time(), []
            for _ in range(n):
                begin = time.perf_counter()
                makers[name]()
                each.append(time.perf_counter() - begin)
            if name in OVERLAPPED:  # the second period's all-reduce: waited for, and counted, in this block
                begin = time.perf_counter()
                strategies[name].sync()
                each.append(time.perf_counter() - begin)
                steady[name].append(statistics.mean(each[sync_every:2 * sync_every]))
            cpu[name].append((time.process_time() - start_cpu) / n)  # this process's every thread: compute, casts, gloo
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / n)
            slowest[name].append(max(each))
    buckets = _bucket_bytes(models["loom fp32"])  # read after DDP's first 10 steps, which log its rebuilt buckets
    runs = ready.runs()
    link = {f"{i}-{j}": _all_reduce_seconds(sum(ready.numel[i:j])) for i, j in runs}
    if dist.get_rank() == 0:
        load = [load_at_start, os.getloadavg()[0]]
        Path(out).write_text(json.dumps({"seconds": seconds, "cpu": cpu, "slowest": slowest, "steady": steady, "load": load, "machine": machine(),
                                         "gradients": ready.summary(), "run_seconds": link, "loom_bucket_bytes": buckets}))  # fmt: skip


class GradientClock:
    """When each gradient is ready in the backward pass, from the start of its step, over many steps.

    Gradients are listed in the order they become ready (the order DDP's buckets fill).
    """

    def __init__(self) -> None:
        self.start = 0.0
        self.times: dict[int, list[float]] = {}
        self.ends: list[tuple[float, float]] = []  # (end of backward, end of the optimizer step)
        self.order: list[int] = []
        self.numel: list[int] = []

    def watch(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.times.setdefault(i, []).append(time.perf_counter() - self.start))

    def clear(self) -> None:
        self.times.clear()
        self.ends.clear()

    def summary(self) -> dict:
        median = {i: statistics.median(t) for i, t in self.times.items()}
        order = sorted(median, key=median.get)
        return {"ready": [median[i] for i in order], "numel": [self.params[i].numel() for i in order],
                "backward_end": statistics.median(e[0] for e in self.ends), "step_end": statistics.median(e[1] for e in self.ends)}  # fmt: skip

    def runs(self) -> list[tuple[int, int]]:
        """Every run of consecutive gradients in the order they are ready: the buckets a schedule could form."""
        self.numel = self.summary()["numel"]
        n = len(self.numel)
        return [(i, j) for i in range(n) for j in range(i + 1, n + 1)]


def _all_reduce_seconds(numel: int, repeats: int = 3) -> float:
    tensor = torch.zeros(numel)
    times = []
    for _ in range(repeats):
        dist.barrier()
        begin = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _bucket_bytes(ddp: nn.Module) -> list[int]:
    """The bytes of each of loom's DDP buckets, in the order they are reduced, as DDP rebuilt them in its first steps."""
    logged = ddp._get_ddp_logging_data()
    return [int(b) for b in str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", "")).split(",") if b.strip()]


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


def plain_step(model: nn.Module, data, clock: GradientClock | None = None, bf16: bool = False) -> Callable[[], None]:
    """A hand-written step on this host's slice of each global batch; ``clock`` times its gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank = dist.get_rank()
    batches = endless([(x[rank * PER_HOST:(rank + 1) * PER_HOST], y[rank * PER_HOST:(rank + 1) * PER_HOST]) for x, y in _global_batches(data)])
    if clock is not None:
        clock.watch(model)

    def step() -> None:
        x, y = next(batches)
        if clock is not None:
            clock.start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        backward_end = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if clock is not None:
            clock.ends.append((backward_end - clock.start, time.perf_counter() - clock.start))

    return step


def loom_step(strategy, workload, data) -> tuple[Callable[[], None], nn.Module]:
    torch.manual_seed(0)
    model, opt = strategy.prepare(workload.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    batches = endless(strategy.distribute(data, batch_size=2 * PER_HOST))
    train = strategy.train_step(model, F.cross_entropy, opt)
    return (lambda: train(*next(batches))), model


def _global_batches(data):
    x, y = data.tensors
    return [(x[i:i + 2 * PER_HOST], y[i:i + 2 * PER_HOST]) for i in range(0, len(x), 2 * PER_HOST)]


CEILINGS = ("compute alone", "all-reduce of every gradient", "all-reduce of the first layer", "compute alone bf16-mixed")


def ceiling_steps(workload, data, clock: GradientClock) -> dict[str, Callable[[], None]]:
    """Compute with no communication (fp32, its gradients timed by ``clock``; and bf16-mixed), the fp32
    all-reduce of every gradient, and of the first layer's alone (DDP's last bucket, which nothing
    overlaps), timed in the same rounds as the contenders."""
    torch.manual_seed(0)
    model = workload.build()
    grads = sum(p.numel() for p in model.parameters())
    first = sum(p.numel() for p in model[0].parameters())
    every, last = torch.zeros(grads), torch.zeros(first)
    steps = (plain_step(model, data, clock), lambda: dist.all_reduce(every), lambda: dist.all_reduce(last), plain_step(workload.build(), data, bf16=True))
    return dict(zip(CEILINGS, steps))


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
        "diloco overlapped, outer_lr 0.7": lambda: loom.DiLoCoStrategy(sync_every=sync_every, overlap_sync=True, timeout=600),
        "diloco overlapped": lambda: loom.DiLoCoStrategy(sync_every=sync_every, overlap_sync=True, outer_lr=0.5, timeout=600),
        "diloco bf16-mixed": lambda: loom.DiLoCoStrategy(sync_every=sync_every, precision="bf16-mixed", timeout=600),
        "diloco overlapped bf16-mixed": lambda: loom.DiLoCoStrategy(sync_every=sync_every, overlap_sync=True, outer_lr=0.5, precision="bf16-mixed", timeout=600),
        "powersgd bf16-mixed": lambda: loom.MirroredStrategy(compression=PowerSGD(rank=2, start_iter=10), precision="bf16-mixed", timeout=600),
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
    from tests.netns import network, on_host, shape

    port = 29_641
    command = [sys.executable, "-m", "loom.launch.cli", "run", "--nnodes", "2", "--master", f"{HOSTS['a']}:{port}",
               "--nproc", "1", "--threads", "1", "--timeout", "600"]  # fmt: skip
    worker = [__file__, "--worker", "throughput", "--rounds", str(args.rounds), "--steps", str(args.steps),
              "--sync-every", str(args.sync_every), "--out", str(out)]  # fmt: skip
    # A host whose one thread is busy with a 38 MB all-reduce on a saturated link is late with its heartbeats.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_HEARTBEAT_TIMEOUT": "120"}
    with network(HOSTS, prefix="s"):
        for host in HOSTS:  # each host's egress at the link's rate
            shape(host, RATE, prefix="s")
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
    parser.add_argument("--skip-quality", action="store_true", help="time the link only; keep the last run's losses")
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
        quality, quality_from = None, None
        if args.skip_quality:  # the losses do not depend on the link: keep the last run's, saying from when
            kept = kept_quality()
            if kept is not None:
                quality, args.quality_steps, quality_from = kept
        else:
            qout = Path(tmp) / "quality.json"
            done = subprocess.run([sys.executable, "-m", "loom.launch.cli", "run", "--nproc", "2", "--threads", "1", __file__,
                                   "--worker", "quality", "--quality-steps", str(args.quality_steps), "--sync-every", str(args.sync_every),
                                   "--out", str(qout)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"the quality job failed: {done.stderr[-3000:]}")
            quality = json.loads(qout.read_text())
    report(measured, quality, args, quality_from)


def best_schedule(gradients: dict, run_seconds: dict[str, float]) -> tuple[float, list[tuple[int, int]]]:
    """When the last all-reduce ends at the earliest, over every bucketing of the gradients in the order they are
    ready, and that bucketing. A bucket starts when its last gradient is ready and the link is free; ending a
    prefix earlier never delays what follows, so the best prefix ends are found one gradient at a time."""
    ready, n = gradients["ready"], len(gradients["ready"])
    best, choice = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            end = max(ready[j - 1], best[i]) + run_seconds[f"{i}-{j}"]
            if end < best[j]:
                best[j], choice[j] = end, i
    runs, j = [], n
    while j:
        runs.append((choice[j], j))
        j = choice[j]
    return best[n], runs[::-1]


def bucket_schedule(gradients: dict, run_seconds: dict[str, float], bucket_bytes: list[int]) -> float | None:
    """When the last all-reduce ends with loom's own buckets (None if they are not runs of ready gradients)."""
    ready, bounds, total = gradients["ready"], [0], 0
    cumulative = [4 * sum(gradients["numel"][:k]) for k in range(len(ready) + 1)]
    for size in bucket_bytes:
        total += size
        if total not in cumulative:
            return None
        bounds.append(cumulative.index(total))
    end = 0.0
    for i, j in zip(bounds, bounds[1:]):
        end = max(ready[j - 1], end) + run_seconds[f"{i}-{j}"]
    return end


def kept_quality() -> tuple[dict, int, str] | None:
    """The last saved run's losses, their step count, and the run they were measured in."""
    path = RESULTS / "slow_link.json"
    if not path.exists():
        return None
    last = json.loads(path.read_text())
    if not last.get("quality"):
        return None
    when = last.get("quality_from") or f"the run of {last['time']} (--quality-steps {last['quality_steps']})"
    return last["quality"], last["quality_steps"], when


def report(measured: dict, quality: dict | None, args: argparse.Namespace, quality_from: str | None = None) -> None:
    median = {name: statistics.median(s) for name, s in measured["seconds"].items()}
    cpu = {name: statistics.median(s) for name, s in measured["cpu"].items()}
    compute, every, last, compute_bf16 = (median.pop(name) for name in CEILINGS)
    ceiling = max(compute, every) + last
    gradients, runs = measured["gradients"], measured["run_seconds"]
    optimizer = gradients["step_end"] - gradients["backward_end"]
    link_end, best_runs = best_schedule(gradients, runs)
    floor = max(gradients["backward_end"], link_end) + optimizer
    loom_end = bucket_schedule(gradients, runs, measured["loom_bucket_bytes"])
    loom_floor = None if loom_end is None else max(gradients["backward_end"], loom_end) + optimizer
    raw = median["raw DDP"]
    rows = {}
    for name, s in median.items():
        rows[name] = {"step_seconds": s, "samples_per_sec": 2 * PER_HOST / s, "vs_raw_ddp": raw / s, "vs_ceiling": s / ceiling,
                      "vs_measured_floor": s / floor, "cpu_seconds_per_step": cpu[name], "blocks": measured["seconds"][name],
                      "slowest_step_seconds": statistics.median(measured["slowest"][name])}  # fmt: skip
        line = (f"{name:<34} {s * 1e3:7.1f} ms/step  {2 * PER_HOST / s:6.0f} samples/s  {raw / s:5.2f}x raw DDP  "
                f"{s / ceiling:5.2f}x the issue's ceiling  {s / floor:5.2f}x the measured floor  {cpu[name] * 1e3:6.1f} CPU ms/step")  # fmt: skip
        if name in measured["steady"]:
            steady = statistics.median(measured["steady"][name])
            rows[name].update(steady_step_seconds=steady, steady_vs_raw_ddp=raw / steady)
            line += f"\n{'':<34} {steady * 1e3:7.1f} ms/step in the steady state (the second period)  {raw / steady:5.2f}x raw DDP"
        print(line)
    sync = rows["loom diloco"]["slowest_step_seconds"]
    print(f"diloco: its slowest step (the one that syncs) {sync * 1e3:.0f} ms, every {args.sync_every} steps")
    print(f"ceiling: compute alone {compute * 1e3:.0f} ms ({cpu['compute alone'] * 1e3:.0f} CPU ms), all-reduce of every "
          f"gradient {every * 1e3:.0f} ms, of the first layer (the last bucket) {last * 1e3:.0f} ms: "
          f"max(compute, all-reduce) + last bucket = {ceiling * 1e3:.0f} ms")  # fmt: skip
    ready = ", ".join(f"{t * 1e3:.0f}" for t in gradients["ready"])
    print(f"gradients ready at {ready} ms (of {gradients['numel']} elements), backward ends at {gradients['backward_end'] * 1e3:.0f} ms, "
          f"the optimizer step takes {optimizer * 1e3:.0f} ms")  # fmt: skip
    print(f"measured floor: the best bucketing {best_runs} ends its last all-reduce at {link_end * 1e3:.0f} ms: "
          f"floor = {floor * 1e3:.0f} ms; with loom's buckets ({measured['loom_bucket_bytes']} bytes) "
          + ("they do not fall on gradient boundaries" if loom_floor is None else f"{loom_floor * 1e3:.0f} ms"))  # fmt: skip
    print(f"no contender can beat raw DDP by more than raw DDP / compute alone = {raw / compute:.2f}x on this machine now "
          f"({raw / compute_bf16:.2f}x in bf16-mixed, whose compute alone is {compute_bf16 * 1e3:.0f} ms)")  # fmt: skip
    print(f"load average during the run: {measured['load'][0]:.1f} at the start, {measured['load'][1]:.1f} at the end (2 cores)")
    if quality:
        base = quality["sync fp32"]
        for name, loss in quality.items():
            print(f"quality {name:<28} validation loss {loss:.4f} ({loss / base - 1:+.1%} vs synchronous fp32)")
    ceilings = {"compute": compute, "compute_bf16_mixed": compute_bf16, "all_reduce": every, "last_bucket": last}
    measured_floor = {"seconds": floor, "link_end": link_end, "best_buckets": best_runs, "loom_buckets_seconds": loom_floor,
                      "loom_bucket_bytes": measured["loom_bucket_bytes"], "gradients": gradients, "run_seconds": runs}  # fmt: skip
    results = {"machine": measured["machine"], "link": RATE, "per_host_batch": PER_HOST, "sync_every": args.sync_every,
               "ceilings": ceilings, "compute_bound_vs_raw_ddp": raw / compute, "ceiling_seconds": ceiling, "measured_floor": measured_floor,
               "contenders": rows, "quality": quality, "quality_steps": args.quality_steps, "load_average": measured["load"],
               "note": "2-core machine shared with other jobs, both hosts on it: figures taken under load"}  # fmt: skip
    if quality_from:  # the losses are an earlier run's
        results["quality_from"] = quality_from
    print(f"saved {save('slow_link', results)}")
    plot(rows, quality, RESULTS / "slow_link.png")


def plot(rows: dict, quality: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = list(rows)
    left.barh(names, [rows[n]["vs_raw_ddp"] for n in names], color="tab:blue")
    left.axvline(1.0, color="gray", lw=1)
    left.set(xlabel="throughput / raw DDP (higher is better)", title="W1 on two hosts at 1 Gbit/s")
    for i, n in enumerate(names):
        left.text(rows[n]["vs_raw_ddp"], i, f" {rows[n]['vs_raw_ddp']:.2f}x", va="center")
    if quality:
        right.barh(list(quality), list(quality.values()), color="tab:green")
        right.axvline(quality["sync fp32"], color="gray", lw=1)
        right.set(xlabel="validation loss (lower is better)", title="small GPT, same samples")
        right.set_xlim(min(quality.values()) * 0.97, max(quality.values()) * 1.01)
    else:
        right.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
