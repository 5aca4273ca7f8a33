"""Bad, special and changing files (issue 18): FIFOs and devices refused without blocking, files
replaced mid-run refused with a typed error naming them, packs that survive an interrupted
overwrite, temporary files that a planted symlink cannot redirect, and typed errors naming
the file for malformed headers and metadata.

Every call that could block on a FIFO runs on a thread joined with a timeout: a regression
fails the test instead of hanging the suite (the FIFO is then opened for writing, which
releases the blocked open)."""

import os
import threading

import numpy as np
import pytest

from torch_fastload import config, fileio, pack, pack_image_folder
from torch_fastload.errors import NotRegularFileError
from torch_fastload.sources import ArrayFile, ImageFolder, RecordDataset

HANG_SECONDS = 20


def _release(fifo: str) -> None:
    """Open ``fifo`` for writing (and close it): an open blocked on its reading end returns."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def raises_without_hanging(call, fifos=()):
    """The exception ``call()`` raises, run on a thread that must finish in HANG_SECONDS."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_SECONDS)
    if thread.is_alive():
        for fifo in fifos:
            _release(fifo)
        thread.join(HANG_SECONDS)
        pytest.fail(f"{call} blocked on a special file for {HANG_SECONDS} s")
    if "error" not in outcome:
        pytest.fail(f"{call} returned {outcome.get('value')!r} instead of refusing a special file")
    return outcome["error"]


def assert_refused(call, path):
    error = raises_without_hanging(call, [path])
    assert isinstance(error, (NotRegularFileError, ValueError)), repr(error)
    assert str(path) in str(error), error
    return error


def make_fifo(path):
    os.mkfifo(path)
    return str(path)


def small_pack(root, names=True):
    records = [bytes([i]) * (i + 1) for i in range(10)]
    return pack(
        records,
        root,
        labels=list(range(10)),
        names=[f"r{i}" for i in range(10)] if names else None,
        progress=False,
    )


# ------------------------------------------------------------------------------------------
# item 4: special files are refused, never blocked on or read forever
# ------------------------------------------------------------------------------------------


def test_npy_fifo_is_refused(tmp_path):
    fifo = make_fifo(tmp_path / "rows.npy")
    error = assert_refused(lambda: ArrayFile.npy(fifo), fifo)
    assert isinstance(error, NotRegularFileError) and error.filename == fifo and "FIFO" in str(error)


def test_raw_records_fifo_is_refused(tmp_path):
    fifo = make_fifo(tmp_path / "rows.bin")
    assert_refused(lambda: ArrayFile.raw(fifo, np.float32, (4,)), fifo)


def test_npy_symlink_to_dev_zero_is_refused(tmp_path):
    link = tmp_path / "zero.npy"
    os.symlink("/dev/zero", link)
    error = assert_refused(lambda: ArrayFile.npy(link), str(link))
    assert "character device" in str(error)


@pytest.mark.parametrize("name", ["meta.json", "index.npy", "labels.npy"])
def test_pack_metadata_fifo_is_refused(tmp_path, name):
    root = tmp_path / "pack"
    small_pack(root)
    os.remove(root / name)
    fifo = make_fifo(root / name)
    assert_refused(lambda: RecordDataset(root), fifo)


def test_pack_shard_fifo_is_refused(tmp_path):
    root = tmp_path / "pack"
    small_pack(root)
    shard = root / "shard-00000.bin"
    os.remove(shard)
    fifo = make_fifo(shard)
    assert_refused(lambda: RecordDataset(root), fifo)


def test_pack_names_fifo_is_refused(tmp_path):
    root = tmp_path / "pack"
    dataset = small_pack(root)
    os.remove(root / "names.txt")
    fifo = make_fifo(root / "names.txt")
    assert_refused(lambda: dataset.name(0), fifo)


def test_tuning_file_fifo_is_refused(tmp_path, monkeypatch):
    fifo = make_fifo(tmp_path / "tuning.json")
    monkeypatch.setenv("TORCH_FASTLOAD_TUNING_FILE", fifo)
    monkeypatch.delenv("TORCH_FASTLOAD_IO_THREADS", raising=False)
    assert_refused(lambda: config.get("io_threads"), fifo)


def write_image_folder(root, n=2):
    from PIL import Image

    os.makedirs(root / "cat")
    for i in range(n):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / "cat" / f"{i}.png")


def test_image_fifo_through_getitem_is_refused(tmp_path):
    write_image_folder(tmp_path / "images")
    dataset = ImageFolder(tmp_path / "images", transform=None)
    path = dataset.paths[1]
    os.remove(path)
    fifo = make_fifo(path)
    assert_refused(lambda: dataset[1], fifo)
    assert dataset[0][0].shape == (3, 8, 8)  # the other image still reads


def test_pack_source_fifo_is_refused(tmp_path):
    write_image_folder(tmp_path / "images")
    fifo = make_fifo(tmp_path / "images" / "cat" / "9.png")
    assert_refused(lambda: pack_image_folder(tmp_path / "images", tmp_path / "pack", progress=False), fifo)


def test_pack_source_symlink_to_dev_zero_is_refused(tmp_path):
    """Read as a file it would grow until MemoryError."""
    write_image_folder(tmp_path / "images")
    link = tmp_path / "images" / "cat" / "zero.png"
    os.symlink("/dev/zero", link)
    assert_refused(lambda: pack_image_folder(tmp_path / "images", tmp_path / "pack", progress=False), str(link))


def test_pack_cli_flat_source_fifo_is_refused(tmp_path, capsys):
    from torch_fastload.packing import main

    os.makedirs(tmp_path / "src")
    (tmp_path / "src" / "a.bin").write_bytes(b"abc")
    fifo = make_fifo(tmp_path / "src" / "b.bin")
    code = raises_without_hanging(
        lambda: (_ for _ in ()).throw(SystemExit(main([str(tmp_path / "src"), str(tmp_path / "out"), "--flat"]))),
        [fifo],
    )
    assert isinstance(code, SystemExit) and code.code == 1
    assert fifo in capsys.readouterr().err


def test_open_regular_keeps_regular_files_readable(tmp_path):
    path = tmp_path / "plain.bin"
    path.write_bytes(b"0123456789")
    assert fileio.read_file(path, 2, 3) == b"234" and fileio.read_file(path) == b"0123456789"
    fd = fileio.open_regular(path)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK was only for the open
    finally:
        os.close(fd)
