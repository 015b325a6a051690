"""``loom run --ps N --ps-tls-cert C --ps-tls-key K``: the servers accept TLS only, and the job trains."""

import json
import subprocess

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, read_progress
from tests.strategies.parameter_server.test_transport import self_signed


def test_a_job_with_tls_trains_and_its_servers_exit_when_the_workers_are_done(tmp_path):
    cert, key = self_signed(tmp_path, "job")
    out, steps = tmp_path / "out", 10
    command = [*LOOM, "run", "--ps", "2", "--workers", "2", "--ps-tls-cert", str(cert), "--ps-tls-key", str(key),
               str(SCRIPTS / "ps_train.py"), str(out), str(steps)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("with TLS") == 2 and done.stdout.count("every worker has finished; exiting") == 2
    assert {w: max(s for v, _, s in read_progress(out) if v == w) for w in (0, 1)} == {0: steps, 1: steps}
    for stats in json.loads(out.with_name("out.stats").read_text()):
        assert sorted(stats["applied"].values()) == [steps, steps], stats


def test_a_half_set_tls_configuration_stops_the_job_before_it_starts(tmp_path):
    cert, _ = self_signed(tmp_path, "job")
    command = [*LOOM, "run", "--ps", "1", "--workers", "1", "--ps-tls-cert", str(cert), str(SCRIPTS / "ps_train.py"), "x", "1"]
    done = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "loom: error: LOOM_PS_TLS_CERT is set but LOOM_PS_TLS_KEY is not: a parameter server needs its certificate's private key" \
        in done.stderr
