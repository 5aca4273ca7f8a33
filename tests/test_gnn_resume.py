"""NeighborBatches under DDP sharding, determinism and exact mid-epoch resume (issue 6, GNN part).

Factories for tests/resume_harness.py are module-level: ``factory(seed, **kwargs)``; the
harness calls them again in a fresh process with another ``seed`` (torch's), so everything
that decides the rest of an epoch must come from the state.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_harness import assert_equal, check_resume, to_cpu

from torch_fastload.gnn import CSRGraph, NeighborBatches, make_graph
from torch_fastload.resume import ResumeError
from torch_fastload.sources import FeatureStore

REPO = Path(__file__).resolve().parents[1]
NODES, DIM = 3000, 16


@functools.cache
def _graph(path: str):
    g = make_graph(path, nodes=NODES, dim=DIM, communities=4, progress=False)  # reused once written
    return CSRGraph(g["indptr"], g["indices"]), g["labels"], g["paths"]["features"]


def batches(
    seed: int = 0,
    *,
    path: str,
    seeds=None,
    prefetch: int = 2,
    num_replicas: int = 1,
    rank: int = 0,
    batch_size: int = 64,
    epoch: int = 0,
    order_seed: int = 7,
    shuffle: bool = True,
    drop_last: bool = False,
    fanouts=(4, 3),
    features: bool = True,
) -> NeighborBatches:
    """The harness factory: NeighborBatches over the test graph, features from a CPU FeatureStore."""
    torch.manual_seed(seed)  # as a script would; must not matter
    graph, labels, feature_path = _graph(path)
    store = FeatureStore(feature_path, device="cpu") if features else None
    ids = np.arange(1, NODES, 2) if seeds is None else np.asarray(seeds)
    nb = NeighborBatches(
        graph,
        ids,
        list(fanouts),
        store,
        labels if features else None,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=order_seed,
        prefetch=prefetch,
        num_replicas=num_replicas,
        rank=rank,
        drop_last=drop_last,
    )
    nb.set_epoch(epoch)
    return nb


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gnn-resume") / "graph")
    _graph(root)
    return root


def seeds_of(batch_list) -> list:
    return [int(s) for b in batch_list for s in b.n_id[: b.batch_size].tolist()]


def test_resume_in_a_fresh_process_is_exact(path):
    # 1500 seeds / 64 = 24 batches; checkpoints after 0, 1, 12, 23 and 24 batches, resumed with prefetch 0
    full = check_resume("test_gnn_resume:batches", {"path": path, "prefetch": 4}, child_overrides={"prefetch": 0})
    assert len(full) == 24 and full[-1]["batch_size"] == 1500 - 23 * 64


def test_sharded_resume_in_a_fresh_process_is_exact(path):
    # rank 2 of 3, epoch 2, 1000 seeds padded to 1002: 334 each, 6 batches of 64 (the last 14)
    kwargs = {"path": path, "seeds": list(range(0, NODES, 3)), "num_replicas": 3, "rank": 2, "epoch": 2, "prefetch": 1}
    full = check_resume("test_gnn_resume:batches", kwargs, points=(1, 3, 6), child_overrides={"prefetch": 3})
    assert [b["batch_size"] for b in full] == [64] * 5 + [14]


def test_two_ranks_cover_every_seed_once_per_epoch(path):
    seeds = np.arange(0, NODES, 2)[:1001]  # odd: one padded seed, or one dropped
    for drop_last in (False, True):
        ranks = [
            batches(
                path=path,
                seeds=seeds,
                num_replicas=2,
                rank=r,
                batch_size=50,
                drop_last=drop_last,
                features=False,
                fanouts=(2,),
            )
            for r in (0, 1)
        ]
        whole = batches(path=path, seeds=seeds, batch_size=50, features=False, fanouts=(2,))
        orders = []
        for epoch in (0, 1):
            for nb in (*ranks, whole):
                nb.set_epoch(epoch)
            got = [[b for b in nb] for nb in ranks]
            assert len(got[0]) == len(got[1]) == len(ranks[0]) == (10 if drop_last else 11)
            mine = [seeds_of(g) for g in got]
            everything = mine[0] + mine[1]
            if drop_last:
                assert len(everything) == len(set(everything)) == 1000
            else:
                assert set(everything) == set(seeds.tolist()) and len(everything) == 1002
            # the global order does not depend on the world size: rank r holds positions r, r + 2, ...
            order = seeds_of(list(whole))
            padded = order + order[:1]
            assert mine[0] == padded[0::2][: len(mine[0])] and mine[1] == padded[1::2][: len(mine[1])]
            orders.append(order)
        assert orders[0] != orders[1]  # each epoch its own shuffle


@pytest.mark.parametrize("new_world,new_batch", [(1, 50), (3, 50), (3, 70)])
def test_reshard_continues_the_epoch_with_every_seed_once(path, new_world, new_batch):
    seeds = np.arange(0, NODES, 2)[:1001]
    kw = dict(path=path, seeds=seeds, epoch=1, features=False, fanouts=(2,))
    ranks = [batches(num_replicas=2, rank=r, batch_size=50, **kw) for r in (0, 1)]
    its = [iter(nb) for nb in ranks]
    head = [[next(it) for _ in range(3)] for it in its]  # 3 batches each: 300 positions consumed
    state = json.loads(json.dumps(ranks[0].state_dict()))
    assert state["in_progress"] and state["epoch"] == 1 and state["position"] == 3 * 50 * 2
    resumed = [batches(num_replicas=new_world, rank=r, batch_size=new_batch, **kw) for r in range(new_world)]
    rest = []
    for nb in resumed:
        nb.load_state_dict(state)
        rest.append(list(nb))
    assert len({len(r) for r in rest}) == 1  # every new rank yields as many batches
    counts = Counter(seeds_of(head[0]) + seeds_of(head[1]) + [s for r in rest for s in seeds_of(r)])
    assert set(counts) == set(seeds.tolist())  # nothing skipped
    padding = -(1001 - 300) % new_world
    assert sum(counts.values()) == 1001 + padding and max(counts.values()) <= 2  # repeats: the padding only
    for nb in resumed:  # the epoch is over: the next iteration is epoch 2, whole
        assert not nb.state_dict()["in_progress"] and nb.epoch == 2


def test_prefetch_depth_never_changes_a_batch(path):
    def run(prefetch, stop=None):
        nb = batches(path=path, prefetch=prefetch, num_replicas=2, rank=1, batch_size=100)
        if stop is None:
            return [to_cpu(b) for b in nb]
        it = iter(nb)
        head = [to_cpu(next(it)) for _ in range(stop)]
        state = nb.state_dict()
        assert state["batches_yielded"] == stop  # yielded, not prefetched
        del it
        again = batches(path=path, prefetch=prefetch, num_replicas=2, rank=1, batch_size=100)
        again.load_state_dict(state)
        return head + [to_cpu(b) for b in again]

    reference = run(0)
    assert len(reference) == 8  # 1500 seeds over 2 ranks: 750 each, 8 batches of <= 100
    for prefetch in (1, 4):
        for i, (a, b) in enumerate(zip(reference, run(prefetch), strict=True)):
            assert_equal(a, b, f"prefetch {prefetch} batch {i}")
        for i, (a, b) in enumerate(zip(reference, run(prefetch, stop=3), strict=True)):
            assert_equal(a, b, f"prefetch {prefetch}, resumed after 3, batch {i}")


def test_a_resumed_epoch_checkpoints_and_resumes_again(path):
    kw = dict(path=path, num_replicas=3, rank=1, batch_size=40, features=False, prefetch=2)
    full = [to_cpu(b) for b in batches(**kw)]  # 1500 / 3 = 500 each: 13 batches
    got, state, places = [], None, []
    for stop in (4, 3, 2, None):  # preempted three times, each run resumed from the last state
        nb = batches(**kw)
        if state is not None:
            nb.load_state_dict(state)
            loaded = nb.state_dict()  # loaded, not iterated yet: the same place
            assert [loaded[k] for k in ("epoch", "in_progress", "position")] == [
                state[k] for k in ("epoch", "in_progress", "position")
            ]
        it = iter(nb)
        got += [to_cpu(b) for _, b in zip(range(stop or len(full)), it)]
        state = json.loads(json.dumps(nb.state_dict()))
        places.append((state["epoch"], state["in_progress"], state["start"], state["position"]))
        del it
    assert places == [
        (0, True, 0, 4 * 120),
        (0, True, 4 * 120, 7 * 120),
        (0, True, 7 * 120, 9 * 120),
        (1, False, 0, 0),
    ]  # the last run reached the epoch's end: next is epoch 1
    for i, (a, b) in enumerate(zip(full, got, strict=True)):
        assert_equal(a, b, f"batch {i}")


def test_state_counts_yielded_batches_and_epochs(path):
    nb = batches(path=path, prefetch=4, batch_size=100, num_replicas=2, rank=0, features=False)
    assert nb.state_dict()["in_progress"] is False and nb.state_dict()["epoch"] == 0
    it = iter(nb)
    assert nb.epoch == 1  # iter() took epoch 0 and advanced: a plain loop reshuffles each epoch
    next(it), next(it)
    state = nb.state_dict()
    assert (state["epoch"], state["batches_yielded"], state["position"]) == (0, 2, 2 * 100 * 2)
    json.dumps(state)
    rest = list(it)
    assert len(rest) == len(nb) - 2
    after = nb.state_dict()
    assert after["in_progress"] is False and after["epoch"] == 1
    nb.set_epoch(5)
    assert nb.state_dict()["epoch"] == 5
    first = seeds_of([next(iter(nb))])
    other = batches(path=path, batch_size=100, num_replicas=2, rank=0, features=False, epoch=5)
    assert first == seeds_of([next(iter(other))])  # set_epoch(5) draws epoch 5 whatever came before


def test_a_state_from_other_seeds_shuffle_or_seed_is_refused(path):
    nb = batches(path=path, features=False)
    it = iter(nb)
    next(it)
    state = nb.state_dict()
    with pytest.raises(ResumeError, match=r"1500 seeds.*1000 seeds"):
        batches(path=path, seeds=np.arange(1000), features=False).load_state_dict(state)
    with pytest.raises(ResumeError, match=r"another set \(or order\) of seed nodes"):  # same count, other nodes
        batches(path=path, seeds=np.arange(0, NODES, 2), features=False).load_state_dict(state)
    with pytest.raises(ResumeError, match="shuffle=True.*shuffle=False"):
        batches(path=path, shuffle=False, features=False).load_state_dict(state)
    with pytest.raises(ResumeError, match="seed=7.*seed=8"):
        batches(path=path, order_seed=8, features=False).load_state_dict(state)
    with pytest.raises(ValueError, match="not a NeighborBatches state"):
        batches(path=path, features=False).load_state_dict({"format": "torch_fastload.DataLoader/1"})
    resumed = batches(path=path, features=False)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    with pytest.raises(ResumeError, match="epoch 0 .* epoch 3"):
        iter(resumed)
    with pytest.raises(ValueError, match="rank 2 of num_replicas 2"):
        batches(path=path, num_replicas=2, rank=2, features=False)


def test_gnn_example_under_torchrun_resumes_a_preempted_run(tmp_path):
    """examples/gnn_sage.py on the CPU: one process is stopped mid-epoch (checkpoint), then two
    ranks under torchrun (gloo, DDP) continue the epoch from it and finish."""
    common = [
        str(REPO / "examples" / "gnn_sage.py"),
        "--root",
        str(tmp_path / "g"),
        "--nodes",
        "20000",
        "--dim",
        "32",
        "--epochs",
        "2",
        "--batch-size",
        "256",
        "--max-steps",
        "20",
        "--no-progress",
        "--device",
        "cpu",
        "--checkpoint",
        str(tmp_path / "ck.pt"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(
        [sys.executable, *common, "--stop-after", "10", "--json", str(tmp_path / "a.json")],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((tmp_path / "a.json").read_text())["stopped_at"] == {"epoch": 0, "step_in_epoch": 10, "step": 10}
    out = tmp_path / "b.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *common,
        "--resume",
        str(tmp_path / "ck.pt"),
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from" in res.stdout and "test accuracy" in res.stdout
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert [(h["epoch"], h["train"]["resumed_at"], h["train"]["steps"]) for h in result["history"]] == [
        (0, 10, 10),
        (1, 0, 20),
    ]  # the rest of epoch 0 (to --max-steps), then epoch 1
    assert result["test"]["accuracy"] > 0.5  # 32 communities: chance is ~3%
    assert result["store_stats"]["cache_hits"] > 0


def test_gnn_example_resumed_mid_epoch_trains_as_if_never_stopped(tmp_path):
    """One process, the CPU: a run stopped after 7 steps (checkpoint) and resumed ends with the
    same weights, losses and accuracies as the run that was never stopped (same batches, same
    optimizer state, same dropout draws), whatever the prefetch depth."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gnn_sage_example", REPO / "examples" / "gnn_sage.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = [
        "--root",
        str(tmp_path / "g"),
        "--nodes",
        "8000",
        "--dim",
        "16",
        "--epochs",
        "2",
        "--batch-size",
        "128",
        "--max-steps",
        "12",
        "--hidden",
        "32",
        "--device",
        "cpu",
        "--no-progress",
    ]
    # The model's CPU float math must be bit-reproducible for weights to compare exactly: with
    # 16 intra-op threads two uninterrupted runs already differ by ~3e-8 (GPU machine, measured),
    # with one they are identical. The loader's part (batches, RNG) does not depend on this.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_whole_and_resumed(example, common, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _compare_whole_and_resumed(example, common, tmp_path):
    whole = example.main(common + ["--checkpoint", str(tmp_path / "whole.pt")])
    stopped = example.main(common + ["--checkpoint", str(tmp_path / "ck.pt"), "--stop-after", "7", "--prefetch", "4"])
    assert stopped["stopped_at"] == {"epoch": 0, "step_in_epoch": 7, "step": 7}
    resumed = example.main(
        common + ["--checkpoint", str(tmp_path / "ck.pt"), "--resume", str(tmp_path / "ck.pt"), "--prefetch", "0"]
    )
    assert [(h["train"]["resumed_at"], h["train"]["steps"]) for h in resumed["history"]] == [(7, 5), (0, 12)]
    metrics = [
        (h["train"]["loss"], h["train"]["accuracy"], h["val"]["loss"], h["val"]["accuracy"])
        for h in (whole["history"][1], resumed["history"][1])
    ]
    assert metrics[0] == metrics[1]
    assert whole["test"]["accuracy"] == resumed["test"]["accuracy"]
    a = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ck.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
