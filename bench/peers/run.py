"""loom against its peers on the same workloads, 2 CPU processes: samples/s and loom's ratio to each.

    python bench/peers/run.py [--repeats 3] [--workloads W1 W2] [--steps W1=20 W2=10]

Peers: hand-written DDP (torchrun), Accelerate and Lightning Fabric (torchrun, in .venv-peers:
``pip install torch==2.13.0 accelerate lightning``), TensorFlow MultiWorkerMirroredStrategy (two
workers by TF_CONFIG, in .venv-tf: ``make bench-tf``). A peer whose environment is missing is
reported as skipped. Configurations are interleaved: each repeat runs every workload and peer
once, in an order rotated from one repeat to the next, so the machine's slow spells spread over
all of them; the median of the repeats is kept. Writes bench/results/peers.json and peers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.workloads import RESULTS, WORKLOADS, save  # noqa: E402

TORCH_PEERS = ROOT / "bench" / "peers" / "torch_peers.py"
TF_PEER = ROOT / "bench" / "peers" / "tf_peer.py"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"
PEERS = ("loom", "ddp", "accelerate", "fabric", "tensorflow")
TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here, or None."""
    if peer in ("accelerate", "fabric") and not PEERS_PYTHON.exists():
        return f"{PEERS_PYTHON.parent.parent} is missing: python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 accelerate lightning"
    if peer == "tensorflow" and not TF_PYTHON.exists():
        return f"{TF_PYTHON.parent.parent} is missing: make bench-tf"
    return None


def launch(peer: str, workload: str, steps: int, out: Path, tf_workers: int = 2, tf_threads: int = 1) -> float:
    """Run one configuration to its end; samples/s as its chief reported them.

    The torch peers run 2 processes of one thread; TensorFlow runs ``tf_workers`` workers of
    ``tf_threads`` intra-op threads each (bench/fast_path.py matches loom's processes with them).
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    args = [workload, str(steps), str(out)]
    if peer == "tensorflow":
        env["TF_THREADS"] = str(tf_threads)
        ports = [_free_port() for _ in range(tf_workers)]
        workers = []
        for index in range(tf_workers):
            config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
            workers.append(subprocess.Popen([str(TF_PYTHON), str(TF_PEER), *args], env={**env, "TF_CONFIG": json.dumps(config)},
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT))  # fmt: skip
        errors = [w.communicate(timeout=TIMEOUT)[1] for w in workers]
        codes = [w.returncode for w in workers]
    else:
        if peer == "loom":
            command = [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", "2"]
        else:
            python = sys.executable if peer == "ddp" else str(PEERS_PYTHON)
            command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        done = subprocess.run([*command, str(TORCH_PEERS), peer, *args], env=env, capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT)
        errors, codes = [done.stderr], [done.returncode]
    if any(codes):
        raise RuntimeError(f"{peer} on {workload} failed: {next(e for e, c in zip(errors, codes) if c)[-2000:]}")
    return json.loads(out.read_text())["samples_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=sorted(WORKLOADS))
    parser.add_argument("--steps", nargs="+", default=["W1=20", "W2=10"], help="timed steps per workload, NAME=STEPS")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    args = parser.parse_args()
    steps = {name: int(n) for name, n in (item.split("=") for item in args.steps)}
    skipped = {peer: why for peer in args.peers if (why := missing(peer))}
    peers = [p for p in args.peers if p not in skipped]
    for peer, why in skipped.items():
        print(f"skipped {peer}: {why}")
    configs = [(w, p) for w in args.workloads for p in peers]
    rates: dict[str, dict[str, list[float]]] = {w: {p: [] for p in peers} for w in args.workloads}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            shift = repeat * len(configs) // args.repeats
            for workload, peer in configs[shift:] + configs[:shift]:  # rotated: each repeat starts elsewhere
                rate = launch(peer, workload, steps[workload], Path(tmp) / f"{workload}-{peer}-{repeat}.json")
                rates[workload][peer].append(rate)
                print(f"repeat {repeat + 1}: {workload} {peer:<11} {rate:9,.0f} samples/s", flush=True)
            table = write(rates, peers, repeat + 1, steps, skipped)  # after every repeat: a run cut short keeps its repeats
    print(table)


def write(rates: dict[str, dict[str, list[float]]], peers: list[str], repeats: int, steps: dict[str, int], skipped: dict[str, str]) -> str:
    """peers.json and peers.md from the repeats so far; returns the table."""
    medians = {w: {p: statistics.median(r) for p, r in by_peer.items()} for w, by_peer in rates.items()}
    ratios = {w: {p: m["loom"] / m[p] for p in peers if p != "loom"} for w, m in medians.items()} if "loom" in peers else {}
    results = {"processes": 2, "threads_per_process": 1, "repeats": repeats, "steps": steps,
               "samples_per_sec": rates, "median": medians, "loom_ratio": ratios, "skipped": skipped}  # fmt: skip
    print(f"saved {save('peers', results)}", flush=True)
    table = markdown(medians, ratios, peers, repeats)
    (RESULTS / "peers.md").write_text(table)
    return table


def markdown(medians: dict, ratios: dict, peers: list[str], repeats: int) -> str:
    """The table of samples/s and loom's ratio to each peer (above 1: loom is faster)."""
    others = [p for p in peers if p != "loom"]
    lines = [
        f"2 CPU processes, 1 thread each; median of {repeats} interleaved repeats; samples/s (loom's ratio to the peer)",
        f"measured {time.strftime('%Y-%m-%d %H:%M')} on a shared, loaded machine: read the ratios, not the absolute rates",
        "",
        "| workload | " + " | ".join(peers) + " |",
        "|---|" + "---|" * len(peers),
    ]
    for workload, by_peer in medians.items():
        cells = [f"{by_peer[p]:,.0f}" + (f" ({ratios[workload][p]:.2f}x)" if p in others and ratios else "") for p in peers]
        lines.append(f"| {workload} {WORKLOADS[workload].description} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
