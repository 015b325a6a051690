"""``loom scale`` launches a script at each size for a bounded number of steps and charts it."""

from __future__ import annotations

import json

import pytest

from loom.launch import cli
from tests.helpers import SCRIPTS, loom_run


def test_scale_runs_each_size_and_writes_json_and_png(tmp_path):
    out = tmp_path / "scale"
    done = loom_run(["scale", "--nproc", "1,2", "--steps", "2", "--out", str(out), str(SCRIPTS / "scale_job.py")], timeout=240)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "scale.json").read_text())
    assert [s["replicas"] for s in summary["sizes"]] == [1, 2]
    assert summary["sizes"][0]["efficiency"] == pytest.approx(1.0)
    assert all(s["samples_per_sec"] > 0 and s["ms_per_step"]["compute"] > 0 for s in summary["sizes"])
    for n in (1, 2):
        report = json.loads((out / f"nproc{n}.json").read_text())
        assert len(report["ranks"]) == n and all(r["steps"] == 2 for r in report["ranks"])
    assert (out / "scale.png").stat().st_size > 1000
    assert "efficiency" in done.stdout and "2 replica(s): " in done.stdout


def test_scale_sizes_are_checked(capsys):
    assert cli.main(["scale", "--nproc", "2,x", "train.py"]) == 2
    assert "--nproc takes distinct positive process counts separated by commas, like 1,2,4; got '2,x'" in capsys.readouterr().err
