"""A worker's last asynchronous saves are committed before it exits (``loom run`` ends workers
with ``os._exit``, which used to kill the writer thread mid-file)."""

import textwrap

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

    fit_dir, save_dir = sys.argv[1:3]
    torch.manual_seed(0)
    loom.fit(nn.Linear(6, 2), F.cross_entropy, lambda p: torch.optim.Adam(p, lr=0.01), data(80, 0), epochs=1,
             batch_size=20, checkpoint_dir=fit_dir, async_checkpoint=True, progress=False)  # its last save: async
    strategy = loom.auto_strategy()  # another strategy: this save does not wait for fit's
    torch.manual_seed(1)
    model = strategy.prepare(nn.Linear(512, 1024))
    strategy.save(save_dir, step=1, async_save=True, model=model, big=torch.full((4_000_000,), 3.0))  # the last act
"""


def test_the_last_async_saves_of_fit_and_of_a_script_are_committed_before_the_workers_exit(tmp_path):
    script = tmp_path / "last_save.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = loom_run(["run", "--nproc", "2", str(script), str(tmp_path / "fit"), str(tmp_path / "save")], timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in committed(tmp_path / "fit")] == ["step-00000004"]
    assert [p.name for p in committed(tmp_path / "save")] == ["step-00000001"]
    assert not list(tmp_path.glob("*/.tmp-step-*"))

    torch.manual_seed(1)
    expected = nn.Linear(512, 1024)
    model, big = nn.Linear(512, 1024), torch.zeros(4_000_000)
    saved = loom.OneDeviceStrategy().restore(tmp_path / "save", model=model, big=big)
    assert saved["world_size"] == 2 and torch.equal(model.weight, expected.weight) and bool((big == 3.0).all())
    assert loom.OneDeviceStrategy().restore(tmp_path / "fit", model=nn.Linear(6, 2))["epoch"] == 1
