"""The benchmark scripts' code paths, run end to end on the CPU with tiny sizes (no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_smoke(script: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``benchmarks/<script> --cpu-smoke`` with its data and output under ``tmp_path``."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / script),
        "--cpu-smoke",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "data"),
        "--no-progress",
        *extra,
    ]
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res, out


def test_read_sweep_cpu_smoke(tmp_path):
    res, out = run_smoke("read_sweep.py", tmp_path)
    results = json.loads((out / "read_sweep.json").read_text())
    hot = [c for c in results["cells"] if c["backend"] == "engine" and c["mode"] == "hot"]
    assert hot, "no engine hot cells in read_sweep.json"
    assert all(c["status"] == "ok" and c["gbps"] > 0 for c in hot), hot
    assert all(c.get("verified") is not False for c in results["cells"])
    # kvikio is never silently dropped: its cells are there, measured or skipped with a reason
    kvikio = [c for c in results["cells"] if c["backend"] == "kvikio"]
    assert kvikio and all(c["status"] == "ok" or c.get("reason") for c in kvikio), kvikio
    assert (out / "read_sweep.png").is_file()
    assert "total time" in res.stdout


def test_file_loader_cpu_smoke(tmp_path):
    _, out = run_smoke("file_loader.py", tmp_path)
    report = json.loads((out / "file_loader.json").read_text())
    assert not report.get("failures"), report.get("failures")
    names = {r["name"] for r in report["runs"]}
    assert {"arrays fastload hot", "arrays fastload cold O_DIRECT", "records fastload hot"} <= names
    assert all(r["gbps"] > 0 and r["samples"] > 0 for r in report["runs"])
    assert report["baselines"]["disk_odirect_gbps"] > 0 and report["verdicts"]
    assert (out / "file_loader.png").is_file()


def test_imagenet_loader_cpu_smoke(tmp_path):
    res, out = run_smoke("imagenet_loader.py", tmp_path)
    report = json.loads((out / "imagenet_loader.json").read_text())
    assert not report["failures"], report["failures"]
    names = {r["name"] for r in report["runs"]}
    assert {"torch", "fastload-folder", "fastload-packed", "fastload-folder-bf16-cl"} <= names
    assert all(r["images_per_s"] > 0 and r["cores"] >= 0 for r in report["runs"])
    fastload = next(r for r in report["runs"] if r["name"] == "fastload-folder")
    assert fastload["decoded"].get("cpu:png", 0) >= 1  # the PNG named .JPEG was routed and counted
    assert (out / "imagenet_loader.png").is_file() and "vs torch" in res.stdout


def test_imagenet_train_cpu_smoke(tmp_path):
    """examples/imagenet.py fed four ways (synthetic, fastload, fastload with other decode
    settings, torch) on tiny data."""
    res, out = run_smoke("imagenet_train.py", tmp_path, "--share-too", "1:2:3")
    report = json.loads((out / "imagenet_train.json").read_text())
    assert not report["failures"], report["failures"]
    loaders = {(r["arch"], r["loader"]) for r in report["runs"]}
    assert loaders == {
        ("resnet18", "synthetic"),
        ("resnet18", "fastload"),
        ("resnet18", "fastload-share-1-2-3"),
        ("resnet18", "torch"),
    }
    assert (
        "TORCH_FASTLOAD_CPU_DECODE_SHARE=1 TORCH_FASTLOAD_CPU_DECODE_THREADS=2 TORCH_FASTLOAD_PREFETCH=3" in res.stdout
    )
    assert all(r["train_images_per_s"] > 0 for r in report["runs"])
    fastload = next(r for r in report["runs"] if r["loader"] == "fastload")
    assert 0.0 <= fastload["history"][-1]["top1"] <= 100.0  # validated
    assert (out / "imagenet_train.png").is_file()


def test_feature_gather_cpu_smoke(tmp_path):
    res, out = run_smoke("feature_gather.py", tmp_path)
    report = json.loads((out / "feature_gather.json").read_text())
    assert not report["failures"], report["failures"]
    assert {r["mode"] for r in report["hot"]} == {"mmap", "storage"}  # uva/cache need a GPU
    assert all(r["gbps"] > 0 for r in report["hot"])
    cold = {r["mode"] for r in report["cold"]}
    assert {"mmap", "storage buffered", "storage O_DIRECT", "disk 4 KiB random O_DIRECT"} <= cold
    assert (out / "feature_gather.png").is_file() and "hot gathers" in res.stdout


def test_remote_cpu_smoke(tmp_path):
    res, out = run_smoke("remote.py", tmp_path)
    report = json.loads((out / "remote.json").read_text())
    assert not report["failures"], report["failures"]
    grids = report["grids"]
    assert {"fastload", "boto3"} <= set(grids), grids.keys()
    for lib in ("fastload", "boto3"):
        cells = [v for row in grids[lib]["0.01"]["gbps"] for v in row]
        assert cells and all(v is not None and v > 0 for v in cells), (lib, cells)
    assert report["cap_bps"] > 0 and report["epochs"]["cache_gbps"] > 0
    assert set(report["epochs"]["cache_io"]) == {"remote-cache"}  # the second epoch never left the cache
    assert report["verdicts"] and (out / "remote.png").is_file()
    assert "total time" in res.stdout
