"""Kills -9 of real processes under ``loom run --groups 3``, in one job paced step by step (tests/scripts/ft_kills.py).

1. Groups 1 and 2 are killed at once in the middle of a step: group 0 trains on alone.
2. Group 1 comes back and is killed while it reads the heal's state from group 0.
3. It comes back again and heals. Group 2 comes back, and the group serving its heal is killed in
   the middle of the response. Group 2, its heal cut short, is left without a live group for a
   while: it waits (it must not start the job over at step 0), then heals from the third group,
   which trains on; the killed server comes back and heals too.

Through it all every sample of each epoch is trained exactly once, and at the end every group holds
the same weights, which equal OneDevice's on the global batches.
"""

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra: pip install loom[ft]")  # installed by make

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen  # noqa: E402
from tests.strategies.ft_jobs import assert_close, finish, no_job_left, one_device, read_steps, samples_per_epoch, started  # noqa: E402, F401


class Job:
    """The launched job and the files it writes, with waits bounded by one deadline."""

    def __init__(self, out, env, timeout, groups=3, restarts=3):
        self.out, self.deadline = out, time.monotonic() + timeout
        (out / "events").mkdir()
        self.allow(3)
        self.proc = started(popen(
            [*LOOM, "run", "--groups", str(groups), "--nproc", "1", "--max-restarts", str(restarts), str(SCRIPTS / "ft_kills.py"), str(out)],
            cwd=ROOT, env=job_env({"LOOM_TIMEOUT": "60", "LOOM_FT_EVENTS": str(out / "events"), **env}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip

    def allow(self, batches, group=None):
        name = "allow" if group is None else f"allow-{group}"
        (self.out / "allow.tmp").write_text(str(batches))
        os.replace(self.out / "allow.tmp", self.out / name)

    def until(self, condition, what):
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended while waiting until {what}:\n{self.proc.communicate()[1][-3000:]}")
            if time.monotonic() > self.deadline:
                self.proc.kill()
                pytest.fail(f"timed out waiting until {what}:\n{self.proc.communicate()[1][-3000:]}")
            time.sleep(0.05)

    def is_parked(self, name):
        path = self.out / name
        return path.exists() and path.read_text().count(" ") == 2

    def parked(self, name):
        """The pid, group and life a parked process wrote to ``name``, once written whole; the file is then removed."""
        path = self.out / name
        self.until(lambda: self.is_parked(name), f"a process parks at {name}")
        pid, group, life = map(int, path.read_text().split())
        path.unlink()
        return pid, group, life

    def requests(self, group, life=0):
        """How many quorum requests that life of the group has sent (0 while the count is being written)."""
        path = self.out / f"quorum-{group}-{life}"
        text = path.read_text() if path.exists() else ""
        return int(text) if text.strip() else 0

    def steps(self):
        return read_steps(self.out) if (self.out / "steps.jsonl").exists() else []

    def committed(self, group, batch, restart=None):
        return any(s["g"] == group and s["batch"] == batch and restart in (None, s["restart"]) for s in self.steps())

    def events(self, group):
        path = self.out / "events" / f"group-{group}.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def joining(self, group, restart):
        return any(e["event"] == "joining" and e["restart"] == restart for e in self.events(group))


@pytest.mark.timeout(420)
def test_two_groups_killed_at_once_and_kills_during_healing_lose_and_double_no_sample(tmp_path):
    job = Job(tmp_path, {"PARK": "1:2,2:2", "GATE": "1:1,1:2,2:1", "TRIP_LOAD": "1:1"}, timeout=400)

    # 1. groups 1 and 2 killed at once, mid-step: batch 2 is not applied, group 0 trains it alone
    parked = [job.parked(f"parked-{g}")[0] for g in (1, 2)]
    for pid in parked:
        os.kill(pid, signal.SIGKILL)
    job.until(lambda: job.committed(0, 2), "group 0 trains batch 2 without groups 1 and 2")

    # 2. group 1's next life is killed while it reads the heal's state: group 0 trains that batch alone
    (tmp_path / "join-1-1").touch()
    job.until(lambda: job.requests(1, 1) > 0, "group 1 asks to join again")
    cut = 3  # the batch whose quorum heals group 1: later while its request reaches the lighthouse after a quorum formed
    while True:
        job.allow(cut + 1)
        job.until(lambda: job.is_parked("parked-1") or job.committed(0, cut), f"group 1 reads a heal, or group 0 trains batch {cut} without it")
        if job.is_parked("parked-1"):
            break
        assert cut < 7, "group 1 asked to join, but five quorums formed without it"
        cut += 1
    os.kill(job.parked("parked-1")[0], signal.SIGKILL)
    job.until(lambda: job.committed(0, cut), f"group 0 trains batch {cut} without group 1")

    # 3. group 1 heals; then the group serving group 2's heal is killed in the middle of its response
    (tmp_path / "join-1-2").touch()
    job.until(lambda: job.joining(1, 2), "group 1 asks to join a second time")
    job.allow(cut + 2)
    job.until(lambda: job.committed(0, cut + 1) and any(e["event"] == "healed" for e in job.events(1)), "group 1 heals")
    (tmp_path / "trip-send").touch()
    (tmp_path / "join-2-1").touch()
    job.until(lambda: (tmp_path / "quorum-2-1").exists(), "group 2 asks to join again")
    heal = cut + 2  # the batch whose quorum heals group 2: later while its request reaches the lighthouse after a quorum formed
    while True:
        job.allow(heal + 1)
        job.until(lambda: job.is_parked("trip-send") or job.committed(0, heal), f"a group serves group 2's heal, or trains batch {heal} without it")
        if job.is_parked("trip-send"):
            break
        assert heal < cut + 6, "group 2 asked to join, but five quorums formed without it"
        heal += 1
    server_pid, server, life = job.parked("trip-send")
    live = ({0, 1} - {server}).pop()
    job.allow(heal)  # the live group, its step refused, waits: group 2 is left alone (or with the server's next life)
    os.kill(server_pid, signal.SIGKILL)
    job.until(lambda: any(e["event"] in ("waiting", "commit") for e in job.events(2)[-1:]), "group 2's heal fails and it waits")
    job.allow(heal + 1)
    job.until(lambda: job.committed(live, heal), f"group {live} trains batch {heal} without group {server}")
    job.until(lambda: job.joining(server, life + 1), f"group {server}, which served the heal, asks to join again")
    job.allow(99)
    err = finish(job.proc, max(job.deadline - time.monotonic(), 30))

    steps = read_steps(tmp_path)
    for epoch, count in samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    by_batch = {s["batch"]: s["groups"] for s in steps if s["g"] == 0}
    assert by_batch[2] == by_batch[cut] == [0]  # trained alone, then with group 1's heal cut short
    assert len({s["pid"] for s in steps if s["g"] == live and s["batch"] >= heal}) == 1  # the server's death did not restart it
    for g, restart in ((1, 2), (2, 1), (server, life + 1)):
        assert any(s["g"] == g and s["restart"] == restart and s["batch"] == 15 for s in steps), f"group {g}'s life {restart} did not train to the end"
    assert not any(s["g"] == 1 and s["restart"] == 1 for s in steps)  # killed while healing: it never trained
    final = {g: torch.load(tmp_path / f"final-{g}-0.pt") for g in range(3)}
    assert all(torch.equal(final[0][k], final[g][k]) for g in (1, 2) for k in final[0])  # bit-identical
    weights, schedule = one_device()
    assert_close(final[0], weights)
    assert all(json.loads((tmp_path / f"lr-{g}-0.json").read_text()) == schedule for g in range(3))
    assert "batch 2 not applied" in err and "group 1 left at batch 2" in err and "group 2 left at batch 2" in err


def split_and_meet(job, ahead, group_0_allowed):
    """Group 1 is stopped (SIGSTOP) until its heartbeat lapses: group 0 trains ``ahead`` batches from batch 3 alone.
    Then group 0 is stopped in turn, outside any quorum, and group 1 goes on: it forms a quorum of its own and trains
    batch 3 as well. Then both ask for their next quorum, group 0 first (allowed batches below ``group_0_allowed``),
    and group 1 before its heartbeat lapses, so that the branches meet in one quorum."""
    job.until(lambda: job.committed(0, 2) and job.committed(1, 2), "both groups train batch 2")
    pids = {g: next(s["pid"] for s in job.steps() if s["g"] == g) for g in (0, 1)}
    job.allow(3 + ahead, group=0)
    job.allow(3, group=1)
    os.kill(pids[1], signal.SIGSTOP)
    job.until(lambda: job.committed(0, 2 + ahead), f"group 0 trains {ahead} batch(es) from batch 3 without group 1")
    os.kill(pids[0], signal.SIGSTOP)  # waiting before its next quorum
    job.allow(4, group=1)
    os.kill(pids[1], signal.SIGCONT)
    job.until(lambda: job.committed(1, 3), "group 1 trains batch 3 in a quorum of its own")
    os.kill(pids[1], signal.SIGSTOP)  # waiting before batch 4's quorum, while group 0 asks for its next first
    job.allow(99, group=1)
    job.allow(group_0_allowed, group=0)
    sent = job.requests(0)
    os.kill(pids[0], signal.SIGCONT)
    # its request sent (which also stands for its lapsed heartbeat): group 1, woken next, meets it in one quorum
    asking = str(3 + ahead)
    job.until(lambda: (job.out / "asking-0").read_text() == asking and job.requests(0) > sent, f"group 0 asks for batch {asking}'s quorum")
    os.kill(pids[1], signal.SIGCONT)  # before its heartbeat lapses: group 0 alone is not a quorum


@pytest.mark.timeout(300)
def test_a_split_quorum_is_found_when_its_branches_meet_and_one_heals_from_the_other(tmp_path):
    """The branches of a split quorum (``split_and_meet``) meet at one step: group 1 (the higher group) leaves with one
    line, restarts and heals from group 0."""
    job = Job(tmp_path, {}, timeout=280, groups=2, restarts=1)
    split_and_meet(job, ahead=1, group_0_allowed=5)  # group 0 holds after batch 4 until group 1 is back
    job.until(lambda: job.joining(1, 1), "group 1, which left, restarts")
    job.allow(99, group=0)
    err = finish(job.proc, max(job.deadline - time.monotonic(), 30))

    steps = read_steps(tmp_path)
    assert [s["groups"] for s in steps if s["batch"] == 3 and s["restart"] == 0] in ([[0], [1]], [[1], [0]])  # the split
    assert "LaunchError: group 1 trained other steps than group 0 (the lighthouse split the quorum" in err, err[-3000:]
    assert_the_kept_branch_trained_every_sample_once(tmp_path, [s for s in steps if not (s["g"] == 1 and s["restart"] == 0 and s["batch"] >= 3)])
    assert any(s["g"] == 1 and s["restart"] == 1 and s["batch"] == 15 for s in steps)  # healed and trained to the end


def assert_the_kept_branch_trained_every_sample_once(out, kept):
    """Every sample once in the steps of the branch kept (group 1's own are dropped), and both groups end bit-identical,
    equal to OneDevice."""
    for epoch, count in samples_per_epoch(kept).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    final = {g: torch.load(out / f"final-{g}-0.pt") for g in (0, 1)}
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert_close(final[0], one_device()[0])


@pytest.mark.timeout(300)
def test_split_branches_that_meet_at_different_steps_heal_and_the_heal_says_what_it_dropped(tmp_path):
    """As above, but group 0 trains batches 3 and 4 alone before group 1 trains batch 3 in a quorum of its own: the
    branches meet a step apart, so torchft heals group 1 from group 0 instead of refusing the step. The heal says it
    dropped group 1's own step; no sample is lost or doubled on the kept branch, and the groups end bit-identical."""
    job = Job(tmp_path, {}, timeout=280, groups=2, restarts=1)
    split_and_meet(job, ahead=2, group_0_allowed=99)
    err = finish(job.proc, max(job.deadline - time.monotonic(), 30))

    steps = read_steps(tmp_path)
    assert [s["groups"] for s in steps if s["batch"] == 3] in ([[0], [1]], [[1], [0]])  # the split
    assert re.search(r"group 1 healed at batch \d+ in [\d.]+s \(.*\); it dropped its own last 1 step\(s\): the lighthouse had split the quorum", err), err[-3000:]
    assert "trained other steps than" not in err  # not a meeting at one step
    assert_the_kept_branch_trained_every_sample_once(tmp_path, [s for s in steps if not (s["g"] == 1 and s["batch"] == 3)])
    assert any(s["g"] == 1 and s["batch"] == 15 for s in steps)  # healed and trained to the end, not restarted
