"""Replica groups that fail, shrink, heal and rejoin while the others train: FT-DDP and FT-HSDP.

``loom run --groups G --nproc N`` starts G groups of N processes; ``auto_strategy()`` then gives
``FaultTolerantMirroredStrategy``: within a group the N processes are ordinary DDP
(``MirroredStrategy``). ``FaultTolerantShardedStrategy`` shards within a group instead (FSDP2,
``ShardedStrategy``) and replicates across groups (HSDP). Across groups it is torchft: a lighthouse decides at every step which groups take part (the quorum),
and each group's gradient is summed across them by torchft's Manager, whose all-reduce a dead
group cannot corrupt, only make fail. One step, the whole contract:

1. quorum: the groups alive now. A group behind the others (restarted) heals in it: torchft's
   transport hands it a live group's weights, optimizer state, ``train_step``'s LR scheduler
   state and step count, and it takes part in this step without data (it adds zeros and
   applies the same update). No checkpoint is read.
2. data: global batch ``d`` (``d`` = steps the job has committed) is split among the groups
   that are not healing, then among each group's N processes (``fault_tolerant_data``).
3. gradients: DDP averages them within the group (FSDP2 reduce-scatters them: process r keeps
   the r-th shard); each group's mean, weighted by its share of the batch, is summed across
   groups: the mean gradient of the whole global batch. Process r of a group sums only the r-th
   of N parts with the other groups (under DDP the group then gathers them). Clipping comes after.
   With them go the groups' digests of the steps they applied: when a split quorum's branches
   meet at one step, the step is refused and all but the lowest group's branch leave
   (``fault_tolerant_history``).
4. commit: the optimizer steps only if every group's all-reduce completed (torchft's
   ``should_commit``), and ``train_step``'s scheduler with it; if a group died mid-step, nobody
   applies the step (nor steps the scheduler) and batch ``d`` is trained again in the next step
   by the groups alive then. A batch is applied once, whole.

``num_replicas_in_sync`` follows the membership. ``reduce``, ``gather`` and ``barrier`` combine
the processes of this group only (they run outside the step, where a group may be missing).

The job's first step makes every group start from group 0's weights (its optimizer is still
empty): each process sums its state with the same process of every group, group 0 adding its
values and the others zeros. torchft's own start-up sync is off: it takes process r's state from
a different group for each r, which mixes the groups' shards under FSDP2.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import time
import urllib.request
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp

from loom.comm.groups import ADDRESS_ENV, GROUP_ENV, GROUPS_ENV, JOB_ENV, LIGHTHOUSE_ENV, EventLog, in_groups
from loom.checkpoint.layout import step_dir
from loom.compat import ft_healing, ft_quorum_id, ft_quorum_ranks, ft_record_quorums
from loom.errors import CheckpointError, LaunchError
from loom.strategies.base import unwrap
from loom.strategies.data_parallel.fault_tolerant_data import GroupLoader, group_slice
from loom.strategies.data_parallel.fault_tolerant_history import History
from loom.strategies.data_parallel.fault_tolerant_overlap import EarlySums
from loom.strategies.data_parallel.mirrored import MirroredStrategy, auto_bucket_cap_mb
from loom.strategies.data_parallel.sync_batchnorm import refuse_torch_sync_batchnorm
from loom.strategies.optimizer import StrategyOptimizer
from loom.strategies.precision import canonical
from loom.strategies.step import LossFn, TrainStep

@dataclass(frozen=True)
class Membership:
    """Who trains the current step: the global batch, the groups, and this group's share of the batch."""

    batch: int  # global batch of the job (steps committed so far)
    groups: tuple[int, ...]  # groups in the quorum, healing ones included
    participants: int  # groups that train on data (the others heal in this step)
    rank: int  # this group's place among them
    quorum_id: int
    start: int  # this group's samples of the global batch: start .. stop - 1
    stop: int

    @property
    def samples(self) -> int:
        return self.stop - self.start


class _AcrossGroups:
    """torchft across the replica groups; mixed in before the strategy that runs within a group.

    A quorum that holds a group launched for another job (see ``loom.launch.groups.job_digest``) is refused.
    """

    trains_across_groups = True

    def __init__(self, precision: str = "32", timeout: float | None = None, **options: Any) -> None:
        name = type(self).__name__
        policy = options.get("mp_policy")
        if canonical(precision) == "16-mixed" or getattr(policy, "param_dtype", None) == torch.float16:
            raise ValueError(f"{name} cannot heal fp16's loss scale: use precision='bf16-mixed' or '32'")
        if options.get("sync_batchnorm"):
            raise ValueError(
                f"{name} cannot sync BatchNorm statistics across groups (sync_batchnorm=True would sync them within each "
                "group only): drop it (each process normalises over its own slice), or use GroupNorm or LayerNorm"
            )
        if not in_groups():
            raise LaunchError(
                f"{name} trains replica groups that a lighthouse coordinates: start the script "
                "with `loom run --groups G --nproc N script.py`"
            )
        super().__init__(precision=precision, timeout=timeout, **options)
        self.group = int(os.environ[GROUP_ENV])
        self.groups = int(os.environ.get(GROUPS_ENV, self.group + 1))
        self.group_size = self.cluster.world_size
        self.membership: Membership | None = None
        self.committed: bool | None = None  # whether the last step applied (False: its batch is trained again)
        self._events = EventLog(self.group, enabled=self.cluster.rank == 0)
        self._job = os.environ.get(JOB_ENV, "")
        self._manager = self._join_groups()
        self._quorums = ft_record_quorums(self._manager)
        self._buckets: list[list[nn.Parameter]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedulers: list[Any] = []  # train_step's: a heal hands them over with the weights
        self._healed_schedulers: list[dict[str, Any]] | None = None  # a live group's, to take after the heal's step
        self._heal_applied = False  # whether the heal's step applied
        self._history = History()  # the quorums of the steps applied: a split quorum's branches differ
        self._dropped: int | None = 0  # steps of its own the last heal dropped (History.take)
        atexit.register(self._manager.shutdown, wait=False)

    def _join_groups(self) -> Any:
        """torchft's Manager for this process; the group's first process starts the group's server.

        The first process makes its Manager before the others: they read the server's address from
        the group's store, where a restarted group would otherwise find its previous life's.
        """
        from torchft import Manager, ProcessGroupGloo

        logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # a warning about NCCL's flight recorder at every quorum
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # torch, reading a heal's bytes
        timeout = timedelta(seconds=self.timeout)
        address = os.environ.get(ADDRESS_ENV)  # set when the groups are on several hosts: a host's name may not resolve on the others
        host = f"[{address}]" if address and ":" in address else address  # in a URL
        reach = {"hostname": host, "store_addr": address} if address else {}

        def make() -> Any:
            return Manager(
                pg=ProcessGroupGloo(timeout=timedelta(seconds=self._start_patience())),  # a collective waits as long for a slow group
                load_state_dict=None,
                state_dict=None,
                init_sync=False,  # the start-up step syncs from group 0 itself (see the module)
                min_replica_size=1,
                use_async_quorum=self.heals_in_its_step,  # loom waits for the quorum before the data either way
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timedelta(seconds=min(self.timeout, 30)),
                rank=self.cluster.rank,
                world_size=self.group_size,
                replica_id=f"job{self._job}_group_{self.group}",  # torchft reads the group from the trailing digits
                lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
                checkpoint_transport=_heal_transport(host, timeout),
                quorum_retries=max(1, int(self.timeout)),  # a quorum that failed on a lighthouse restarted at its address is asked again
                **reach,
            )

        if self.cluster.rank == 0:
            manager = make()
        with self._guard():
            dist.barrier()
        return manager if self.cluster.rank == 0 else make()

    # ---- topology follows the membership ------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        groups = self.membership.participants if self.membership else self.groups
        return groups * self.group_size

    @property
    def replica_id(self) -> int:
        if self.membership is None:
            return self.group * self.group_size + self.cluster.rank
        return self.membership.rank * self.group_size + self.cluster.rank

    def committed_batches(self) -> int:
        """Global batches the job has trained: its committed steps, less the first (the start-up sync), and
        those of the checkpoint it resumed from (``GroupLoader.load_state_dict``)."""
        return max(0, self._manager.current_step() - 1) + self._resumed

    def _resume_at(self, batches: int) -> None:
        """The job has trained ``batches`` global batches (a restored loader's position); a heal hands it on.
        The position goes into the digest of the steps applied, which the groups compare at every step: groups
        that restored different checkpoints (or one none) are told apart at their next step, as branches."""
        self._resumed = batches - max(0, self._manager.current_step() - 1)
        self._history.resume(batches)

    # ---- model and optimizer ------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, **options: Any) -> Any:  # type: ignore[override]
        """Wrap as the strategy within the group does, then join the job: take the weights of a live group (or of group 0 at the start)."""
        if optimizer is None:
            raise ValueError(
                "under --groups a restarted group heals with the optimizer's state too: pass the optimizer, "
                "strategy.prepare(model, optimizer)"
            )
        if self._optimizer is not None:
            raise ValueError(f"{type(self).__name__} trains one model and optimizer: call prepare() once")
        wrapped, opt = super().prepare(model, optimizer, **options)
        module, inner = unwrap(wrapped), opt.optimizer
        self._optimizer = inner
        self._buckets = _buckets([p for p in module.parameters() if p.requires_grad])
        if self.group_size == 1 and not self.shards_gradients and self.sums_every_step:  # with N processes a gradient is final only after DDP's own all-reduce
            self._early = EarlySums(self._buckets, self._flatten, lambda flat: self._manager.allreduce(flat, reduce_op=ReduceOp.SUM))
            for bucket in self._buckets:
                for p in bucket:
                    p.register_post_accumulate_grad_hook(self._grad_ready)

        self._manager.register_state_dict_fn("loom", lambda saved: self._load_heal(module, inner, saved), lambda: self._heal_state(module, inner))
        self._before_start(module)
        self._start(module)
        return wrapped, self._stepping_optimizer(inner)

    def _heal_state(self, module: nn.Module, inner: torch.optim.Optimizer) -> dict[str, Any]:
        """What a group healing from this one takes (torchft's transport serves it from the quorum to the step's commit vote)."""
        schedulers = [s.state_dict() for s in self._schedulers]
        model = {key: self._local(value) for key, value in module.state_dict().items()}  # process r's parts heal process r
        optimizer = self._local_optimizer_state(inner)
        return {"model": model, "optimizer": optimizer, "schedulers": schedulers, "history": self._history.state(), "clip": self._clip,
                "resumed": self._resumed}

    def _load_heal(self, module: nn.Module, inner: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        with torch.no_grad():
            for key, value in module.state_dict().items():
                self._local(value).copy_(saved["model"][key])
        inner.load_state_dict(self._whole_optimizer_state(inner, saved["optimizer"]))
        self._healed_schedulers = saved["schedulers"]
        self._clip = saved["clip"]
        self._resumed = saved["resumed"]
        dropped = self._history.take(saved["history"])  # a heal whose step fails is taken again: the first one's finding stands
        self._dropped = dropped if self._dropped == 0 else self._dropped

    def _before_start(self, module: nn.Module) -> None:
        """What a strategy across groups sets up before the job's first step (or this group's heal)."""

    def _stepping_optimizer(self, inner: torch.optim.Optimizer) -> StrategyOptimizer:
        return _CommittingOptimizer(inner, self.precision, self._may_step, self._sync_and_commit)

    def _start(self, module: nn.Module) -> None:
        """The job's first step is a sync: every group takes group 0's weights. A group joining later heals instead.

        Process r of every group sums its state with process r of the others, group 0 adding its
        values and the others zeros (see the module). Until this group is in the job (the sync or
        its heal applied), it takes quorums again: a heal whose live group died in the middle is
        taken again from another, never started over at step 0.
        """
        started = time.time()
        self._events.write("joining", restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        while True:
            self._quorum(self._start_patience())
            self._wait_for_every_group(started)
            if self._under_way() and ft_healing(self._manager):  # this group heals in that quorum's step
                self._ghost_step(started)
                if self._heal_applied:
                    return
                continue
            if self._under_way() and not self._holds_the_jobs_state():  # a heal in the quorum failed (its live group died): again
                continue
            if self._under_way():  # in the job already (healed in the quorum, or by a heal whose step failed): it trains in this quorum
                self._quorum_ready = True
                return
            states = [self._local(t) for t in module.state_dict().values() if isinstance(t, torch.Tensor)]
            flats = _flat_by_dtype(states)
            if self.group != min(self._quorum_groups()):
                flats = {dtype: torch.zeros_like(flat) for dtype, flat in flats.items()}
            self._managed_sum(list(flats.values()))
            if self._manager.should_commit():
                break
        _unflat_by_dtype(flats, states)

    def _holds_the_jobs_state(self) -> bool:
        """Whether this group is at the job's step with nothing failed: not a group whose heal in the quorum failed."""
        last = self._quorums.last
        return self._manager.errored() is None and (last is None or self._manager.current_step() >= last.max_step)

    def _under_way(self) -> bool:
        """Whether a group of the current quorum has trained: the job has started (this group's own step may still be 0)."""
        return self._manager.current_step() > 0 or (self._quorums.last is not None and self._quorums.last.max_step > 0)

    def _wait_for_every_group(self, started: float) -> None:
        """Take quorums until one shows the job under way (this group heals) or holds every group.

        A quorum of groups all at step 0 is not enough to start the job: a group that started it may be
        missing only for a moment (its heartbeat late on a busy machine). Starting again without it
        would train the batches it trained a second time, on weights it never takes.
        """
        waiting = False
        while not self._under_way() and len(self._quorum_groups()) < self.groups:
            if not waiting:
                self._events.write("waiting", groups=list(self._quorum_groups()))
                waiting = True
            if time.time() - started > self._start_patience():
                raise LaunchError(
                    f"group {self.group} waited {self._start_patience():g}s for all {self.groups} groups to start the job "
                    f"(or for a live group to heal from), but only group(s) {list(self._quorum_groups())} came: start the others"
                )
            self._quorum(self._start_patience())

    def _start_patience(self) -> float:
        """Seconds a group waits for a quorum that holds every group or shows the job under way, and a collective
        across the groups for the slowest of them."""
        return self.timeout

    def _quorum_groups(self) -> tuple[int, ...]:
        """The groups in the current quorum."""
        return tuple(sorted({r // self.group_size for r in ft_quorum_ranks(self._manager) or [self.group]}))

    # ---- one step -----------------------------------------------------------------------------
    def _quorum(self, timeout: float | None = None) -> None:
        """The next quorum, waited for up to ``timeout`` seconds (the strategy's timeout by default)."""
        if self._left:
            raise RuntimeError(f"this {type(self).__name__} left the replica groups (leave()): make a new strategy to train again")
        timeout = self.timeout if timeout is None else timeout
        try:
            self._manager.start_quorum(timeout=timedelta(seconds=timeout))  # waits for the quorum itself where the group heals in it (FT-DiLoCo)
            self._manager.wait_quorum()
        except TimeoutError:
            raise LaunchError(
                f"group {self.group} got no quorum within {timeout:g}s from the lighthouse at {os.environ[LIGHTHOUSE_ENV]}: "
                "if it died or cannot be reached, start `loom lighthouse` there again, and the groups from their last checkpoint"
            ) from None
        self._check_same_job()

    def _check_same_job(self) -> None:
        """Refuse a quorum with a group of another job (launched with another script, arguments, --groups or --nproc),
        or a second group of this group's number: each would train on as if it were one of ours."""
        seen: set[str] = set()
        for replica in self._quorums.last.replica_ids if self._quorums.last else ():
            job, _, group = replica.split(":")[0].rpartition("_group_")
            if job != f"job{self._job}":
                raise LaunchError(
                    f"group {group} runs another job than group {self.group} (its script, arguments, --groups or --nproc differ: "
                    f"{job.removeprefix('job') or 'none'} vs {self._job or 'none'}): start every group with the same `loom run` line"
                )
            if group in seen:
                raise LaunchError(f"two launchers run group {group} of this job: give each host its own --group")
            seen.add(group)
    def _next_batch(self, end: int) -> int | None:
        """The global batch this step trains, after its quorum; None once the job has trained batch ``end - 1``.

        A quorum in which this group heals is a step of its own (without data): then the next one is taken.
        """
        if self._in_step or self._synced:  # the last batch's step was not taken: it would be trained again, or counted as trained
            raise RuntimeError(
                "under --groups each batch that distribute() hands out is one optimizer step (its quorum decides its data): "
                "call optimizer.step() for every batch, and accumulate with train_step(accumulate=k), not strategy.accumulate()"
            )
        while True:
            batch = self.committed_batches()
            if batch >= end:
                return None
            started = time.time()
            self._take_quorum()
            if ft_healing(self._manager):
                self._ghost_step(started)
                continue
            self._take_part(batch, started)
            if self._early is not None:
                self._early.begin(self.membership.samples / self._global_batch)
            return batch

    def _take_quorum(self) -> None:
        """The quorum of the next step: a new one, or the one ``_start`` took, in which this group is a participant already."""
        if self._quorum_ready:
            self._quorum_ready = False
        else:
            self._quorum()

    def _take_part(self, batch: int, started: float) -> None:
        """This group trains batch ``batch`` in the quorum just taken: its share of it, in ``membership``."""
        rank, count = self._manager.participating_rank(), self._manager.num_participants()
        members = self._quorum_groups()
        quorum_id = ft_quorum_id(self._manager)
        start, stop = group_slice(self._global_batch, self.group_size, rank, count)
        if self.membership is None or self.membership.quorum_id != quorum_id:
            self._events.write("quorum", batch=batch, groups=list(members), waited=time.time() - started)
        self.membership = Membership(batch, members, count, rank, quorum_id, start, stop)
        self._keeps_live_state = False
        self._in_step = True

    def _process_slice(self) -> tuple[int, int]:
        """Samples of the global batch that this process trains: its part of the group's slice."""
        m = self.membership
        each = m.samples // self.group_size
        return m.start + self.cluster.rank * each, m.start + (self.cluster.rank + 1) * each

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the global batch's gradient: the groups' sum is taken first (the step's commit vote with it), then clipped.

        The norm goes with a heal: the healing group applies the step's update as the live one does, clipping included.
        """
        self._clip = (max_norm, norm_type)
        if self._in_step and self.sync_gradients and self.sums_every_step:
            self._sync()
        return super().clip_gradients(optimizer, max_norm, norm_type)  # type: ignore[misc]

    def _sync_and_commit(self) -> bool:
        """The optimizer's step: True when every group's all-reduce completed and the step may apply."""
        if not self._synced:
            self._sync()
        self._synced = False
        return bool(self.committed)

    def _sync(self) -> None:
        """Sum the groups' weighted gradients and vote on the step: ``committed`` says whether it applies."""
        if not self._in_step:
            raise RuntimeError(
                "under --groups each step trains the batch that strategy.distribute(...) hands out after the step's "
                "quorum: iterate that loader, one optimizer step per batch"
            )
        self._in_step = False
        self._synced = True
        history = self._history.slots(self.group, self.groups)
        present = torch.tensor([float(p.grad is not None) for bucket in self._buckets for p in bucket])
        sent = self._early.finish() if self._early is not None else None
        if sent is None:
            weight = self.membership.samples / self._global_batch
            flats = [self._flatten(bucket, weight) for bucket in self._buckets]
            self._sum_across_groups([*flats, history, present])
        else:  # the buckets went during backward; the history and the mask follow them
            flats = [flat for flat, _ in sent]
            for work in [work for _, work in sent] + [self._manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in (history, present)]:
                work.wait()
        committed = self.committed = self._vote(history)
        if committed:
            self._history.advance(self.membership.quorum_id)
            self._apply_sums(flats, present)
        self._events.write("commit" if committed else "refused", batch=self.membership.batch, groups=list(self.membership.groups))

    def _vote(self, history: torch.Tensor) -> bool:
        """torchft's commit vote on the step whose sums (``history``'s slots among them) have arrived: refused where a
        split quorum's branches met (all but the lowest group's branch then stop here)."""
        diverged = History.diverged(history)
        if diverged:  # a split quorum's branches met: nobody applies this step, and the other branch leaves
            self._manager.report_error(RuntimeError(f"group(s) {diverged} trained another branch of the job"))
        committed = self._manager.should_commit()
        if self.group in diverged:
            self._events.write("diverged", batch=self.membership.batch, groups=list(self.membership.groups))
            raise LaunchError(
                f"group {self.group} trained other steps than group {min(self.membership.groups)} (the lighthouse split the quorum: "
                "a group's heartbeat lapsed while both were at one step; or the groups restored different checkpoints, or one none: "
                "every group must restore the same one); it stops to be restarted and heal from it (--max-restarts)"
            )
        return committed

    def _grad_ready(self, param: nn.Parameter) -> None:
        """A gradient that backward has finished: in train_step's last micro-batch its bucket may cross the
        groups while backward goes on (see ``fault_tolerant_overlap``)."""
        if self._sends_early and self.sync_gradients and self.step_recorder.in_train_step:
            self._early.grad_ready(param)

    @contextmanager
    def _skip_gradient_sync(self) -> Iterator[None]:
        """train_step's micro-batches before the last: their gradients are not final, so none is sent early."""
        self._sends_early = False
        try:
            with super()._skip_gradient_sync():
                yield
        finally:
            self._sends_early = True

    def _sum_across_groups(self, flats: list[torch.Tensor]) -> None:
        """Sum each bucket over the groups, in place: process r of each group sums the r-th of N parts
        with process r of the others (torchft's managed all-reduce), then the group gathers the parts."""
        n, rank = self._split, self.cluster.rank
        if n == 1:
            return self._managed_sum(flats)
        padded = [flat if flat.numel() % n == 0 else F.pad(flat, (0, -flat.numel() % n)) for flat in flats]  # buckets are cut to fit
        mine = [p.view(n, -1)[rank] for p in padded]
        self._managed_sum(mine)  # in place
        with self._guard():
            for p, part in zip(padded, mine):
                dist.all_gather(list(p.view(n, -1).unbind(0)), part.clone())
        for flat, summed in zip(flats, padded):
            if summed is not flat:
                flat.copy_(summed[: flat.numel()])

    def _managed_sum(self, tensors: list[torch.Tensor]) -> None:
        for work in [self._manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in tensors]:
            work.wait()  # a failure is the Manager's to report: should_commit then says no

    def _ghost_step(self, started: float) -> None:
        """Take part in a step without data while healing: add zeros, take the live state, apply the same update."""
        flats = [torch.zeros(sum(self._local(p).numel() for p in bucket), dtype=bucket[0].dtype, device=self._local(bucket[0]).device) for bucket in self._buckets]
        present = torch.zeros(sum(len(bucket) for bucket in self._buckets))
        self._sum_across_groups([*flats, self._history.slots(self.group, self.groups, healing=True), present])  # the live groups' order
        self._heal_applied = self._manager.should_commit()  # loads the live group's state (and history) before deciding
        if self._heal_applied:
            self._history.advance(ft_quorum_id(self._manager))
            self._apply_sums(flats, present)
            if self._clip is not None:  # the live group's, healed with its state: it clipped this sum too, in this order
                self._clip_grad_norm([p for group in self._optimizer.param_groups for p in group["params"] if p.grad is not None], *self._clip)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        self._take_schedulers()
        if self._heal_applied:
            self._keeps_live_state = True
            self._events.write("healed", batch=self.committed_batches() - 1, seconds=time.time() - started, dropped=self._dropped)
            self._dropped = 0

    # ---- LR schedulers -------------------------------------------------------------------------
    def train_step(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        accumulate: int = 1,
    ) -> TrainStep:
        """Mirrored's step; its scheduler steps only on applied steps and heals with the weights."""
        step = super().train_step(model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)
        if max_grad_norm is not None:
            self._clip = (max_grad_norm, 2.0)  # before its first step: a group may heal from this one before it clips
        if scheduler is not None:
            self._schedulers.append(scheduler)
            self._take_schedulers()  # a group that healed in prepare() takes the live schedulers now
        return step

    def _update_applied(self) -> bool:
        return self.committed is not False

    def _take_schedulers(self) -> None:
        """After a heal's step: take the live group's schedulers (as of before that step) and, if the step
        applied, step them once, as the live group does.

        Their learning rates are set back to the live ones first: a scheduler built after the heal
        reset them, and a chainable one (StepLR) computes the next from them.
        """
        healed = self._healed_schedulers
        if healed is None or len(self._schedulers) < len(healed):
            return  # not healed, or the script has not built them yet
        self._healed_schedulers = None
        for scheduler, saved in zip(self._schedulers, healed):
            scheduler.load_state_dict(saved)
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
            if self._heal_applied:
                scheduler.step()

    # ---- data ---------------------------------------------------------------------------------
    def distribute(  # type: ignore[override]
        self,
        data: Any,
        batch_size: int | None = None,
        shuffle: bool | None = None,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **options: Any,
    ) -> GroupLoader:
        """This process's part of each global batch, split among the groups alive at each step (see the module)."""
        unsupported = {k: v for k, v in options.items() if v not in (None, False, "auto")}
        if unsupported:
            raise ValueError(f"under --groups, distribute() does not take {', '.join(unsupported)}: the groups split each batch themselves")
        self._announce()
        return GroupLoader(self, data, batch_size, shuffle, seed, collate_fn)

    _global_batch = 1
    _left = False  # leave() was called: the Manager is shut down
    _resumed = 0  # global batches trained before this job's first step (a restored checkpoint's)
    sums_every_step = True  # the groups sum gradients at every step (DiLoCo's meet every sync_every steps instead)
    heals_in_its_step = True  # a healing group takes part in the step without data (False: it heals in the quorum, then trains)
    _quorum_ready = False  # _start took the quorum of this group's first step
    _keeps_live_state = False  # healed, and no batch trained since: a restore at the script's start loads nothing
    _in_step = False  # a quorum was taken for a batch whose gradients are not yet synced
    _synced = False  # clipping summed this step's gradients across the groups already
    _clip: tuple[float, float] | None = None  # the norm (and its type) the steps clip to, once a step has clipped
    shards_gradients = False  # whether process r holds only the r-th shard of each gradient (FSDP2)
    _early: EarlySums | None = None  # the buckets that cross the groups during backward (one process per group)
    _sends_early = True  # False in train_step's micro-batches before the last

    # ---- process r's part of a tensor: all of it here; FaultTolerantShardedStrategy's: its DTensor shard ----
    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @staticmethod
    def _shard_like(param: torch.Tensor, local: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """``_local``'s inverse: ``local`` as the part of a tensor on ``param``'s devices, laid out as
        ``layout`` says (``_layout``'s), else as ``param``."""
        return local

    @staticmethod
    def _layout(tensor: torch.Tensor) -> Any:
        """How a tensor of which ``_local`` gives a part is laid out: what ``_shard_like`` needs to rebuild it."""
        return None

    @property
    def _split(self) -> int:
        """The parts a bucket is cut into to cross the groups, one per process of the group (1: it crosses whole)."""
        return 1 if self.shards_gradients else self.group_size

    def _flatten(self, bucket: list[nn.Parameter], weight: float) -> torch.Tensor:
        """The bucket's gradients times ``weight``, in one flat tensor written in one pass (zeros for a missing one),
        padded with zeros to cut into ``_split`` equal parts."""
        size = sum(self._local(p.detach()).numel() for p in bucket)
        flat = self._local(bucket[0].detach()).new_empty(size + -size % self._split)
        flat[size:].zero_()
        for p, part in zip(bucket, self._parts(flat, bucket)):
            if p.grad is None:
                part.zero_()
            else:
                torch.mul(self._local(p.grad).detach(), weight, out=part)
        return flat

    def _unflatten(self, flat: torch.Tensor, bucket: list[nn.Parameter]) -> None:
        """The summed bucket into the gradients: as views of it where the gradient is whole (no copy);
        into FSDP2's own shards where it is sharded."""
        for p, part in zip(bucket, self._parts(flat, bucket)):
            if not self.shards_gradients:
                p.grad = part
            elif p.grad is None:
                p.grad = self._shard_like(p, part.clone())
            else:
                self._local(p.grad).copy_(part)

    def _parts(self, flat: torch.Tensor, bucket: list[nn.Parameter]) -> Iterable[torch.Tensor]:
        """Each parameter's span of a bucket's flat tensor, shaped as its part on this process."""
        offset = 0
        for p in bucket:
            local = self._local(p.detach())
            yield flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()

    def _apply_sums(self, flats: list[torch.Tensor], present: torch.Tensor) -> None:
        """The summed gradients into the parameters; one that no group computed a gradient for keeps none,
        as under DDP, so the optimizer leaves it alone (Adam would move it with zeros)."""
        for bucket, flat in zip(self._buckets, flats):
            self._unflatten(flat, bucket)
        for p, groups in zip((p for bucket in self._buckets for p in bucket), present.tolist()):
            if not groups:
                p.grad = None

    def _local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with process r's parts (those that differ from the whole named in ``"sharded"``)."""
        saved = optimizer.state_dict()
        state = {index: {key: self._local(v) if isinstance(v, torch.Tensor) else v for key, v in entry.items()} for index, entry in saved["state"].items()}
        sharded = [[index, key, self._layout(v)] for index, entry in saved["state"].items() for key, v in entry.items() if state[index][key] is not v]
        return {**saved, "state": state, "sharded": sharded}

    def _whole_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """``_local_optimizer_state``'s inverse, on this process's parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {index: dict(entry) for index, entry in saved["state"].items()}
        for index, key, layout in saved["sharded"]:
            state[index][key] = self._shard_like(params[index], state[index][key], layout)
        return {"state": state, "param_groups": saved["param_groups"]}

    # ---- checkpoints and the end --------------------------------------------------------------
    def save(self, directory: Any, *, step: int | None = None, **options: Any) -> Any:  # type: ignore[override]
        """Written by one group, the lowest that trained the last quorum's step (not one healing in it): after
        the step every group holds the same state, and two groups writing one directory (on one machine, or
        a shared file system) would race. The other groups return its path without writing (on hosts that
        share no file system, the checkpoint is on that group's host). ``step`` defaults to the global batches the
        job has trained."""
        step = self.committed_batches() if step is None else step  # the same in every group, whatever each sees on disk
        if self._manager.participating_rank() != 0:
            return step_dir(directory, step)
        return super().save(directory, step=step, **options)  # type: ignore[misc]

    def restore(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """As every strategy restores; but a group that has just healed from a live group (and trained no batch
        since) keeps the live state, which is newer than any checkpoint its script restores at its start: it loads
        nothing and returns None, as if there were no checkpoint."""
        if self._keeps_live_state:
            self.print(f"loom: group {self.group} healed from a live group and keeps its state: restore({directory}) loads nothing", file=sys.stderr)
            return None
        return super().restore(directory, **options)  # type: ignore[misc]

    def leave(self) -> None:
        """Leave the replica groups and keep the process group: another strategy may then train in these processes.

        Every group leaves at the same point (after the same step), as every replica calls ``save``; the next
        strategy's first step starts a new job of the groups, from group 0's weights.
        """
        if not self._left:
            self._left = True
            atexit.unregister(self._manager.shutdown)
            self._manager.shutdown(wait=False)

    def shutdown(self) -> None:
        self.leave()
        super().shutdown()  # type: ignore[misc]


class FaultTolerantMirroredStrategy(_AcrossGroups, MirroredStrategy):
    """MirroredStrategy (DDP) within each replica group, torchft's fault-tolerant all-reduce across groups (FT-DDP).

    Args:
        precision: ``"32"`` or ``"bf16-mixed"`` (fp16's loss scale is not healed, so it is refused).
        timeout: seconds a collective or a quorum may wait (default: ``LOOM_TIMEOUT``, else 300).
        **options: MirroredStrategy's DDP options, for the processes of a group.
    """

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        """DDP within a group of several processes; a group of one has nothing to reduce within it, and
        DDP would only copy each gradient into its buckets again (the groups' sum starts in backward instead)."""
        if self.group_size > 1:
            return super()._wrap_model(module)
        refuse_torch_sync_batchnorm(module, self.device, type(self).__name__)
        return module


class _CommittingOptimizer(StrategyOptimizer):
    """Steps only when the step commits (every group's gradients arrived); otherwise the batch is trained again."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any, should_step: Callable[[Any], bool], commit: Callable[[], bool]) -> None:
        super().__init__(optimizer, precision, should_step)
        self._commit = commit

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if not self._step_acts() or not self._commit():
            return None
        return self.precision.step(self.optimizer, closure)


def _heal_transport(address: str | None, timeout: timedelta) -> Any:
    """torchft's HTTP transport of the heals, loading what another process sends as tensors and plain values only
    (torchft unpickles it whole, which runs whatever the bytes say), and giving the other groups this host's
    ``address``, where set, instead of its name."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._server.RequestHandlerClass.log_message = lambda handler, *args: None  # http.server's line per request, on stderr

        def address(self) -> str:
            return super().address() if address is None else f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

        @classmethod
        def _load_from_address(cls, url: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as f:
                return load_heal(f)

    return Transport(timeout=timeout, num_chunks=0)


def load_heal(f: Any) -> object:
    """A heal's state from a stream, as tensors and plain values: any other object in it is refused, not built."""
    from torch.distributed._serialization import _streaming_load

    try:
        return _streaming_load(f, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"a heal's state held an object loom does not load from another process: {str(error).splitlines()[0]}") from None


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters in reverse order (the order backward usually fills their gradients), cut into buckets
    of Mirrored's automatic size (``auto_bucket_cap_mb``) and at each change of dtype: the same on every
    group, restarted or not."""
    cap = auto_bucket_cap_mb([p.shape for p in params]) * 2**20
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and (size + nbytes > cap or p.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


def _flat_by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """The tensors' values in one flat copy per dtype (bool as uint8, which gloo can sum)."""
    flats: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        flats.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {dtype: torch.cat(parts).to(torch.uint8 if dtype == torch.bool else dtype) for dtype, parts in flats.items()}


def _unflat_by_dtype(flats: dict[torch.dtype, torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """``_flat_by_dtype``'s inverse: the values copied back into ``tensors``, in place."""
    offsets = dict.fromkeys(flats, 0)
    with torch.no_grad():
        for t in tensors:
            start = offsets[t.dtype]
            t.copy_(flats[t.dtype][start : start + t.numel()].view_as(t))
            offsets[t.dtype] = start + t.numel()
