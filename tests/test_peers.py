"""The peer baselines (torch_fastload/_benchutil/peers.py): a peer that is absent is reported
as "not installed", never silently dropped; and the resume table, run on the CPU, finds
torch_fastload exact wherever torchdata's StatefulDataLoader is."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_fastload._benchutil import peers

REPO = Path(__file__).resolve().parents[1]


def run(script: str, tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[str, Path]:
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / script), "--device", "cpu", "--quick", "--out", str(out)]
    res = subprocess.run(
        cmd + ["--no-progress", *extra], cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res.stdout, out


def test_an_absent_peer_is_not_installed_with_the_reason(monkeypatch):
    def no_module(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(peers, "_import_module", no_module)
    for name in ("dali", "spdl", "torchdata"):
        st = peers.status(name)
        assert not st.installed and st.version is None
        assert st.line().startswith(f"{st.label}: not installed (ModuleNotFoundError")
        assert f"pip install {peers.PEERS[name][1]}" in st.line()
        with pytest.raises(peers.PeerUnavailable, match="not installed"):
            peers.require(name)
    assert "not installable here" in peers.status("ffcv").line()
    assert peers.all_status()["dali"]["installed"] is False


def test_a_gpu_peer_on_the_cpu_says_it_needs_cuda(monkeypatch):
    monkeypatch.setattr(peers, "_import_module", lambda name: object())
    with pytest.raises(peers.PeerUnavailable, match="needs CUDA"):
        peers.require("dali", torch.device("cpu"))
    assert peers.require("torchdata", torch.device("cpu")).installed  # torchdata runs anywhere


def test_benchmark_rows_say_not_installed(tmp_path):
    """The benchmarks list each hidden peer as a row with its reason, in the table and the JSON."""
    env = dict(os.environ, **{peers.HIDE_ENV: "dali,spdl,torchdata"})
    stdout, out = run("imagenet_loader.py", tmp_path, "--dir", str(tmp_path / "images"), env=env)
    data = json.loads((out / "imagenet_loader.json").read_text())
    assert set(data["peer_rows_not_run"]) == {"dali", "dali-fp16-nhwc", "spdl-cpu", "spdl-nvjpeg"}
    assert "DALI: not installed" in stdout and "SPDL: not installed" in stdout
    assert not data["failures"] and {r["name"] for r in data["runs"]} >= {"torch", "fastload-folder"}
    stdout, out = run("file_loader.py", tmp_path, "--dir", str(tmp_path / "data"), env=env)
    data = json.loads((out / "file_loader.json").read_text())
    assert set(data["peer_rows_not_run"]) == {"torchdata", "dali numpy"}
    assert "torchdata StatefulDataLoader: not installed" in stdout
    assert not any(r["loader"] == "torchdata" for r in data["runs"])


def _resume_peers():
    spec = importlib.util.spec_from_file_location("resume_peers", REPO / "benchmarks" / "resume_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_table_finds_a_loader_that_ignores_its_state():
    """Negative control: a loader whose load_state_dict does nothing restarts the epoch: wrong."""
    rp = _resume_peers()

    class Forgetful(torch.utils.data.DataLoader):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def make(kind, seed, workers):
        g = torch.Generator().manual_seed(0)
        return Forgetful(rp.Numbers(32), 4, shuffle=True, generator=g, num_workers=workers)

    result = rp.same_rest("forgetful", make, 3, {"workers": 0}, {"workers": 0})
    assert result["outcome"] == "wrong", result


def test_resume_peers_fastload_exact_wherever_torchdata_is(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    stdout, out = run("resume_peers.py", tmp_path)
    data = json.loads((out / "resume_peers.json").read_text())
    cases = data["cases"]
    assert len(cases) == 9 and not data["failures"]
    for name in ("mid-epoch w0", "mid-epoch w2", "iterable w0", "iterable w2"):
        assert cases[name]["torchdata"]["outcome"] == "exact", (name, cases[name])  # the harness is sound
    theirs = [n for n, by in cases.items() if by["torchdata"]["outcome"] == "exact"]
    missed = {n: cases[n]["fastload"] for n in theirs if cases[n]["fastload"]["outcome"] != "exact"}
    assert not missed, missed
    for name in ("other world 2->1", "other world 2->3", "other workers 2->0"):
        assert cases[name]["fastload"]["outcome"] == "exact", cases[name]
    assert data["verdicts"][0]["pass"] is True and "torch_fastload" in stdout


def test_dali_pipelines_on_the_cpu(tmp_path):
    """Where DALI is installed: its image pipeline (the example's CPU branch) and numpy reader
    yield every batch, every epoch, in our output layouts."""
    pytest.importorskip("nvidia.dali")
    import numpy as np

    from torch_fastload.vision.sample_data import make_image_folder

    cpu = torch.device("cpu")
    train, _ = make_image_folder(str(tmp_path / "images"), 3, 6, 1, edge_cases=True, progress=False)
    for half in (False, True):
        loader = peers.dali_image_loader(train, 4, 2, cpu, half_nhwc=half)
        for _ in range(2):
            batches = [(x, y) for x, y in loader]
            assert len(batches) == len(loader) == 18 // 4
            for x, y in batches:
                assert x.shape == (4, 3, 224, 224) and y.dtype == torch.int64 and set(y.tolist()) <= {0, 1, 2}
                assert x.dtype == (torch.float16 if half else torch.float32)
                assert x.is_contiguous(memory_format=torch.channels_last if half else torch.contiguous_format)
    features = tmp_path / "features.npy"
    np.save(features, np.arange(40 * 48, dtype=np.float32).reshape(40, 3, 4, 4))
    files = peers.write_rows_as_files(features, tmp_path / "rows")
    rows = [
        int(r[0, 0, 0]) // 48
        for (batch,) in peers.dali_numpy_loader(tmp_path / "rows", files, 8, 2, cpu, gpu_reader=False)
        for r in batch
    ]
    assert sorted(rows) == list(range(40)) and rows != list(range(40))  # every row once, shuffled


def test_spdl_pipeline_on_the_cpu(tmp_path):
    """Where SPDL (and FFmpeg's libraries) are installed: its CPU-decode pipeline yields every
    batch, normalized fp32 NCHW, each epoch reshuffled."""
    pytest.importorskip("spdl.io")
    from torch_fastload.vision.sample_data import make_image_folder

    train, _ = make_image_folder(str(tmp_path / "images"), 3, 6, 1, edge_cases=True, progress=False)
    loader = peers.spdl_image_loader(peers.image_samples(train), 4, 2, torch.device("cpu"), nvjpeg=False)
    try:
        epochs = [[y.tolist() for x, y in loader] for _ in range(2)]
    except RuntimeError as exc:
        if "libspdl" in str(exc) or "yielded" in str(exc):
            pytest.skip(f"SPDL without FFmpeg's libraries here: {exc}")
        raise
    assert all(len(e) == len(loader) == 4 for e in epochs) and epochs[0] != epochs[1]
    x, _ = next(iter(loader))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32 and -3 < float(x.mean()) < 3


def test_example_loader_dali_says_why_it_cannot_run(tmp_path):
    """examples/imagenet.py --loader dali without DALI (or without a GPU) ends with the reason."""
    env = dict(os.environ, **{peers.HIDE_ENV: "dali"})
    cmd = [sys.executable, str(REPO / "examples" / "imagenet.py"), "--loader", "dali", "--no-progress"]
    cmd += ["--sample-dir", str(tmp_path / "images"), "--sample-classes", "2", "--sample-train-per-class", "2"]
    cmd += ["--sample-val-per-class", "1", "--checkpoint-dir", str(tmp_path / "ckpt")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1 and "--loader dali: DALI: not installed" in res.stderr, res.stderr[-2000:]
