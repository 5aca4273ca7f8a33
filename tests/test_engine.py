"""Tests of the C++ I/O engine (torch_fastload._C) through torch_fastload.engine, on real files.

CPU only. The hostile-input tests check both the exception and that the destination was not
touched: every range is bounds-checked before the first byte is read.
"""

from __future__ import annotations

import errno
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from torch_fastload import engine

_C = engine._require()  # a clear ImportError at collection if the extension was not built

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(REPO, "tests", "fuzz_read_ranges.py")
INT64_MAX = 2**63 - 1
SENTINEL = 0xAB
SYSFS_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"  # st_size 4096, content ~50 bytes


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def python_read(path, offset, length) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def o_direct_reason(directory) -> str | None:
    """Why O_DIRECT cannot be tested in ``directory`` (None when it can)."""
    probe = os.path.join(directory, ".o_direct_probe")
    write(probe, b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"the filesystem of {directory} refuses O_DIRECT (EINVAL)"
        raise
    finally:
        os.unlink(probe)
    return None


@pytest.fixture
def files(tmp_path):
    rng = random.Random(1234)
    contents = [rng.randbytes(1_000_003), rng.randbytes(4097), b"", rng.randbytes(65_536)]
    paths = [write(tmp_path / f"f{i}.bin", data) for i, data in enumerate(contents)]
    return paths, contents


def untouched(buffer) -> bool:
    return bool((np.asarray(buffer) == SENTINEL).all())


# ------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", [False, True], ids=["pread", "o_direct"])
@pytest.mark.parametrize("task_size", [511, 4097, 65_536, 4 << 20])
@pytest.mark.parametrize("num_threads", [1, 4, 16])
def test_random_ranges_match_python_reads(files, tmp_path, num_threads, task_size, o_direct):
    if o_direct and (reason := o_direct_reason(tmp_path)):
        pytest.skip(reason)
    paths, contents = files
    rng = random.Random(num_threads * 1_000_003 + task_size)
    fi, off, ln, dsto, cursor = [], [], [], [], 0
    for _ in range(300):
        f = rng.randrange(len(paths))
        length = rng.randrange(0, min(len(contents[f]), 20_000) + 1)
        offset = rng.randrange(0, len(contents[f]) - length + 1)
        cursor += rng.choice([0, 0, 1, 13, 4096])
        fi.append(f), off.append(offset), ln.append(length), dsto.append(cursor)
        cursor += length
    dst = torch.full((cursor + 100,), SENTINEL, dtype=torch.uint8)

    total = engine.read_ranges(
        paths, fi, off, ln, dst, dsto, num_threads=num_threads, task_size=task_size, o_direct=o_direct
    )

    assert total == sum(ln)
    expected = np.full(cursor + 100, SENTINEL, dtype=np.uint8)
    for k in range(len(fi)):
        expected[dsto[k] : dsto[k] + ln[k]] = np.frombuffer(python_read(paths[fi[k]], off[k], ln[k]), np.uint8)
    np.testing.assert_array_equal(dst.numpy(), expected)


@pytest.mark.parametrize("o_direct", [False, True], ids=["pread", "o_direct"])
def test_unaligned_everything_and_file_tail(tmp_path, o_direct):
    """O_DIRECT goes through an aligned bounce buffer: odd offsets, lengths, destinations and a
    range ending at an unaligned end of file must all come out exact."""
    if o_direct and (reason := o_direct_reason(tmp_path)):
        pytest.skip(reason)
    data = random.Random(7).randbytes(3 * 4096 + 123)
    path = write(tmp_path / "odd.bin", data)
    backing = np.full(len(data) + 16, SENTINEL, dtype=np.uint8)
    dst = backing[3:]  # destination address not aligned
    cases = [(1, 4094), (4095, 2), (4096, 4096), (8190, 4096 + 50), (0, len(data)), (len(data) - 1, 1)]
    for offset, length in cases:
        dst[:] = SENTINEL
        assert engine.read_ranges(path, None, [offset], [length], dst, [5], o_direct=o_direct, task_size=4096) == length
        assert bytes(dst[5 : 5 + length]) == data[offset : offset + length]
        assert untouched(dst[:5]) and untouched(dst[5 + length :])


def test_aligned_o_direct_reads_straight_into_destination(tmp_path):
    if reason := o_direct_reason(tmp_path):
        pytest.skip(reason)
    data = random.Random(8).randbytes(1 << 20)
    path = write(tmp_path / "aligned.bin", data)
    raw = np.empty((1 << 20) + 8192, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    dst = raw[start : start + (1 << 20)]
    assert dst.ctypes.data % 4096 == 0
    assert engine.read_ranges(path, None, [0], [1 << 20], dst, o_direct=True, task_size=1 << 16) == 1 << 20
    assert dst.tobytes() == data


def test_default_destination_offsets_pack_back_to_back(files):
    paths, contents = files
    dst = np.full(30, SENTINEL, dtype=np.uint8)
    assert engine.read_ranges(paths[0], None, [100, 0, 50], [10, 10, 10], dst) == 30
    assert dst.tobytes() == contents[0][100:110] + contents[0][0:10] + contents[0][50:60]


@pytest.mark.parametrize("kind", ["tensor", "pinned_like_view", "ndarray", "bytearray"])
def test_destination_kinds(files, kind):
    paths, contents = files
    if kind == "tensor":
        dst = torch.zeros(16, dtype=torch.float32)  # 64 bytes, dtype does not matter
    elif kind == "pinned_like_view":
        dst = torch.zeros(128, dtype=torch.uint8)[64:]  # contiguous view with a storage offset
    elif kind == "ndarray":
        dst = np.zeros(64, dtype=np.uint8)
    else:
        dst = bytearray(64)
    assert engine.read_ranges(paths[0], None, [7], [64], dst) == 64
    raw = dst.numpy().tobytes() if isinstance(dst, torch.Tensor) else bytes(dst)
    assert raw == contents[0][7:71]


def test_coalescing_merges_only_ranges_adjacent_in_file_and_destination(files):
    paths, contents = files
    # Four pieces of one file, contiguous in both file and destination, given shuffled.
    order = [2, 0, 3, 1]
    off = [1000 + 100 * k for k in order]
    dsto = [100 * k for k in order]
    plan = engine.plan_ranges(paths, [0] * 4, off, [100] * 4, 400, dsto)
    assert plan == [[(0, 1000, 400, 0)]]
    dst = np.full(400, SENTINEL, dtype=np.uint8)
    assert engine.read_ranges(paths, [0] * 4, off, [100] * 4, dst, dsto) == 400
    assert dst.tobytes() == contents[0][1000:1400]

    # Adjacent in the file but not in the destination (and vice versa): never merged.
    fi, off, ln, dsto = [0, 0, 3, 3], [0, 100, 0, 500], [100, 100, 100, 100], [100, 0, 200, 300]
    plan = engine.plan_ranges(paths, fi, off, ln, 400, dsto)
    assert sorted(read for task in plan for read in task) == sorted(zip(fi, off, ln, dsto))
    dst = np.full(400, SENTINEL, dtype=np.uint8)
    engine.read_ranges(paths, fi, off, ln, dst, dsto)
    assert dst.tobytes() == contents[0][100:200] + contents[0][0:100] + contents[3][0:100] + contents[3][500:600]


def test_no_range_is_coalesced_across_a_separate_allocation(files):
    """The C++ loop's output fields are separate tensors that may lie back to back: a read
    coalesced across their boundary would become one DMA copy spanning two allocations, which
    the driver refuses (the ring route failed that way on an H100 with features + labels)."""
    paths, contents = files
    off, dsto = [1000, 1100, 1200, 1300], [0, 100, 200, 300]
    assert engine.plan_ranges(paths, [0] * 4, off, [100] * 4, 400, dsto) == [[(0, 1000, 400, 0)]]
    plan = engine.plan_ranges(paths, [0] * 4, off, [100] * 4, 400, dsto, dst_breaks=[200])
    assert plan == [[(0, 1000, 200, 0), (0, 1200, 200, 200)]]
    dst = np.full(400, SENTINEL, dtype=np.uint8)
    engine.read_ranges(paths, [0] * 4, off, [100] * 4, dst, dsto)
    assert dst.tobytes() == contents[0][1000:1400]


def test_big_range_is_sliced_into_task_size_tasks(files):
    paths, contents = files
    plan = engine.plan_ranges(paths, [0], [3], [1_000_000], 1_000_000, [0], task_size=300_000)
    assert plan == [
        [(0, 3, 300_000, 0)],
        [(0, 300_003, 300_000, 300_000)],
        [(0, 600_003, 300_000, 600_000)],
        [(0, 900_003, 100_000, 900_000)],
    ]
    # Small ranges share a task; zero-length ranges produce no read.
    plan = engine.plan_ranges(paths, [0, 0, 0], [0, 50, 90], [10, 0, 10], 100, [0, 20, 40], task_size=1 << 20)
    assert plan == [[(0, 0, 10, 0), (0, 90, 10, 40)]]
    # O_DIRECT rounds the task size up to the 4096-byte alignment, so slices stay aligned.
    plan = engine.plan_ranges(paths, [0], [4096], [20_000], 20_000, [0], task_size=5000, o_direct=True)
    assert [read[1] for task in plan for read in task] == [4096, 4096 + 8192, 4096 + 16384]


def test_many_threads_and_one_huge_task_list(tmp_path):
    data = random.Random(3).randbytes(8 << 20)
    path = write(tmp_path / "big.bin", data)
    dst = torch.empty(8 << 20, dtype=torch.uint8)
    assert engine.read_ranges(path, None, [0], [8 << 20], dst, num_threads=16, task_size=64 << 10) == 8 << 20
    assert dst.numpy().tobytes() == data


# ------------------------------------------------------------------------------------------
# files that are not what the index says
# ------------------------------------------------------------------------------------------


def test_zero_length_file(tmp_path):
    path = write(tmp_path / "empty.bin", b"")
    dst = np.full(8, SENTINEL, dtype=np.uint8)
    assert engine.read_ranges(path, None, [0], [0], dst) == 0
    assert engine.read_ranges(path, None, [], [], dst) == 0
    with pytest.raises(engine.RangeError, match=r"offset=0, length=1.*empty\.bin.*end of the file \(0 bytes\)"):
        engine.read_ranges(path, None, [0], [1], dst)
    assert untouched(dst)


def test_file_shorter_than_the_range_is_rejected_before_reading(tmp_path):
    path = write(tmp_path / "short.bin", b"0123456789")
    dst = np.full(32, SENTINEL, dtype=np.uint8)
    with pytest.raises(engine.RangeError) as info:
        engine.read_ranges([path, path], [0, 1], [0, 5], [5, 6], dst, [0, 10])
    message = str(info.value)
    assert "short.bin" in message and "offset=5" in message and "length=6" in message
    assert "10 bytes" in message
    assert untouched(dst)  # the valid first range was not read either


def test_file_truncated_after_planning(tmp_path):
    data = random.Random(5).randbytes(100_000)
    path = write(tmp_path / "shrinks.bin", data)
    offsets, lengths = [0, 40_000, 80_000], [40_000, 40_000, 20_000]  # planned from the full size
    os.truncate(path, 90_000)
    dst = np.full(100_000, SENTINEL, dtype=np.uint8)
    with pytest.raises(engine.RangeError, match=r"range #2 \(offset=80000, length=20000.*shrinks\.bin.*90000 bytes"):
        engine.read_ranges(path, None, offsets, lengths, dst)
    assert untouched(dst)


@pytest.mark.skipif(not os.path.exists(SYSFS_FILE), reason=f"{SYSFS_FILE} is not available")
def test_end_of_file_during_the_read_is_an_error(tmp_path):
    """A sysfs attribute claims 4096 bytes but holds far fewer: the size check passes, pread
    comes back short and then at EOF: the call must fail, naming the file, offset and length."""
    actual = len(open(SYSFS_FILE, "rb").read())
    assert os.stat(SYSFS_FILE).st_size > 100 > actual
    dst = np.full(100, SENTINEL, dtype=np.uint8)
    with pytest.raises(engine.ShortReadError) as info:
        engine.read_ranges(SYSFS_FILE, None, [0], [100], dst)
    assert isinstance(info.value, EOFError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert SYSFS_FILE in message and "offset=0" in message and "length=100" in message
    assert f"at byte {actual}" in message
    # Whatever it wrote before failing, the call reported failure; reading only what exists works.
    assert engine.read_ranges(SYSFS_FILE, None, [0], [actual], dst) == actual
    assert dst[:actual].tobytes() == open(SYSFS_FILE, "rb").read()


@pytest.mark.skipif(not os.path.exists(SYSFS_FILE), reason=f"{SYSFS_FILE} is not available")
def test_one_failing_task_stops_the_rest(tmp_path):
    big = write(tmp_path / "big.bin", random.Random(6).randbytes(4 << 20))
    # Task 0 (file 0 sorts first) fails; with one thread the later tasks must be skipped.
    fi = [0] + [1] * 16
    off = [0] + [k * (256 << 10) for k in range(16)]
    ln = [100] + [256 << 10] * 16
    dsto = [0] + [4096 + k * (256 << 10) for k in range(16)]
    dst = np.full(4096 + (4 << 20), SENTINEL, dtype=np.uint8)
    with pytest.raises(engine.ShortReadError):
        engine.read_ranges([SYSFS_FILE, big], fi, off, ln, dst, dsto, num_threads=1, task_size=256 << 10)
    assert untouched(dst[4096:])
    with pytest.raises(engine.ShortReadError):  # many threads: still the error, never success
        engine.read_ranges([SYSFS_FILE, big], fi, off, ln, dst, dsto, num_threads=8, task_size=64 << 10)


def test_missing_file(tmp_path):
    missing = str(tmp_path / "missing.bin")
    dst = np.full(8, SENTINEL, dtype=np.uint8)
    with pytest.raises(FileNotFoundError) as info:
        engine.read_ranges(missing, None, [3], [4], dst)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == missing
    assert "missing.bin" in str(info.value) and "offset=3" in str(info.value) and "length=4" in str(info.value)
    assert untouched(dst)


@pytest.mark.parametrize("o_direct", [False, True], ids=["pread", "o_direct"])
def test_directory_instead_of_file(tmp_path, o_direct):
    dst = np.full(8, SENTINEL, dtype=np.uint8)
    with pytest.raises(IsADirectoryError) as info:
        engine.read_ranges(str(tmp_path), None, [0], [4], dst, o_direct=o_direct)
    assert info.value.filename == str(tmp_path) and "offset=0" in str(info.value)
    assert untouched(dst)


def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        engine.read_ranges(fifo, None, [0], [1], np.zeros(1, np.uint8))


def test_permission_denied(tmp_path):
    path = write(tmp_path / "secret.bin", b"secret")
    os.chmod(path, 0)
    script = textwrap.dedent(f"""
        import os, numpy as np
        from torch_fastload import engine
        if os.geteuid() == 0:  # root ignores file modes: become nobody first
            os.setgid(65534); os.setuid(65534)
        try:
            engine.read_ranges({path!r}, None, [1], [2], np.zeros(2, np.uint8))
        except PermissionError as exc:
            print("PermissionError", exc.errno, exc.filename, exc)
        else:
            print("read succeeded")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"PermissionError {errno.EACCES} {path}"), out.stdout
    assert "offset=1" in out.stdout and "length=2" in out.stdout


def test_o_direct_refused_by_the_filesystem_is_a_clear_error():
    try:
        os.close(os.open("/proc/self/status", os.O_RDONLY | os.O_DIRECT))
        pytest.skip("procfs accepts O_DIRECT on this kernel")
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    with pytest.raises(OSError) as info:
        engine.read_ranges("/proc/self/status", None, [0], [0], np.zeros(1, np.uint8), o_direct=True)
    assert info.value.errno == errno.EINVAL
    assert "O_DIRECT" in str(info.value) and "o_direct=False" in str(info.value)
    assert info.value.filename == "/proc/self/status"


# ------------------------------------------------------------------------------------------
# hostile indices
# ------------------------------------------------------------------------------------------

HOSTILE = {
    "negative offset": (0, -1, 4, 0, "must be >= 0"),
    "negative length": (0, 0, -4, 0, "must be >= 0"),
    "negative dst_offset": (0, 0, 4, -1, "must be >= 0"),
    "most negative offset": (0, -(2**63), 4, 0, "must be >= 0"),
    "file_index -1": (-1, 0, 4, 0, r"file_index -1 is not in \[0, 4\)"),
    "file_index past the end": (4, 0, 4, 0, r"file_index 4 is not in \[0, 4\)"),
    "offset past end of file": (1, 4098, 0, 0, "end of the file"),
    "range past end of file": (1, 4090, 10, 0, "end of the file"),
    "offset + length overflows": (0, INT64_MAX, 1, 0, "overflows int64"),
    "huge length": (0, 0, INT64_MAX, 0, "overflows int64|exceed the buffer"),
    "dst_offset + length > dst_size": (0, 0, 64, 1, "exceed the buffer of 64 bytes"),
    "length > dst_size": (0, 0, 65, 0, "exceed the buffer of 64 bytes"),
    "dst_offset + length overflows": (0, 0, 8, INT64_MAX - 3, "exceed the buffer of 64 bytes"),
    "dst_offset at INT64_MAX": (0, 0, 1, INT64_MAX, "exceed the buffer of 64 bytes"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_range_is_rejected_and_nothing_is_written(files, case):
    paths, _ = files
    fi, off, ln, dsto, pattern = HOSTILE[case]
    # A guarded view: the engine sees 64 bytes; anything it wrote outside lands in the canaries.
    backing = torch.full((64 + 2 * 4096,), SENTINEL, dtype=torch.uint8)
    dst = backing[4096 : 4096 + 64]
    # A valid range first: it must not be read either, since checks precede every read.
    with pytest.raises(engine.RangeError, match=pattern) as info:
        engine.read_ranges(paths, [0, fi], [0, off], [8, ln], dst, [0, dsto])
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"offset={off}" in message and f"length={ln}" in message and "range #1" in message
    if 0 <= fi < len(paths):
        assert paths[fi] in message
    assert untouched(backing)


def test_bad_argument_shapes_and_types(files):
    paths, _ = files
    dst = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="same length"):
        _C.read_ranges(paths, [0, 0], [0], [1], dst.ctypes.data, 16, [0])
    with pytest.raises(TypeError, match="integers"):
        engine.read_ranges(paths, [0], [0.5], [1], dst)
    with pytest.raises(TypeError):  # the extension itself refuses float arrays (no silent truncation)
        _C.read_ranges(paths, np.array([0]), np.array([0.5]), np.array([1]), dst.ctypes.data, 16, np.array([0]))
    with pytest.raises(ValueError, match="1-D"):
        engine.read_ranges(paths, [[0]], [[0]], [[1]], dst, [[0]])
    with pytest.raises(engine.RangeError, match="does not fit in int64"):
        engine.read_ranges(paths, [0], np.array([2**63], dtype=np.uint64), [1], dst)
    with pytest.raises(ValueError, match="num_threads"):
        engine.read_ranges(paths, [0], [0], [1], dst, num_threads=0)
    with pytest.raises(ValueError, match="num_threads"):
        _C.read_ranges(paths, [0], [0], [1], dst.ctypes.data, 16, [0], num_threads=10_000)
    with pytest.raises(ValueError, match="task_size"):
        _C.read_ranges(paths, [0], [0], [1], dst.ctypes.data, 16, [0], task_size=0)
    with pytest.raises(ValueError, match="dst_ptr is null"):
        _C.read_ranges(paths, [0], [0], [1], 0, 16, [0])
    with pytest.raises(ValueError, match="dst_size must be >= 0"):
        _C.read_ranges(paths, [0], [0], [1], dst.ctypes.data, -1, [0])
    with pytest.raises(ValueError, match="overflows the address space"):
        _C.read_ranges(paths, [0], [0], [1], 2**64 - 8, 16, [0])
    with pytest.raises(ValueError, match="file_index is required"):
        engine.read_ranges(paths, None, [0], [1], dst)


def test_destination_validation(files):
    paths, _ = files
    with pytest.raises(ValueError, match="meta"):
        engine.read_ranges(paths[0], None, [0], [1], torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="contiguous"):
        engine.read_ranges(paths[0], None, [0], [1], torch.zeros(4, 4, dtype=torch.uint8).t())
    readonly = np.zeros(4, np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        engine.read_ranges(paths[0], None, [0], [1], readonly)
    with pytest.raises(ValueError, match="read-only"):
        engine.read_ranges(paths[0], None, [0], [1], b"immutable")
    with pytest.raises(TypeError, match="writable buffer"):
        engine.read_ranges(paths[0], None, [0], [1], 12345)


def test_index_arrays_are_copied_before_the_gil_is_released(files):
    """The engine checks and reads its own copy: a caller mutating the index afterwards (another
    thread could, once the GIL is released) cannot turn a checked range into an unchecked one."""
    paths, contents = files
    offsets = np.array([0, 100], dtype=np.int64)
    dst = np.zeros(20, np.uint8)
    engine.read_ranges(paths[0], None, offsets, [10, 10], dst)
    assert offsets.tolist() == [0, 100]
    assert dst.tobytes() == contents[0][0:10] + contents[0][100:110]


# ------------------------------------------------------------------------------------------
# pool, GIL, fork, concurrency
# ------------------------------------------------------------------------------------------


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_pool_is_persistent(files):
    paths, contents = files
    dst = np.zeros(1_000_003, np.uint8)
    engine.read_ranges(paths[0], None, [0], [1_000_003], dst, num_threads=5, task_size=4096)
    workers, threads = engine.pool_size(), thread_count()
    assert workers >= 4
    for _ in range(20):
        engine.read_ranges(paths[0], None, [0], [1_000_003], dst, num_threads=5, task_size=4096)
    # <=: threads of earlier tests (loader pipelines winding down) may still exit meanwhile
    assert engine.pool_size() == workers and thread_count() <= threads
    assert dst.tobytes() == contents[0]


def test_gil_is_released_during_the_read(tmp_path):
    path = write(tmp_path / "gil.bin", random.Random(9).randbytes(32 << 20))
    piece = 512
    pages = (32 << 20) // piece
    # Reversed destination order: nothing coalesces, so the call issues 65536 small preads
    # (long enough to observe even where the page cache serves 8192 4 KiB preads in < 20 ms).
    offsets = np.arange(pages, dtype=np.int64) * piece
    dsto = offsets[::-1].copy()
    dst = np.empty(32 << 20, np.uint8)
    ticks, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)
        for _ in range(5):
            start = time.perf_counter()
            engine.read_ranges(path, None, offsets, np.full(pages, piece), dst, dsto, num_threads=1, task_size=piece)
            end = time.perf_counter()
            if end - start > 0.02:
                break
    finally:
        stop.set()
        spinner.join()
    inside = [t for t in ticks if start + 0.002 < t < end - 0.002]
    assert end - start > 0.02, "the read was too quick to observe"
    assert len(inside) > 100, f"only {len(inside)} Python steps ran during a {end - start:.3f}s call"
    assert dst[:piece].tobytes() == python_read(path, (pages - 1) * piece, piece)


def test_concurrent_calls_share_the_pool(files):
    paths, contents = files
    errors = []

    def worker(seed):
        try:
            rng = random.Random(seed)
            for _ in range(20):
                off = sorted(rng.randrange(0, 900_000) for _ in range(8))
                dst = np.zeros(8 * 10_000, np.uint8)
                engine.read_ranges(paths[0], None, off, [10_000] * 8, dst, num_threads=4, task_size=4096)
                expected = b"".join(contents[0][o : o + 10_000] for o in off)
                assert dst.tobytes() == expected
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_pool_works_in_a_forked_child(files):
    """DataLoader workers fork: the pool's threads don't survive fork, the child must build its own."""
    paths, contents = files
    dst = np.zeros(1_000_003, np.uint8)
    engine.read_ranges(paths[0], None, [0], [1_000_003], dst, num_threads=4, task_size=4096)  # pool warm
    with warnings.catch_warnings():  # 3.12+ warns about fork() with threads: that is the point here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: exit status tells the result; never returns into pytest
        try:
            child = np.zeros(1_000_003, np.uint8)
            engine.read_ranges(paths[0], None, [0], [1_000_003], child, num_threads=4, task_size=4096)
            os._exit(0 if child.tobytes() == contents[0] else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("read_ranges hung in a forked child")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


# ------------------------------------------------------------------------------------------
# copy_ranges
# ------------------------------------------------------------------------------------------


def test_copy_ranges_parallel_memcpy():
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, size, dtype=np.uint8) for size in (0, 1, 4095, 3 << 20, 100_000)]
    dsts = [np.zeros(len(s), np.uint8) for s in srcs]
    total = engine.copy_ranges(
        [d.ctypes.data for d in dsts],
        [s.ctypes.data for s in srcs],
        [s.nbytes for s in srcs],
        num_threads=4,
        task_size=64 << 10,
    )
    assert total == sum(s.nbytes for s in srcs)
    for d, s in zip(dsts, srcs):
        np.testing.assert_array_equal(d, s)
    # Between torch tensors, by data_ptr.
    a, b = torch.arange(1 << 20, dtype=torch.int32), torch.zeros(1 << 20, dtype=torch.int32)
    assert engine.copy_ranges([b.data_ptr()], [a.data_ptr()], [a.numel() * 4]) == 4 << 20
    assert torch.equal(a, b)


def test_copy_ranges_rejects_bad_input():
    a, b = np.zeros(8, np.uint8), np.ones(8, np.uint8)
    with pytest.raises(engine.RangeError, match=r"copy #1 .*size=-1"):
        engine.copy_ranges([a.ctypes.data] * 2, [b.ctypes.data] * 2, [8, -1])
    with pytest.raises(engine.RangeError, match="non-null"):
        engine.copy_ranges([0], [b.ctypes.data], [8])
    with pytest.raises(ValueError, match="same length"):
        engine.copy_ranges([a.ctypes.data], [b.ctypes.data] * 2, [8])
    assert not a.any()


def test_stage_host_batch_copies_and_rebases_into_the_slot_in_one_call():
    """The one-call stage's host half (no device pointer: nothing goes to a GPU): pageable
    ranges copied and Arrow offsets rebased and widened into one slot, as the stager lays them."""
    rng = np.random.default_rng(3)
    slot = np.zeros(1 << 16, np.uint8)
    values = rng.integers(0, 256, 5000, dtype=np.uint8)
    floats = rng.standard_normal(300).astype(np.float32)
    offsets32 = (np.arange(101, dtype=np.int32) * 7) + 40  # a batch cut from row 40's value on
    offsets64 = np.arange(51, dtype=np.int64) * 3 + 9
    base = slot.ctypes.data
    written = _C.stage_host_batch(
        [base, base + 8192],
        [values.ctypes.data, floats.ctypes.data],
        [values.nbytes, floats.nbytes],
        [base + 16384, base + 16384 + 101 * 8],
        [offsets32.ctypes.data, offsets64.ctypes.data + 8],  # the second piece skips its leading value
        [101, 50],
        [-40, 700 - 12],
        [4, 8],
        4,
        1 << 12,
        False,
        0,
        0,
        0,
        0,
        None,
        None,
    )
    assert written == values.nbytes + floats.nbytes + (101 + 50) * 8
    np.testing.assert_array_equal(slot[:5000], values)
    np.testing.assert_array_equal(slot[8192 : 8192 + floats.nbytes].view(np.float32), floats)
    rebased = slot[16384 : 16384 + 151 * 8].view(np.int64)
    np.testing.assert_array_equal(rebased[:101], offsets32 - 40)
    np.testing.assert_array_equal(rebased[101:], offsets64[1:] + 700 - 12)


def test_stage_host_batch_refuses_bad_ranges_before_any_device_copy():
    a, b = np.zeros(8, np.uint8), np.ones(8, np.uint8)
    args = ([], [], [], [], [], [], [], [], 2, 1 << 12, False)
    with pytest.raises(engine.RangeError, match=r"copy #0 .*size=-1"):
        _C.stage_host_batch([a.ctypes.data], [b.ctypes.data], [-1], *args[3:], 0, 0, 0, 0, None, None)
    with pytest.raises(engine.RangeError, match="src_widths must be 4 or 8"):
        _C.stage_host_batch(
            [], [], [], [a.ctypes.data], [b.ctypes.data], [1], [0], [2], *args[8:], 0, 0, 0, 0, None, None
        )
    with pytest.raises(ValueError, match="stream other than the legacy default"):
        _C.stage_host_batch(*args, a.ctypes.data, 12345, 8, 0, None, None)  # a device copy needs a stream
    assert not a.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no CUDA driver loads")
def test_copy_event_without_a_driver_says_so():
    with pytest.raises(ValueError, match="libcuda|CUDA driver"):
        _C.CopyEvent(1)


# ------------------------------------------------------------------------------------------
# defaults and availability
# ------------------------------------------------------------------------------------------


def test_defaults_from_environment(monkeypatch):
    monkeypatch.delenv("TORCH_FASTLOAD_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_FASTLOAD_TASK_SIZE", raising=False)
    assert engine.default_num_threads() == 16 and engine.default_task_size() == 4 << 20
    monkeypatch.setenv("TORCH_FASTLOAD_NUM_THREADS", "3")
    monkeypatch.setenv("TORCH_FASTLOAD_TASK_SIZE", "1MiB")
    assert engine.default_num_threads() == 3 and engine.default_task_size() == 1 << 20
    monkeypatch.setenv("TORCH_FASTLOAD_TASK_SIZE", "65536")
    assert engine.default_task_size() == 65536
    monkeypatch.setenv("TORCH_FASTLOAD_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="TORCH_FASTLOAD_NUM_THREADS='lots'"):
        engine.default_num_threads()
    monkeypatch.setenv("TORCH_FASTLOAD_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="TORCH_FASTLOAD_NUM_THREADS"):
        engine.read_ranges("/dev/null", None, [], [], np.zeros(1, np.uint8))


def test_available_and_error_types():
    assert engine.available()
    assert issubclass(engine.RangeError, ValueError)
    assert issubclass(engine.ShortReadError, engine.RangeError) and issubclass(engine.ShortReadError, EOFError)
    assert engine.RangeError.__module__ == "torch_fastload._C"


def test_import_error_is_clear_when_not_built():
    """Without the built extension, engine still imports and explains how to build."""
    script = textwrap.dedent("""
        import sys
        sys.modules["torch_fastload._C"] = None  # makes `from . import _C` fail as if never built
        from torch_fastload import engine
        assert not engine.available()
        assert issubclass(engine.RangeError, ValueError)
        try:
            engine.read_ranges("x", None, [0], [1], bytearray(1))
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "not built" in out.stdout and "pip install -e ." in out.stdout


# ------------------------------------------------------------------------------------------
# fuzz, plain and under AddressSanitizer
# ------------------------------------------------------------------------------------------


def test_fuzz_plain_build():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, FUZZ, "--seconds", "4", "--seed", "11"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "failures=0" in out.stdout and " ok=" in out.stdout


def _asan_runtime() -> tuple[str, str] | None:
    libs = []
    for compiler, name in (("gcc", "libasan.so"), ("g++", "libstdc++.so")):
        if shutil.which(compiler) is None:
            return None
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(found) or not os.path.exists(found):
            return None
        libs.append(os.path.realpath(found))
    return libs[0], libs[1]


def test_fuzz_under_address_sanitizer(tmp_path):
    runtime = _asan_runtime()
    if runtime is None:
        pytest.skip("the C++ compiler has no AddressSanitizer runtime (gcc -print-file-name=libasan.so)")
    libasan, libstdcxx = runtime
    env = {**os.environ, "TORCH_FASTLOAD_ASAN": "1"}
    build = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "obj"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (so,) = glob.glob(str(tmp_path / "lib" / "torch_fastload" / "_C*.so"))
    assert b"__asan_init" in open(so, "rb").read(), "the extension was not built with -fsanitize=address"
    # libstdc++ is preloaded too: ASan must see __cxa_throw at start-up to intercept C++ throws.
    run_env = {
        **os.environ,
        "LD_PRELOAD": f"{libasan} {libstdcxx}",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=86",
    }
    run_env.pop("TORCH_FASTLOAD_ASAN", None)

    # The harness must notice a real overflow, or a clean run would prove nothing.
    provoke = subprocess.run(
        [sys.executable, FUZZ, "--so", so, "--provoke-overflow"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert provoke.returncode == 86 and "heap-buffer-overflow" in provoke.stderr, (
        provoke.stdout + provoke.stderr[-3000:]
    )

    fuzz = subprocess.run(
        [sys.executable, FUZZ, "--so", so, "--seconds", "15", "--seed", "12345"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert fuzz.returncode == 0, fuzz.stdout + fuzz.stderr[-5000:]
    assert "AddressSanitizer" not in fuzz.stderr
    assert "failures=0" in fuzz.stdout


def test_io_options_are_named_after_themselves_and_old_names_still_work(monkeypatch):
    from torch_fastload import config

    for name in ("TORCH_FASTLOAD_NUM_THREADS", "TORCH_FASTLOAD_TASK_SIZE", "TORCH_FASTLOAD_IO_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FASTLOAD_IO_THREADS", "5")
    monkeypatch.setenv("TORCH_FASTLOAD_IO_TASK_SIZE", "2MiB")
    assert config._lookup("io_threads") == (5, "TORCH_FASTLOAD_IO_THREADS")
    assert engine.default_task_size() == 2 << 20
    monkeypatch.delenv("TORCH_FASTLOAD_IO_THREADS")
    monkeypatch.setenv("TORCH_FASTLOAD_NUM_THREADS", "7")
    with pytest.warns(
        DeprecationWarning, match="TORCH_FASTLOAD_NUM_THREADS is deprecated: set TORCH_FASTLOAD_IO_THREADS"
    ):
        assert config.get("io_threads") == 7


def test_the_rings_group_size_defaults_to_4_and_bad_settings_are_refused(monkeypatch):
    ring = np.zeros(8 * 4096, dtype=np.uint8)  # the constructor touches no GPU: host memory does
    make = lambda group=0: _C.DeviceStager(ring.ctypes.data, ring.nbytes, 4096, group)  # noqa: E731
    assert make().group_chunks == 4 and make(3).group_chunks == 3 and make().chunks == 8
    with pytest.raises(ValueError, match="group_chunks must be >= 1, got -2"):
        make(-2)
    monkeypatch.setenv("TORCH_FASTLOAD_RING_GROUP", "7")
    assert make().group_chunks == 7 and make(2).group_chunks == 2  # the argument wins
    for bad in ("0", "four", "4x"):
        monkeypatch.setenv("TORCH_FASTLOAD_RING_GROUP", bad)
        with pytest.raises(ValueError, match=f"TORCH_FASTLOAD_RING_GROUP must be an integer >= 1, got '{bad}'"):
            make()


def test_driver_calls_are_not_counted_unless_asked():
    """The per-thread driver call counter is a probe's switch: off, nothing is counted (and no
    trampoline sits in front of the loader's calls)."""
    if os.environ.get("TORCH_FASTLOAD_COUNT_DRIVER_CALLS") == "1":
        pytest.skip("counting was switched on for this process")
    assert _C.driver_call_counts() == {}
