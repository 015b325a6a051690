"""Workers forked from the launcher's zygote are the processes a new interpreter would be."""

import json
import os
import signal
import subprocess
import time

from loom.launch.zygote import compatible
from tests.helpers import LOOM, job_env, popen

SCRIPT = """
import json, os, sys
import numpy as np
import torch, loom

strategy = loom.MirroredStrategy()
rank, restart = strategy.cluster.rank, int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model, opt = strategy.prepare(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
strategy.backward(model(torch.ones(8, 4)).sum())
opt.step()
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
held = [os.readlink(f"/proc/{os.getppid()}/fd/{fd}") for fd in os.listdir(f"/proc/{os.getppid()}/fd") if int(fd) > 2]
found = {"pid": os.getpid(), "parent": os.getppid(), "zygote": b"--zygote" in parent, "rank_env": os.environ["RANK"],
         "zygote_parent": int(open(f"/proc/{os.getppid()}/stat").read().split()[3]), "zygote_sockets": sum(h.startswith("socket:") for h in held),
         "zygote_cmdline": open(f"/proc/{os.getppid()}/cmdline").read(),
         "launcher_cmdline": open(f"/proc/{open(f'/proc/{os.getppid()}/stat').read().split()[3]}/cmdline").read(),
         "argv": sys.argv, "cwd": os.getcwd(), "draw": float(np.random.rand()), "weight": model.module.weight.sum().item()}
with open(os.path.join(sys.argv[1], f"{restart}-{rank}.json"), "w") as f:
    json.dump(found, f)
if restart == 0 and rank == 1 and sys.argv[2] == "fail":
    sys.exit(3)
"""


def _launch(tmp_path, fork, fail, start=subprocess.Popen):
    out = tmp_path / f"fork{fork}{start.__name__}"
    out.mkdir()
    script = tmp_path / "record.py"
    script.write_text(SCRIPT)
    args = ["run", "--nproc", "2", "--max-restarts", "1", str(script), str(out), "fail" if fail else "pass"]
    agent = start([*LOOM, *args], cwd=tmp_path, env=job_env({"LOOM_FORK_WORKERS": fork}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-3000:]
    return agent.pid, {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}, err


def test_forked_workers_are_fresh_processes_and_a_restart_forks_again(tmp_path):
    agent, runs, err = _launch(tmp_path, "1", fail=True)
    assert sorted(runs) == ["0-0", "0-1", "1-0", "1-1"]
    assert "restart 1 of 1: rank 1 on" in err and "exited with code 3" in err
    zygotes = {r["parent"] for r in runs.values()}
    assert len(zygotes) == 1 and agent not in zygotes and all(r["zygote"] for r in runs.values())  # restarts forked by the same zygote
    assert all(r["zygote_cmdline"] != r["launcher_cmdline"] for r in runs.values())  # a new interpreter: `loom` is no worker
    assert len({r["pid"] for r in runs.values()}) == 4
    for name, r in runs.items():
        assert r["rank_env"] == name[-1] and r["argv"] == [str(tmp_path / "record.py"), str(tmp_path / "fork1Popen"), "fail"]
        assert r["cwd"] == str(tmp_path)
    assert len({r["draw"] for r in runs.values()}) == 4  # numpy's global generator is seeded in each, as a new process's is
    assert len({r["weight"] for r in runs.values()}) == 1  # and the job trains as one

    agent, runs, _ = _launch(tmp_path, "0", fail=False)
    assert {r["parent"] for r in runs.values()} == {agent} and not any(r["zygote"] for r in runs.values())


def test_a_launcher_started_as_its_workers_start_forks_their_zygote_from_itself(tmp_path):
    agent, runs, err = _launch(tmp_path, "1", fail=True, start=popen)  # the suite starts launchers so
    assert sorted(runs) == ["0-0", "0-1", "1-0", "1-1"] and "exited with code 3" in err
    zygote = {r["parent"] for r in runs.values()}
    assert len(zygote) == 1 and {r["zygote_parent"] for r in runs.values()} == {agent}
    assert all(r["zygote_cmdline"] == r["launcher_cmdline"] for r in runs.values())  # the launcher forked: no interpreter of its own
    for name, r in runs.items():
        assert r["rank_env"] == name[-1] and r["argv"][1:] == [str(tmp_path / "fork1popen"), "fail"] and r["cwd"] == str(tmp_path)
    assert {r["zygote_sockets"] for r in runs.values()} == {1}  # its channel; the launcher's store and sockets are not held
    assert len({r["draw"] for r in runs.values()}) == 4 and len({r["weight"] for r in runs.values()}) == 1


def test_a_worker_that_reads_other_values_at_start_is_not_forked():
    first = {"RANK": "0", "MALLOC_ARENA_MAX": "2", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "PATH": "/bin"}
    assert compatible({**first, "RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}, first)  # read later, when used
    assert not compatible({**first, "MALLOC_ARENA_MAX": "4"}, first)
    assert not compatible({k: v for k, v in first.items() if k != "GLIBC_TUNABLES"}, first)
    assert not compatible({**first, "LD_PRELOAD": "libjemalloc.so"}, first)
    assert not compatible({**first, "PYTHONHASHSEED": "0"}, first)


GRACEFUL = """
import os, pathlib, signal, sys, time
import loom

strategy = loom.MirroredStrategy()
out, rank = pathlib.Path(sys.argv[1]), strategy.cluster.rank


def stop(*_):
    time.sleep(1.0)  # work a SIGTERM handler does before it exits: a save, say
    (out / f"graceful-{rank}").write_text("1")
    os._exit(0)


signal.signal(signal.SIGTERM, stop)
(out / f"ready-{rank}").write_text("1")
while True:
    time.sleep(0.05)
"""


def test_a_sigterm_to_the_launchers_process_group_leaves_the_workers_their_grace(tmp_path):
    # as `timeout`, Slurm or a shell's kill -TERM -PGID send it: the zygote, in the launcher's group, must live
    # to report the workers' ends, or the agent, seeing no worker it can wait for, kills them at once
    script = tmp_path / "graceful.py"
    script.write_text(GRACEFUL)
    agent = subprocess.Popen([*LOOM, "run", "--nproc", "2", str(script), str(tmp_path)], cwd=tmp_path, env=job_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the workers did not start within 120 s"
        time.sleep(0.05)
    os.killpg(agent.pid, signal.SIGTERM)
    _, err = agent.communicate(timeout=90)
    assert all((tmp_path / f"graceful-{r}").exists() for r in (0, 1)), err[-3000:]
