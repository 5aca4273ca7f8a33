"""Bad, special and changing files (issue 18): FIFOs and devices refused without blocking, files
replaced mid-run refused with a typed error naming them, packs that survive an interrupted
overwrite, temporary files that a planted symlink cannot redirect, and typed errors naming
the file for malformed headers and metadata.

Every call that could block on a FIFO runs on a thread joined with a timeout: a regression
fails the test instead of hanging the suite (the FIFO is then opened for writing, which
releases the blocked open)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from torch_fastload import DataLoader, config, engine, fileio, pack, pack_image_folder
from torch_fastload.errors import FileChangedError, NotRegularFileError
from torch_fastload.sources import (
    ArrayDataset,
    ArrayFile,
    ArrayFormatError,
    ImageFolder,
    RecordDataset,
    RecordFormatError,
)

HANG_SECONDS = 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ------------------------------------------------------------------------------------------
# item 5: a file replaced or rewritten mid-run is a typed error, never rows of another file
# ------------------------------------------------------------------------------------------

READ_PATHS = {
    "native": dict(native="auto"),
    "engine": dict(native="off"),
    "os.pread": dict(native="off", python_reads=True),
}


@pytest.fixture(params=list(READ_PATHS))
def read_path(request, monkeypatch):
    """The loader's C++ loop, the Python pipeline on the engine, or on os.pread."""
    settings = dict(READ_PATHS[request.param])
    if settings.pop("python_reads", False):
        monkeypatch.setattr(engine, "available", lambda: False)
    elif not engine.available():
        pytest.skip("the C++ engine is not built")
    with config.override(**settings):
        yield request.param


def first_error(loader, after_first, check):
    """Iterate ``loader``: ``after_first()`` once the first batch arrived, ``check(k, batch)``
    on every batch delivered; returns (batches delivered, the exception that ended it or None)."""
    delivered = 0
    iterator = iter(loader)
    try:
        for k, batch in enumerate(iterator):
            check(k, batch)
            delivered += 1
            if k == 0:
                after_first()
    except Exception as exc:
        return delivered, exc
    return delivered, None


def test_npy_replaced_mid_run_is_refused(tmp_path, read_path):
    path = str(tmp_path / "rows.npy")
    rows = np.arange(4000 * 3, dtype=np.float32).reshape(4000, 3)
    np.save(path, rows)
    dataset = ArrayDataset(path)
    loader = DataLoader(dataset, batch_size=4, device="cpu")

    def replace():
        np.save(str(tmp_path / "other.npy"), np.full((4000, 5), -1, dtype=np.float32))  # another row size
        os.replace(tmp_path / "other.npy", path)

    def check(k, batch):
        assert torch.equal(batch, torch.from_numpy(rows[4 * k : 4 * k + 4])), f"batch {k} holds wrong rows"

    delivered, error = first_error(loader, replace, check)
    assert isinstance(error, FileChangedError), repr(error)
    assert error.filename == path and "replaced" in str(error)
    assert 1 <= delivered < 1000


def test_npy_rewritten_in_place_is_refused(tmp_path, read_path):
    path = str(tmp_path / "rows.npy")
    rows = np.arange(4000 * 3, dtype=np.float32).reshape(4000, 3)
    np.save(path, rows)
    loader = DataLoader(ArrayDataset(path), batch_size=4, device="cpu")
    header = os.path.getsize(path) - rows.nbytes

    def rewrite():
        time.sleep(0.05)  # past the file system's timestamp granularity
        with open(path, "r+b") as f:
            f.seek(header)
            f.write(np.full_like(rows, -1).tobytes())  # same size, other bytes

    def check(k, batch):
        assert torch.equal(batch, torch.from_numpy(rows[4 * k : 4 * k + 4])), f"batch {k} holds wrong rows"

    delivered, error = first_error(loader, rewrite, check)
    assert isinstance(error, FileChangedError) and error.filename == path, repr(error)


def test_pack_shard_rewritten_at_the_same_size_is_refused(tmp_path, read_path):
    records = [bytes([i % 251]) * 97 for i in range(2000)]
    dataset = pack(records, tmp_path / "pack", progress=False)
    shard = dataset.shard_paths[0]
    loader = DataLoader(dataset, batch_size=4, device="cpu")

    def rewrite():
        time.sleep(0.05)  # past the file system's timestamp granularity
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.write(b"\xff" * size)

    def check(k, batch):
        expected = b"".join(records[4 * k : 4 * k + 4])
        assert bytes(batch.data.numpy()) == expected, f"batch {k} holds wrong bytes"

    delivered, error = first_error(loader, rewrite, check)
    assert isinstance(error, FileChangedError) and error.filename == shard, repr(error)


def test_sample_path_refuses_a_replaced_npy(tmp_path):
    path = str(tmp_path / "rows.npy")
    np.save(path, np.zeros((8, 2), dtype=np.float32))
    dataset = ArrayDataset(path)
    np.save(str(tmp_path / "other.npy"), np.ones((8, 3), dtype=np.float32))
    os.replace(tmp_path / "other.npy", path)
    with pytest.raises(FileChangedError):
        dataset[0]


def test_meta_json_listing_a_shard_twice_is_refused(tmp_path):
    root = tmp_path / "pack"
    small_pack(root)
    meta = json.loads((root / "meta.json").read_text())
    meta["shards"] = meta["shards"] * 3
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RecordFormatError, match="listed 3 times") as info:
        RecordDataset(root)
    assert info.value.path == str(root / "meta.json")


def test_pack_records_shard_checksums(tmp_path, monkeypatch):
    root = tmp_path / "pack"
    dataset = small_pack(root)
    shard = dataset.shard_paths[0]
    crc = zlib.crc32(open(shard, "rb").read())
    assert dataset.meta["shards"][0]["crc32"] == crc
    with open(shard, "r+b") as f:  # damaged at rest: same size, other bytes
        f.write(b"\xff\xff")
    RecordDataset(root)  # the default checks sizes only (cheap)
    with pytest.raises(RecordFormatError, match="CRC-32") as info:
        RecordDataset(root, verify="checksum")
    assert info.value.path == shard
    monkeypatch.setenv("TORCH_FASTLOAD_PACK_VERIFY", "checksum")
    with pytest.raises(RecordFormatError, match="CRC-32"):
        RecordDataset(root)


def test_packs_without_checksums_still_open(tmp_path):
    root = tmp_path / "pack"
    small_pack(root)
    meta = json.loads((root / "meta.json").read_text())
    for shard in meta["shards"]:
        del shard["crc32"]
    (root / "meta.json").write_text(json.dumps(meta))
    dataset = RecordDataset(root, verify="checksum")
    assert bytes(dataset[3][0].numpy()) == bytes([3]) * 4


# ------------------------------------------------------------------------------------------
# item 6: pack --overwrite never loses the old pack
# ------------------------------------------------------------------------------------------


def old_pack(root):
    records = [b"old-%d" % i for i in range(20)]
    pack(records, root, progress=False)
    return records


def assert_pack_holds(root, records):
    dataset = RecordDataset(root)
    assert [bytes(dataset[i].numpy()) for i in range(len(dataset))] == records


def no_leftovers(parent):
    return [name for name in os.listdir(parent) if ".packing-" in name or ".old-" in name]


def test_failed_overwrite_leaves_the_old_pack(tmp_path):
    root = tmp_path / "pack"
    records = old_pack(root)

    def failing():
        for i in range(1000):
            if i == 500:
                raise RuntimeError("the source broke mid-pack")
            yield b"new-%d" % i

    with pytest.raises(RuntimeError, match="mid-pack"):
        pack(failing(), root, overwrite=True, shard_size=1024, progress=False)
    assert_pack_holds(root, records)
    assert no_leftovers(tmp_path) == []


KILLED_PACKER = """
import os, sys, time
from torch_fastload import pack

def items():
    for i in range(10**9):
        if i == 2000:
            open(sys.argv[2], "w").close()  # the new pack is half written: kill me now
            time.sleep(600)
        yield b"new-%d" % i

pack(items(), sys.argv[1], overwrite=True, shard_size=4096, progress=False)
"""


def test_killed_overwrite_leaves_the_old_pack(tmp_path):
    root = tmp_path / "pack"
    records = old_pack(root)
    marker = tmp_path / "half-written"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", KILLED_PACKER, str(root), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120  # a guard against a hang, not a timing assertion
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the packer exited ({child.returncode}) before packing half its records"
        assert_pack_holds(root, records)  # while the new one is being written
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert_pack_holds(root, records)  # after the kill: the old pack, whole


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_overwrite_replaces_the_pack_and_keeps_other_entries(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(fileio, "exchange_paths", lambda a, b: False)
    root = tmp_path / "pack"
    old_pack(root)
    (root / "NOTES.md").write_text("kept")
    new = [b"new-%d" % i for i in range(7)]
    pack(new, root, overwrite=True, progress=False)
    assert_pack_holds(root, new)
    assert (root / "NOTES.md").read_text() == "kept"
    assert no_leftovers(tmp_path) == []


def test_pack_cli_names_the_overwrite_flag(tmp_path, capsys):
    from torch_fastload.packing import main

    os.makedirs(tmp_path / "src")
    (tmp_path / "src" / "a.bin").write_bytes(b"abc")
    out = tmp_path / "out"
    assert main([str(tmp_path / "src"), str(out), "--flat", "--no-progress"]) == 0
    assert main([str(tmp_path / "src"), str(out), "--flat", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    with pytest.raises(FileExistsError, match="pass overwrite=True"):  # the Python API names its argument
        pack([b"x"], out, progress=False)


# ------------------------------------------------------------------------------------------
# item 7: temporary files cannot be redirected by a planted symlink
# ------------------------------------------------------------------------------------------


def plant(links, victim):
    victim.write_text("precious")
    for link in links:
        os.symlink(victim, link)


def test_pack_ignores_a_symlink_planted_at_the_old_temporary_name(tmp_path):
    root = tmp_path / "pack"
    os.makedirs(root)
    victim = tmp_path / "victim.txt"
    plant([root / ".meta.json.tmp"], victim)  # hidden: the directory still counts as empty
    pack([b"a", b"b"], root, progress=False)
    assert victim.read_text() == "precious"
    assert_pack_holds(root, [b"a", b"b"])


def test_benchmark_json_ignores_planted_symlinks(tmp_path):
    from torch_fastload._benchutil.output import write_json

    out = tmp_path / "result.json"
    victim = tmp_path / "victim.txt"
    plant([tmp_path / "result.json.tmp", tmp_path / ".result.json.tmp"], victim)
    write_json(out, {"ratio": 1.5})
    assert victim.read_text() == "precious"
    assert json.loads(out.read_text()) == {"ratio": 1.5} and not out.is_symlink()


def test_benchmark_random_file_ignores_a_planted_symlink(tmp_path):
    from torch_fastload._benchutil.files import write_random

    out = tmp_path / "data.bin"
    victim = tmp_path / "victim.txt"
    plant([tmp_path / "data.bin.tmp"], victim)
    assert write_random(out, 4096, seed=1, progress=False)
    assert victim.read_text() == "precious" and out.stat().st_size == 4096


def test_write_atomic_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def broken(f):
        f.write("half")
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError):
        fileio.write_atomic(target, broken)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


# ------------------------------------------------------------------------------------------
# item 8: rows of no bytes
# ------------------------------------------------------------------------------------------


def test_npy_of_shape_n_by_0_gives_empty_rows(tmp_path, read_path):
    np.save(tmp_path / "empty.npy", np.zeros((10, 0), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(10, dtype=np.int64))
    alone = ArrayDataset(tmp_path / "empty.npy")
    batches = list(DataLoader(alone, batch_size=4, device="cpu"))
    assert [tuple(b.shape) for b in batches] == [(4, 0), (4, 0), (2, 0)]
    assert all(b.dtype == torch.float32 for b in batches)
    paired = ArrayDataset(tmp_path / "empty.npy", tmp_path / "y.npy")
    ours = list(DataLoader(paired, batch_size=4, device="cpu"))
    theirs = list(torch.utils.data.DataLoader(paired, batch_size=4))
    assert len(ours) == len(theirs) == 3
    for (x, y), (tx, ty) in zip(ours, theirs):
        assert x.shape == tx.shape and torch.equal(y, ty)


# ------------------------------------------------------------------------------------------
# item 10: typed errors naming the file, settings refused where they are read
# ------------------------------------------------------------------------------------------


def npy_with_header(path, header: bytes, declared_length: int | None = None, data: bytes = b"\0" * 64):
    """A version 1.0 .npy whose header dict is ``header`` (its length field may lie)."""
    length = len(header) if declared_length is None else declared_length
    path.write_bytes(b"\x93NUMPY\x01\x00" + length.to_bytes(2, "little") + header + data)
    return str(path)


def test_negative_npy_dimension_is_refused_at_open(tmp_path):
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (-4, 3), }".ljust(117) + b"\n"
    path = npy_with_header(tmp_path / "neg.npy", header)
    with pytest.raises(ArrayFormatError, match="negative") as info:
        ArrayFile.npy(path)
    assert info.value.path == path


def test_npy_header_length_lie_is_a_typed_error(tmp_path):
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3), }".ljust(117) + b"\n"
    path = npy_with_header(tmp_path / "lie.npy", header, declared_length=20)
    with pytest.raises(ArrayFormatError, match="not a valid .npy header") as info:
        ArrayFile.npy(path)
    assert info.value.path == path


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"format": "torch_fastload.records", "version": 1, "num_records": Infinity, "shards": []}', "Infinity"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ],
    ids=["infinity", "deep-nesting"],
)
def test_hostile_meta_json_is_a_typed_error(tmp_path, text, problem):
    root = tmp_path / "pack"
    small_pack(root)
    (root / "meta.json").write_text(text)
    with pytest.raises(RecordFormatError, match=problem) as info:
        RecordDataset(root)
    assert info.value.path == str(root / "meta.json")


def test_huge_record_count_is_a_typed_error(tmp_path):
    root = tmp_path / "pack"
    small_pack(root)
    meta = json.loads((root / "meta.json").read_text())
    meta["num_records"] = 1e400  # json.dumps writes Infinity; 1e400 parses as inf too
    (root / "meta.json").write_text(json.dumps(meta).replace("Infinity", "1e400"))
    with pytest.raises(RecordFormatError) as info:
        RecordDataset(root)
    assert info.value.path == str(root / "meta.json")


def test_non_utf8_names_is_a_typed_error_naming_it(tmp_path):
    root = tmp_path / "pack"
    dataset = small_pack(root)
    (root / "names.txt").write_bytes(b"r0\n\xff\xfe bad\n")
    with pytest.raises(RecordFormatError, match="not UTF-8") as info:
        dataset.name(1)
    assert info.value.path == str(root / "names.txt")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_shutdown_timeout_must_be_finite_and_positive(monkeypatch, value):
    monkeypatch.setenv("TORCH_FASTLOAD_SHUTDOWN_TIMEOUT", value)
    with pytest.raises(ValueError, match="shutdown_timeout.*finite number > 0"):
        config.get("shutdown_timeout")


def test_bad_gather_blocks_does_not_break_import():
    env = dict(os.environ, TORCH_FASTLOAD_GATHER_BLOCKS="lots", PYTHONPATH=REPO)
    code = (
        "import torch_fastload, torch_fastload.uva, torch_fastload.io, torch_fastload.native\n"
        "from torch_fastload import config\n"
        "try:\n"
        "    config.get('gather_blocks')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: torch_fastload option 'gather_blocks' must be an integer" in done.stdout
    assert "TORCH_FASTLOAD_GATHER_BLOCKS='lots'" in done.stdout


def test_feature_store_refuses_a_fifo_and_a_replaced_matrix(tmp_path):
    from torch_fastload.sources import FeatureStore

    fifo = make_fifo(tmp_path / "features.bin")
    assert_refused(lambda: FeatureStore(fifo, shape=(4, 4), dtype=torch.float32, device="cpu"), fifo)
    path = str(tmp_path / "features.npy")
    np.save(path, np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    store = FeatureStore(path, device="cpu")
    assert torch.equal(store.gather([1, 2])[0], torch.arange(8, 16, dtype=torch.float32))
    np.save(str(tmp_path / "other.npy"), np.zeros((64, 8), dtype=np.float32))
    os.replace(tmp_path / "other.npy", path)
    with pytest.raises(FileChangedError) as info:
        store.gather([5, 6])
    assert info.value.filename == path


def test_non_utf8_names_does_not_hide_an_image_decode_error(tmp_path):
    from torch_fastload.sources import PackedImageFolder
    from torch_fastload.vision.decode import ImageDecodeError

    write_image_folder(tmp_path / "images")
    (tmp_path / "images" / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    pack_image_folder(tmp_path / "images", tmp_path / "pack", progress=False)
    (tmp_path / "pack" / "names.txt").write_bytes(b"\xff\xfe\n" * 3)
    dataset = PackedImageFolder(tmp_path / "pack", transform=None)
    broken = next(i for i in range(len(dataset)) if len(dataset.read_bytes(i)) < 40)
    with pytest.raises(ImageDecodeError) as info:
        dataset[broken]
    assert "names.txt" in str(info.value) and "not UTF-8" in str(info.value)


def test_a_pin_from_another_host_is_taken_afresh_here(tmp_path):
    """A dataset pickled to another machine (its own copy of the files) is not refused there."""
    path = tmp_path / "rows.bin"
    path.write_bytes(b"x" * 64)
    elsewhere = fileio.pin(path)._replace(device=12345, inode=678, host="another-host")
    fileio.check_unchanged(path, elsewhere)  # first use here: pinned as it is now
    os.replace(tmp_path / "rows.bin", tmp_path / "kept.bin")
    (tmp_path / "rows.bin").write_bytes(b"y" * 32)
    with pytest.raises(FileChangedError):  # changed after that first use: refused as usual
        fileio.check_unchanged(path, elsewhere)
