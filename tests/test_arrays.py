"""Array files as a batch-read source: same batches as torch's per-sample path; hostile input."""

import os
import traceback

import numpy as np
import pytest
import torch
from test_loader import ListSampler, assert_same

from torch_fastload import DataLoader, engine
from torch_fastload.errors import FileChangedError
from torch_fastload.sources import ArrayDataset, ArrayFile, ArrayFormatError
from torch_fastload.staging import PendingRead


@pytest.fixture
def arrays(tmp_path):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((300, 4, 5)).astype(np.float32)
    labels = rng.integers(0, 10, 300).astype(np.int64)
    np.save(tmp_path / "x.npy", features)
    np.save(tmp_path / "y.npy", labels)
    return tmp_path, features, labels


@pytest.mark.parametrize("native", [True, False])
def test_batches_equal_torch_per_sample_path(arrays, native, monkeypatch):
    from torch_fastload import staging

    if not native:
        monkeypatch.setattr(staging, "_native_copy", None)
        monkeypatch.setattr(engine, "available", lambda: False)  # io.select falls back to os.pread
    if native and not engine.available():
        pytest.skip("torch_fastload._C is not built")
    root, features, labels = arrays
    dataset = ArrayDataset(root / "x.npy", root / "y.npy")
    loader = DataLoader(dataset, batch_size=32, shuffle=True, device="cpu", generator=torch.Generator().manual_seed(5))
    ours = list(loader)
    theirs = list(
        torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5))
    )
    assert_same(ours, theirs)
    assert loader.io.mode == ("engine-posix" if native else "python-posix")
    assert loader.stats().io.startswith(loader.io.mode)
    assert isinstance(dataset.__fastload_batch__([0, 1])[0], PendingRead)
    seen = torch.cat([y for _, y in ours])
    assert sorted(seen.tolist()) == sorted(labels.tolist())


def test_single_file_and_raw_records(tmp_path):
    records = np.arange(120, dtype=np.int16).reshape(40, 3)
    records.tofile(tmp_path / "r.bin")
    raw = ArrayFile.raw(tmp_path / "r.bin", np.int16, (3,))
    assert raw.rows == 40 and raw.row_bytes == 6
    dataset = ArrayDataset(raw)
    ours = list(DataLoader(dataset, batch_size=7, device="cpu"))
    assert_same(ours, list(torch.utils.data.DataLoader(dataset, batch_size=7)))
    assert torch.equal(torch.cat(ours), torch.from_numpy(records))
    with pytest.raises(ArrayFormatError, match="240 bytes from offset 0 are not a whole number of 14-byte records"):
        ArrayFile.raw(tmp_path / "r.bin", np.int16, (7,))


def write_header(path, header: bytes, body: bytes = b""):
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + body)


@pytest.mark.parametrize(
    "name,header,match",
    [
        ("unknown-dtype", b"{'descr': '<x9', 'fortran_order': False, 'shape': (4,), }", "not a valid .npy header"),
        ("object", b"{'descr': '|O', 'fortran_order': False, 'shape': (4,), }", "not a plain numeric dtype"),
        ("big-endian", b"{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", "big-endian"),
        ("fortran", b"{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", "Fortran-ordered"),
        ("too-long", b"{'descr': '<f4', 'fortran_order': False, 'shape': (1000,), }", "has only"),
        ("garbage", b"not a dict at all", "not a valid .npy header"),
    ],
)
def test_bad_headers_name_the_file(tmp_path, name, header, match):
    path = tmp_path / f"{name}.npy"
    write_header(path, header.ljust(118) + b"\n", b"\0" * 16)
    with pytest.raises(ArrayFormatError, match=match) as info:
        ArrayFile.npy(path)
    assert str(path) in str(info.value)


def test_truncated_zero_length_missing_and_directory(tmp_path):
    np.save(tmp_path / "full.npy", np.ones((10, 8), np.float32))
    blob = (tmp_path / "full.npy").read_bytes()
    (tmp_path / "header_only.npy").write_bytes(blob[:128])
    (tmp_path / "mid_sample.npy").write_bytes(blob[: 128 + 8 * 4 * 5 + 7])
    (tmp_path / "empty.npy").write_bytes(b"")
    for name, match in [
        ("header_only", "has only 128 bytes"),
        ("mid_sample", "has only 295 bytes"),
        ("empty", "not a valid .npy header"),
    ]:
        with pytest.raises(ArrayFormatError, match=match):
            ArrayFile.npy(tmp_path / f"{name}.npy")
    with pytest.raises(FileNotFoundError):
        ArrayFile.npy(tmp_path / "missing.npy")
    with pytest.raises(IsADirectoryError):
        ArrayFile.npy(tmp_path)


def test_out_of_range_and_negative_indices(arrays):
    root, features, _ = arrays
    dataset = ArrayDataset(root / "x.npy")
    assert torch.equal(dataset[-1], torch.from_numpy(features[-1]))
    loader = DataLoader(dataset, batch_size=2, sampler=ListSampler([-1, 0, 300, 1, 2, 3]), device="cpu")
    it = iter(loader)
    assert torch.equal(next(it), torch.from_numpy(features[[-1, 0]]))
    with pytest.raises(IndexError, match="index 300 is out of range for .*x.npy \\(300 rows\\)"):
        next(it)
    assert torch.equal(next(it), torch.from_numpy(features[[2, 3]]))


@pytest.mark.skipif(not engine.available(), reason="torch_fastload._C is not built")
def test_file_truncated_between_planning_and_reading(arrays):
    root, features, _ = arrays
    path = root / "x.npy"
    dataset = ArrayDataset(path)  # header checked against the full file
    row_bytes = 4 * 5 * 4
    os.truncate(path, 128 + 100 * row_bytes)  # rows 100.. are gone now
    it = iter(DataLoader(dataset, batch_size=50, device="cpu"))
    with pytest.raises(FileChangedError) as info:  # the file is no longer the one opened: no batch of it
        next(it)
    assert info.value.filename == str(path) and "changed size" in str(info.value)
    text = "".join(traceback.format_exception(info.value))
    assert str(path) in text and "batch 0" in text


def test_worker_processes_read_rows_through_memmaps(arrays):
    root, features, labels = arrays
    dataset = ArrayDataset(root / "x.npy", root / "y.npy")
    ours = list(DataLoader(dataset, batch_size=64, num_workers=2, device="cpu"))
    assert torch.equal(torch.cat([x for x, _ in ours]), torch.from_numpy(features))
    assert torch.equal(torch.cat([y for _, y in ours]), torch.from_numpy(labels))
