"""Data and checks shared by the remote-source tests (loopback HTTP server and S3 server):
every file-backed source built once from local files and once from URLs of the same files,
read through the DataLoader, must give the same batches byte for byte."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import torch
from test_loader import assert_same

from torch_fastload import ArrayDataset, ArrayFile, DataLoader, RecordDataset, pack, pack_image_folder
from torch_fastload.sources import FeatureStore, PackedImageFolder

ROWS, DIM = 1500, 33


def make_data(root) -> dict:
    """Arrays, a raw record file, features, a record pack and an image pack under ``root``;
    returns name -> path relative to ``root`` (what a URL appends)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    np.save(os.path.join(root, "x.npy"), rng.standard_normal((ROWS, DIM)).astype(np.float32))
    np.save(os.path.join(root, "y.npy"), np.arange(ROWS, dtype=np.int64) % 7)
    rng.integers(0, 256, (ROWS, 24), dtype=np.uint8).tofile(os.path.join(root, "raw.bin"))
    np.save(os.path.join(root, "features.npy"), rng.standard_normal((4000, 96)).astype(np.float32))
    lengths = rng.integers(0, 5000, 400)
    records = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in lengths]
    pack(
        zip(records, (i % 5 for i in range(len(records)))),
        os.path.join(root, "pack"),
        shard_size=96 << 10,
        progress=False,
    )
    from torch_fastload.vision.sample_data import make_image_folder

    _, val = make_image_folder(
        os.path.join(root, "folder"), classes=3, train_per_class=1, val_per_class=3, edge_cases=False, progress=False
    )
    pack_image_folder(val, os.path.join(root, "images"), progress=False)
    return {
        "x": "x.npy",
        "y": "y.npy",
        "raw": "raw.bin",
        "features": "features.npy",
        "pack": "pack",
        "images": "images",
    }


def batches(dataset, **kwargs) -> tuple[list, object]:
    """Every batch of one epoch through torch_fastload's DataLoader on the CPU, and its stats."""
    loader = DataLoader(dataset, device="cpu", generator=torch.Generator().manual_seed(11), **kwargs)
    try:
        return list(loader), loader.stats()
    finally:
        loader.close()


def sources(at, cache_dir=None) -> dict:
    """Each source over ``at(name)`` (a local path or a URL of the same file)."""
    return {
        "arrays": lambda: ArrayDataset(at("x.npy"), at("y.npy"), cache_dir=cache_dir),
        "raw": lambda: ArrayDataset(ArrayFile.raw(at("raw.bin"), np.uint8, (24,), cache_dir=cache_dir)),
        "records": lambda: RecordDataset(at("pack"), cache_dir=cache_dir),
        "images": lambda: PackedImageFolder(at("images"), "val", seed=3, cache_dir=cache_dir),
    }


LOADER_ARGS = {
    "arrays": dict(batch_size=64, shuffle=True),
    "raw": dict(batch_size=100, shuffle=True),
    "records": dict(batch_size=32, shuffle=True),
    "images": dict(batch_size=4),
}


def check_every_source(local, remote, cache_dir=None) -> dict:
    """Batches over URLs equal batches over local files for every source (and the sample
    path); returns each source's loader stats."""
    stats = {}
    for name, make in sources(remote, cache_dir).items():
        theirs, _ = batches(sources(local)[name](), **LOADER_ARGS[name])
        dataset = make()
        ours, stats[name] = batches(dataset, **LOADER_ARGS[name])
        assert len(ours) == len(theirs) > 1, name
        assert_same(ours, theirs, name)
        if name != "images":  # per sample (torch's DataLoader path): byte ranges of the object
            assert_same(dataset[7], sources(local)[name]()[7], f"{name}[7]")
    features_match(local("features.npy"), remote("features.npy"), cache_dir)
    return stats


def features_match(local_path, url, cache_dir=None) -> None:
    ids = np.random.default_rng(2).integers(0, 4000, 700)
    expected = torch.from_numpy(np.load(local_path)[ids])
    store = FeatureStore(url, device="cpu", cache_dir=cache_dir)
    try:
        assert torch.equal(store.gather(ids), expected)
        cached = FeatureStore(url, device="cpu", cache_ids=ids[:50], cache_dir=cache_dir)
        try:
            assert torch.equal(cached.gather(ids), expected)
        finally:
            cached.close()
    finally:
        store.close()


def remote_threads() -> list:
    """Live threads of torch_fastload's loaders and remote readers."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fastload-") and t.is_alive())


def assert_no_threads_left() -> None:
    gc.collect()
    deadline = time.monotonic() + 5
    while remote_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert remote_threads() == []
