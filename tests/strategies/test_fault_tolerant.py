"""FaultTolerantMirroredStrategy under ``loom run --groups``: exact data through a kill -9, healing, equivalence.

Launched jobs, each shared by several assertions; every step clips the gradient norm, about half
of them below it. Without failure, 2 groups of 2 processes end where OneDeviceStrategy on the
global batch ends (clipped as one device clips: the norm of the whole batch's gradient). With group 1 killed in the middle of a
step: the step is not applied and is trained again by group 0 alone, group 0 is never
restarted, group 1 comes back, heals from group 0 (no checkpoint exists) and ends bit-identical
to it, its StepLR schedule included; every sample of every epoch is trained exactly once, and the
weights and learning rate still equal OneDevice's (the schedule steps only on applied steps).
Group 1 starts late (``LATE``): the job's start waits for it, and if group 0 had started without
it, group 0 would be stopped until group 1 dies, as a busy machine stops a heartbeat.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import loom

pytest.importorskip("torchft", reason="the ft extra: pip install loom[ft]")  # installed by make

from loom.strategies.data_parallel.fault_tolerant_overlap import EarlySums  # noqa: E402
from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, run  # noqa: E402
from tests.netns import network, on_host, shape, why_no_namespaces  # noqa: E402
from tests.strategies.ft_jobs import assert_close, assert_two_groups_trained_as_one_device, evaluated, finish, ft_train, kill_the_dying_group, lighthouse, no_job_left, one_device, read_steps, samples_per_epoch, start_job  # noqa: E402, F401


@pytest.mark.timeout(300)
def test_groups_without_failure_equal_one_device(tmp_path):
    job = start_job(tmp_path, "--groups", "2", "--nproc", "2", env={"CHECK_REFUSALS": "1"})
    finish(job, 280)
    steps = read_steps(tmp_path)
    assert {s["replicas"] for s in steps} == {4}  # 2 groups x 2 processes
    assert 0 < sum(s["norm"] > ft_train.MAX_NORM for s in steps) < len(steps)  # clipping bites, not at every step
    assert all(c == Counter(range(96)) for c in samples_per_epoch(steps).values())
    final = {(g, r): torch.load(tmp_path / f"final-{g}-{r}.pt") for g in (0, 1) for r in (0, 1)}
    weights, schedule = one_device()
    for g, r in final:
        assert_close(final[g, r], weights)
        assert json.loads((tmp_path / f"lr-{g}-{r}.json").read_text()) == schedule
        # loom.evaluate takes no quorum: each group evaluates every sample (91: a partial last batch), split among its processes
        assert json.loads((tmp_path / f"eval-{g}-{r}.json").read_text())["loss"] == pytest.approx(evaluated(final[g, r]), rel=1e-6)
    refusals = json.loads((tmp_path / "refusals-1-1.json").read_text())
    assert refusals[0].startswith("under --groups a restarted group heals with the optimizer's state too: pass the optimizer")
    assert refusals[1] == "FaultTolerantMirroredStrategy trains one model and optimizer: call prepare() once"
    assert refusals[2].startswith("under --groups each step trains the batch that strategy.distribute(...) hands out")
    assert refusals[3].startswith("under --groups every step trains a whole global batch, but 96 samples leave a last batch of 44")
    left = json.loads((tmp_path / "left-0-1.json").read_text())
    assert left == "this FaultTolerantMirroredStrategy left the replica groups (leave()): make a new strategy to train again"


@pytest.mark.timeout(300)
def test_groups_launched_apart_join_a_lighthouse_and_equal_one_device_and_other_jobs_are_refused(tmp_path):
    """`loom lighthouse` and one `loom run --group I` per group, each a process of its own, as on three hosts;
    each step in two micro-batches (``train_step(accumulate=2)``)."""
    with lighthouse() as address:
        apart = ("--lighthouse", address, "--groups", "2", "--nproc", "1")
        other = tmp_path / "other"  # the script's argument differs: another job
        other.mkdir()
        jobs = [start_job(out, *apart, "--group", str(g)) for g, out in ((0, tmp_path), (1, other))]
        for g, job in enumerate(jobs):
            _, err = job.communicate(timeout=150)
            assert job.returncode == 1
            assert re.search(rf"LaunchError: group {1 - g} runs another job than group {g} \(its script, arguments, --groups or --nproc differ: \w+ vs \w+\): start every group with the same `loom run` line", err), err[-3000:]
        assert not (tmp_path / "steps.jsonl").exists() and not (other / "steps.jsonl").exists()  # refused before any step

        jobs = [start_job(tmp_path, *apart, "--group", str(g), env={"ACCUMULATE": "2"}) for g in (0, 1)]  # two backward passes a step
        for job in jobs:
            finish(job, 200)
    assert_two_groups_trained_as_one_device(tmp_path)


@pytest.mark.timeout(120)
def test_a_lighthouse_lost_mid_job_stops_every_group_within_the_timeout_in_one_line(tmp_path):
    """Killed with SIGKILL after batch 2 and never started again: each group, at its next quorum, waits
    LOOM_TIMEOUT (15 s here: the groups' start waits as long for both launchers) and stops naming the lighthouse and what to do, rather than hang or raise gRPC's error."""
    started: list = []
    with lighthouse(started) as address:
        apart = ("--lighthouse", address, "--groups", "2", "--nproc", "1")
        jobs = [start_job(tmp_path, *apart, "--group", str(g), env={"PAUSE_AT": "2", "LOOM_TIMEOUT": "15"}) for g in (0, 1)]
        while not all((tmp_path / f"paused-{g}-0").exists() for g in (0, 1)):
            assert all(job.poll() is None for job in jobs), jobs[0].communicate()[1][-3000:]
            time.sleep(0.05)
        started[0].kill()
        lost = time.monotonic()
        (tmp_path / "go").write_text("")
        errors = [job.communicate(timeout=60)[1] for job in jobs]
    assert time.monotonic() - lost < 45
    for g, (job, err) in enumerate(zip(jobs, errors)):
        assert job.returncode == 1
        assert f"LaunchError: group {g} got no quorum within 15s from the lighthouse at http://{address}: if it died or cannot be " \
               "reached, start `loom lighthouse` there again, and the groups from their last checkpoint" in err, err[-3000:]


def test_fp16_and_batchnorm_synced_within_groups_only_are_refused_in_one_line():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for fp16 in (lambda: loom.FaultTolerantMirroredStrategy(precision="16-mixed"), lambda: loom.FaultTolerantMirroredStrategy(precision="mixed_float16"),
                 lambda: loom.FaultTolerantShardedStrategy(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))):  # fmt: skip
        with pytest.raises(ValueError, match=r"cannot heal fp16's loss scale: use precision='bf16-mixed' or '32'"):
            fp16()
    with pytest.raises(ValueError, match=r"^FaultTolerantShardedStrategy cannot sync BatchNorm statistics across groups \(sync_batchnorm=True would sync them within each group only\)"):
        loom.FaultTolerantShardedStrategy(sync_batchnorm=True)


def test_a_parameter_no_group_computed_a_gradient_for_keeps_none():
    """As under DDP and on one device: the optimizer skips it (Adam would move it with a zero gradient)."""
    used, unused = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    strategy = object.__new__(loom.FaultTolerantMirroredStrategy)  # only its arithmetic, no job
    strategy._buckets = [[used, unused]]
    strategy._apply_sums([torch.arange(5.0)], present=torch.tensor([2.0, 0.0]))  # summed over the groups: 2 had one, none the other
    assert used.grad.tolist() == [0.0, 1.0] and unused.grad is None


class _Sends:
    """EarlySums' all-reduces, recorded: which bucket went when, and which were waited for."""

    def __init__(self, buckets):
        self.sent, self.waited = [], []
        self.early = EarlySums(buckets, lambda bucket, weight: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) * weight for p in bucket]), self.send)

    def send(self, flat):
        self.sent.append(flat.tolist())
        return SimpleNamespace(wait=lambda: self.waited.append(flat.tolist()))


def _backward(params, *order):
    for i in order:
        params[i].grad = torch.full((1,), float(i))


def test_buckets_cross_the_groups_during_backward_in_one_order_whatever_backward_fills_first():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    sends = _Sends([[params[3], params[2]], [params[1]], [params[0]]])  # the order backward fills them
    sends.early.begin(0.5)
    for i in (1, 3):  # bucket 1 is complete first, but bucket 0 must go before it in every group
        _backward(params, i)
        sends.early.grad_ready(params[i])
    assert sends.sent == []
    _backward(params, 2)
    sends.early.grad_ready(params[2])
    assert sends.sent == [[1.5, 1.0], [0.5]]  # both, in order, weighted
    sent = sends.early.finish()  # parameter 0 got no gradient: its bucket goes at the sync, as zeros
    assert [flat.tolist() for flat, _ in sent] == [[1.5, 1.0], [0.5], [0.0]] and sends.sent[-1] == [0.0]
    sends.early.grad_ready(params[3])  # outside a step (after finish): nothing goes
    assert len(sends.sent) == 3 and sends.early.finish() is None


def test_a_gradient_reported_twice_sends_no_bucket_twice():
    """Every group must start one all-reduce per bucket a step (a healing group starts exactly that many)."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    sends = _Sends([[params[1]], [params[0]]])
    sends.early.begin(1.0)
    for i in (1, 1, 0, 1, 0):
        _backward(params, i)
        sends.early.grad_ready(params[i])
    assert len(sends.sent) == 2 and len(sends.early.finish()) == 2 and len(sends.sent) == 2


class _RunsACommand:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_heals_state_is_loaded_as_tensors_and_plain_values_and_code_in_it_is_not_run(tmp_path):
    """torchft unpickles a heal whole; loom's transport loads it with torch's weights-only unpickler."""
    import io

    from torch.distributed._serialization import _streaming_save

    from loom.errors import CheckpointError
    from loom.strategies.data_parallel.fault_tolerant import load_heal

    def sent(state):
        stream = io.BytesIO()
        _streaming_save(state, stream)
        stream.seek(0)
        return stream

    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    state = {"user": {"loom": {"model": {"w": torch.ones(2)}, "optimizer": opt.state_dict(), "clip": (0.5, 2.0)}}, "torchft": {"step": 3}}
    assert load_heal(sent(state))["user"]["loom"]["clip"] == (0.5, 2.0)
    evil = _RunsACommand()
    evil.marker = tmp_path / "ran"
    with pytest.raises(CheckpointError, match=r"^a heal's state held an object loom does not load from another process: .*system"):
        load_heal(sent({"user": {"loom": {"w": torch.ones(2), "x": evil}}}))
    assert not evil.marker.exists()


def test_a_heal_tells_a_group_behind_on_its_own_branch_from_one_that_drops_steps_of_its_own(monkeypatch):
    from loom.strategies.data_parallel import fault_tolerant_history
    from loom.strategies.data_parallel.fault_tolerant_history import History

    def trained(*quorums):
        history = History()
        for quorum in quorums:
            history.advance(quorum)
        return history

    live = trained(1, 2, 3, 4, 5)
    assert trained(1, 2, 3).take(live.state()) == 0  # left out of two quorums: behind on the same branch
    assert History().take(live.state()) == 0  # restarted: nothing of its own
    healed = trained(1, 2, 3, 9)  # a quorum of its own at the fourth step: a branch
    assert healed.take(live.state()) == 1
    assert (healed.value, healed.steps) == (live.value, live.steps)  # now on the live branch, digests and all
    assert healed.take(live.state()) == 0
    monkeypatch.setattr(fault_tolerant_history, "KEPT", 2)
    live = trained(1, 2, 3, 4, 5)
    assert trained(1, 2).take(live.state()) is None  # further behind than the digests kept


def test_groups_that_restored_different_checkpoints_are_told_apart_at_their_next_step():
    """The restored position goes into each group's digest: summed in their slots, as a step does, groups that
    resumed from another checkpoint than the lowest group's (or from none) are the ones that diverged."""
    from loom.strategies.data_parallel.fault_tolerant_history import History

    def resumed(batches):
        history = History()
        history.advance(1)  # a first step
        if batches is not None:
            history.resume(batches)
        return history

    def diverged(*histories):
        return History.diverged(sum(h.slots(g, len(histories)) for g, h in enumerate(histories)))

    assert diverged(resumed(8), resumed(8), resumed(8)) == []
    digest = "from loom.strategies.data_parallel.fault_tolerant_history import History as H; h = H(); h.advance(1); h.resume(8); print(h.value)"
    in_other_processes = {run([sys.executable, "-c", digest], timeout=60, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert in_other_processes == {f"{resumed(8).value}\n"}  # the groups are processes of their own, each with its own hash seed
    assert diverged(resumed(8), resumed(None), resumed(4)) == [1, 2]
    assert diverged(resumed(None), resumed(8)) == [1]


def test_a_group_whose_restored_epoch_is_ahead_of_the_groups_it_healed_from_stops_in_one_line():
    """It restored a later checkpoint than the live groups' and, slower to start, healed from them: its loader's
    epoch would take the wrong samples for the job's batch."""
    from loom.errors import LaunchError
    from loom.strategies.data_parallel.fault_tolerant_data import GroupLoader

    strategy = SimpleNamespace(group=1, groups=2, group_size=1, device=torch.device("cpu"), _next_batch=lambda end: 5, _process_slice=lambda: (0, 4))
    loader = GroupLoader(strategy, torch.utils.data.TensorDataset(torch.arange(32.0)), batch_size=8)
    loader.epoch = 2  # its checkpoint's; the live groups are at batch 5, in epoch 1
    with pytest.raises(LaunchError, match=r"^group 1 restored the data at epoch 2, but the groups it healed from are at global batch 5 \(epoch 1\): "
                                          r"every group must restore the same checkpoint$"):
        next(iter(loader))


def test_a_batch_without_its_optimizer_step_is_refused_before_the_next():
    """As under ``strategy.accumulate(2)``: the next batch would take the same global batch again; or, after clipping
    (which summed the gradients and voted), be counted as trained."""
    from loom.strategies.data_parallel.fault_tolerant import _AcrossGroups

    refusal = r"^under --groups each batch that distribute\(\) hands out is one optimizer step .* not strategy.accumulate\(\)$"
    for not_stepped in (SimpleNamespace(_in_step=True, _synced=False), SimpleNamespace(_in_step=False, _synced=True)):  # or clipped, not stepped
        with pytest.raises(RuntimeError, match=refusal):
            _AcrossGroups._next_batch(not_stepped, end=8)


@pytest.mark.timeout(240)
def test_groups_on_hosts_whose_names_resolve_nowhere_train_together_and_equal_one_device(tmp_path):
    """A lighthouse host and a host per group (network namespaces on a bridge, links shaped to 1 Gbit/s), each named
    what no host resolves, its own included: each group gives the others its address towards the lighthouse, and
    each host's gloo listens on the link that reaches it, not on loopback."""
    reason = why_no_namespaces()
    if reason:
        pytest.skip(reason)
    hosts = {"l": "10.81.0.1", "a": "10.81.0.2", "b": "10.81.0.3"}
    started = []
    try:
        with network(hosts, prefix="t"):
            for host in "ab":
                shape(host, "1gbit", prefix="t")

            def run(host, *args):
                started.append(subprocess.Popen(on_host(host, [*LOOM, *args], prefix="t"), cwd=ROOT, env=job_env({"LOOM_TIMEOUT": "60"}),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))  # fmt: skip
                return started[-1]

            said = run("l", "lighthouse", "--port", "29611").stdout.readline()  # its first line: it listens, and says where
            assert "listening on host-l:29611;" in said and f"--lighthouse {hosts['l']}:29611 " in said, said  # its name resolves nowhere
            jobs = [run(host, "run", "--lighthouse", f"{hosts['l']}:29611", "--groups", "2", "--group", str(g), "--nproc", "1", str(SCRIPTS / "ft_train.py"), str(tmp_path)) for g, host in enumerate("ab")]
            for job in jobs:
                finish(job, 180)
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert_two_groups_trained_as_one_device(tmp_path)


@pytest.mark.timeout(300)
def test_a_group_killed_mid_step_heals_from_a_live_group_and_no_sample_is_lost_or_doubled(tmp_path):
    die_at, hold_at = 3, 5
    job = start_job(tmp_path, "--groups", "2", "--nproc", "1", "--max-restarts", "1", env={"DIE_AT": f"1:{die_at}", "HOLD_AT": str(hold_at), "LATE": "1"})
    err = kill_the_dying_group(job, tmp_path)

    steps = read_steps(tmp_path)
    survivor = [s for s in steps if s["g"] == 0]
    assert {(s["pid"], s["restart"]) for s in survivor} == {(survivor[0]["pid"], 0)}  # never restarted
    assert [s["batch"] for s in survivor] == list(range(16))  # every batch, the killed one once (redone alone)
    assert next(s for s in survivor if s["batch"] == die_at)["groups"] == [0]
    first_life = [s for s in steps if s["g"] == 1 and s["restart"] == 0]
    assert first_life and all(s["groups"] == [0, 1] for s in first_life)  # it started late, but never started the job again alone
    healed = [s for s in steps if s["g"] == 1 and s["restart"] == 1]
    assert healed and healed[0]["batch"] > hold_at and healed[-1]["batch"] == 15  # took up where the job was
    for epoch, count in samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    final0, final1 = (torch.load(tmp_path / f"final-{g}-0.pt") for g in (0, 1))
    assert all(torch.equal(final0[k], final1[k]) for k in final0)  # bit-identical after healing
    weights, schedule = one_device()
    assert_close(final0, weights)  # and still the one-device run: no batch lost or applied twice
    lr0, lr1 = (json.loads((tmp_path / f"lr-{g}-0.json").read_text()) for g in (0, 1))
    assert lr0 == lr1 == schedule  # the schedule healed too, and stepped only on applied steps
    assert f"batch {die_at} not applied" in err
    assert "group 1 left at batch" in err and "group 1 rejoined at batch" in err and "group 1 healed at batch" in err
    assert not list(tmp_path.glob("**/*checkpoint*"))


@pytest.mark.timeout(300)
def test_sharded_groups_heal_shard_by_shard_from_a_live_group_and_equal_one_device(tmp_path):
    """FT-HSDP: 2 groups x 2 FSDP2 processes, group 1 killed mid-step. Each process holds half of the model
    and heals it from the same process of group 0; the groups start unequal and end as one device."""
    die_at, hold_at = 3, 5
    job = start_job(tmp_path, "--groups", "2", "--nproc", "2", "--max-restarts", "1", env={"STRATEGY": "sharded", "DIE_AT": f"1:{die_at}", "HOLD_AT": str(hold_at)})
    err = kill_the_dying_group(job, tmp_path)

    steps = read_steps(tmp_path)
    assert next(s for s in steps if s["g"] == 0 and s["batch"] == die_at)["groups"] == [0]  # redone without the dead group
    healed = [s for s in steps if s["g"] == 1 and s["restart"] == 1]
    assert healed and healed[0]["batch"] > hold_at and healed[-1]["batch"] == 15
    for epoch, count in samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    held = [json.loads((tmp_path / f"held-0-{r}.json").read_text()) for r in (0, 1)]
    assert [(h["0.weight"], h["2.weight"]) for h in held] == [(8 * 8, 2 * 15), (7 * 8, 1 * 15)]  # uneven shards of 15 and 3 rows
    final = {(g, r): torch.load(tmp_path / f"final-{g}-{r}.pt") for g in (0, 1) for r in (0, 1)}
    assert all(torch.equal(final[0, 0][k], final[g, r][k]) for g, r in final for k in final[0, 0])  # bit-identical
    weights, schedule = one_device()
    assert_close(final[0, 0], weights)
    assert json.loads((tmp_path / "lr-1-1.json").read_text()) == schedule
    for g, r in final:
        assert json.loads((tmp_path / f"eval-{g}-{r}.json").read_text())["loss"] == pytest.approx(evaluated(final[g, r]), rel=1e-6)
    heal = next(s for s in steps if s["g"] == 0 and s["batch"] == healed[0]["batch"] - 1)
    assert heal["norm"] > ft_train.MAX_NORM  # the step group 1 healed in was clipped: so was its copy of it
    assert "group 1 healed at batch" in err


@pytest.mark.timeout(300)
def test_the_group_writing_a_checkpoint_killed_mid_save_leaves_every_committed_one_whole_and_heals(tmp_path):
    """Group 0 writes the checkpoints (the lowest group of the quorum) every 2 batches. Killed in the save
    after batch 3, its files written and not committed, it leaves no checkpoint of that step; group 1
    trains on and writes the next ones; group 0 comes back, heals from it and writes again. Every
    committed checkpoint restores under OneDevice, and the last holds the final weights and schedule.
    The script restores its checkpoint directory at its start, as scripts do: group 0's next life, healed,
    keeps the live state rather than load the older checkpoint over it."""
    from loom.checkpoint import layout

    die_at, hold_at = 3, 5
    env = {"DIE_AT": f"0:{die_at}", "DIE_IN": "save", "SAVE_EVERY": "2", "HOLD_AT": str(hold_at), "RESUME_FROM": str(tmp_path / "checkpoints")}
    job = start_job(tmp_path, "--groups", "2", "--nproc", "1", "--max-restarts", "1", env=env)
    err = kill_the_dying_group(job, tmp_path)

    steps = read_steps(tmp_path)
    survivor = [s for s in steps if s["g"] == 1]
    assert {s["restart"] for s in survivor} == {0} and [s["batch"] for s in survivor] == list(range(16))
    assert next(s for s in survivor if s["batch"] == die_at + 1)["groups"] == [1]  # trained on without the writer
    healed = [s for s in steps if s["g"] == 0 and s["restart"] == 1]
    assert healed and healed[0]["batch"] > hold_at and healed[-1]["batch"] == 15
    for epoch, count in samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    assert "group 0 healed at batch" in err and "GET /checkpoint" not in err  # (http.server's line per request)
    assert "group 0 healed from a live group and keeps its state" in err
    final = torch.load(tmp_path / "final-1-0.pt")
    assert all(torch.equal(torch.load(tmp_path / "final-0-0.pt")[k], final[k]) for k in final)

    checkpoints = tmp_path / "checkpoints"
    assert [layout.step_of(p) for p in layout.committed(checkpoints)] == [2, 6, 8, 10, 12, 14, 16]  # none of step 4
    assert not list(checkpoints.glob(".tmp-*"))  # the killed save's files, never committed, cleared by a later save
    for path in layout.committed(checkpoints):
        one = loom.OneDeviceStrategy("cpu")
        model, opt = one.prepare(ft_train.make_model(0), ft_train.optimizer)
        sched = ft_train.scheduler(opt)
        restored = one.restore(path, model=model, optimizer=opt, scheduler=sched)
        assert restored["step"] == layout.step_of(path) and opt.state_dict()["state"]
    assert all(torch.equal(loom.unwrap(model).state_dict()[k], final[k]) for k in final)  # the last one: the final weights
    assert ft_train.schedule_state(opt, sched) == json.loads((tmp_path / "lr-1-0.json").read_text())

    resumed = tmp_path / "resumed"  # a new job of the groups from the checkpoint of batch 8: the same end, bit for bit
    resumed.mkdir()
    finish(start_job(resumed, "--groups", "2", "--nproc", "1", env={"RESUME_FROM": str(checkpoints / "step-00000008")}), 120)
    assert [s["batch"] for s in read_steps(resumed) if s["g"] == 0] == list(range(8, 16))
    for g in (0, 1):
        again = torch.load(resumed / f"final-{g}-0.pt")
        assert all(torch.equal(again[k], final[k]) for k in final)
