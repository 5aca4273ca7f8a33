"""Random-fuzz ``_C.read_ranges`` with hostile ranges against guarded destination buffers.

Meant to run under AddressSanitizer (tests/test_engine.py builds an ASan ``_C`` and runs this
with libasan preloaded), but also checks on its own: each destination is either an exact-size
allocation (ASan's redzones catch a stray write) or a view flanked by canary bytes (checked
after every call). For each call the expected outcome is computed here independently:
- every range valid: the call succeeds, each range holds the file's bytes, the rest is untouched;
- any range invalid: the call raises and the destination is untouched (checks precede reads).

Imports only numpy and the extension (no torch), so it starts fast under ASan.
Exit status 0 means no failure; the last line is a summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import tempfile
import time

import numpy as np

INT64_MAX = 2**63 - 1
CANARY = 64
FILL = 0xAB


def load_extension(so_path: str | None):
    if so_path is None:
        from torch_fastload import _C

        return _C
    spec = importlib.util.spec_from_file_location("_C", so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_files(root: str, rng: random.Random):
    sizes = [0, 1, 4095, 4096, 4097, 65_536 + 3, 300_001]
    paths, contents = [], []
    for i, size in enumerate(sizes):
        path = os.path.join(root, f"f{i}.bin")
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
        contents.append(data)
    directory = os.path.join(root, "a_directory")
    os.mkdir(directory)
    paths.append(directory)
    contents.append(None)
    paths.append(os.path.join(root, "missing.bin"))
    contents.append(None)
    return paths, contents


def hostile(rng: random.Random, near: int) -> int:
    return rng.choice(
        [
            -1,
            -near - 1,
            -(2**63),
            INT64_MAX,
            INT64_MAX - rng.randrange(0, 4097),
            near,
            near + 1,
            near + rng.randrange(1, 1 << 20),
            2**31,
            2**32 + 1,
            rng.randrange(-(2**63), 2**63),
        ]
    )


def one_call(ext, rng, paths, contents, o_direct_ok, stats):
    n = rng.randrange(0, 40)
    dst_size = rng.choice([0, 1, 4096, rng.randrange(1, 700_000)])
    regular = [i for i, c in enumerate(contents) if c is not None]
    fi, off, ln, dsto = [], [], [], []
    cursor = 0
    for _ in range(n):
        f = rng.choice(regular) if rng.random() < 0.95 else rng.randrange(len(paths))
        size = len(contents[f]) if contents[f] is not None else 0
        length = rng.randrange(0, min(size, 70_000) + 1)
        offset = rng.randrange(0, size - length + 1)
        gap = rng.choice([0, 0, 0, 1, 7, 4096])
        fi.append(f)
        off.append(offset)
        ln.append(length)
        dsto.append(cursor + gap)
        cursor += gap + length
    # Occasionally run a contiguous stretch of one file so coalescing is exercised.
    if n > 3 and rng.random() < 0.3:
        f = max(regular, key=lambda i: len(contents[i]))
        start = rng.randrange(0, 1000)
        for k in range(n):
            fi[k], off[k], ln[k] = f, start + sum(ln[:k]), min(ln[k], 1000)
        cursor = 0
        for k in range(n):
            dsto[k] = cursor
            cursor += ln[k]
    if rng.random() < 0.8:
        dst_size = max(dst_size, cursor)  # usually let the valid layout fit
    # In about half the calls, corrupt one to three fields.
    for _ in range(rng.choice([0, 0, 0, 1, 2, 3]) if n else 0):
        k = rng.randrange(n)
        field = rng.randrange(4)
        if field == 0:
            fi[k] = rng.choice([-1, len(paths), 2**31, INT64_MAX, -(2**63)])
        elif field == 1:
            off[k] = hostile(rng, len(contents[fi[k]] or b"") if 0 <= fi[k] < len(paths) else 0)
        elif field == 2:
            ln[k] = hostile(rng, dst_size)
        else:
            dsto[k] = hostile(rng, dst_size)

    def valid(k):
        if not 0 <= fi[k] < len(paths) or contents[fi[k]] is None:
            return False
        if off[k] < 0 or ln[k] < 0 or dsto[k] < 0:
            return False
        return off[k] + ln[k] <= len(contents[fi[k]]) and dsto[k] + ln[k] <= dst_size

    expect_ok = all(valid(k) for k in range(n))
    exact = rng.random() < 0.5
    if exact:
        backing = np.full(dst_size, FILL, dtype=np.uint8)  # ASan redzones right after it
        view = backing
    else:
        backing = np.full(dst_size + 2 * CANARY, FILL ^ 0xFF, dtype=np.uint8)
        view = backing[CANARY : CANARY + dst_size]
        view[:] = FILL
    threads = rng.choice([1, 2, 3, 8])
    task_size = rng.choice([1, 7, 4096, 65_536, 1 << 20])
    o_direct = o_direct_ok and rng.random() < 0.3
    arrays = [np.array(x, dtype=np.int64) for x in (fi, off, ln, dsto)]
    try:
        got = ext.read_ranges(
            paths,
            arrays[0],
            arrays[1],
            arrays[2],
            view.ctypes.data,
            dst_size,
            arrays[3],
            num_threads=threads,
            task_size=task_size,
            o_direct=o_direct,
        )
        error = None
    except (ValueError, OSError) as exc:  # RangeError is a ValueError
        error = exc

    failures = []
    if not exact:
        if (backing[:CANARY] != FILL ^ 0xFF).any() or (backing[CANARY + dst_size :] != FILL ^ 0xFF).any():
            failures.append("canary overwritten")
    if expect_ok:
        if error is not None:
            failures.append(f"valid call raised {error!r}")
        else:
            if got != sum(ln):
                failures.append(f"returned {got}, expected {sum(ln)}")
            expected = np.full(dst_size, FILL, dtype=np.uint8)
            for k in range(n):
                expected[dsto[k] : dsto[k] + ln[k]] = np.frombuffer(contents[fi[k]], np.uint8)[off[k] : off[k] + ln[k]]
            if not np.array_equal(view, expected):
                failures.append("destination differs from the file bytes")
        stats["ok"] += 1
    else:
        if error is None:
            failures.append("invalid call succeeded")
        elif (view != FILL).any():
            failures.append(f"rejected call ({error!r}) wrote to the destination")
        stats["rejected"] += 1
    if failures:
        detail = dict(
            fi=fi,
            off=off,
            ln=ln,
            dsto=dsto,
            dst_size=dst_size,
            threads=threads,
            task_size=task_size,
            o_direct=o_direct,
            exact=exact,
        )
        raise AssertionError(f"{failures}: {detail}")


def fuzz_copy(ext, rng, stats):
    n = rng.randrange(1, 8)
    srcs = [np.frombuffer(rng.randbytes(rng.randrange(0, 50_000)), np.uint8).copy() for _ in range(n)]
    dsts = [np.zeros(len(s), np.uint8) for s in srcs]
    sizes = [len(s) for s in srcs]
    bad = rng.random() < 0.3
    if bad:
        sizes[rng.randrange(n)] = rng.choice([-1, -(2**63)])
    try:
        total = ext.copy_ranges(
            [d.ctypes.data for d in dsts],
            [s.ctypes.data for s in srcs],
            sizes,
            num_threads=rng.choice([1, 4]),
            task_size=rng.choice([1, 1000, 1 << 20]),
        )
    except ValueError:
        if not bad:
            raise
        if any(d.any() for d in dsts):
            raise AssertionError("rejected copy_ranges wrote to a destination") from None
        stats["rejected"] += 1
        return
    if bad:
        raise AssertionError(f"copy_ranges accepted sizes {sizes}")
    if total != sum(sizes) or not all(np.array_equal(d, s) for d, s in zip(dsts, srcs)):
        raise AssertionError("copy_ranges copied wrong bytes")
    stats["ok"] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--so", help="path of a built _C extension (default: import torch_fastload._C)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--provoke-overflow",
        action="store_true",
        help="copy one byte past an allocation on purpose, to prove ASan is watching",
    )
    args = parser.parse_args()
    ext = load_extension(args.so)
    if args.provoke_overflow:
        src = np.zeros(4096, np.uint8)
        dst = np.zeros(4096, np.uint8)
        ext.copy_ranges([dst.ctypes.data], [src.ctypes.data], [4097], num_threads=1)
        print("overflow was not detected")
        return 0
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    stats = {"ok": 0, "rejected": 0}
    deadline = time.monotonic() + args.seconds
    with tempfile.TemporaryDirectory() as root:
        paths, contents = make_files(root, rng)
        try:
            ext.read_ranges(paths[:1], [0], [0], [0], 0, 0, [0], o_direct=True)
            o_direct_ok = True
        except OSError:
            o_direct_ok = False
        calls = 0
        while calls < args.iterations and time.monotonic() < deadline:
            try:
                if calls % 10 == 9:
                    fuzz_copy(ext, rng, stats)
                else:
                    one_call(ext, rng, paths, contents, o_direct_ok, stats)
            except AssertionError as exc:
                print(f"FAIL (seed {seed}, call {calls}): {exc}", file=sys.stderr)
                return 1
            calls += 1
    print(
        f"fuzz: seed={seed} calls={calls} ok={stats['ok']} rejected={stats['rejected']} "
        f"o_direct={o_direct_ok} failures=0"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
