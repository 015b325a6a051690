"""Machines simulated as network namespaces joined by a bridge, for tests that cross a network.

Each host is a namespace with its own address and hostname (``unshare --uts``); a test can
cut a host off by taking its link down. Tests that use it skip, with the reason, where
namespaces cannot be made (they need root and iproute2).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from contextlib import contextmanager
from typing import Iterator

TAG = str(os.getpid() % 10_000)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    probe = f"lprobe{TAG}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def network(hosts: dict[str, str], prefix: str = "l") -> Iterator[dict[str, str]]:
    """One namespace per host (name -> address in a /24) on one bridge; yields each host's root-side link."""
    bridge = f"{prefix}br{TAG}"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "link", "set", bridge, "up")
    links = {}
    try:
        for name, address in hosts.items():
            ns, inside, outside = namespace(name, prefix), f"{prefix}{name}i{TAG}", f"{prefix}{name}o{TAG}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "link", "set", outside, "master", bridge)
            sh("ip", "link", "set", outside, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inside)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            links[name] = outside
        yield links
    finally:
        for name in hosts:
            subprocess.run(["ip", "netns", "del", namespace(name, prefix)], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{prefix}{name}o{TAG}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def shape(host: str, rate: str, prefix: str = "l") -> None:
    """Limit what ``host`` sends to ``rate`` (``tc ... tbf``, e.g. "1gbit"): this kernel has no netem."""
    sh("ip", "netns", "exec", namespace(host, prefix), "tc", "qdisc", "add", "dev", f"{prefix}{host}i{TAG}", "root",
       "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")  # fmt: skip


def namespace(host: str, prefix: str = "l") -> str:
    return f"{prefix}{host}{TAG}"


def on_host(host: str, command: list[str], prefix: str = "l") -> list[str]:
    """``command`` run inside ``host``'s namespace, with hostname ``host-<host>``."""
    script = f"hostname host-{host} && exec {shlex.join(command)}"
    return ["ip", "netns", "exec", namespace(host, prefix), "unshare", "--uts", "sh", "-c", script]
