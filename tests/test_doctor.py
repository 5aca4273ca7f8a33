"""Tests of ``python -m torch_fastload doctor``: a quick run end to end on the CPU (storage, GDS
report, sweep, --save into the tuning file that config reads, --json), argument errors, and that
one failing section does not end the report. The H2D test needs a GPU."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from torch_fastload import config, doctor, engine

MiB = 1 << 20
THREADS_ENV = config.OPTIONS["io_threads"].env
TASK_ENV = config.OPTIONS["io_task_size"].env


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """A private tuning file path, and no env var shadowing it."""
    path = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv("TORCH_FASTLOAD_TUNING_FILE", str(path))
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv(TASK_ENV, raising=False)
    return path


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".torch_fastload_doctor-")]


def test_quick_run_saves_tuning_and_json(tmp_path, tuning, monkeypatch, capsys):
    out_json = tmp_path / "d.json"
    rc = doctor.main(
        ["--quick", "--dir", str(tmp_path), "--size", "8M", "--save", "--json", str(out_json)], prog="doctor"
    )
    out = capsys.readouterr().out
    assert rc == 0
    for title in ("== GPU ==", "== GDS / kvikio ==", "== Storage ==", "== Sweep"):
        assert title in out, out
    assert "recommended: io_threads=" in out
    assert ": failed: " not in out, out
    assert leftovers(tmp_path) == []  # the test data file is gone

    report = json.loads(out_json.read_text())
    assert report["storage"]["size"] == 8 * MiB
    assert report["storage"]["hot"]["gbps"] > 0
    assert report["storage"]["cold_buffered"]["gbps"] > 0
    sweep = report["sweep"]
    assert sweep["threads"] == [1, 4, 16] and sweep["task_sizes"] == [MiB, 4 * MiB]
    assert len(sweep["gbps"]) == 3 and all(len(row) == 2 and all(v > 0 for v in row) for row in sweep["gbps"])
    rec = sweep["recommended"]
    assert (rec["threads"], rec["task_size"]) in {(c["threads"], c["task_size"]) for c in sweep["cells"]}
    assert rec["gbps"] >= doctor.NEAR_BEST * max(c["gbps"] for c in sweep["cells"])

    saved = json.loads(tuning.read_text())
    assert saved["settings"] == {"io_threads": rec["threads"], "io_task_size": rec["task_size"]}
    assert saved["measured"]["sweep"]["gbps"] == sweep["gbps"] and saved["date"] and saved["machine"]
    assert str(tuning) in out
    assert config.get("io_threads") == rec["threads"] and config.source("io_threads") == "tuning file"
    assert config.get("io_task_size") == rec["task_size"] and config.source("io_task_size") == "tuning file"
    assert engine.default_num_threads() == rec["threads"]

    other = 1 if rec["threads"] != 1 else 2
    monkeypatch.setenv(THREADS_ENV, str(other))  # the environment beats the tuning file
    assert config.get("io_threads") == other and config.source("io_threads") == THREADS_ENV
    with config.override(io_threads=5):  # and an override beats both
        assert config.get("io_threads") == 5 and config.source("io_threads") == "override"


@pytest.mark.parametrize(
    "argv",
    [
        ["--size", "nonsense"],
        ["--size", "0"],
        ["--threads", "0"],
        ["--tasks", "4X"],
        ["--dir", "/nonexistent/doctor"],
        ["--bogus"],
    ],
)
def test_bad_arguments_exit_2(argv, tuning, capsys):
    assert doctor.main(argv, prog="doctor") == 2
    assert "error" in capsys.readouterr().err
    assert not tuning.exists()


def test_help_through_the_package_entry_point():
    res = subprocess.run(
        [sys.executable, "-m", "torch_fastload", "doctor", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "--save" in res.stdout and "--quick" in res.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "torch_fastload", "--help"], capture_output=True, text=True, timeout=120
    )
    assert "doctor" in listing.stdout


def test_a_failing_section_does_not_end_the_report(tmp_path, tuning, monkeypatch, capsys):
    def boom():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(doctor, "gds_info", boom)
    rc = doctor.main(["--quick", "--dir", str(tmp_path), "--size", "4M", "--no-progress", "--save"], prog="doctor")
    out = capsys.readouterr().out
    assert rc == 0
    assert "gds: failed: RuntimeError: probe exploded" in out
    assert "== Storage ==" in out and "recommended: io_threads=" in out and tuning.exists()
    assert leftovers(tmp_path) == []


def test_storage_failure_skips_the_sweep_and_the_save(tmp_path, tuning, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "no reads today")

    monkeypatch.setattr(engine, "read_ranges", refuse)
    rc = doctor.main(["--quick", "--dir", str(tmp_path), "--size", "4M", "--no-progress", "--save"], prog="doctor")
    out = capsys.readouterr().out
    assert rc == 0
    assert "storage: failed: PermissionError" in out and "sweep: failed: PermissionError" in out
    assert "nothing to record" in out and not tuning.exists()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_doctor_killed_mid_run_leaves_no_test_file(tmp_path, tuning, sig):
    """Ctrl-C, SIGTERM or SIGKILL while the sweep reads the test file: the file is gone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_fastload", "doctor", "--dir", str(tmp_path), "--size", "32M"]
        + ["--threads", "1,2,4,8", "--tasks", "1M,4M", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    watchdog = threading.Timer(120, proc.kill)  # a doctor that never gets there fails, not hangs
    watchdog.start()
    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if "== Storage ==" in line:  # the storage section is done; the sweep reads the file now
                proc.send_signal(sig)
                break
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "== Storage ==" in seen, seen
    assert proc.returncode == -sig, (proc.returncode, seen)  # killed mid-run, not finished
    assert leftovers(tmp_path) == []


def test_the_test_file_goes_to_the_temporary_directory_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(doctor.cli.tempfile, "tempdir", None)  # tempfile caches the directory
    assert doctor.build_parser().parse_args([]).dir == str(tmp_path)
    with doctor.scratch_file(str(tmp_path)) as path:
        doctor.write_test_file(path, MiB)
        assert os.path.getsize(path) == MiB
    assert os.listdir(tmp_path) == []


def test_o_direct_refused_is_reported_and_skipped(tmp_path, monkeypatch, capsys):
    real = engine.read_ranges

    def no_direct(*args, o_direct=False, **kwargs):
        if o_direct:
            raise OSError(errno.EINVAL, "the filesystem refuses O_DIRECT (open returned EINVAL)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "read_ranges", no_direct)
    path = str(tmp_path / "data.bin")
    result = doctor.measure_storage(path, 2 * MiB)
    assert "EINVAL" in result["cold_odirect"]["skipped"]
    assert result["cold_buffered"]["gbps"] > 0 and result["hot"]["gbps"] > 0
    doctor.render("storage", result)
    out = capsys.readouterr().out
    assert "cold read, O_DIRECT" in out and "skipped" in out


def test_recommend_prefers_fewer_threads_then_smaller_tasks_within_5_percent():
    cells = [
        {"threads": t, "task_size": s, "gbps": g}
        for t, s, g in [(16, 4 * MiB, 10.0), (4, 4 * MiB, 9.7), (4, MiB, 9.6), (2, 16 * MiB, 9.0), (8, MiB, 9.9)]
    ]
    rec = doctor.recommend(cells)
    assert (rec["threads"], rec["task_size"]) == (4, MiB)
    assert (rec["best"]["threads"], rec["best"]["task_size"]) == (16, 4 * MiB)


def test_filesystem_of_a_directory(tmp_path):
    fs = doctor.filesystem_of(str(tmp_path))
    assert fs["fstype"] and fs["mount_point"]
    assert fs["dir"] == fs["mount_point"] or fs["dir"].startswith(fs["mount_point"].rstrip("/") + "/")


def test_without_cuda_the_gpu_sections_say_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert doctor.gpu_info()["cuda"] is False
    assert doctor.measure_h2d(MiB) == {"skipped": "no CUDA device"}


@pytest.mark.cuda
def test_h2d_and_file_to_gpu_sweep(tmp_path, tuning, capsys):
    h2d = doctor.measure_h2d(64 * MiB)
    assert h2d["pinned"]["gbps"] > 0 and h2d["pageable"]["gbps"] > 0
    gpu = doctor.gpu_info()
    assert gpu["cuda"] and gpu["device"]["name"]
    out_json = tmp_path / "d.json"
    assert (
        doctor.main(["--quick", "--dir", str(tmp_path), "--size", "64M", "--json", str(out_json)], prog="doctor") == 0
    )
    report = json.loads(out_json.read_text())
    assert report["h2d"]["pinned"]["gbps"] > 0 and report["h2d"]["pageable"]["gbps"] > 0
    assert report["sweep"]["to_gpu"] is True and all(v > 0 for row in report["sweep"]["gbps"] for v in row)
    assert "Host -> device" in capsys.readouterr().out
