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
