"""A dead worker's last push: applied on every server it touched, or on none.

A worker stages its push on every server it touches, then commits it on each. Killed in
between, it leaves staged shares behind. Its launcher, which saw it die, settles them before
starting a successor: a push committed somewhere, or staged on every server it was meant
for, is whole, and is committed on the rest; any other is aborted where it was staged.
"""

from __future__ import annotations

from loom.strategies.parameter_server.client import ServerClient


def settle(clients: list[ServerClient], worker: str) -> list[str]:
    """Commit or abort ``worker``'s staged pushes on every server; one line per push settled."""
    pending = [client.call({"op": "pending", "worker": worker})[0] for client in clients]
    committed = max(p["committed"] for p in pending)
    outcome = []
    for seq in sorted({int(seq) for p in pending for seq in p["staged"]}):
        holders = [s for s, p in enumerate(pending) if str(seq) in p["staged"]]
        parts = pending[holders[0]]["staged"][str(seq)]
        whole = seq <= committed or all(s in holders for s in parts)
        for server in holders:
            clients[server].call({"op": "commit" if whole else "abort", "worker": worker, "seq": seq})
        servers = ", ".join(clients[s].address for s in parts)
        outcome.append(f"push {seq} of {worker} {'applied on every server' if whole else 'applied on none'} ({servers})")
    return outcome
