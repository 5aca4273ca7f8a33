"""FeatureStore: random row gathers from an on-disk feature matrix, per tier, and bad input."""

import numpy as np
import pytest
import torch

from torch_fastload.sources.arrays import ArrayFormatError
from torch_fastload.sources.features import FeatureStore, FeatureStoreError

pytest.importorskip("torch_fastload._C")


@pytest.fixture
def npy(tmp_path):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((5000, 48)).astype(np.float32)
    path = tmp_path / "features.npy"
    np.save(path, features)
    return path, features


def random_ids(n, size, seed=1):
    return np.random.default_rng(seed).integers(0, n, size)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_storage_gather_returns_rows_in_request_order_with_duplicates(npy, device):
    path, features = npy
    store = FeatureStore(path, device=device)
    ids = random_ids(len(features), 3000)  # many duplicates
    out = store.gather(ids)
    assert out.device.type == device and out.shape == (3000, 48)
    assert torch.equal(out.cpu(), torch.from_numpy(features[ids]))
    stats = store.stats()
    assert stats.rows == 3000 and stats.unique_rows == len(np.unique(ids)) == stats.storage_rows
    assert store.gather(torch.tensor([4999, 0, 4999])).cpu().equal(torch.from_numpy(features[[4999, 0, 4999]]))
    assert store.gather([]).shape == (0, 48)


@pytest.mark.parametrize("o_direct", [False, True])
def test_raw_bf16_file_and_o_direct(tmp_path, o_direct):
    values = torch.randn(3000, 64).to(torch.bfloat16)
    path = tmp_path / "features.bf16"
    values.view(torch.uint16).numpy().tofile(path)
    store = FeatureStore(path, shape=(3000, 64), dtype=torch.bfloat16, device="cpu", o_direct=o_direct)
    ids = random_ids(3000, 777)
    assert torch.equal(store.gather(ids), values[torch.from_numpy(ids)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cache_tier_serves_hot_rows_and_counts_hits(npy, device):
    path, features = npy
    hot = np.arange(1000)
    store = FeatureStore(path, device=device, cache_ids=hot)
    ids = np.concatenate([np.arange(0, 1000, 7), np.arange(2000, 2100)])
    out = store.gather(ids)
    assert torch.equal(out.cpu(), torch.from_numpy(features[ids]))
    stats = store.stats()
    assert stats.cache_hits == len(np.arange(0, 1000, 7)) and stats.storage_rows == 100
    assert 0.0 < stats.cache_hit_rate < 1.0


@pytest.mark.cuda
def test_uva_tier_gathers_from_registered_host_memory(npy):
    path, features = npy
    store = FeatureStore(path, device="cuda", pin=True)
    ids = random_ids(len(features), 4096)
    assert torch.equal(store.gather(ids).cpu(), torch.from_numpy(features[ids]))
    assert store.stats().uva_rows == len(np.unique(ids)) and store.stats().storage_rows == 0


@pytest.mark.cuda
@pytest.mark.parametrize("pin", [True, False])
def test_cache_with_uva_or_storage_misses_dedupes_on_the_gpu(npy, pin):
    """With a cache the ids are deduplicated and looked up on the GPU; misses come from the uva
    tier or go back to the host for storage reads. Rows, order, duplicates and counts as on the
    host path."""
    path, features = npy
    cached = np.arange(0, 5000, 3)
    store = FeatureStore(path, device="cuda", pin=pin, cache_ids=cached)
    batches = [random_ids(5000, 6000), cached[::-1].copy(), np.array([1, 1, 2, 4999, 1]), np.arange(1, 5000, 3)]
    for ids in batches:
        out = store.gather(torch.from_numpy(ids))
        assert out.is_cuda and torch.equal(out.cpu(), torch.from_numpy(features[ids]))
    stats = store.stats()
    uniques = [np.unique(ids) for ids in batches]
    assert stats.rows == sum(len(ids) for ids in batches)
    assert stats.unique_rows == sum(len(u) for u in uniques)
    assert stats.cache_hits == sum(int((u % 3 == 0).sum()) for u in uniques)
    misses = stats.unique_rows - stats.cache_hits
    assert (stats.uva_rows, stats.storage_rows) == ((misses, 0) if pin else (0, misses))


@pytest.mark.cuda
def test_cache_larger_than_gpu_memory_is_refused(tmp_path):
    path = tmp_path / "huge.f32"
    with open(path, "wb") as f:
        f.truncate(200 << 30)  # sparse: 200 GiB of zeros on disk, no blocks written
    n = (200 << 30) // (4 * 1024)
    with pytest.raises(FeatureStoreError, match="does not fit"):
        FeatureStore(path, shape=(n, 1024), dtype=torch.float32, device="cuda", cache_ids=np.arange(n))


def test_bad_ids_are_refused_with_their_values(npy):
    path, _ = npy
    store = FeatureStore(path, device="cpu")
    with pytest.raises(FeatureStoreError, match=r"\[5000, 7000\].*outside \[0, 5000\)"):
        store.gather([1, 5000, 7000])
    with pytest.raises(FeatureStoreError, match=r"\[-1\]"):
        store.gather([-1, 3])
    with pytest.raises(FeatureStoreError, match="must be integers"):
        store.gather(torch.tensor([1.0, 2.0]))
    with pytest.raises(FeatureStoreError, match="must be integers"):
        store.gather(np.array([0.5]))
    with pytest.raises(FeatureStoreError, match="outside"):
        FeatureStore(path, device="cpu", cache_ids=[5000])


def test_short_or_malformed_files_are_refused(npy, tmp_path):
    path, features = npy
    data = path.read_bytes()
    short = tmp_path / "short.npy"
    short.write_bytes(data[: len(data) - 100])
    with pytest.raises(ArrayFormatError, match="only"):
        FeatureStore(short, device="cpu")
    np.save(tmp_path / "vector.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ArrayFormatError, match="2-D"):
        FeatureStore(tmp_path / "vector.npy", device="cpu")
    raw = tmp_path / "raw.f32"
    raw.write_bytes(b"\0" * 1000)
    with pytest.raises(ArrayFormatError, match="needs 4000 bytes"):
        FeatureStore(raw, shape=(10, 100), dtype=torch.float32, device="cpu")
    with pytest.raises(FeatureStoreError, match="needs shape"):
        FeatureStore(raw, device="cpu")
    with pytest.raises(FileNotFoundError):
        FeatureStore(tmp_path / "missing.npy", device="cpu")


def test_pin_auto_says_why_and_bad_values_are_refused(npy):
    path, features = npy
    store = FeatureStore(path, device="cpu", pin="auto")
    assert store.pin_reason.startswith("not pinned") and "not a GPU" in store.pin_reason
    assert torch.equal(store.gather([3, 1]), torch.from_numpy(features[[3, 1]]))
    with pytest.raises(FeatureStoreError, match="pin must be"):
        FeatureStore(path, device="cpu", pin="yes")


@pytest.mark.cuda
def test_pin_auto_uses_the_uva_tier_where_the_file_fits_the_budget(npy):
    import torch_fastload

    path, features = npy
    store = FeatureStore(path, device="cuda", pin="auto")
    assert store.pin_reason.startswith("pinned: auto")
    ids = random_ids(len(features), 100)
    assert torch.equal(store.gather(ids).cpu(), torch.from_numpy(features[ids]))
    assert store.stats().uva_rows == len(np.unique(ids))
    with torch_fastload.config.override(map_budget=1000):
        small = FeatureStore(path, device="cuda", pin="auto")
    assert small.pin_reason.startswith("not pinned") and "exceeds map_budget" in small.pin_reason
