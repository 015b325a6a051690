"""A parameter-server job killed mid-``fit(checkpoint_dir=...)`` and restarted resumes with the servers' state."""

import torch

from tests.helpers import SCRIPTS, loom_run


def test_a_worker_killed_mid_fit_resumes_with_the_servers_values_and_slots_intact(tmp_path):
    out = tmp_path / "out"
    done = loom_run(["run", "--ps", "2", "--workers", "1", "--max-restarts", "1", str(SCRIPTS / "ps_fit_restart.py"), str(out)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exited with code -9; restarting it (1 of 1)" in done.stderr
    assert "loom: resumed from" in done.stdout and "(step 3, epoch 1)" in done.stdout
    before, after = torch.load(f"{out}.before"), torch.load(f"{out}.after")  # step 5's state; then after the restore
    assert before.keys() == after.keys() and "bag" in before
    for name, (value, slots) in before.items():  # the servers kept what they learned after the checkpoint
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1]["sum"], slots["sum"]), name
        assert after[name][1]["step"] == slots["step"] == 5
