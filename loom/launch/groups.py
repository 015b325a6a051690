"""Replica groups: ``loom run --groups G --nproc N script.py`` on one machine, or across machines
``loom lighthouse`` on one host and ``loom run --lighthouse HOST:PORT --groups G --group I`` on each group's.

The launcher starts a torchft lighthouse (or uses ``--lighthouse HOST:PORT``) and G groups (or group I), each
one ``loom run --nproc N`` of its own: torchrun's agent, restarting the group's processes up to
``--max-restarts`` times when one fails, while the other groups train on. A restarted group
rejoins at the next step and heals from a live group (``FaultTolerantMirroredStrategy``). From
the groups' events the launcher says, in one line each, when a group left, rejoined and healed,
and how long each took.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from loom.comm.groups import ADDRESS_ENV, EVENTS_ENV, GROUP_ENV, GROUPS_ENV, JOB_ENV, LIGHTHOUSE_ENV, EventReader
from loom.devices import cuda_count, thread_budget
from loom.errors import LaunchError
from loom.fast import allocator
from loom.launch.parent import die_with_parent
from loom.launch.torchrun import LaunchOptions, address_towards, interface_addresses, interface_towards, name_resolves, run_job
from loom.launch.zygote import ForkedWorker, Forker

# A group whose heartbeat the lighthouse has not heard for this long is out of the next quorum:
# the time the others wait after a group dies. Too short, and a busy machine drops live groups.
HEARTBEAT_TIMEOUT_MS = int(os.environ.get("LOOM_FT_HEARTBEAT_TIMEOUT_MS", "2000"))
# Past a failure the lighthouse waits this long for groups that heartbeat but have not asked to join.
JOIN_TIMEOUT_MS = 1000


def _say(message: str) -> None:
    print(f"loom: {message}", file=sys.stderr, flush=True)


def start_lighthouse(port: int = 0, min_groups: int = 1) -> Any:
    """A lighthouse in this process, on ``port`` (0: a free one), that forms a quorum of ``min_groups`` groups or more."""
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(
            bind=f"[::]:{port}", min_replicas=min_groups, join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=20, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
        )
    except RuntimeError as error:
        raise LaunchError(f"the lighthouse cannot listen on port {port} ({error}): pick a free one with --port") from None


def serve_lighthouse(port: int, min_groups: int) -> int:
    """``loom lighthouse``: a lighthouse for groups launched on other hosts, until it is stopped (Ctrl-C, SIGTERM)."""
    if min_groups < 1:
        raise LaunchError(f"--min-groups takes the groups a step needs, at least 1 (got {min_groups})")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log says every quorum, at info
    server = start_lighthouse(port, min_groups)
    address = server.address().removeprefix("http://")
    print(f"loom: lighthouse listening on {address}; {_reach(address)}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.wait(0.2):  # a short wait: the signal handler runs between waits
        pass
    server.shutdown()
    return 0


def _reach(address: str) -> str:
    """How the groups' hosts reach a lighthouse at ``address`` (this host's name and port): by that
    name where it resolves, else by one of this host's addresses, which are listed."""
    port = address.rpartition(":")[2]
    addresses = [ip for ip in interface_addresses().values() if not _loopback(ip)]
    routed = address_towards("192.0.2.1")  # the default route's (a documentation address: nothing is sent)
    addresses.sort(key=lambda ip: ip != routed)
    at = address if name_resolves() or not addresses else f"{addresses[0]}:{port}"
    listed = f" (this host's addresses: {', '.join(addresses)})" if addresses else ""
    return f"on each group's host: loom run --lighthouse {at} --groups G --group I --nproc N script.py{listed}"


def _dropped(steps: int | None) -> str:
    """What a heal dropped of the healed group's own steps (``History.take``)."""
    if steps == 0:
        return ""
    if steps is None:
        return "; whether it dropped steps of its own cannot be told: its branch, or how far it was behind, goes past the steps whose digests are kept"
    return (
        f"; it dropped its own last {steps} step(s): the lighthouse had split the quorum, and it trained them on a branch "
        "of its own, which the kept branch trained too"
    )


def job_digest(entry: list[str], groups: int, nproc: int) -> str:
    """What every group of one job must share: the script's text (or module name), its arguments, --groups and --nproc."""
    digest = hashlib.sha256(f"{groups} {nproc}".encode())
    for part in entry:
        digest.update(b"\0" + part.encode())
        if os.path.isfile(part):
            with open(part, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:12]


def check_lighthouse(address: str) -> tuple[str, str]:
    """``HOST:PORT`` of a lighthouse started elsewhere, as torchft takes it, and this host's address towards it
    (where the other groups' hosts can reach this one, unless it is loopback); one line when it cannot be reached."""
    host, _, port = address.removeprefix("http://").rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"--lighthouse takes HOST:PORT (e.g. node0:29510), not {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as connection:
            here = connection.getsockname()[0]
    except OSError as error:
        raise LaunchError(
            f"the lighthouse at {host}:{port} cannot be reached within 5s ({error.strerror or error}): start it there with "
            "`loom lighthouse --port PORT`, or leave --lighthouse out to start one here"
        ) from None
    return f"http://{host}:{port}", here


def _given_address() -> str | None:
    """``LOOM_GROUP_ADDRESS`` where set: an IP address, or a name that resolves here; one line otherwise."""
    value = os.environ.get(ADDRESS_ENV)
    if not value:
        return None
    try:
        ipaddress.ip_address(value.split("%")[0])
        return value
    except ValueError:
        pass
    try:
        socket.getaddrinfo(value, None)
    except OSError:
        raise LaunchError(
            f"{ADDRESS_ENV}={value!r} is neither an IP address nor a host name that resolves: set it to the address where "
            "the other groups' hosts reach this one, or unset it (this host's address towards the lighthouse is the default)"
        ) from None
    return value


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def run_groups(entry: list[str], opts: LaunchOptions, groups: int, lighthouse: str | None = None, group: int | None = None) -> int:
    """Run ``groups`` replica groups of ``opts.nproc`` processes here (or only ``group``, of a job across hosts) until each is done."""
    if groups < 1:
        raise LaunchError(f"--groups takes a number of replica groups, at least 1 (got {groups})")
    if group is not None and not 0 <= group < groups:
        raise LaunchError(f"--group takes this host's group, 0 .. {groups - 1} of --groups {groups} (got {group})")
    if opts.node().nnodes > 1:
        raise LaunchError("--groups starts a group's processes on this machine; it does not take --nnodes (across machines: --group I on each group's host)")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log says every quorum and commit, at info
    nproc = opts.processes()
    here = range(groups) if group is None else [group]
    threads = opts.threads or thread_budget(len(here) * nproc)
    # Each group is a launcher started as its workers start, so that it forks their zygote from itself; the
    # groups are forked from one zygote: this process, forked before the lighthouse's threads run, where it
    # can be (loom.launch.zygote), else a new interpreter.
    started = {"OMP_NUM_THREADS": str(threads), **(allocator.launcher_environment(os.environ) if not cuda_count() else {})}
    forker = Forker() if not cuda_count() else None
    if forker is not None:
        forker.start_early({**os.environ, **started})
    server, address = None, {}
    if lighthouse is None:
        server = start_lighthouse()
        lighthouse = server.address()
    else:  # other groups may be on other hosts: tell them an address of this one they can reach, not its name
        lighthouse, reachable = check_lighthouse(lighthouse)
        mine = _given_address() or (None if _loopback(reachable) else reachable)
        if mine:  # (a lighthouse reached over loopback says nothing of where the other hosts reach this one)
            address = {ADDRESS_ENV: mine}
            interface = os.environ.get("GLOO_SOCKET_IFNAME") or interface_towards(mine)
            if interface:  # gloo listens where this host's name resolves to, loopback where it does not
                address["GLOO_SOCKET_IFNAME"] = interface
    events = os.environ.get(EVENTS_ENV) or tempfile.mkdtemp(prefix="loom-groups-")  # one given is kept
    env = {**os.environ, **started, **address, LIGHTHOUSE_ENV: lighthouse, GROUPS_ENV: str(groups), EVENTS_ENV: events, JOB_ENV: job_digest(entry, groups, nproc)}
    running = {g: _start_group(g, entry, opts, nproc, threads, env, groups, forker) for g in here}
    failed: dict[int, int] = {}
    stopped: list[subprocess.Popen] = []
    reader, lines = EventReader(events), MembershipLines()
    try:
        while running:
            time.sleep(0.1)
            exited = {g: code for g, code in ((g, p.poll()) for g, p in running.items()) if code is not None}
            for event in reader.read():  # after the poll: an exited group's last events are in
                for line in lines.feed(event):
                    _say(line)
            for g, code in exited.items():
                if running.pop(g, None) is None:
                    continue  # stopped above, as late
                if code:
                    failed[g] = code
                    _say(f"group {g} failed for good (exit code {code}, after {opts.max_restarts} restart(s)); the others train on")
                    continue
                for late in sorted(set(running) - lines.last_groups.get(g, set(running))):
                    _say(f"group {late} stopped: the job finished (group {g} trained its last batch) while it was restarting")
                    stopped.append(running.pop(late))
                    stopped[-1].terminate()
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in [*running.values(), *stopped]:
            proc.wait()
        if forker is not None:
            forker.close()
        if server is not None:
            server.shutdown()
        if events != os.environ.get(EVENTS_ENV):
            shutil.rmtree(events, ignore_errors=True)
    return 1 if failed else 0


def _start_group(group: int, entry: list[str], opts: LaunchOptions, nproc: int, threads: int, env: dict[str, str], groups: int,
                 forker: Forker | None) -> subprocess.Popen | ForkedWorker:  # fmt: skip
    """Group ``group``'s launcher, forked where it can be, else ``python -u -m loom.launch.groups ...``; it ends with this one."""
    timeout = "-" if opts.timeout is None else str(opts.timeout)
    command = ["-m", "loom.launch.groups", str(group), str(groups), str(nproc), str(opts.max_restarts), str(threads), timeout, *entry]
    env = {**env, GROUP_ENV: str(group)}
    forked = forker.fork(command, env, die_with_parent=True) if forker is not None else None
    return forked or subprocess.Popen([sys.executable, "-u", *command], env=env, preexec_fn=die_with_parent)


class MembershipLines:
    """The launcher's lines from the groups' events: a group left, rejoined, healed; a step not applied."""

    def __init__(self) -> None:
        self.members: set[int] | None = None
        self.last_with: dict[int, float] = {}  # group -> when the last step with it committed
        self.left_at: dict[int, float] = {}  # group -> when the first step without it committed
        self.refused: set[int] = set()
        self.last_groups: dict[int, set[int]] = {}  # group -> the groups of the last step it committed

    def feed(self, event: dict[str, Any]) -> list[str]:
        kind, t = event["event"], event["t"]
        if kind == "healed":
            line = f"group {event['group']} healed at batch {event['batch']} in {event['seconds']:.1f}s (a live group's weights and optimizer state, no checkpoint)"
            return [line + _dropped(event.get("dropped", 0))]
        if kind == "refused":
            if event["batch"] in self.refused:
                return []
            self.refused.add(event["batch"])
            if event.get("last", event["batch"]) > event["batch"]:  # a DiLoCo round
                return [f"batches {event['batch']}-{event['last']} not applied: a group failed during their round; the groups alive train them again"]
            return [f"batch {event['batch']} not applied: a group failed during its step; the groups alive train it again"]
        if kind != "commit":
            return []
        members, out = set(event["groups"]), []
        self.last_groups[event["group"]] = members
        if self.members is not None:
            for g in sorted(self.members - members):
                others = ", ".join(map(str, sorted(members)))
                out.append(f"group {g} left at batch {event['batch']}: group(s) {others} went on without it {t - self.last_with[g]:.1f}s after the last step with it")
                self.left_at[g] = t
            for g in sorted(members - self.members):
                since = f", {t - self.left_at.pop(g):.1f}s after it left" if g in self.left_at else ""
                out.append(f"group {g} {'rejoined' if since else 'joined'} at batch {event['batch']}{since}")
        self.members = members
        for g in members:
            self.last_with[g] = t
        return out


def main(argv: list[str]) -> int:
    """One group: ``python -m loom.launch.groups GROUP GROUPS NPROC MAX_RESTARTS THREADS TIMEOUT SCRIPT [args]``."""
    group, groups, nproc, restarts, threads = (int(a) for a in argv[:5])
    timeout = None if argv[5] == "-" else float(argv[5])
    opts = LaunchOptions(nproc=nproc, max_restarts=restarts, threads=threads, timeout=timeout)
    layout = f"{groups} groups x {nproc} process{'es' if nproc > 1 else ''} (--groups {groups} --nproc {nproc}), this is group {group}"
    return run_job(argv[6:], opts, layout=layout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
