"""String and list offsets of Parquet range batches, rebased and widened to int64 by the stager
as it writes the slot (``PendingOffsets``: the engine's ``rebase_offsets``, or numpy), equal
pyarrow's values across row-group boundaries, with nulls, sliced arrays and 64-bit offsets."""

from __future__ import annotations

import resource

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_parquet import expected

from torch_fastload import DataLoader, staging
from torch_fastload.sources import ParquetDataset, ParquetSampler
from torch_fastload.sources.parquet_tensors import columns_to_tensors
from torch_fastload.staging import ParallelCopier, PendingConcat, PendingOffsets, materialize, plan_batch


@pytest.fixture(params=["native", "numpy"])
def backend(request, monkeypatch):
    if request.param == "native" and staging._native_rebase is None:
        pytest.skip("torch_fastload._C is not built")
    if request.param == "numpy":
        monkeypatch.setattr(staging, "_native_copy", None)
        monkeypatch.setattr(staging, "_native_rebase", None)
    return request.param


def ragged_table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    nulls = rng.random(n) < 0.15
    words = [None if z else "w" * int(k) + str(i) for i, (k, z) in enumerate(zip(rng.integers(0, 12, n), nulls))]
    lists = [None if z else list(range(int(k))) for k, z in zip(rng.integers(0, 6, n), nulls)]
    return pa.table(
        {
            "id": pa.array(np.arange(n)),
            "word": pa.array(words, pa.string()),
            "big_word": pa.array(words, pa.large_string()),
            "blob": pa.array([w.encode() if w is not None else None for w in words], pa.binary()),
            "small_list": pa.array(lists, pa.list_(pa.int32())),
            "big_list": pa.array(lists, pa.large_list(pa.int64())),
        }
    )


def offsets_of(arr: pa.Array) -> np.ndarray:
    """The Arrow offsets a (possibly sliced) string/list array reads, as a contiguous view."""
    dtype = np.int64 if pa.types.is_large_string(arr.type) or pa.types.is_large_list(arr.type) else np.int32
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr) + 1]


@pytest.mark.parametrize("threads", [1, 3])
def test_offsets_of_sliced_arrays_widened_and_rebased_into_the_slot(backend, threads):
    small = pa.array(["ab", "", None, "cde", "f" * 300, "g"] * 50_000).slice(7, 200_001)  # int32, sliced
    large = pa.array(["xyz", None, "", "hi"] * 40_000, pa.large_string()).slice(3, 90_000)  # int64
    first, second = offsets_of(small), offsets_of(large)
    field = PendingOffsets([first, second], [5, 11], [1000, 80_000], [-int(first[5]), 12345])
    want = np.concatenate([first[5:1005].astype(np.int64) - int(first[5]), second[11:80_011] + 12345])
    dst = torch.full((64 + field.shape[0] * 8 + 64,), 0xAB, dtype=torch.uint8)
    copied = ParallelCopier(threads).copy_into(dst, [(64, field)], threads)
    assert copied == field.shape[0] * 8
    assert torch.equal(dst[64 : 64 + copied].view(torch.int64), torch.from_numpy(want))
    assert bool((dst[:64] == 0xAB).all()) and bool((dst[64 + copied :] == 0xAB).all())  # nothing outside
    assert torch.equal(materialize({"o": field})["o"], torch.from_numpy(want))


def test_pending_offsets_refuses_what_it_cannot_write():
    source = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="outside a source of 10"):
        PendingOffsets([source], [4], [7], [0])
    with pytest.raises(ValueError, match="int32/int64"):
        PendingOffsets([source.astype(np.float64)], [0], [3], [0])
    with pytest.raises(ValueError, match="differ in length"):
        PendingOffsets([source], [0, 1], [3], [0])


def stage(batch: dict, threads: int = 2) -> dict:
    """``batch`` as the loader's slot holds it: laid out, copied and unpacked."""
    plan = plan_batch(batch)
    flat = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    ParallelCopier(threads).copy_into(flat, plan.copy_list(), threads)
    return plan.unpack(flat, lambda tensor: tensor)


@pytest.mark.parametrize("masks", ["auto", "always"])
def test_range_batches_across_row_groups_equal_pyarrow_through_the_slot(tmp_path, backend, masks):
    path = tmp_path / "ragged.parquet"
    pq.write_table(ragged_table(700), path, row_group_size=64)
    reference = pq.read_table(path)
    dataset = ParquetDataset(path, threads=2, masks=masks)
    for first, stop in [(0, 64), (60, 70), (10, 300), (63, 65), (640, 700), (0, 700)]:
        fields = dataset.__fastload_batch__(range(first, stop))
        spanned = -(-stop // 64) - first // 64  # row groups the rows span
        assert isinstance(fields["word__offsets"], PendingOffsets)
        assert len(fields["word__offsets"].sources) == spanned
        if spanned > 1:
            assert isinstance(fields["word"], PendingConcat)
        staged = stage(fields)
        assert list(staged) == dataset.keys()
        rows = reference.slice(first, stop - first)
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                if key == "small_list":
                    want = want.to(torch.int32)
                assert staged[key].dtype == want.dtype and torch.equal(staged[key], want), (first, stop, key)
    dataset.close()


def test_loader_batches_of_ragged_columns_equal_pyarrow(tmp_path, backend, device="cpu"):
    path = tmp_path / "ragged.parquet"
    pq.write_table(ragged_table(1000, seed=1), path, row_group_size=96)
    reference = pq.read_table(path)
    dataset = ParquetDataset(path, threads=2, masks="always")
    loader = DataLoader(dataset, batch_sampler=ParquetSampler(dataset, shuffle=False).batches(150), device=device)
    first = 0
    for batch in loader:
        assert all(t.device.type == device for t in batch.values())
        batch = {key: t.cpu() for key, t in batch.items()}
        rows = reference.slice(first, len(batch["id"]))
        assert batch["id"].tolist() == list(range(first, first + len(batch["id"])))
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                want = want.to(batch[key].dtype) if key == "small_list" else want
                assert torch.equal(batch[key], want), (first, key)
        first += len(batch["id"])
    assert first == 1000
    dataset.close()


@pytest.mark.cuda
def test_loader_batches_of_ragged_columns_equal_pyarrow_on_the_gpu(tmp_path, backend):
    """Through the pinned slot: the offsets rebased there, then copied to the device."""
    test_loader_batches_of_ragged_columns_equal_pyarrow(tmp_path, backend, device="cuda")


@pytest.mark.parametrize("masks", ["auto", "always"])
def test_arrow_route_chains_the_offsets_of_sliced_chunks(tmp_path, backend, masks):
    path = tmp_path / "ragged.parquet"
    table = ragged_table(400, seed=2)
    pq.write_table(table, path, row_group_size=100)
    dataset = ParquetDataset(path, threads=2, masks=masks)
    chunked = pa.concat_tables([table.slice(5, 60), table.slice(0, 0), table.slice(170, 1), table.slice(233, 150)])
    fields = columns_to_tensors(str(path), dataset.plan.columns, chunked)
    assert isinstance(fields["big_word__offsets"], PendingOffsets) and len(fields["big_word__offsets"].sources) == 3
    staged = stage(fields)
    for spec in dataset.plan.columns:
        for key, want in expected(chunked, spec.name, spec.masked).items():
            want = want.to(staged[key].dtype) if key == "small_list" else want
            assert torch.equal(staged[key], want), key
            assert torch.equal(materialize(fields)[key], want), key
    shuffled = dataset.batch(np.random.default_rng(0).permutation(400)[:123])  # a gathered batch
    assert shuffled["word__offsets"].dtype == torch.int64 and int(shuffled["word__offsets"][0]) == 0
    dataset.close()


def test_engine_rebase_offsets_checks_every_piece_before_writing():
    if staging._native_rebase is None:
        pytest.skip("torch_fastload._C is not built")
    source = np.array([7, 9, 20], dtype=np.int32)
    out = np.full(4, -1, dtype=np.int64)
    dst, src = out.ctypes.data, source.ctypes.data
    assert staging._native_rebase([dst, dst + 24], [src, src], [3, 1], [-7, 100], [4, 4], 2) == 32
    assert out.tolist() == [0, 2, 13, 107]
    with pytest.raises(ValueError, match="src_widths must be 4 or 8"):
        staging._native_rebase([dst], [src], [3], [0], [2], 1)
    with pytest.raises(ValueError, match="count must be >= 0"):
        staging._native_rebase([dst], [src], [-1], [0], [4], 1)
    with pytest.raises(ValueError, match="same length"):
        staging._native_rebase([dst], [src], [3, 1], [0], [4], 1)
    with pytest.raises(ValueError, match="non-null"):
        staging._native_rebase([0], [src], [3], [0], [4], 1)
    assert out.tolist() == [0, 2, 13, 107]  # refused calls wrote nothing


def test_read_only_arrow_buffers_never_warn_in_a_fresh_process(tmp_path):
    """torch warns once a process about tensors over read-only arrays; the source hides that
    once, without catch_warnings on every column (costly, and racy across decode threads)."""
    import subprocess
    import sys

    path = tmp_path / "t.parquet"
    table = ragged_table(300).append_column("code", pa.array([f"c{i % 7}" for i in range(300)]))
    pq.write_table(table, path, row_group_size=64)
    script = (
        "import sys, numpy as np\n"
        "from torch_fastload.sources import ParquetDataset\n"
        "d = ParquetDataset(sys.argv[1], threads=2, dictionary_columns=['code'])\n"
        "for rows in (range(0, 100), np.arange(300)[::-3], range(150, 300)):\n"
        "    d.batch(rows)\n"
        "d.close()\n"
    )
    res = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", script, str(path)], capture_output=True, text=True
    )
    assert res.returncode == 0 and "not writable" not in res.stderr, res.stderr[-3000:]


def test_a_dataset_left_open_at_interpreter_exit_prints_no_traceback(tmp_path):
    """Decodes finishing while the interpreter exits start no read-ahead (its pool is shut)."""
    import subprocess
    import sys

    path = tmp_path / "t.parquet"
    pq.write_table(ragged_table(3000), path, row_group_size=64)
    script = (
        "import sys\n"
        "from torch_fastload.sources import ParquetDataset, ParquetSampler\n"
        "d = ParquetDataset(sys.argv[1], threads=2)\n"
        "sampler = ParquetSampler(d, shuffle=False)\n"
        "d.__fastload_batch__(next(iter(sampler.batches(100))))\n"
    )
    for _ in range(3):
        res = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_a_batch_of_one_row_group_hands_out_masks_of_its_own(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(ragged_table(200), path, row_group_size=100)
    dataset = ParquetDataset(path, threads=2, masks="always")
    first = dataset.batch(range(0, 50))
    want_id, want_word = first["id__valid"].clone(), first["word__valid"].clone()
    first["id__valid"].fill_(False)  # the user's batch is theirs to change
    first["word__valid"].fill_(False)
    again = dataset.batch(range(0, 50))
    assert torch.equal(again["id__valid"], want_id) and torch.equal(again["word__valid"], want_word)
    dataset.close()


def test_gather_rows_across_sources_checks_rows_and_reuses_its_buffers():
    """The C++ gather behind shuffled Parquet batches: rows counted through a column's sources
    back to back (an empty one between), int32 and int64 offsets, fixed-size rows; a row out of
    range or offsets past the values refuse the whole call (RangeError); a result's buffers go
    back to the pool when it is dropped and serve the next call (no fresh pages a batch)."""
    _C = pytest.importorskip("torch_fastload._C")
    a, va = np.array([0, 1, 3], np.int32), np.frombuffer(b"abc", np.uint8)
    b, vb = np.array([0], np.int64), np.zeros(1, np.uint8)
    c, vc = np.array([0, 2, 2, 5], np.int64), np.frombuffer(b"dexyz", np.uint8)
    strings = [(a, va.ctypes.data, 3, 1, 2), (b, vb.ctypes.data, 0, 1, 0), (c, vc.ctypes.data, 5, 1, 3)]
    f1, f2 = np.array([10, 20], np.int16), np.array([30, 40, 50], np.int16)
    shorts = [(None, f1.ctypes.data, 4, 2, 2), (None, f2.ctypes.data, 6, 2, 3)]
    rows = np.array([4, 0, 2, 1, 3], np.int64)
    (offsets, values), (none, fixed) = _C.gather_rows([strings, shorts], rows, 2)
    assert np.frombuffer(offsets, np.int64).tolist() == [0, 3, 4, 6, 8, 8]
    assert bytes(np.frombuffer(values, np.uint8)) == b"xyzadebc"
    assert none is None and np.frombuffer(fixed, np.int16).tolist() == [50, 10, 30, 20, 40]

    with pytest.raises(_C.RangeError, match=r"column #1: row 5 \(batch position 1\) is outside its 5 rows"):
        _C.gather_rows([strings + strings[:1], shorts], np.array([0, 5], np.int64), 2)  # 7 rows, then 5
    corrupt = np.array([0, 1, 9], np.int32)  # row 1 ends past the 3 value bytes
    with pytest.raises(_C.RangeError, match="outside its 3 values"):
        _C.gather_rows([[(corrupt, va.ctypes.data, 3, 1, 2)]], np.array([0, 1], np.int64), 1)

    big = np.arange(1 << 16, dtype=np.int64)  # 512 KiB a result: fresh memory would fault 128 pages a call
    source, order = [(None, big.ctypes.data, big.nbytes, 8, len(big))], np.arange(len(big))[::-1].copy()
    del _C.gather_rows([source], order, 2)[0]  # its buffer made once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        ((_, out),) = _C.gather_rows([source], order, 2)
        assert np.frombuffer(out, np.int64)[0] == len(big) - 1
        del out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 128  # reused, not faulted in again


def test_gather_rows_carves_its_buffers_from_the_region_and_reuses_them():
    """Once ``gathered_region`` is made (the Parquet source registers it with CUDA as a direct
    region), gather_rows' buffers lie inside it, and a dropped result's block serves the next call;
    a column larger than the region is still gathered (malloc'd, outside it)."""
    _C = pytest.importorskip("torch_fastload._C")
    base, size = _C.gathered_region(4 << 20)  # the process's region: this size, or an earlier call's
    assert size >= 4 << 20 and base % 4096 == 0 and _C.gathered_region(1) == (base, size)
    source = np.arange(1000, dtype=np.int64)
    spec = [(None, source.ctypes.data, source.nbytes, 8, len(source))]
    order = np.arange(len(source))[::-1].copy()

    def address(buffer) -> int:
        return np.frombuffer(buffer, np.uint8).ctypes.data

    ((_, first),) = _C.gather_rows([spec], order, 2)
    assert base <= address(first) < base + size
    assert np.frombuffer(first, np.int64).tolist() == source[::-1].tolist()
    at = address(first)
    del first
    ((_, again),) = _C.gather_rows([spec], order, 2)
    assert address(again) == at  # the freed block, not a new carve
    huge = np.zeros(size // 8 + 1, np.int64)
    ((_, outside),) = _C.gather_rows([[(None, huge.ctypes.data, huge.nbytes, 8, len(huge))]], np.array([0, 1]), 1)
    assert np.frombuffer(outside, np.int64).tolist() == [0, 0]
    wide = [(None, huge.ctypes.data, huge.nbytes, huge.nbytes // 2, 2)]  # two rows of half the region each
    ((_, big),) = _C.gather_rows([wide], np.array([1, 0]), 1)
    assert not base <= address(big) < base + size and len(big) == huge.nbytes
