"""torch.distributed with 2 processes (gloo, CPU): each rank reads its share, together they read
the epoch exactly once; an epoch checkpointed at 2 ranks continues at 1 or 3 ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROWS = 203  # not a multiple of 2, 3 or 8: padding and a short last batch


def torchrun(nproc: int, *args, timeout=240):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "dist_worker.py"),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "rows.npy"
    np.save(path, np.repeat(np.arange(ROWS, dtype=np.float32)[:, None], 4, axis=1))
    return path


def read(out, epoch):
    with open(out / f"epoch-{epoch}.json") as f:
        return json.load(f)["ids"]


def test_two_ranks_read_disjoint_shares_that_cover_each_epoch(data, tmp_path):
    torchrun(2, data, tmp_path, "--epochs", 2)
    orders = []
    for epoch in range(2):
        rank0, rank1 = read(tmp_path, epoch)
        assert len(rank0) == len(rank1) == (ROWS + 1) // 2  # padded to equal shares
        assert sorted(set(rank0 + rank1)) == list(range(ROWS))
        assert len(set(rank0) & set(rank1)) <= 1  # only the one padding sample may repeat
        orders.append(rank0)
    assert orders[0] != orders[1], "set_epoch did not reshuffle"


@pytest.mark.parametrize("new_world", [1, 3])
def test_checkpoint_at_two_ranks_resumes_at_another_world_size(data, tmp_path, new_world):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    torchrun(2, data, first, "--epochs", 1, "--stop-after", 5)
    head = [i for ids in read(first, 0) for i in ids]
    assert len(head) == 2 * 5 * 8
    torchrun(new_world, data, second, "--epochs", 1, "--resume", first / "state.json")
    rest = [i for ids in read(second, 0) for i in ids]
    counts = np.bincount(head + rest, minlength=ROWS)
    assert (counts >= 1).all(), f"skipped rows {np.flatnonzero(counts == 0).tolist()}"
    assert counts.sum() - ROWS < new_world, f"repeated rows {np.flatnonzero(counts > 1).tolist()}"
