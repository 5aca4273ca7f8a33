"""Generated Parquet files for benchmarks/parquet.py (written once, reused while they exist).

alert table  shaped like the DataPelago alert table of the libcudf/pyarrow study: 14 columns,
             9 string ids (16-24 characters, cardinalities 1e3..1e6), 2 timestamps (us), 2
             int64, 1 bool; at the row counts asked, snappy or uncompressed.
profiles     one column type per file, in the spirit of cuDF's reader benchmarks: int64,
             float64, string (16-32 bytes), timestamp (us), list<int32> (0-8 items); run length
             1 or 32 (each value repeated); cardinality unlimited (0) or 1000; sized by the
             table's in-memory (decoded) bytes.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["alert_table", "write_alert", "profile_table", "write_profile", "write_all", "PROFILE_TYPES"]

PROFILE_TYPES = ("int", "float", "string", "timestamp", "list")
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)


def random_strings(rng, n: int, low: int, high: int, prefix: bytes = b"") -> pa.Array:
    """``n`` random strings of ``low..high`` characters (plus ``prefix``), built from buffers."""
    lengths = rng.integers(low, high + 1, n) + len(prefix)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = _LETTERS[rng.integers(0, len(_LETTERS), int(offsets[-1]))]
    if prefix:
        starts = offsets[:-1]
        for k, byte in enumerate(prefix):
            data[starts + k] = byte
    kind = pa.large_string() if offsets[-1] >= 2**31 else pa.string()
    offsets = offsets if kind == pa.large_string() else offsets.astype(np.int32)
    return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _codes(rng, n: int, cardinality: int, run_length: int) -> np.ndarray | None:
    """Positions into a pool of ``cardinality`` values (None: every value drawn fresh), each
    repeated ``run_length`` times."""
    runs = -(-n // run_length)
    if not cardinality:
        return None if run_length == 1 else np.repeat(np.arange(runs), run_length)[:n]
    return np.repeat(rng.integers(0, cardinality, runs), run_length)[:n]


@functools.lru_cache(maxsize=1)  # the snappy and the uncompressed file of a size share one table
def alert_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns = {}
    for k, name in enumerate(
        ["alert_id", "device_id", "site_id", "rule_id", "user_id", "session_id", "tenant_id", "region", "source_id"]
    ):
        cardinality = [1_000_000, 100_000, 10_000, 1_000][k % 4]
        pool = random_strings(rng, cardinality, 12, 20, prefix=name[:3].encode() + b"-")
        columns[name] = pool.take(pa.array(rng.integers(0, cardinality, rows)))
    start = 1_700_000_000_000_000
    created = np.sort(rng.integers(start, start + 86_400_000_000 * 30, rows))
    columns["created_at"] = pa.array(created, pa.timestamp("us"))
    columns["updated_at"] = pa.array(created + rng.integers(0, 3_600_000_000, rows), pa.timestamp("us"))
    columns["severity"] = pa.array(rng.integers(0, 5, rows))
    columns["count"] = pa.array(rng.integers(0, 1 << 40, rows))
    columns["resolved"] = pa.array(rng.random(rows) < 0.3)
    return pa.table(columns)


def write_alert(root: Path, rows: int, compression: str, row_group_rows: int) -> Path:
    path = root / f"alert-{rows}-{compression}-rg{row_group_rows}.parquet"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        pq.write_table(alert_table(rows), tmp, compression=compression, row_group_size=row_group_rows)
        os.replace(tmp, path)
    return path


def profile_table(kind: str, nbytes: int, run_length: int, cardinality: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    per_row = {"int": 8, "float": 8, "string": 28, "timestamp": 8, "list": 4 * 4 + 4}[kind]
    n = max(1, nbytes // per_row)
    codes = _codes(rng, n, cardinality, run_length)
    pool_size = cardinality or (n if codes is None else -(-n // run_length))

    def pick(pool: pa.Array | np.ndarray):
        if codes is None:
            return pool
        return pool.take(pa.array(codes)) if isinstance(pool, pa.Array) else pool[codes]

    if kind == "int":
        column = pa.array(pick(rng.integers(-(2**62), 2**62, pool_size)))
    elif kind == "float":
        column = pa.array(pick(rng.standard_normal(pool_size)))
    elif kind == "timestamp":
        column = pa.array(pick(rng.integers(0, 2**52, pool_size)), pa.timestamp("us"))
    elif kind == "string":
        column = pick(random_strings(rng, pool_size, 16, 32))
    elif kind == "list":
        lengths = rng.integers(0, 9, pool_size)
        offsets = np.zeros(pool_size + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = pa.array(rng.integers(-(2**31), 2**31, int(offsets[-1])).astype(np.int32))
        column = pick(pa.ListArray.from_arrays(pa.array(offsets), values))
    else:
        raise ValueError(f"unknown profile type {kind!r}")
    return pa.table({kind: column})


def write_profile(root: Path, kind: str, nbytes: int, run_length: int, cardinality: int, compression: str) -> Path:
    path = root / f"profile-{kind}-{nbytes >> 20}MiB-run{run_length}-card{cardinality}-{compression}.parquet"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        pq.write_table(profile_table(kind, nbytes, run_length, cardinality), tmp, compression=compression)
        os.replace(tmp, path)
    return path


def _write_alerts(root: Path, rows: int, compressions: tuple, row_group_rows: int) -> None:
    for compression in compressions:  # one process: the files of a row count share one table
        write_alert(root, rows, compression, row_group_rows)


def write_all(root: Path, alerts: list, profiles: list, workers: int) -> None:
    """Every file a run reads, written by ``workers`` processes at once (files already there are
    kept): on a fresh machine, writing them one after another took minutes of the run.
    ``alerts``: (rows, compressions, row_group_rows); ``profiles``: write_profile's arguments
    after ``root``. A file asked for twice is written once."""
    root.mkdir(parents=True, exist_ok=True)
    merged: dict = {}
    for rows, compressions, row_group_rows in alerts:
        merged.setdefault((rows, row_group_rows), set()).update(compressions)
    alerts = [(rows, tuple(sorted(c)), rg) for (rows, rg), c in merged.items()]
    profiles = list(dict.fromkeys(tuple(spec) for spec in profiles))
    if workers <= 1:
        for spec in alerts:
            _write_alerts(root, *spec)
        for spec in profiles:
            write_profile(root, *spec)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(_write_alerts, root, *spec) for spec in alerts]
        jobs += [pool.submit(write_profile, root, *spec) for spec in profiles]
        for job in jobs:
            job.result()
