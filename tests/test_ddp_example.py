"""DDP on the CPU: examples/imagenet.py and benchmarks/ddp_scaling.py under torchrun with two
processes over gloo (tiny sizes; ~35 s on 2 cores). The GPU variant is marked multigpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
CLASSES, TRAIN_PER_CLASS, BATCH = 3, 8, 4  # 24 images: 12 a rank, 3 batches of 4 a rank


def run(cmd: list, timeout: float = 300, gpus: bool = False) -> subprocess.CompletedProcess:
    """``gpus=False`` hides CUDA from the processes: two ranks on the CPU over gloo on any
    machine (on a 1-GPU machine, rank 1 would otherwise ask for cuda:1)."""
    env = dict(os.environ)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res


def imagenet_ddp(tmp_path: Path, name: str, *extra: str, gpus: bool = False) -> tuple[dict, str]:
    """examples/imagenet.py under torchrun, 2 processes (the tiny settings of test_examples.py)."""
    out = tmp_path / f"{name}.json"
    cmd = [
        *TORCHRUN,
        str(REPO / "examples" / "imagenet.py"),
        "--arch",
        "resnet18",
        "--batch-size",
        str(BATCH),
        "--sample-dir",
        str(tmp_path / "sample"),
        "--sample-classes",
        str(CLASSES),
        "--sample-train-per-class",
        str(TRAIN_PER_CLASS),
        "--sample-val-per-class",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--no-progress",
        "--warmup-steps",
        "1",
        "--no-amp",
        "--epochs",
        "1",
        "--json",
        str(out),
        *extra,
    ]
    res = run(cmd, gpus=gpus)
    return json.loads(out.read_text()), res.stdout


def expected_checksum(train_dir: Path, world: int = 2, epoch: int = 0) -> float:
    """The example's label checksum of one whole epoch, from torch's DistributedSampler order."""
    from torch.utils.data.distributed import DistributedSampler

    from torch_fastload.sources import ImageFolder

    labels = ImageFolder(str(train_dir)).labels
    total = 0.0
    for rank in range(world):
        sampler = DistributedSampler(range(len(labels)), num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(len(order) // BATCH):  # drop_last
            for j, index in enumerate(order[i * BATCH : (i + 1) * BATCH]):
                total += (labels[index] + 1) * (i * BATCH + j + 1)
    return total


def check_mid_epoch_resume(tmp_path: Path, gpus: bool) -> None:
    backend, device = ("nccl", "cuda") if gpus else ("gloo", "cpu")
    # stopped after one step of three, with a mid-epoch checkpoint (model, optimizer, loader state)
    first, stdout = imagenet_ddp(tmp_path, "first", "--checkpoint-every", "1", "--max-steps", "1", gpus=gpus)
    assert first["world_size"] == 2 and first["backend"] == backend
    assert (first["device"] == "cpu") == (device == "cpu")
    assert first["steps"] == 1
    part = first["history"][0]
    assert part["partial"] and part["steps"] == 1 and part["samples"] == 2 * BATCH  # both ranks, all-reduced
    assert stdout.count("checkpoint: epoch 0 step 1") == 1  # rank 0 alone prints (and saves)
    checkpoint = tmp_path / "ckpt" / "resnet18-last.pt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["mid_epoch"] and saved["epoch"] == 0 and saved["epoch_step"] == 1 and saved["world_size"] == 2
    assert {"model", "optimizer", "scheduler"} <= set(saved) and saved["scheduler"]["step"] == 1

    # resumed: exactly the two batches a rank had left, then validation (all-reduced)
    resumed, stdout = imagenet_ddp(tmp_path, "resumed", "--resume", str(checkpoint), gpus=gpus)
    assert stdout.count("resumed from") == 1 and stdout.count("epoch 0: train loss") == 1
    rest = resumed["history"][0]
    assert rest["epoch"] == 0 and rest["resumed_at"] == 1 and not rest["partial"]
    assert rest["steps"] == 2 and rest["samples"] == 2 * 2 * BATCH
    assert resumed["steps"] == 3 and resumed["train_images_per_s"] > 0
    assert 0.0 <= rest["top1"] <= 100.0 and 0.0 <= rest["top5"] <= 100.0
    # the two parts together are the epoch's batches in the sampler's order, once each
    assert part["label_checksum"] + rest["label_checksum"] == expected_checksum(tmp_path / "sample" / "train")
    assert not torch.load(checkpoint, map_location="cpu", weights_only=True)["mid_epoch"]  # epoch-end checkpoint


def test_imagenet_example_two_processes_checkpoint_mid_epoch_and_resume(tmp_path):
    check_mid_epoch_resume(tmp_path, gpus=False)


@pytest.mark.multigpu
@pytest.mark.cuda
def test_imagenet_example_two_gpus_checkpoint_mid_epoch_and_resume(tmp_path):
    check_mid_epoch_resume(tmp_path, gpus=True)


def check_scaling_report(report: dict, counts: list) -> None:
    assert not report["failures"], report["failures"]
    assert sorted(report["runs"], key=int) == [str(n) for n in counts]
    for n in counts:
        run_ = report["runs"][str(n)]
        assert run_["world_size"] == n and len(run_["ranks"]) == n
        for name in ("fastload", "torch"):
            agg = run_["aggregate"][name]
            assert agg["coverage"]["status"] == "exact", agg["coverage"]
            assert agg["samples_per_s"] > 0 and agg["gbps"] > 0
            assert len(agg["per_rank_samples_per_s"]) == n


def test_ddp_scaling_cpu_smoke_covers_every_sample_once(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "ddp_scaling.py"),
        "--driver",
        "--device",
        "cpu",
        "--quick",
        "--gpus",
        "1,2",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "data"),
        "--no-progress",
    ]
    res = run(cmd)
    report = json.loads((out / "ddp_scaling.json").read_text())
    check_scaling_report(report, [1, 2])
    assert report["runs"]["2"]["backend"] == "gloo"
    rows = report["data"]["rows"]
    # from the ids each rank actually received (recorded on the CPU): disjoint, together all
    for name in ("fastload", "torch"):
        ranks = [r["runs"][name]["id_stats"] for r in report["runs"]["2"]["ranks"]]
        epochs = [e["epoch"] for e in ranks[0]]
        assert epochs == [e["epoch"] for e in ranks[1]] and len(epochs) >= 1
        for k, epoch in enumerate(epochs):
            a, b = ranks[0][k]["ids"], ranks[1][k]["ids"]
            assert len(a) == len(b) == rows // 2, (name, epoch)
            assert sorted(a + b) == list(range(rows)), (name, epoch)
            assert ranks[0][k]["count"] + ranks[1][k]["count"] == rows
            assert ranks[0][k]["id_sum"] + ranks[1][k]["id_sum"] == rows * (rows - 1) // 2
        if name == "fastload" and len(epochs) > 1:
            assert ranks[0][0]["ids"] != ranks[0][1]["ids"]  # set_epoch reshuffles
    assert "fastload_scaling" in report and (out / "ddp_scaling.png").is_file()
    assert (out / "ddp_scaling-2gpu.log").is_file() and "aggregate" in res.stdout


@pytest.mark.multigpu
@pytest.mark.cuda
def test_ddp_scaling_two_gpus_small(tmp_path):
    """On a machine with 2+ GPUs: nccl, one GPU a rank, small data; coverage exact."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "ddp_scaling.py"),
        "--driver",
        "--gpus",
        "1,2",
        "--gib",
        "0.25",
        "--epochs",
        "2",
        "--torch-workers",
        "2",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "data"),
        "--no-progress",
    ]
    run(cmd, timeout=600, gpus=True)
    report = json.loads((out / "ddp_scaling.json").read_text())
    check_scaling_report(report, [1, 2])
    assert report["runs"]["2"]["backend"] == "nccl"
    assert {r["device"] for r in report["runs"]["2"]["ranks"]} == {"cuda:0", "cuda:1"}
