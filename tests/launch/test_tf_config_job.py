"""A TF_CONFIG job of two workers on localhost: one replica per worker, a visible wait for a late one,
and the host's cores divided between the two workers."""

import json
import subprocess
import time

from loom.devices import available_cores
from tests.helpers import LOOM, ROOT, free_port, job_env, popen, wait_all


def _worker(index: int, ports: list[int], script: str) -> subprocess.Popen:
    config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    env = job_env({"TF_CONFIG": json.dumps(config), "LOOM_RENDEZVOUS_REPORT": "1"})
    return popen([*LOOM, "run", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_tf_config_workers_wait_visibly_for_each_other_and_share_the_host(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(
        "import os\nimport torch\nimport loom\nstrategy = loom.MultiWorkerMirroredStrategy()\n"
        "print('replica', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
        "print('threads', strategy.threads, torch.get_num_threads(), flush=True)\n"
        "strategy.print('in sync:', strategy.num_replicas_in_sync)\n"
    )
    ports = [free_port(), free_port()]
    chief = _worker(0, ports, str(script))
    try:
        started = time.monotonic()
        waiting = chief.stderr.readline()
        waited = time.monotonic() - started
    except BaseException:
        chief.kill()
        raise
    late = _worker(1, ports, str(script))
    (code0, out0, err0), (code1, out1, err1) = wait_all([chief, late], timeout=90)
    # The chief's strategy says what runs, once the nodes have met (the launcher cannot know the strategy).
    assert "loom: 2 replicas = 2 nodes x 1 process (TF_CONFIG: one process per worker on CPU; --nproc N to change)\n" in err0
    assert waiting.startswith("loom: node 0 has waited ") and waiting.endswith(
        f"s for node 1 (127.0.0.1) to join at 127.0.0.1:{ports[0]}\n"
    ), waiting
    assert waited < 25  # the 1 s report interval, not the default 30 s (a loaded machine takes seconds to start loom run)
    assert code0 == 0 and code1 == 0, err0 + err1
    assert "loom: node 0: all 2 nodes joined after " in err0
    assert "replicas = " not in err1  # said once, by the chief
    half = max(1, available_cores() // 2)  # two workers on this host: each takes half its cores
    assert sorted(out0.splitlines() + out1.splitlines()) == ["in sync: 2", "replica 0 of 2", "replica 1 of 2"] + [f"threads {half} {half}"] * 2
