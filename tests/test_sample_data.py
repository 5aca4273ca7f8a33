"""The sample image folder: generated beside its target and renamed into place, so its stamp
always describes what it holds (issue 19: a 3-class run silently trained on a stale 100-class set)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from torch_fastload.vision import sample_data
from torch_fastload.vision.sample_data import STAMP, make_image_folder

pytest.importorskip("PIL")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listing(split: str) -> dict[str, int]:
    return {name: len(os.listdir(os.path.join(split, name))) for name in sorted(os.listdir(split))}


def small(root, classes, per_class, **kw):
    return make_image_folder(str(root), classes, per_class, 1, edge_cases=False, progress=False, threads=2, **kw)


def test_second_config_replaces_the_first(tmp_path):
    root = tmp_path / "sample"
    train, val = small(root, 4, 3)
    assert listing(train) == {f"n{c:08d}": 3 for c in range(4)}
    train, val = small(root, 2, 2)
    assert listing(train) == {f"n{c:08d}": 2 for c in range(2)}  # no class left over from the first
    assert listing(val) == {f"n{c:08d}": 1 for c in range(2)}
    assert sorted(os.listdir(root)) == sorted([STAMP, "train", "val"])
    assert [e for e in os.listdir(tmp_path) if e != "sample"] == []  # no staging folder left behind


def test_same_config_is_reused_and_a_tampered_folder_regenerated(tmp_path):
    root = tmp_path / "sample"
    train, _ = small(root, 2, 2)
    first = os.stat(os.path.join(train, "n00000000", "n00000000_0.JPEG")).st_ino
    small(root, 2, 2)
    assert os.stat(os.path.join(train, "n00000000", "n00000000_0.JPEG")).st_ino == first  # reused
    os.makedirs(os.path.join(train, "n00000099"))  # stamp still matches, contents do not
    small(root, 2, 2)
    assert listing(train) == {"n00000000": 2, "n00000001": 2}


def test_stale_folder_from_old_code_is_replaced(tmp_path):
    """The old generator wrote into the existing folder: a 100-class leftover with a 3-class stamp."""
    root = tmp_path / "sample"
    for c in range(5):
        os.makedirs(root / "train" / f"n{c:08d}")
        (root / "train" / f"n{c:08d}" / "x.JPEG").write_bytes(b"old")
    (root / STAMP).write_text("2 2 1 95 False 0\n")
    train, _ = small(root, 2, 2)
    assert listing(train) == {"n00000000": 2, "n00000001": 2}


def test_refuses_to_replace_a_folder_that_is_not_a_sample_set(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="mine.txt"):
        small(tmp_path, 2, 2)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_killed_mid_generation_leaves_no_valid_looking_folder(tmp_path):
    root = tmp_path / "sample"
    code = (
        "import sys; from torch_fastload.vision.sample_data import make_image_folder; "
        "make_image_folder(sys.argv[1], 40, 40, 1, edge_cases=False, progress=False, threads=1)"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until images are being written
            staging = [e for e in os.listdir(tmp_path) if e.startswith(".sample.partial-")]
            if staging and any(files for _, _, files in os.walk(tmp_path / staging[0])):
                break
            assert proc.poll() is None, "the generator finished before it could be killed; make it bigger"
            time.sleep(0.05)
        else:
            pytest.fail("no image was written within 120 s")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not root.exists()  # nothing at the target: no stamp describing half a folder
    assert staging and (tmp_path / staging[0]).exists()  # the half-written one is aside
    assert not (tmp_path / staging[0] / STAMP).exists()
    train, _ = small(root, 2, 2)  # the next run cleans the dead run's staging folder up
    assert listing(train) == {"n00000000": 2, "n00000001": 2}
    assert os.listdir(tmp_path) == ["sample"]


def test_staging_folder_of_a_live_process_is_left_alone(tmp_path):
    live = tmp_path / f".sample.partial-{os.getpid()}-abc"
    live.mkdir()
    sample_data._remove_abandoned(str(tmp_path), "sample")
    assert live.exists()


def test_a_set_renamed_into_place_by_another_process_first_is_taken(tmp_path, monkeypatch):
    """Two generators of the same set (nodes of one job on a shared disk): the one whose rename
    loses finds the other's complete set at the target and returns it."""
    root = tmp_path / "sample"
    real_swap = sample_data._swap_into_place

    def lose_the_race(staging, target):
        monkeypatch.setattr(sample_data, "_swap_into_place", real_swap)
        small(target, 2, 2)  # the other process finishes first
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(sample_data, "_swap_into_place", lose_the_race)
    train, _ = small(root, 2, 2)
    assert listing(train) == {"n00000000": 2, "n00000001": 2}
    assert os.listdir(tmp_path) == ["sample"]  # the loser's staging folder removed
