"""Packed records: the writer, batch reads into one slab, parity with torch's DataLoader,
sharding, and hostile or damaged packs (typed errors naming the file, never a partial batch)."""

import json
import os
import subprocess
import sys
import traceback

import numpy as np
import pytest
import torch
from test_loader import ListSampler, assert_same
from torch.utils.data.distributed import DistributedSampler

from torch_fastload import DataLoader, RecordBatch, RecordDataset, engine, pack, pack_image_folder
from torch_fastload.errors import FileChangedError
from torch_fastload.sources import RecordFormatError
from torch_fastload.staging import PendingRead

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_records(n=200, seed=0, max_len=3000):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, n)
    lengths[3] = 0  # an empty record is a record too
    return [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in lengths], rng.integers(0, 7, n).tolist()


@pytest.fixture
def packed(tmp_path):
    records, labels = make_records()
    dataset = pack(zip(records, labels), tmp_path / "pack", shard_size=64 << 10, progress=False)
    return dataset, records, labels


def test_pack_round_trip_across_shards(packed):
    dataset, records, labels = packed
    assert len(dataset) == len(records) and len(dataset.shard_paths) > 3
    for i in (0, 3, 57, len(records) - 1, -1):
        data, label = dataset[i]
        assert data.dtype == torch.uint8 and bytes(data.numpy()) == records[i] and label == labels[i]
    assert dataset.meta["bytes"] == sum(map(len, records))


@pytest.mark.parametrize("python_reads", [False, True], ids=["engine", "os.pread"])
def test_batches_equal_torch_with_the_dataset_collate(packed, python_reads, monkeypatch):
    if python_reads:
        monkeypatch.setattr(engine, "available", lambda: False)
    dataset, records, labels = packed
    kwargs = dict(batch_size=16, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, device="cpu", generator=torch.Generator().manual_seed(3), **kwargs)
    ours = list(loader)
    theirs = list(
        torch.utils.data.DataLoader(
            dataset, collate_fn=dataset.collate, generator=torch.Generator().manual_seed(3), **kwargs
        )
    )
    assert len(ours) == len(records) // 16
    assert_same(ours, theirs)
    assert loader.io.mode == ("python-posix" if python_reads else "engine-posix")
    batch = ours[0]
    assert isinstance(batch, RecordBatch) and len(batch.offsets) == 17
    order = batch.labels.tolist()
    assert len(batch.split()) == 16 and len(order) == 16
    assert isinstance(dataset.__fastload_batch__([0, 1]).data, PendingRead)


def test_slab_of_one_batch_and_pool_sized_once(packed):
    dataset, records, _ = packed
    loader = DataLoader(dataset, batch_size=10, sampler=ListSampler(list(range(len(records)))[::-1]), device="cpu")
    got = [bytes(r.numpy()) for batch in loader for r in batch.split()]
    assert got == records[::-1]
    assert loader.stats().pool_regrows == 0  # __fastload_slot_bytes__ bounds every batch


def test_worker_processes_use_the_dataset_collate(packed):
    dataset, records, labels = packed
    batches = list(DataLoader(dataset, batch_size=32, num_workers=2, device="cpu"))
    assert [bytes(r.numpy()) for b in batches for r in b.split()] == records
    assert torch.cat([b.labels for b in batches]).tolist() == labels


def test_aligned_records_and_unlabelled_packs(tmp_path):
    records, _ = make_records(50, seed=1)
    dataset = pack(records, tmp_path / "p", align=4096, progress=False)
    assert dataset.labels is None and (dataset.index[:, 1] % 4096 == 0).all()
    batch = next(iter(DataLoader(dataset, batch_size=50, device="cpu")))
    assert batch.labels is None and [bytes(r.numpy()) for r in batch.split()] == records
    assert bytes(dataset[7].numpy()) == records[7]


def test_ranks_read_disjoint_shares_covering_the_epoch(packed):
    dataset, records, _ = packed
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=4)
        sampler.set_epoch(1)
        for batch in DataLoader(dataset, batch_size=8, sampler=sampler, device="cpu"):
            seen += [bytes(r.numpy()) for r in batch.split()]
    assert len(seen) == len(records) and sorted(seen) == sorted(records)


def test_image_folder_and_cli(tmp_path):
    root = tmp_path / "images"
    payloads = {}
    for cls in ("dog", "cat", "ant"):
        (root / cls / "sub").mkdir(parents=True)
        for k in range(3):
            name = root / cls / ("sub" if k == 2 else "") / f"img{k}.JPEG"
            payloads[str(name)] = os.urandom(100 + k)
            name.write_bytes(payloads[str(name)])
        (root / cls / "notes.txt").write_text("not an image")
    dataset = pack_image_folder(root, tmp_path / "pack", progress=False)
    assert dataset.classes == ["ant", "cat", "dog"] and len(dataset) == 9
    ImageFolder = pytest.importorskip("torchvision.datasets").ImageFolder  # the reference layout

    reference = ImageFolder(str(root), loader=lambda p: open(p, "rb").read())
    for i, (path, label) in enumerate(reference.samples):
        data, got_label = dataset[i]
        assert bytes(data.numpy()) == payloads[path] and got_label == label
        assert dataset.name(i) == os.path.relpath(path, root)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_fastload",
            "pack",
            str(root),
            str(tmp_path / "cli"),
            "--no-progress",
            "--shard-size",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "packed 9 records" in out.stdout and "3 classes" in out.stdout
    assert len(RecordDataset(tmp_path / "cli").shard_paths) > 1
    again = subprocess.run(
        [sys.executable, "-m", "torch_fastload", "pack", str(root), str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert again.returncode == 1 and "not empty" in again.stderr


# ------------------------------------------------------------------------------------------
# damaged and hostile packs
# ------------------------------------------------------------------------------------------


def rewrite_index(dataset, row, values):
    index = dataset.index.copy()
    index[row] = values
    np.save(os.path.join(dataset.root, "index.npy"), index)


@pytest.mark.parametrize(
    "values,match",
    [
        ((0, 10**9, 5), "record 5: offset=1000000000, length=5"),
        ((0, 0, -1), "record 5: offset=0, length=-1"),
        ((99, 0, 5), "shard 99 \\(the pack has"),
        ((-1, 0, 5), "shard -1"),
        ((0, -8, 5), "offset=-8"),
        ((0, 2**62, 2**62), "lies outside its shard"),  # offset + length overflows int64
    ],
)
def test_hostile_index_is_refused_when_opened(packed, values, match):
    dataset = packed[0]
    rewrite_index(dataset, 5, values)
    with pytest.raises(RecordFormatError, match=match) as info:
        RecordDataset(dataset.root)
    assert "index.npy" in str(info.value)


def test_bad_metadata(packed, tmp_path):
    dataset = packed[0]
    meta_path = os.path.join(dataset.root, "meta.json")
    meta = json.load(open(meta_path))
    cases = [
        ("{not json", "not valid JSON"),
        (json.dumps({**meta, "version": 7}), "version 7 is not supported"),
        (json.dumps({**meta, "format": "zip"}), "not a torch_fastload.records pack"),
        (json.dumps({**meta, "num_records": 5}), "holds 200 records, meta.json says 5"),
        (json.dumps({**meta, "shards": [{"file": "../../etc/passwd", "bytes": 1}]}), "shard name that is a path"),
        (json.dumps({k: v for k, v in meta.items() if k != "shards"}), "missing or malformed field"),
    ]
    for text, match in cases:
        with open(meta_path, "w") as f:
            f.write(text)
        with pytest.raises(RecordFormatError, match=match):
            RecordDataset(dataset.root)
    os.remove(meta_path)
    with pytest.raises(RecordFormatError, match="not a finished pack"):
        RecordDataset(dataset.root)
    with pytest.raises(FileNotFoundError):
        RecordDataset(tmp_path / "nowhere")
    np.save(tmp_path / "index.npy", np.zeros((3, 2), np.int64))
    with open(tmp_path / "meta.json", "w") as f:
        json.dump({**meta, "num_records": 3, "shards": []}, f)
    with pytest.raises(RecordFormatError, match="index \\(N, 3\\)"):
        RecordDataset(tmp_path)


def test_truncated_missing_and_directory_shards(packed):
    dataset = packed[0]
    shard = dataset.shard_paths[1]
    size = os.path.getsize(shard)
    os.truncate(shard, size - 1)
    with pytest.raises(RecordFormatError, match=f"shard has {size - 1} bytes, meta.json recorded {size}"):
        RecordDataset(dataset.root)
    os.remove(shard)
    with pytest.raises(FileNotFoundError) as info:
        RecordDataset(dataset.root)
    assert info.value.filename == shard
    os.mkdir(shard)
    with pytest.raises(RecordFormatError, match="not a regular file"):
        RecordDataset(dataset.root)


@pytest.mark.parametrize("python_reads", [False, True], ids=["engine", "os.pread"])
def test_shard_truncated_between_opening_and_reading(packed, python_reads, monkeypatch):
    if python_reads:
        monkeypatch.setattr(engine, "available", lambda: False)
    dataset, records, _ = packed
    last = dataset.shard_paths[-1]
    victims = np.flatnonzero(dataset.index[:, 0] == len(dataset.shard_paths) - 1)
    os.truncate(last, int(dataset.index[victims[0], 1]) + 1)  # cut inside the shard's first record
    order = list(range(len(records)))
    loader = DataLoader(dataset, batch_size=20, sampler=ListSampler(order), device="cpu")
    it = iter(loader)
    first = next(it)
    assert [bytes(r.numpy()) for r in first.split()] == records[:20]
    bad_batch = int(victims[0]) // 20
    for _ in range(1, bad_batch):
        next(it)
    with pytest.raises(FileChangedError) as info:  # nothing partial or zero-filled comes out
        next(it)
    assert info.value.filename == last and "changed size" in str(info.value)
    assert isinstance(info.value.__cause__, engine.RangeError)  # the read that found it
    text = "".join(traceback.format_exception(info.value))
    assert last in text and "offset=" in text and f"batch {bad_batch}" in text
    it.close()


def test_out_of_range_and_negative_indices(packed):
    dataset, records, _ = packed
    assert bytes(dataset[-2][0].numpy()) == records[-2]
    it = iter(DataLoader(dataset, batch_size=2, sampler=ListSampler([0, -1, 5, 200, 7, 8]), device="cpu"))
    assert [bytes(r.numpy()) for r in next(it).split()] == [records[0], records[-1]]
    with pytest.raises(IndexError, match="record index 200 is out of range .* \\(200 records\\)"):
        next(it)
    assert [bytes(r.numpy()) for r in next(it).split()] == [records[7], records[8]]


def test_writer_refuses_mixed_items_and_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="all or none"):
        pack([(b"a", 1), b"b"], tmp_path / "a", progress=False)
    with pytest.raises(TypeError, match="item 1: records must be bytes-like"):
        pack([b"a", 3.5], tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="labels has 1 entries for 2 records"):
        pack([b"a", b"b"], tmp_path / "c", labels=[1], progress=False)
    pack([b"x"], tmp_path / "d", progress=False)
    with pytest.raises(FileExistsError, match="not empty"):
        pack([b"y"], tmp_path / "d", progress=False)
    assert bytes(pack([b"y"], tmp_path / "d", overwrite=True, progress=False)[0].numpy()) == b"y"
    empty = pack([], tmp_path / "e", progress=False)
    assert len(empty) == 0 and list(DataLoader(empty, batch_size=4, device="cpu")) == []
