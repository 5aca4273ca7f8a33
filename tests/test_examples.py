"""examples/ run end to end on the CPU on their embedded defaults (tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_imagenet(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"run-{len(list(tmp_path.glob('run-*.json')))}.json"
    cmd = [
        sys.executable,
        str(REPO / "examples" / "imagenet.py"),
        "--arch",
        "resnet18",
        "--batch-size",
        "4",
        "--sample-dir",
        str(tmp_path / "sample"),
        "--sample-classes",
        "3",
        "--sample-train-per-class",
        "4",
        "--sample-val-per-class",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--no-progress",
        "--warmup-steps",
        "1",
        "--no-amp",
        "--json",
        str(out),
        *extra,
    ]
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_imagenet_example_trains_validates_and_resumes(tmp_path):
    first = run_imagenet(tmp_path, "--epochs", "1")
    assert first["loader"] == "fastload" and first["train_images_per_s"] > 0
    assert len(first["history"]) == 1 and 0.0 <= first["history"][0]["top1"] <= 100.0
    checkpoint = tmp_path / "ckpt" / "resnet18-last.pt"
    assert checkpoint.is_file()
    resumed = run_imagenet(tmp_path, "--epochs", "2", "--resume", str(checkpoint))
    assert [h["epoch"] for h in resumed["history"]] == [1]  # continued after the saved epoch


def test_imagenet_example_torch_loader_and_evaluate(tmp_path):
    result = run_imagenet(tmp_path, "--epochs", "1", "--loader", "torch", "--workers", "0", "--steps-per-epoch", "2")
    assert result["loader"] == "torch" and result["history"]
    evaluated = run_imagenet(tmp_path, "--evaluate", "--resume", str(tmp_path / "ckpt" / "resnet18-last.pt"))
    assert set(evaluated) == {"top1", "top5"}
