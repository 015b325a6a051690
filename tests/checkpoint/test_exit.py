"""A worker's last asynchronous save is committed before it exits (``loom run`` ends workers with
``os._exit``, which used to kill the writer thread mid-file)."""

import textwrap

import pytest
import torch
from torch import nn

import loom
from loom.checkpoint import committed
from tests.helpers import loom_run

SCRIPT = """
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    import loom
    from tests.scripts.fit_job import data

    how, directory = sys.argv[1:3]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 1024), nn.ReLU(), nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2))  # as _net()
    if how == "fit":  # fit's last act is its epoch-end save
        loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=0.01), data(80, 0), epochs=1,
                 batch_size=20, checkpoint_dir=directory, async_checkpoint=True, progress=False)
    else:
        strategy = loom.auto_strategy()
        strategy.save(directory, step=1, async_save=True, model=strategy.prepare(model), big=torch.full((4_000_000,), 3.0))
"""


def _net():
    return nn.Sequential(nn.Linear(6, 1024), nn.ReLU(), nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2))  # 8 MB


@pytest.mark.parametrize("how, step", [("save", 1), ("fit", 4)])
def test_the_last_async_save_is_committed_before_the_workers_exit(tmp_path, how, step):
    script = tmp_path / "last_save.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = loom_run(["run", "--nproc", "2", str(script), how, str(tmp_path / "ckpt")], timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in committed(tmp_path / "ckpt")] == [f"step-{step:08d}"]
    assert not list(tmp_path.glob("ckpt/.tmp-step-*"))
    if how == "save":
        torch.manual_seed(0)
        expected, model, big = _net(), _net(), torch.zeros(4_000_000)
        saved = loom.OneDeviceStrategy().restore(tmp_path / "ckpt", model=model, big=big)
        assert saved["world_size"] == 2 and bool((big == 3.0).all())
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))
