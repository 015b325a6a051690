"""``loom doctor``: would a job start on these nodes? A preflight, run on each node as ``loom run``.

Node 0 hosts a store at the master's address, as its agent would; every node reaches it,
reports what it would run with (versions, devices, threads, the interface it would pick, the
checkpoint directory it sees), then the nodes run one small gloo all-reduce and time a
transfer between each pair. Node 0 prints one line per finding, with its fix, and every node
exits 0 only when the job would start.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import loom
from loom.cluster import NodeSpec
from loom.devices import available_cores, check_nproc, cuda_count
from loom.errors import LoomError
from loom.launch.torchrun import LaunchOptions, interface_towards

PROBE_BYTES = 8 << 20  # per bandwidth probe: long enough for a shaped link's burst not to count
KEYS = "loom/doctor"


@dataclass
class Finding:
    ok: bool
    text: str
    fix: str = ""

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.text}" + (f"; fix: {self.fix}" if self.fix else "")


def _name(node: int, host: str) -> str:
    return f"node {node} ({host})"


def local_report(opts: LaunchOptions, node: NodeSpec, checkpoint_dir: str | None) -> dict[str, Any]:
    """What this node would run with: checked here, compared across nodes on node 0."""
    findings: list[Finding] = []
    host = socket.gethostname()
    me = _name(node.node_rank, host)
    nproc = opts.processes()
    try:
        check_nproc(nproc)
        gpus = cuda_count()
        findings.append(Finding(True, f"{me}: {nproc} process(es) on " + (f"{gpus} GPU(s)" if gpus else f"CPU, {available_cores()} core(s)")))
    except LoomError as exc:
        findings.append(Finding(False, f"{me}: {exc}"))
    threads, cores = opts.threads_per_process(), available_cores()
    if nproc * threads > cores:
        findings.append(Finding(False, f"{me}: {nproc} processes x {threads} threads > {cores} cores", f"pass --threads {max(1, cores // nproc)} (or fewer --nproc)"))
    else:
        findings.append(Finding(True, f"{me}: {threads} thread(s) per process, {nproc * threads} of {cores} cores"))
    interface = os.environ.get("GLOO_SOCKET_IFNAME") or (interface_towards(node.master_addr) if node.nnodes > 1 else None)
    address = _address_towards(node.master_addr) if node.nnodes > 1 else "127.0.0.1"
    if node.nnodes > 1:
        if interface:
            findings.append(Finding(True, f"{me}: talks over {interface} ({address}); sets GLOO_SOCKET_IFNAME={interface} NCCL_SOCKET_IFNAME={interface}"))
        else:
            findings.append(Finding(False, f"{me}: no interface routes to the master {node.master_addr}", "set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface that reaches the other nodes"))
    return {
        "node": node.node_rank, "host": host, "address": address, "interface": interface,
        "versions": {"torch": torch.__version__, "loom": loom.__version__, "python": platform.python_version()},
        "checkpoint": _checkpoint_dir(me, checkpoint_dir, findings),
        "findings": [f.__dict__ for f in findings],
    }  # fmt: skip


def _address_towards(master: str) -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _checkpoint_dir(me: str, path: str | None, findings: list[Finding]) -> str | None:
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".loom-doctor-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
        findings.append(Finding(True, f"{me}: checkpoint directory {path} is writable"))
        return str(Path(path).resolve())
    except OSError as exc:
        findings.append(Finding(False, f"{me}: checkpoint directory {path} is not writable ({exc.strerror})", "create it with write permission for this user, or pass another --checkpoint-dir"))
        return None


def reach_master(node: NodeSpec, wait: float) -> Finding | None:
    """None when the master's port answers within ``wait`` seconds; else what is wrong and the fix."""
    where = f"{node.master_addr}:{node.master_port}"
    me = f"node {node.node_rank} ({socket.gethostname()})"
    deadline = time.monotonic() + wait
    while True:
        try:
            socket.create_connection((node.master_addr, node.master_port), timeout=min(3.0, wait)).close()
            return None
        except socket.gaierror:
            return Finding(False, f"{me}: the master's host {node.master_addr} does not resolve", "pass --master with an address or a name every node resolves")
        except ConnectionRefusedError:
            why = (f"{me}: nothing listens on the master's port {where} (connection refused)",
                   f"start node 0 first, check the port in --master, or open port {node.master_port} in {node.master_addr}'s firewall")  # fmt: skip
        except OSError as exc:
            why = (f"{me}: cannot reach the master {node.master_addr} ({exc.strerror or 'timed out'})",
                   f"check that {node.master_addr} is node 0's address on a network this node is on (a route, a VPN, security groups)")  # fmt: skip
        if time.monotonic() > deadline:
            return Finding(False, *why)
        time.sleep(0.5)


def _open_store(node: NodeSpec, wait: float) -> dist.TCPStore:
    return dist.TCPStore(node.master_addr, node.master_port, is_master=node.node_rank == 0,
                         wait_for_workers=False, timeout=timedelta(seconds=wait))  # fmt: skip


def _gather(store: dist.TCPStore, kind: str, nnodes: int, wait: float) -> dict[int, Any]:
    found = {}
    deadline = time.monotonic() + wait
    while len(found) < nnodes and time.monotonic() < deadline:
        for r in range(nnodes):
            if r not in found and store.check([f"{KEYS}/{kind}/{r}"]):
                found[r] = json.loads(store.get(f"{KEYS}/{kind}/{r}"))
        time.sleep(0.1)
    return found


def _network_checks(store: dist.TCPStore, node: NodeSpec, reports: dict[int, dict], wait: float) -> dict[str, Any]:
    """One small all-reduce over gloo, then a timed transfer to this node from each lower node."""
    if reports[node.node_rank]["interface"]:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", reports[node.node_rank]["interface"])
    result: dict[str, Any] = {"bandwidth": {}}
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{KEYS}/pg", store), rank=node.node_rank,
                                world_size=node.nnodes, timeout=timedelta(seconds=wait))  # fmt: skip
        total = torch.ones(1)
        dist.all_reduce(total)
        result["all_reduce"] = None if total.item() == node.nnodes else f"summed to {total.item():g}, not {node.nnodes}"
        big, small = torch.empty(PROBE_BYTES // 4), torch.empty(1)
        for src in range(node.nnodes):
            for dst in range(src + 1, node.nnodes):
                if node.node_rank == src:
                    dist.send(small, dst)
                    dist.send(big, dst)
                elif node.node_rank == dst:
                    dist.recv(small, src)
                    start = time.perf_counter()
                    dist.recv(big, src)
                    result["bandwidth"][f"{src}-{dst}"] = PROBE_BYTES / 1e6 / (time.perf_counter() - start)
                dist.barrier()
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError) as exc:
        result["all_reduce"] = str(exc).splitlines()[0][:300]
    return result


def _compare(reports: dict[int, dict], checks: dict[int, dict], nnodes: int) -> list[Finding]:
    findings = [Finding(**f) for r in sorted(reports) for f in reports[r]["findings"]]
    names = {r: _name(r, rep["host"]) for r, rep in reports.items()}
    chief = reports[0]["versions"]
    for r, rep in sorted(reports.items()):
        for what, version in rep["versions"].items():
            if version != chief[what]:
                findings.append(Finding(False, f"{names[r]} has {what} {version} but node 0 has {chief[what]}", f"install {what} {chief[what]} on {names[r]} (every node must run the same versions)"))
    if all(rep["versions"] == chief for rep in reports.values()):
        findings.append(Finding(True, "torch {torch}, loom {loom} and Python {python} on every node".format(**chief)))
    dirs = {r: rep["checkpoint"] for r, rep in reports.items() if rep["checkpoint"]}
    for r, rep in sorted(reports.items()):
        if r and dirs.get(0) and rep.get("sees_node0_checkpoint") is False:
            findings.append(Finding(False, f"{names[r]} does not see node 0's checkpoint directory {dirs[0]}", "put checkpoints on storage every node mounts at the same path (NFS, a parallel filesystem)"))
    for r in range(nnodes):
        failed = checks.get(r, {}).get("all_reduce", "no answer")
        if failed:
            findings.append(Finding(False, f"{names.get(r, f'node {r}')}: the all-reduce across nodes failed: {failed}", "check that GLOO_SOCKET_IFNAME names an interface the other nodes reach, and that no firewall blocks ports between the nodes"))
    if nnodes > 1 and not any(checks.get(r, {}).get("all_reduce", "x") for r in range(nnodes)):
        findings.append(Finding(True, f"an all-reduce across the {nnodes} nodes gave the right sum"))
    for r, check in sorted(checks.items()):
        for pair, rate in sorted(check["bandwidth"].items()):
            src, dst = map(int, pair.split("-"))
            findings.append(Finding(True, f"bandwidth {names[src]} -> {names[dst]}: {rate:,.0f} MB/s"))
    return findings


def doctor(opts: LaunchOptions, checkpoint_dir: str | None = None, wait: float = 60.0) -> int:
    """Check this node (and, with several nodes, the network between them); 0 when a job would start."""
    node = opts.node()
    report = local_report(opts, node, checkpoint_dir)
    if node.nnodes == 1:
        return _print([Finding(**f) for f in report["findings"]])
    if node.node_rank != 0:
        unreachable = reach_master(node, wait)
        if unreachable is not None:
            return _print([Finding(**f) for f in report["findings"]] + [unreachable])
        report["findings"].append(Finding(True, f"{_name(node.node_rank, report['host'])}: reaches the master {node.master_addr}:{node.master_port}").__dict__)
    try:
        store = _open_store(node, wait)
    except (RuntimeError, dist.DistError) as exc:
        fix = f"stop what holds port {node.master_port}, or pick a free one in --master" if node.node_rank == 0 else "start node 0 first"
        return _print([Finding(False, f"node {node.node_rank}: cannot open the job's store at {node.master_addr}:{node.master_port} ({str(exc).splitlines()[0][:200]})", fix)])
    if node.node_rank == 0 and report["checkpoint"]:
        Path(report["checkpoint"], ".loom-doctor-node0").write_text(str(os.getpid()))
    store.set(f"{KEYS}/report/{node.node_rank}", json.dumps(report))
    reports = _gather(store, "report", node.nnodes, wait)
    if len(reports) < node.nnodes:
        missing = ", ".join(str(r) for r in range(node.nnodes) if r not in reports)
        verdict = [Finding(False, f"node(s) {missing} did not report within {wait:g}s", "run `loom doctor` there with the same --nnodes and --master")]
    else:
        if node.node_rank and reports[0]["checkpoint"]:
            report["sees_node0_checkpoint"] = Path(report["checkpoint"] or "/nonexistent", ".loom-doctor-node0").exists()
            store.set(f"{KEYS}/report/{node.node_rank}", json.dumps(report))
            reports = _gather(store, "report", node.nnodes, 1.0)
            reports[node.node_rank] = report
        store.set(f"{KEYS}/checks/{node.node_rank}", json.dumps(_network_checks(store, node, reports, wait)))
        checks = _gather(store, "checks", node.nnodes, wait)
        reports = _gather(store, "report", node.nnodes, 1.0)  # with each node's view of node 0's directory
        verdict = _compare(reports, checks, node.nnodes)
    if node.node_rank == 0:
        code = _print(verdict)
        store.set(f"{KEYS}/verdict", str(code))
        _gather(store, "bye", node.nnodes - 1, 10.0)  # keep the store up until every node has read the verdict
        if report["checkpoint"]:
            Path(report["checkpoint"], ".loom-doctor-node0").unlink(missing_ok=True)
        return code
    try:
        store.wait([f"{KEYS}/verdict"], timedelta(seconds=wait))
        code = int(store.get(f"{KEYS}/verdict"))
    except (RuntimeError, dist.DistError):
        code = 1
    store.set(f"{KEYS}/bye/{node.node_rank - 1}", "1")
    problems = [f for f in verdict if not f.ok]
    for f in problems:
        print(f.line())
    print(f"loom doctor: node 0 found the job {'would start' if code == 0 else 'would not start'}; its output lists every finding")
    return code


def _print(findings: list[Finding]) -> int:
    for f in findings:
        print(f.line())
    problems = sum(not f.ok for f in findings)
    print("loom doctor: the job would start" if not problems else f"loom doctor: {problems} problem(s); the job would not start")
    sys.stdout.flush()
    return 1 if problems else 0
