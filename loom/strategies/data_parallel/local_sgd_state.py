"""What a local SGD or DiLoCo checkpoint holds beside the model: each replica's own state, and what they hold alike.

``loom.strategies.data_parallel.local_sgd`` says what a save writes and how a restore reads it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from loom.strategies.data_parallel.local_sgd_comms import InFlight, average

if TYPE_CHECKING:
    from loom.strategies.data_parallel.local_sgd import Replicas

SHARED_SUFFIX = "_local_sgd"  # beside a model: what its replicas hold alike (the period, DiLoCo's outer state)
REPLICA_SUFFIX = "_replica"  # + the replica's index: what is its own (its parameters while apart, its optimizer state)


class SharedState:
    """What every replica of a model holds alike: the period's count, and DiLoCo's anchor, outer momentum and the
    mean in flight. Every replica saves the same values (DCP writes them once).

    ``scaled``: whether the replicas' parts hold an fp16 loss scale. ``saved``: the checkpoint's plain
    values of it, when loading (they say which tensors it holds); ``period=False`` loads the outer
    momentum and the counts only (another number of replicas).
    """

    def __init__(self, replicas: Replicas, scaled: bool = False, saved: dict[str, Any] | None = None, period: bool = True) -> None:
        self.replicas, self.scaled, self.saved, self.period = replicas, scaled, saved, period

    def state_dict(self) -> dict[str, Any]:
        r = self.replicas
        if self.saved is not None:  # tensors to load into
            like = dict(zip(r.names, r.params))
            return {
                **self.saved,
                "anchor": {n: torch.empty_like(like[n]) for n in (r.names if self.saved["outer"] else [])},
                "momentum": {n: torch.empty_like(like[n]) for n in self.saved["momentum_names"]},
                "in_flight": {n: torch.empty_like(like[n]) for n in (r.names if self.saved["in_flight_mean"] else [])},
            }
        momentum = {}
        if r.outer is not None:
            held = [(n, r.outer.state.get(a, {}).get("momentum_buffer")) for n, a in zip(r.names, r.anchor)]
            momentum = {n: buffer for n, buffer in held if buffer is not None}
        in_flight = dict(zip(r.names, r.in_flight.mean())) if r.in_flight is not None else {}
        return {
            "replicas": dist.get_world_size(),
            "scaled": self.scaled,
            "pending": r.pending,
            "syncs": r.syncs,
            "outer_steps": r.outer_steps,
            "apart": r.apart,
            "outer": r.outer is not None,
            "anchor": dict(zip(r.names, r.anchor)) if r.outer is not None else {},
            "momentum_names": list(momentum),
            "momentum": momentum,
            "in_flight_mean": bool(in_flight),
            "in_flight": in_flight,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = self.replicas
        r.syncs, r.outer_steps = state["syncs"], state["outer_steps"]
        if r.outer is not None:
            anchors = dict(zip(r.names, r.anchor))
            for name, buffer in state["momentum"].items():
                r.outer.state[anchors[name]]["momentum_buffer"] = buffer.clone()
        if not self.period:
            return
        r.pending = state["pending"]
        for anchor, name in zip(r.anchor or [], r.names):
            anchor.copy_(state["anchor"][name])
        if state["in_flight_mean"]:
            r.in_flight = InFlight.arrived([state["in_flight"][n] for n in r.names])


class ReplicaState:
    """One replica's own part of a checkpoint: its parameters and buffers while the replicas are apart (and,
    overlapped, where its period began), and the tensors of its inner optimizers and its fp16 loss scale.

    Every replica names every replica's part, so that the checkpoint lists them all; only its own holds
    tensors. ``optimizers``: by the names they are saved under; ``None`` leaves them out (replica 0's are
    saved under those names). ``saved``, when loading: the checkpoint's ``SharedState`` values, which say
    whether it holds the parameters and a loss scale (read only into an fp16 run's scaler).
    """

    def __init__(
        self, replicas: Replicas, optimizers: dict[str, torch.optim.Optimizer] | None, scaler: Any, mine: bool, saved: dict[str, Any] | None = None
    ) -> None:
        self.replicas, self.optimizers, self.mine = replicas, optimizers or {}, mine
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.loading = saved is not None
        self.apart = saved["apart"] if saved is not None else replicas.apart
        self.scaled = saved.get("scaled", False) if saved is not None else self.scaler is not None
        self.live = self._tensors() if mine else {}  # now: a save replaces the parameters' data with their mean meanwhile

    def _tensors(self) -> dict[str, Any]:
        r = self.replicas
        tensors: dict[str, Any] = {}
        if self.apart:
            tensors["params"] = {n: p.detach() for n, p in zip(r.names, r.params)}
            tensors["buffers"] = {n: b.detach() for n, b in zip(r.buffer_names, r.buffers)}
            if r.start is not None:
                tensors["start"] = dict(zip(r.names, r.start))
        by_id = {id(p): n for n, p in zip(r.names, r.params)}
        tensors["optimizers"] = {
            key: {by_id[id(p)]: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items() if id(p) in by_id}
            for key, opt in self.optimizers.items()
        }
        if self.scaled:
            scale, tracker = (self.scaler.get_scale(), self.scaler._get_growth_tracker()) if self.scaler else (0.0, 0)
            tensors["scaler"] = {"scale": torch.tensor(scale, dtype=torch.float64), "growth_tracker": torch.tensor(tracker)}
        return tensors

    def state_dict(self) -> dict[str, Any]:
        return _empty_like(self.live) if self.loading else self.live

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = self.live
        for group in ("params", "buffers", "start"):
            for name, tensor in live.get(group, {}).items():
                tensor.copy_(state[group][name])
        for key, by_param in live["optimizers"].items():
            for name, tensors in by_param.items():
                for k, tensor in tensors.items():
                    tensor.copy_(state["optimizers"][key][name][k])
        if "scaler" in live and self.scaler is not None:
            saved = state["scaler"]
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": float(saved["scale"]), "_growth_tracker": int(saved["growth_tracker"])})


class Absent:
    """Saved in place of an object that only replica 0 writes under its name."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _empty_like(tree: Any) -> Any:
    return {k: _empty_like(v) for k, v in tree.items()} if isinstance(tree, dict) else torch.empty_like(tree)


@contextmanager
def agreed(apart: list[Replicas]) -> Iterator[None]:
    """Within: the parameters and buffers of replicas that are apart replaced by their mean; after, as they were.

    ``average`` gives each tensor new data (a view of the averaged flat buffer), so the old data
    is put back as it was, the same storage: the training that follows does not see the save.
    """
    kept = [[t.data for t in r.params + r.buffers] for r in apart]
    try:
        with torch.no_grad():
            for r in apart:
                average(r.params + r.buffers)
        yield
    finally:
        for r, data in zip(apart, kept):
            for t, d in zip(r.params + r.buffers, data):
                t.data = d
