"""Replica groups (``loom run --groups``): what they cost with no failure, and how a kill -9 is recovered from.

Overhead: W1 (MLP 784-2048x3-10, global batch 512, SGD with momentum, ``train_step``) trained by the same script
under ``loom run --groups 2 --nproc N`` (FaultTolerantMirroredStrategy) and ``loom run --nproc 2N``
(MirroredStrategy), for N = 1 and 2: the same processes either way, jobs interleaved (Mirrored,
groups, Mirrored, ...), median step time of each job after its warm-up steps.

Recovery: the same job with ``--max-restarts 1``; once group 1 has trained a few steps it is
killed with SIGKILL, and the groups' own events give each phase, in seconds after the kill:
detection (group 0's first step that failed or waited on it), quorum (the lighthouse's membership
without it), group 0's first committed step without it, the restarted process's start, its
request to join, its heal (weights and optimizer state from group 0, no checkpoint) and its
first committed step. The survivors hold after batch HOLD until the restarted group asks to
join, so the heal is measured whatever the restart costs.

Chaos (``--chaos K``): 3 groups x 1 process learn a fixed random linear rule (MLP 256-256-10,
global batch 96, Adam), 26 K steps. The groups stop at every K-th step until the driver lets them
go on. At a stop where every group trained the batch (and the stop before killed none), a random
group's process is killed with SIGKILL first, 10 times in all; the survivors train the next K
steps without it; at a stop where a group is missing, they wait until its restarted process asks
to join, and it heals in the next step. A failure-free run of the same job (same seed,
same batches) gives the reference loss curve. Each global batch's loss is the sample-weighted mean
of the groups' losses on their slices; every sample id the groups trained is counted.

Across hosts (``--hosts``, root): the lighthouse on one network-namespace host and each group on one of
two others, the groups' links shaped to 1 Gbit/s; the overhead against MultiWorkerMirrored on the same
two hosts, the quorum's cost per step (the wait for a batch, which under --groups holds the step's
quorum, against MultiWorkerMirrored's), and the recovery after a kill -9 of group 1.

    python bench/live_recovery.py [--rounds 2] [--steps 30]
    python bench/live_recovery.py --chaos 5
    python bench/live_recovery.py --hosts [--rounds 2] [--steps 30]
    python bench/live_recovery.py --lighthouse-loss 5 -1
    python bench/live_recovery.py --diloco 8 [--rounds 3] [--steps 40]

Lighthouse loss (``--lighthouse-loss DOWN ...``): ``loom lighthouse`` in a process of its own, a launcher per
group (2 x 1 process, W1, ``--max-restarts 1``, LOOM_TIMEOUT=20); once group 0 has committed a few steps the
lighthouse is killed with SIGKILL and started again at its address DOWN seconds later (a negative DOWN:
never). The gap in group 0's commits and the launchers' lines (a group whose quorum request waited past the
timeout restarts, rejoins and heals), or, never restarted, how long the groups wait and the line they stop with.

DiLoCo across groups (``--diloco H``): the same W1 job under FaultTolerantDiLoCoStrategy(sync_every=H), 2 groups x
1 process, against FT-DDP and Mirrored on the same two processes, interleaved; the mean step time, a round's
meeting (its quorum, the sum of the pseudo-gradients and the commit vote) spread over its H steps.

Writes bench/results/live_recovery.json and .png (chaos: live_recovery_chaos.json and .png; hosts:
live_recovery_hosts.json and .png; lighthouse loss: live_recovery_lighthouse.json; DiLoCo: live_recovery_diloco.json). Run as a job's script (by the above), it trains.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: a restarted process's start

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KILL_AFTER, HOLD = 5, 12  # group 1 is killed once it has committed this many batches; group 0 holds after batch HOLD
HOSTS, LIGHTHOUSE_PORT, RATE = {"l": "10.82.0.1", "a": "10.82.0.2", "b": "10.82.0.3"}, 29620, "1gbit"  # --hosts: the lighthouse's, one a group
CHAOS_GROUPS, CHAOS_KILLS, CHAOS_BATCH = 3, 10, 96


# ---- the training script (run by loom run) ---------------------------------------------------------
def train(out: Path, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import loom
    from workloads import WORKLOADS

    w1 = WORKLOADS["W1"]
    every = os.environ.get("BENCH_DILOCO")
    strategy = loom.FaultTolerantDiLoCoStrategy(sync_every=int(every)) if every else loom.auto_strategy()
    group = getattr(strategy, "group", 0)
    record = strategy.cluster.rank == 0
    torch.manual_seed(0)
    model, opt = strategy.prepare(w1.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    step = strategy.train_step(model, F.cross_entropy, opt)
    loader = strategy.distribute(w1.data(batches=8), batch_size=w1.global_batch)
    log = open(out / f"steps-{group}.jsonl", "a") if record else None
    if log:
        log.write(json.dumps({"started": STARTED, "pid": os.getpid()}) + "\n")
    done, asked = 0, time.time()
    while done < steps:
        for x, y in loader:
            fetch = time.time() - asked  # the batch's wait: under --groups, the step's quorum with it
            step(x, y)
            m = getattr(strategy, "membership", None)
            batch = m.batch if m else done
            if log:
                log.write(json.dumps({"t": time.time(), "fetch": fetch, "batch": batch, "committed": getattr(strategy, "committed", True)}) + "\n")
                log.flush()
            if m and batch == HOLD and group == 0 and os.environ.get("HOLD_FOR_REJOIN"):
                while not _asked_to_join(1):
                    time.sleep(0.05)
            done = batch + 1
            if done >= steps:
                break
            asked = time.time()


def train_chaos(out: Path, steps: int, k: int) -> None:
    """The chaos job's script: logs each committed step's loss and sample ids; after each K-th batch, waits for OUT/go-<batch>."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import loom

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * CHAOS_BATCH, 256, generator=g)
    y = (x @ torch.randn(256, 10, generator=g)).argmax(1)
    data = torch.utils.data.TensorDataset(x, y, torch.arange(len(x)))
    strategy = loom.auto_strategy()
    torch.manual_seed(0)
    model, opt = strategy.prepare(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)), lambda p: torch.optim.Adam(p, lr=1e-3))
    loader = strategy.distribute(data, batch_size=CHAOS_BATCH)
    log = open(out / f"chaos-{strategy.group}.jsonl", "a") if strategy.cluster.rank == 0 else None
    if log:
        log.write(json.dumps({"pid": os.getpid(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}) + "\n")
    for xb, yb, ids in loader:
        loss = F.cross_entropy(model(xb), yb)
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        if not strategy.committed:
            continue
        m = strategy.membership
        if log:
            log.write(json.dumps({"t": time.time(), "batch": m.batch, "groups": m.groups, "participants": m.participants, "loss": loss.item(), "ids": ids.tolist()}) + "\n")
            log.flush()
        while (m.batch + 1) % k == 0 and m.batch + 1 < steps and not (out / f"go-{m.batch}").exists():
            time.sleep(0.02)


def _asked_to_join(group: int) -> bool:
    path = Path(os.environ["LOOM_FT_EVENTS"]) / f"group-{group}.jsonl"
    return path.exists() and any(json.loads(line).get("restart", 0) > 0 for line in path.read_text().splitlines() if '"joining"' in line)


# ---- the driver ----------------------------------------------------------------------------------
def _job(out: Path, steps: int, *flags: str, env: dict[str, str] | None = None, train: tuple[str, ...] = ("--train",)) -> subprocess.Popen:
    (out / "events").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "loom.launch.cli", "run", *flags, __file__, *train, str(out), "--steps", str(steps)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "LOOM_FT_EVENTS": str(out / "events"), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(job: subprocess.Popen, timeout: float = 900) -> str:
    _, err = job.communicate(timeout=timeout)
    if job.returncode:
        raise SystemExit(f"a benchmark job failed ({job.returncode}):\n{err[-3000:]}")
    return err


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def median_step(out: Path, warmup: int = 3) -> float:
    return statistics.median(_gaps(out, warmup))


def overhead(rounds: int, steps: int, nproc: int) -> dict:
    """Groups of ``nproc`` processes against Mirrored on as many processes."""
    seconds: dict[str, list[float]] = {f"MirroredStrategy (--nproc {2 * nproc})": [], f"FaultTolerantMirrored (--groups 2 --nproc {nproc})": []}
    for _ in range(rounds):
        for name, flags in zip(seconds, (["--nproc", str(2 * nproc)], ["--groups", "2", "--nproc", str(nproc)])):
            out = Path(tempfile.mkdtemp(prefix="live-recovery-"))
            _finish(_job(out, steps, *flags))
            seconds[name].append(median_step(out))
    mirrored, groups = (statistics.median(v) for v in seconds.values())
    return {"median_step_s": seconds, "overhead": groups / mirrored - 1}


def diloco_cost(rounds: int, steps: int, every: int) -> dict:
    """FaultTolerantDiLoCo (2 groups x 1 process, rounds of ``every`` batches) against FT-DDP and Mirrored on the same
    two processes, interleaved: the median step time of each, and DiLoCo's over Mirrored's (its rounds' meetings included)."""
    kinds = {
        "MirroredStrategy (--nproc 2)": (["--nproc", "2"], {}),
        "FaultTolerantMirrored (--groups 2 --nproc 1)": (["--groups", "2", "--nproc", "1"], {}),
        f"FaultTolerantDiLoCo (--groups 2 --nproc 1, sync_every={every})": (["--groups", "2", "--nproc", "1"], {"BENCH_DILOCO": str(every)}),
    }
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, (flags, env) in kinds.items():
            out = Path(tempfile.mkdtemp(prefix="live-recovery-"))
            _finish(_job(out, steps, *flags, env=env))
            seconds[name].append(statistics.mean(_gaps(out)))  # the mean: a round's meeting is one step in `every`
    mirrored, ddp, diloco = (statistics.median(v) for v in seconds.values())
    return {"mean_step_s": seconds, "ft_ddp_over_mirrored": ddp / mirrored - 1, "diloco_over_mirrored": diloco / mirrored - 1}


def _gaps(out: Path, warmup: int = 3) -> list[float]:
    times = [s["t"] for s in _lines(out / "steps-0.jsonl") if "t" in s]
    return [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]


def median_fetch(out: Path, warmup: int = 3) -> float:
    """The median wait for a batch: under --groups it holds the step's quorum."""
    return statistics.median([s["fetch"] for s in _lines(out / "steps-0.jsonl") if "fetch" in s][warmup:])


def recovery(steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="live-recovery-"))
    job = _job(out, steps, "--groups", "2", "--nproc", "1", "--max-restarts", "1", env={"HOLD_FOR_REJOIN": "1"})
    killed = _kill_group_1(out, [job])
    err = _finish(job)
    return phases(out, killed) | {"launcher_lines": _group_lines(err)}


def _kill_group_1(out: Path, jobs: list[subprocess.Popen]) -> float:
    """Once group 1 has committed KILL_AFTER steps, kill -9 its process; when it was killed."""
    deadline = time.monotonic() + 600
    while len([s for s in _lines(out / "steps-1.jsonl") if s.get("committed")]) < KILL_AFTER:
        if any(job.poll() is not None for job in jobs) or time.monotonic() > deadline:
            for job in jobs:
                job.kill()
            raise SystemExit(f"group 1 never trained {KILL_AFTER} steps:\n" + "\n".join(job.communicate()[1][-3000:] for job in jobs))
        time.sleep(0.02)
    killed = time.time()
    os.kill(_lines(out / "steps-1.jsonl")[0]["pid"], 9)
    return killed


def lighthouse_loss(steps: int, down: float, timeout: int = 20) -> dict:
    """``loom lighthouse`` in a process of its own and a launcher per group; once group 0 has committed
    KILL_AFTER steps the lighthouse is killed with SIGKILL and, after ``down`` seconds, started again at
    its address (``down`` None: never, and the groups stop after ``timeout``). Seconds after the kill."""
    out = Path(tempfile.mkdtemp(prefix="live-recovery-"))
    port = LIGHTHOUSE_PORT + 1
    lighthouse = _lighthouse(port)
    env = {"LOOM_TIMEOUT": str(timeout)}
    flags = ("--lighthouse", f"127.0.0.1:{port}", "--groups", "2", "--nproc", "1", "--max-restarts", "1")
    jobs = [_job(out, steps, *flags, "--group", str(g), env=env) for g in (0, 1)]
    try:
        while len([s for s in _lines(out / "steps-0.jsonl") if s.get("committed")]) < KILL_AFTER:
            if any(job.poll() is not None for job in jobs):
                raise SystemExit("a group ended before the lighthouse was killed:\n" + "\n".join(job.communicate()[1][-3000:] for job in jobs))
            time.sleep(0.02)
        killed = time.time()
        lighthouse.kill()
        lighthouse.wait()
        if down is not None:
            time.sleep(down)
            restarted, lighthouse = time.time(), _lighthouse(port)
        errors = [job.communicate(timeout=300)[1] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
        lighthouse.kill()
    commits = [s["t"] for s in _lines(out / "steps-0.jsonl") if s.get("committed")]
    after = [t - killed for t in commits if t > killed]
    result = {"down_s": down, "timeout_s": timeout, "exit_codes": [job.returncode for job in jobs],
              "last_commit_before_kill_s": max(t for t in commits if t <= killed) - killed,
              "batches": len(commits)}  # fmt: skip
    if down is None:
        ended = max(float(s["t"]) for s in _lines(out / "steps-1.jsonl") if "t" in s) - killed
        return result | {"last_commit_s": ended, "line": next((l for l in errors[0].splitlines() if "got no quorum" in l), None)}
    since = restarted - killed
    return result | {"first_commit_after_kill_s": min(after), "first_commit_after_restart_s": min(t for t in after if t > since) - since,
                     "launcher_lines": [line for err in errors for line in _group_lines(err) if "replicas =" not in line]}  # fmt: skip


def _lighthouse(port: int) -> subprocess.Popen:
    """``loom lighthouse`` on ``port``, once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "loom.launch.cli", "lighthouse", "--port", str(port)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    if "listening" not in proc.stdout.readline():
        raise SystemExit(f"loom lighthouse did not start on port {port}")
    return proc


def _group_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("loom: ") and "group" in line]


def across_hosts(rounds: int, steps: int) -> dict:
    """The overhead and a recovery again with each group on a host of its own and the lighthouse on a third (network
    namespaces on a bridge, the groups' links shaped to 1 Gbit/s), against MultiWorkerMirrored on the same two hosts."""
    sys.path.insert(0, str(ROOT))
    from tests.netns import network, on_host, shape, why_no_namespaces

    reason = why_no_namespaces()
    if reason:
        raise SystemExit(f"--hosts needs network namespaces: {reason}")
    started: list[subprocess.Popen] = []

    def on(host: str, out: Path, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        started.append(subprocess.Popen(
            on_host(host, [sys.executable, "-m", "loom.launch.cli", *command], prefix="r"), cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LOOM_FT_EVENTS": str(out / "events"), **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        ))  # fmt: skip
        return started[-1]

    def train_on_hosts(out: Path, steps: int, flags: Callable[[int], list[str]], env: dict[str, str] | None = None) -> list[subprocess.Popen]:
        return [on(host, out, ["run", *flags(i), "--nproc", "1", __file__, "--train", str(out), "--steps", str(steps)], env) for i, host in enumerate("ab")]

    def fresh() -> Path:
        out = Path(tempfile.mkdtemp(prefix="live-recovery-hosts-"))
        (out / "events").mkdir()
        return out

    lighthouse = f"{HOSTS['l']}:{LIGHTHOUSE_PORT}"
    in_groups = lambda g: ["--lighthouse", lighthouse, "--groups", "2", "--group", str(g)]  # noqa: E731
    try:
        with network(HOSTS, prefix="r"):
            for host in "ab":
                shape(host, RATE, prefix="r")
            if "listening on" not in on("l", fresh(), ["lighthouse", "--port", str(LIGHTHOUSE_PORT)]).stdout.readline():
                raise SystemExit("the lighthouse did not start")
            seconds: dict[str, list[float]] = {"MultiWorkerMirrored (2 hosts)": [], "FaultTolerantMirrored (--groups 2, a host each)": []}
            fetch: dict[str, list[float]] = {name: [] for name in seconds}
            for r in range(rounds):
                for name, flags in zip(seconds, (lambda i: ["--nnodes", "2", "--node-rank", str(i), "--master", f"{HOSTS['a']}:{29621 + r}"], in_groups)):
                    out = fresh()
                    for job in train_on_hosts(out, steps, flags):
                        _finish(job)
                    seconds[name].append(median_step(out))
                    fetch[name].append(median_fetch(out))
            mirrored, groups = (statistics.median(v) for v in seconds.values())
            waited = [statistics.median(v) for v in fetch.values()]
            overhead = {"median_step_s": seconds, "overhead": groups / mirrored - 1, "median_batch_wait_s": fetch, "quorum_per_step_s": waited[1] - waited[0]}
            out = fresh()
            jobs = train_on_hosts(out, HOLD + 10, lambda g: [*in_groups(g), "--max-restarts", "1"], env={"HOLD_FOR_REJOIN": "1"})
            killed = _kill_group_1(out, jobs)
            err = [_finish(job) for job in jobs]
            return {"overhead": {f"2 hosts, {RATE}": overhead}, "recovery": phases(out, killed) | {"launcher_lines": _group_lines(err[0] + err[1])}}
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def phases(out: Path, killed: float) -> dict:
    """Seconds after the kill of each recovery phase, from the groups' events and step logs."""
    events = [e for g in (0, 1) for e in _lines(out / "events" / f"group-{g}.jsonl")]
    after = sorted((e for e in events if e["t"] > killed), key=lambda e: e["t"])
    survivor = [e for e in after if e["group"] == 0]
    healer = [e for e in after if e["group"] == 1]
    healed = next(e for e in healer if e["event"] == "healed")
    restart = next(s for s in _lines(out / "steps-1.jsonl") if s.get("started", 0) > killed)

    def first(kind: str, groups: list[int] | None = None) -> float | None:
        """When the survivor's first such event came; None: a restarted group 1 was back before the lighthouse dropped it."""
        return next((e["t"] - killed for e in survivor if e["event"] == kind and groups in (None, e["groups"])), None)

    return {
        "detection": next(e for e in survivor if e["event"] in ("refused", "quorum"))["t"] - killed,
        "quorum_without_it": first("quorum", [0]),
        "first_commit_without_it": first("commit", [0]),
        "first_commit_after_kill": first("commit"),
        "restarted_process_started": restart["started"] - killed,
        "asked_to_join": next(e for e in healer if e["event"] == "joining")["t"] - killed,
        "healed": healed["t"] - killed,
        "heal_seconds": healed["seconds"],
        "healed_group_first_commit": next(e for e in healer if e["event"] == "commit" and e["t"] > healed["t"])["t"] - killed,
    }


def chaos(k: int) -> dict:
    """A failure-free run and a run with a random group killed at every other stop of K steps, 10 times: loss curves, kills, samples."""
    steps = k * (2 * CHAOS_KILLS + 6)  # a stop with a group still healing kills none: room for 10 kills
    runs = {}
    for name in ("failure_free", "chaos"):
        out = Path(tempfile.mkdtemp(prefix="live-recovery-chaos-"))
        started = time.time()
        job = _job(out, steps, "--groups", str(CHAOS_GROUPS), "--nproc", "1", "--max-restarts", str(2 * CHAOS_KILLS), env={"LOOM_TIMEOUT": "60"}, train=("--k", str(k), "--train-chaos"))
        kills = _stops(job, out, k, steps, kill=name == "chaos")
        err = _finish(job)
        runs[name] = _chaos_run(out, steps) | {"wall_s": time.time() - started, "kills": kills}
        if name == "chaos":
            runs[name]["launcher_lines"] = [line for line in err.splitlines() if line.startswith("loom: ") and "group" in line]
    free, hit = runs["failure_free"]["loss"], runs["chaos"]["loss"]
    return {
        "every_k_steps": k, "steps": steps, "groups": CHAOS_GROUPS, **runs,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(free, hit)),
        "final_loss": {"failure_free": free[-1], "chaos": hit[-1]},
        "first_loss": free[0],
    }  # fmt: skip


def _stops(job: subprocess.Popen, out: Path, k: int, steps: int, kill: bool) -> list[dict]:
    """Let the groups go on at each stop (after every K-th batch). At a stop where every group trained the batch and the
    last stop killed none, kill -9 a random group first (10 times in all); where a group is missing, first wait until
    its newest life (restarted) asks to join, so that it heals in the next step."""
    chooser, kills, deadline = random.Random(0), [], time.monotonic() + 1800

    def wait(condition, what: str) -> None:
        while not condition():
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"chaos: the job ended or timed out waiting until {what}:\n{job.communicate()[1][-3000:]}")
            time.sleep(0.02)

    def rejoining(group: int) -> bool:
        since = max([kill["t"] for kill in kills if kill["group"] == group], default=0)
        return any(e["event"] == "joining" and e["t"] > since for e in _lines_whole(out / "events" / f"group-{group}.jsonl"))

    killed_last = False
    for batch in range(k - 1, steps - 1, k):
        commits = lambda: [s for s in _commits(out) if s["batch"] == batch]  # noqa: E731
        wait(lambda: commits() and len({s["g"] for s in commits()}) == commits()[0]["participants"], f"the groups train batch {batch}")
        missing = set(range(CHAOS_GROUPS)) - {s["g"] for s in commits()}
        if kill and not missing and not killed_last and len(kills) < CHAOS_KILLS:
            group = chooser.randrange(CHAOS_GROUPS)
            os.kill([s for s in _lines_whole(out / f"chaos-{group}.jsonl") if "pid" in s][-1]["pid"], 9)
            kills.append({"t": time.time(), "group": group, "after_batch": batch})
        for group in missing:
            wait(lambda: rejoining(group), f"group {group} restarts and asks to join")
        killed_last = bool(kills) and kills[-1]["after_batch"] == batch
        (out / f"go-{batch}").touch()
    return kills


def _commits(out: Path) -> list[dict]:
    return [s | {"g": g} for g in range(CHAOS_GROUPS) for s in _lines_whole(out / f"chaos-{g}.jsonl") if "batch" in s]


def _lines_whole(path: Path) -> list[dict]:
    """The complete lines of a file being written."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _chaos_run(out: Path, steps: int) -> dict:
    """Each global batch's loss (sample-weighted over the groups that trained it) and the samples counted."""
    commits = _commits(out)
    per_batch: dict[int, list[tuple[float, int]]] = {}
    for s in commits:
        per_batch.setdefault(s["batch"], []).append((s["loss"], len(s["ids"])))
    counts = Counter(i for s in commits for i in s["ids"])
    expected = steps * CHAOS_BATCH
    return {
        "loss": [sum(loss * n for loss, n in per_batch[b]) / sum(n for _, n in per_batch[b]) for b in range(steps)],
        "samples": {"expected": expected, "trained_once": sum(1 for i in range(expected) if counts[i] == 1),
                    "lost": sum(1 for i in range(expected) if counts[i] == 0), "doubled": sum(1 for n in counts.values() if n > 1)},
        "steps_alone": sum(1 for b in per_batch if len({g for s in commits if s["batch"] == b for g in s["groups"]}) < CHAOS_GROUPS),
    }  # fmt: skip


def plot_chaos(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(results["failure_free"]["loss"], label="failure-free", color="#888", lw=3)
    ax.plot(results["chaos"]["loss"], label=f"{len(results['chaos']['kills'])} kills -9 (at stops every {results['every_k_steps']} steps)", color="#c44", lw=1)
    for kill in results["chaos"]["kills"]:
        ax.axvline(kill["after_batch"], color="#c44", alpha=0.3, lw=0.8)
    ax.set_xlabel("global batch")
    ax.set_ylabel("loss (global batch)")
    samples = results["chaos"]["samples"]
    ax.set_title(f"3 groups, chaos: max |loss difference| {results['max_abs_loss_difference']:.1e}; samples lost {samples['lost']}, doubled {samples['doubled']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = {name: statistics.median(v) for pair in results["overhead"].values() for name, v in pair["median_step_s"].items()}
    left.bar(range(len(steps)), [v * 1e3 for v in steps.values()], color=["#888", "#c44"] * len(results["overhead"]))
    left.set_xticks(range(len(steps)), [n.replace(" (", "\n(") for n in steps], fontsize=7)
    left.set_ylabel("median step (ms)")
    left.set_title("W1: groups cost " + ", ".join(f"{v['overhead']:+.1%} ({k})" for k, v in results["overhead"].items()), fontsize=9)
    phases_ = {k: v for k, v in results["recovery"].items() if k not in ("launcher_lines", "heal_seconds") and v is not None}
    right.barh(range(len(phases_)), list(phases_.values()), color="#48c")
    right.set_yticks(range(len(phases_)), [k.replace("_", " ") for k in phases_], fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("seconds after kill -9 of group 1")
    right.set_title(f"recovery (heal itself {results['recovery']['heal_seconds']:.2f}s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="jobs of each kind, interleaved")
    parser.add_argument("--steps", type=int, default=30, help="steps per overhead job")
    parser.add_argument("--chaos", type=int, metavar="K", help="instead: kill a random group every K steps, 10 times, against a failure-free run")
    parser.add_argument("--hosts", action="store_true", help=f"instead: each group on a network-namespace host of its own, links at {RATE} (needs root)")
    parser.add_argument("--lighthouse-loss", type=float, nargs="+", metavar="DOWN",
                        help="instead: kill -9 the lighthouse mid-job and start it again after DOWN seconds (a negative DOWN: never)")
    parser.add_argument("--diloco", type=int, metavar="H", help="instead: FaultTolerantDiLoCo(sync_every=H)'s step cost against FT-DDP and Mirrored")
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--train-chaos", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        return train(Path(args.train), args.steps)
    if args.train_chaos:
        return train_chaos(Path(args.train_chaos), args.steps, args.k)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import RESULTS, machine, save

    results = {"machine": machine(), "command": "python bench/live_recovery.py " + " ".join(sys.argv[1:])}
    if args.chaos:
        results["chaos"] = chaos(args.chaos)
        path = save("live_recovery_chaos", results)
        plot_chaos(results["chaos"], RESULTS / "live_recovery_chaos.png")
        summary = {k: v for k, v in results["chaos"].items() if k not in ("failure_free", "chaos")}
        print(json.dumps(summary | {"samples": results["chaos"]["chaos"]["samples"]}, indent=2))
        print(f"wrote {path} and {RESULTS / 'live_recovery_chaos.png'}")
        return None
    if args.diloco:
        results["diloco"] = diloco_cost(args.rounds, args.steps, args.diloco)
        path = save("live_recovery_diloco", results)
        print(json.dumps(results["diloco"], indent=2))
        print(f"wrote {path}")
        return None
    if args.lighthouse_loss:
        results["lighthouse_loss"] = [lighthouse_loss(KILL_AFTER + 40, None if down < 0 else down) for down in args.lighthouse_loss]
        path = save("live_recovery_lighthouse", results)
        print(json.dumps(results["lighthouse_loss"], indent=2))
        print(f"wrote {path}")
        return None
    if args.hosts:
        results |= across_hosts(args.rounds, args.steps)
        path = save("live_recovery_hosts", results)
        plot(results, RESULTS / "live_recovery_hosts.png")
        print(json.dumps({k: results[k] for k in ("overhead", "recovery")}, indent=2))
        print(f"wrote {path} and {RESULTS / 'live_recovery_hosts.png'}")
        return None
    results["overhead"] = {f"{2 * n} processes": overhead(args.rounds, args.steps, n) for n in (1, 2)}
    print(json.dumps({"overhead": results["overhead"]}, indent=2), flush=True)
    results["recovery"] = recovery(steps=HOLD + 10)
    path = save("live_recovery", results)
    plot(results, RESULTS / "live_recovery.png")
    print(json.dumps({"recovery": results["recovery"]}, indent=2))
    print(f"wrote {path} and {RESULTS / 'live_recovery.png'}")


if __name__ == "__main__":
    main()
