"""Seeded, time-bounded fuzz of Parquet footer and page bytes against ``ParquetDataset``.

Writes a small valid file, then repeatedly damages a copy (flipped bytes, overwritten runs,
truncation, in the footer, in its length, or in the pages) and opens and reads it, by ``batch()``
or through a loader (whose batches of consecutive rows the C++ planner cuts). Every outcome
must be a decoded batch or a ``ParquetError`` (a typed error naming the file); any other
exception is a failure, and a crash of the process (pyarrow's parser on a hostile footer) is
seen by the test that runs this in a subprocess as a signal exit status.
Exit status 0 means no failure; the last line is a summary.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torch_fastload import DataLoader
from torch_fastload.errors import ParquetError
from torch_fastload.sources import ParquetDataset


def valid_file(path: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = 600
    table = pa.table(
        {
            "i": pa.array(rng.integers(-1000, 1000, n)),
            "f": pa.array(rng.random(n)),
            "s": pa.array([None if k % 11 == 0 else f"id-{k % 37}" for k in range(n)]),
            "t": pa.array(rng.integers(0, 10**12, n), pa.timestamp("ms")),
            "l": pa.array([list(range(k % 5)) for k in range(n)], pa.list_(pa.int32())),
            "b": pa.array([None if k % 7 == 0 else bool(k % 3) for k in range(n)]),
            "w": pa.array([f"word-{k % 13}" * (k % 3) for k in range(n)]),
        }
    )
    # the seed also picks the pages' kinds the page decoder meets: v1 or v2 data pages,
    # dictionary or PLAIN, one page a chunk or many small ones
    choose = random.Random(seed)
    options = dict(
        compression=choose.choice(["snappy", "zstd", "none"]),
        data_page_version=choose.choice(["1.0", "2.0"]),
        use_dictionary=choose.choice([True, False]),
        data_page_size=choose.choice([1 << 20, 256]),
    )
    if choose.random() < 0.5:  # the DELTA_* and BYTE_STREAM_SPLIT pages of data page v2 writers
        options["use_dictionary"] = False
        options["column_encoding"] = {
            "i": "DELTA_BINARY_PACKED",
            "t": "DELTA_BINARY_PACKED",
            "f": "BYTE_STREAM_SPLIT",
            "s": "DELTA_BYTE_ARRAY",
            "w": "DELTA_LENGTH_BYTE_ARRAY",
        }
    pq.write_table(table, path, row_group_size=200, **options)
    return options


def damage(data: bytearray, rng: random.Random) -> tuple[bytearray, str]:
    size = len(data)
    footer_len = int.from_bytes(data[-8:-4], "little")
    footer_start = size - 8 - footer_len
    how = rng.choice(["footer", "footer", "length", "pages", "pages", "truncate", "run"])
    if how == "footer":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(footer_start, size - 8)] = rng.randrange(256)
    elif how == "length":
        data[-8:-4] = rng.choice(
            [0, 1, footer_len - 1, footer_len + 1, size, 2**31 - 1, rng.randrange(2**32)]
        ).to_bytes(4, "little")
    elif how == "pages":
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(4, footer_start)] = rng.randrange(256)
    elif how == "truncate":
        data = data[: rng.randrange(0, size)]
    else:
        start = rng.randrange(0, size)
        data[start : start + rng.randint(1, 64)] = bytes(rng.randrange(256) for _ in range(64))[: size - start]
    return data, how


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-cases", type=int, default=100000)
    parser.add_argument("--arena", action="store_true", help="decode through the pinned arena (torch_fastload._arrow)")
    args = parser.parse_args()
    arena_decode = None
    if args.arena:
        from torch_fastload import _arrow  # raises where it is not built: the caller asked for it

        _arrow.make_arena(32 << 20)
        arena_decode = _arrow.read_row_group
    rng = random.Random(args.seed)
    outcomes: dict = {}
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base.parquet")
        written = valid_file(base, args.seed)
        original = bytearray(open(base, "rb").read())
        path = os.path.join(tmp, "case.parquet")
        deadline = time.monotonic() + args.seconds
        case = 0
        while time.monotonic() < deadline and case < args.max_cases:
            data, how = damage(bytearray(original), rng)
            via = rng.choice(["batch", "loader"])
            with open(path, "wb") as f:
                f.write(data)
            try:
                dataset = ParquetDataset(path, threads=2, read_mode=rng.choice(["pyarrow", "pread"]))
                if arena_decode is not None:
                    dataset._reader().arena_decode = arena_decode  # (read_mode "pyarrow" only)
                try:
                    if via == "loader":  # batches of consecutive rows planned in C++ (parquet_range_plan)
                        for _ in DataLoader(dataset, batch_size=256, device="cpu"):
                            pass
                    else:
                        for start in range(0, len(dataset), 256):
                            dataset.batch(range(start, min(start + 256, len(dataset))))
                finally:
                    dataset.close()
                result = "read"
            except ParquetError:
                result = "typed error"
            except Exception as exc:  # anything untyped is a failure (the file is in the message)
                failures += 1
                result = "untyped"
                print(f"case {case} ({how}): {type(exc).__name__}: {exc}", file=sys.stderr)
            outcomes[(f"{how}:{via}", result)] = outcomes.get((f"{how}:{via}", result), 0) + 1
            case += 1
    summary = ", ".join(f"{h}/{r}={n}" for (h, r), n in sorted(outcomes.items()))
    print(
        f"fuzz_parquet: seed={args.seed} arena={args.arena} written {written} cases={case} failures={failures} "
        f"[{summary}]"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
