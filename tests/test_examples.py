"""examples/ run end to end on the CPU on their embedded defaults (tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

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


def load_imagenet_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("imagenet_example", REPO / "examples" / "imagenet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_imagenet_example_on_the_cpu_picks_cpu_sized_defaults_and_says_so(tmp_path):
    """No GPU, no --arch/--amp/--max-steps: ResNet-18, float32, a few steps, and one line saying so;
    --batch-size given stays as given."""
    out = tmp_path / "run.json"
    cmd = [
        sys.executable,
        str(REPO / "examples" / "imagenet.py"),
        "--sample-dir",
        str(tmp_path / "sample"),
        "--sample-classes",
        "2",
        "--sample-train-per-class",
        "4",
        "--sample-val-per-class",
        "1",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--no-progress",
        "--json",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    notes = [line for line in res.stdout.splitlines() if line.startswith("no GPU: CPU-sized defaults")]
    assert len(notes) == 1, res.stdout
    assert "--arch resnet18" in notes[0] and "--no-amp" in notes[0] and "--max-steps 12" in notes[0]
    assert "--batch-size" not in notes[0] and "--sample-classes" not in notes[0]  # given, not picked
    result = json.loads(out.read_text())
    assert result["arch"] == "resnet18" and result["amp"] is False and result["batch_size"] == 4
    assert result["device"] == "cpu" and result["steps"] == 2  # 8 images / 4


def test_imagenet_example_explicit_arguments_win_over_device_defaults():
    example = load_imagenet_example()
    args = example.parse_args(["--arch", "resnet50", "--amp", "--max-steps", "0", "--batch-size", "64"])
    note = example.apply_defaults(args, torch.device("cpu"))
    assert (args.arch, args.no_amp, args.max_steps, args.batch_size) == ("resnet50", False, 0, 64)
    assert args.warmup_steps == 2 and args.sample_dir.endswith("imagenet-sample-cpu")  # the rest: CPU-sized
    assert note.startswith("no GPU: CPU-sized defaults (--workers 2 --warmup-steps 2")
    gpu = example.parse_args([])
    assert example.apply_defaults(gpu, torch.device("cuda", 0)) is None
    assert (gpu.arch, gpu.batch_size, gpu.no_amp, gpu.max_steps) == ("resnet50", 256, False, 0)
    data = example.parse_args(["--data", "/datasets/imagenet"])
    assert "--sample" not in example.apply_defaults(data, torch.device("cpu"))  # no sample set is made
