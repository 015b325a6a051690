"""What the health monitor asks of the job's one store as the job grows: 8 to 512 simulated ranks.

Each simulated rank is a ``HealthMonitor`` in this process (its own threads and store clients,
beating at the default 1 s) against one TCPStore, as a job's ranks are against the agent's.
Counted over a window once every rank beats: each request every rank's clients send, and the
gaps between each rank's beats (a gap well over the interval is a beat the store, or this
process, could not serve in time; a peer reads a long enough one as silence), and each
request's time to its answer. All ranks share this process's interpreter lock: at hundreds of
ranks on a few cores, it rather than the store can make beats late. The ring (each
rank watches ``ring.WATCHED`` peers) is compared with every rank watching every other, as the
monitor did before, up to the size where that is still worth the machine's time.

    PYTHONPATH=. python bench/health_scale.py [--window 10] [--sizes 8,32,128,512] [--all-peers-up-to 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from loom.cluster import ClusterSpec
from loom.comm import ring
from loom.comm.health import HealthMonitor

RESULTS = Path(__file__).parent / "results"
INTERVAL = 1.0  # the monitor's default beat


class Counted:
    """A store client that counts and times its requests, and times its rank's beats."""

    def __init__(self, store: dist.TCPStore, rank: int, log: dict[str, Any]) -> None:
        self._store, self._rank, self._log = store, rank, log
        self._beat_key = f"/beat/{rank}"

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def request(*args: Any, **kwargs: Any) -> Any:
            with self._log["lock"]:  # several threads of a rank send requests
                self._log["requests"][self._rank] += 1
            sent = time.monotonic()
            if name == "add" and args[1] == 1 and args[0].endswith(self._beat_key):
                self._log["beats"][self._rank].append(sent)
            try:
                return method(*args, **kwargs)
            finally:
                if name != "wait":  # the listener's wait lasts until an alarm, by design
                    self._log["latency"].append((sent, time.monotonic() - sent))

        return request


class SimulatedRank(HealthMonitor):
    """A monitor whose store clients are counted, and which records, rather than ends the process,
    when it would stop the job (a false alarm here: no rank fails)."""

    def __init__(self, spec: ClusterSpec, log: dict[str, Any]) -> None:
        self._log = log
        super().__init__(spec, interval=INTERVAL, store_timeout=120)  # connects stall for seconds on some hosts

    def _connect(self) -> Counted:
        return Counted(super()._connect(), self.spec.rank, self._log)

    def _leave(self, line: str | None, code: int) -> None:
        self._log["alarms"].append(line)
        threading.Event().wait()  # as the real one: this thread goes no further


def measure(world: int, window: float) -> dict[str, Any]:
    """Requests per second, in all and per rank, and the beats' gaps, for ``world`` simulated ranks."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    log: dict[str, Any] = {"requests": [0] * world, "beats": [[] for _ in range(world)], "alarms": [], "latency": [], "lock": threading.Lock()}
    with ThreadPoolExecutor(64) as pool:  # each rank's clients connect at once, as a job's ranks do
        ranks = list(pool.map(lambda r: SimulatedRank(ClusterSpec(r, world, r, world, 0, "127.0.0.1", master.port), log), range(world)))
    for rank in ranks:
        rank.watch()
    try:
        deadline = time.monotonic() + 300
        while min(len(b) for b in log["beats"]) < 2:  # every rank has joined and watches
            if time.monotonic() > deadline:
                raise RuntimeError(f"{world} simulated ranks did not all beat within 300 s")
            time.sleep(0.05)
        sent, start = sum(log["requests"]), time.monotonic()
        time.sleep(window)
        sent, elapsed = sum(log["requests"]) - sent, time.monotonic() - start
    finally:
        for rank in ranks:
            rank.stop()
    gaps = [b - a for beats in log["beats"] for a, b in zip(beats, beats[1:]) if start <= a < start + elapsed]
    latency = sorted(d for sent_at, d in log["latency"] if start <= sent_at < start + elapsed)
    return {
        "ranks": world,
        "watched_per_rank": min(ring.WATCHED, world - 1),
        "requests_per_s": sent / elapsed,
        "requests_per_s_per_rank": sent / elapsed / world,
        "beat_gap_median_s": statistics.median(gaps),
        "beat_gap_max_s": max(gaps),
        "late_beats": sum(g > 1.5 * INTERVAL for g in gaps) / len(gaps),  # a beat over half an interval late
        # from a rank's call to its answer: the store's time, plus this process's threads taking turns at the GIL
        "request_ms_median": 1000 * latency[len(latency) // 2],
        "request_ms_p99": 1000 * latency[int(0.99 * len(latency))],
        "false_alarms": len(log["alarms"]),
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, gaps) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rows in results.items():
        if rows:
            n = [r["ranks"] for r in rows]
            load.plot(n, [r["requests_per_s_per_rank"] for r in rows], "o-", label=mode)
            gaps.plot(n, [r["beat_gap_max_s"] for r in rows], "o-", label=mode)
    load.set(xscale="log", yscale="log", xlabel="simulated ranks", ylabel="store requests/s per rank", title="load per rank")
    load.set_yticks([2, 5, 10, 20, 50, 100, 200], ["2", "5", "10", "20", "50", "100", "200"])
    load.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    gaps.axhline(INTERVAL, color="grey", linestyle=":", label="beat interval")
    gaps.set(xscale="log", xlabel="simulated ranks", ylabel="longest gap between a rank's beats (s)", title="beats on time?")
    for ax in (load, gaps):
        ax.set_xticks([r["ranks"] for r in results["ring"]], [str(r["ranks"]) for r in results["ring"]])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=10.0, help="seconds counted at each size")
    parser.add_argument("--sizes", default="8,32,128,512", help="simulated ranks, comma-separated")
    parser.add_argument("--all-peers-up-to", type=int, default=128, help="largest size also run with every rank watching every other")
    args = parser.parse_args()
    os.environ["LOOM_HANG_CHECK"] = "3600"  # the ranks share this process's main thread, which waits here
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, list[dict[str, Any]]] = {"ring": [], "all peers (before)": []}
    for world in sizes:
        results["ring"].append(measure(world, args.window))
        print(json.dumps(results["ring"][-1]), flush=True)
    ring_size = ring.WATCHED
    try:
        for world in (w for w in sizes if w <= args.all_peers_up_to):
            ring.WATCHED = world - 1  # every rank watches every other
            results["all peers (before)"].append(measure(world, args.window))
            print(json.dumps({"mode": "all peers", **results["all peers (before)"][-1]}), flush=True)
    finally:
        ring.WATCHED = ring_size
    RESULTS.mkdir(exist_ok=True)
    report = {"what": f"health monitor's store requests, {args.window:g} s window, beat interval {INTERVAL:g} s, one TCPStore, simulated ranks as threads", **results}
    (RESULTS / "health_scale.json").write_text(json.dumps({**report, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    plot(results, RESULTS / "health_scale.png")
    print(f"saved {RESULTS / 'health_scale.json'} and health_scale.png")


if __name__ == "__main__":
    main()
