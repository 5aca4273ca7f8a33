#!/usr/bin/env python3
"""Remote reads: torch_fastload's concurrent range reader against boto3 in a thread pool, on a
loopback object server with injected per-request latency and a bandwidth cap, same run.

Server: ``torch_fastload.remote.loopback`` in its own process (asyncio + sendfile), serving one
random object (--size) path-style (``/bucket/key``: boto3 talks to it as S3). Every answer waits
--latencies seconds first; all bodies share one token bucket of --cap bytes/s ('auto': 60% of
what this machine's loopback moves uncapped with the reader at 64 x 16 MiB, measured first, so
the cap, not the CPU, is the limit).

The server runs --server-processes event loops (a quarter of the cores) on one listener, so
it is not the wall the clients share. Per latency, a concurrency x request-size grid (GB/s,
decimal; client CPU seconds per GB; the server's busy cores, to tell a client limit from a
server one; the mean requests in flight the server saw, what the client kept busy) of:
  fastload   RemoteReader(concurrency, request_size).read of consecutive spans of
             2 x concurrency x request_size bytes (capped at the object) into one buffer, from
             s3://bench/object.bin, SigV4-signed like boto3's (the server ignores signatures)
  boto3      get_object(Range=...) of request_size pieces on a ThreadPoolExecutor of
             `concurrency` threads (one client, max_pool_connections=concurrency), each body
             copied into the same buffer; the baseline is its best cell
  kvikio     kvikio RemoteFile.pread (num_threads x task_size) where it runs (CUDA hosts)
  loader     (capped grids only) torch_fastload.DataLoader over the object as 1 MiB rows read in
             order, --loader-batch bytes a batch, remote_concurrency x remote_request_size the
             cell's and every other option its default (the read-ahead of the batches the loader
             fetched ahead among them): what a training loop gets, so the cap verdict judges it;
             the fastload row's synchronous span loop (no read-ahead) is printed beside it
Each cell reads for --min-seconds after a warm-up that opens its connections, into one
destination buffer written beforehand (no first-touch page faults in any cell); the libraries
take each cell in turns. Both libraries
are also timed uncapped at 0 ms (64 x 16 MiB): what each moves through this CPU at most.

The same grids again with no cap, at each latency, from --uncapped-from requests in flight up
(fewer are bound by latency x requests, the same with or without a cap): each library's best
GB/s and its CPU seconds per GB there. Why both: issue 22 asks for >= 1.5x boto3's best at the
same latency AND >= 80% of the cap. Under a cap both libraries can only approach the cap, and a
boto3 that reaches 67% of it makes 1.5x impossible for anyone (on the 2-core CPU machine boto3
reached 90%): the two floors conflict wherever the cap is the limit. So the 80% floor is judged
on the capped grids (can the reader fill a constrained link?) and the 1.5x floor on the
uncapped ones (what each library moves at that latency when the link is not the limit; its CPU
per GB says what the rate costs): each library's best uncapped cell is run --repeats times more,
the libraries in turns, and the medians are compared (a grid's maximum is its luckiest cell).
The capped ratio is still printed, for the record. Uncapped,
the loopback itself (server process + kernel copies, the server's busy cores are printed) is
the next ceiling: on a machine with few free cores both clients reach it at large requests
(the 2-core CPU machine: ~2 GB/s each at 16 x 16 MiB, fastload at half boto3's CPU per GB), so
the 1.5x floor is meant for hosts with cores to spare (the 16-core GPU hosts).

Then, uncapped at the lowest latency, an epoch of an ArrayDataset (64 KiB rows, shuffled)
through torch_fastload.DataLoader: remote, from the shard cache (cache hit), and from the local
file (page cache hot), --epochs of each taken in turns: the cache-hit rate vs the local one
and the read path each took. The verdict compares the rates from each epoch's first batch on
(what the read path sustains); the whole-epoch rates and the wait for the first batch are
printed beside it: a cached epoch's first batch waits for one HEAD per object (the check that a
replaced object is refused before any batch), a fixed cost of one round trip per epoch that
dominates only epochs as short as this benchmark's (a 512 MiB epoch is ~4 ms at 120 GB/s).

Targets (issue 22): fastload's best >= 1.5x boto3's best at each latency (uncapped); the
loader's best >= 80% of the cap (capped); the cache-hit epoch at the local file path's rate
(>= 0.9x).

    python benchmarks/remote.py               # ~3-4 min (1 GiB object)
    python benchmarks/remote.py --quick       # 256 MiB, smaller grid
    python benchmarks/remote.py --cpu-smoke   # tiny: code paths only (tests)

Prints a line per cell, the grids and PASS/FAIL verdicts; writes remote.json (every number,
machine, command) and remote.png (the heatmaps) to --out (default benchmarks/out); the report
side (verdicts, tables, heatmaps) lives in remote_report.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import numpy as np  # noqa: E402
import torch  # noqa: E402

from torch_fastload import config, remote  # noqa: E402
from torch_fastload._benchutil import (  # noqa: E402
    Progress,
    error_text,
    float_list,
    log,
    machine_info,
    positive_int_list,
    size_list,
    write_json,
)
from torch_fastload.config import parse_size  # noqa: E402
from torch_fastload.remote.loopback import LoopbackServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remote_epochs import BUCKET, ROW_FLOATS, ROWS_KEY, loader_cell, loader_epochs  # noqa: E402
from remote_report import plot, print_report, verdicts  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
KEY = "object.bin"
FULL = dict(
    size=GiB, concurrency=[1, 4, 16, 64, 128], sizes=[MiB, 4 * MiB, 16 * MiB, 64 * MiB], min_seconds=0.5, repeats=3
)
QUICK = dict(size=256 * MiB, concurrency=[4, 16, 64], sizes=[MiB, 4 * MiB, 16 * MiB], min_seconds=0.3, repeats=3)
SMOKE = dict(size=8 * MiB, concurrency=[1, 4], sizes=[MiB, 4 * MiB], min_seconds=0.05, repeats=2)
UNCAPPED_FROM = 16  # requests in flight from which the uncapped grids start (fewer: latency-bound)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def make_data(root: Path, size: int) -> None:
    """``bench/object.bin`` (random bytes) and ``bench/rows.npy`` (float32 64 KiB rows), reused."""
    (root / BUCKET).mkdir(parents=True, exist_ok=True)
    target = root / BUCKET / KEY
    if not target.exists() or target.stat().st_size != size:
        with open(target, "wb") as f:
            for k, start in enumerate(range(0, size, 64 * MiB)):
                f.write(np.random.default_rng(k).bytes(min(64 * MiB, size - start)))
    rows = max(64, size // (4 * ROW_FLOATS) // 2)
    target = root / BUCKET / ROWS_KEY
    if not target.exists() or target.stat().st_size != 128 + rows * 4 * ROW_FLOATS:
        out = np.lib.format.open_memmap(target, mode="w+", dtype=np.float32, shape=(rows, ROW_FLOATS))
        out[:] = np.random.default_rng(7).standard_normal((rows, ROW_FLOATS), dtype=np.float32)
        out.flush()
        del out


# --------------------------------------------------------------------------------------------
# cells
# --------------------------------------------------------------------------------------------
def timed_spans(read, size: int, span: int, min_seconds: float) -> tuple[float, float]:
    """``(GB/s, client CPU seconds per GB)`` of ``read(offset, length)`` over consecutive spans
    (wrapping) for ``min_seconds``; the CPU is this process's (the server is another)."""
    moved, offset, started, cpu = 0, 0, time.perf_counter(), time.process_time()
    while True:
        length = min(span, size - offset)
        read(offset, length)
        moved += length
        offset = 0 if offset + length >= size else offset + length
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return moved / elapsed / 1e9, (time.process_time() - cpu) / (moved / 1e9)


_DESTINATION: list = []


def destination(size: int) -> np.ndarray:
    """One buffer, written once, for every cell of every library: no cell pays the first-touch
    page faults of a fresh 1 GiB destination (a fault per 4 KiB page: a large share of a
    0.5 s cell, and a different one for each library's way of writing)."""
    if not _DESTINATION or _DESTINATION[0].size != size:
        _DESTINATION[:] = [np.ones(size, dtype=np.uint8)]
    return _DESTINATION[0]


def fastload_cell(url: str, size: int, concurrency: int, request_size: int, min_seconds: float, backend="http"):
    buffer = torch.from_numpy(destination(size))
    zero = np.zeros(1, dtype=np.int64)
    span = min(size, 2 * concurrency * request_size)
    with remote.RemoteReader(concurrency=concurrency, request_size=request_size, backend=backend) as reader:

        def read(offset: int, length: int) -> None:
            reader.read(buffer, [url], zero, np.array([offset]), np.array([length]), np.array([offset]))

        read(0, min(size, concurrency * request_size))  # warm-up: connections opened
        return timed_spans(read, size, span, min_seconds)


def boto3_cell(endpoint: str, size: int, concurrency: int, request_size: int, min_seconds: float):
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(max_pool_connections=concurrency, retries={"max_attempts": 3}),
    )
    buffer = destination(size)
    span = min(size, 2 * concurrency * request_size)

    def piece(offset: int, length: int) -> None:
        body = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={offset}-{offset + length - 1}")["Body"].read()
        buffer[offset : offset + length] = np.frombuffer(body, dtype=np.uint8)

    with ThreadPoolExecutor(concurrency) as pool:

        def read(offset: int, length: int) -> None:
            starts = range(offset, offset + length, request_size)
            list(pool.map(lambda a: piece(a, min(request_size, offset + length - a)), starts))

        read(0, min(size, concurrency * request_size))
        return timed_spans(read, size, span, min_seconds)


def grids(cells: dict, latency: float, server, args, bar, concurrency=None, label: str = "") -> dict:
    """``{library: result}``: each library's concurrency x request-size grid at ``latency``, the
    libraries taken in turns cell by cell (a shared machine's slow spell hits all of them, not
    one library's whole grid); errors kept per cell."""
    server.control(latency=latency)
    concurrency = concurrency or args.concurrency
    keys = ("gbps", "cpu_s_per_gb", "server_cores", "in_flight")
    out = {lib: {"concurrency": concurrency} | {k: [] for k in keys} for lib in cells}
    for c in concurrency:
        for result in out.values():
            for k in keys:
                result[k].append([])
        for s in args.sizes:
            for lib, cell in cells.items():
                measured = measure_cell(f"{lib}{label}", cell, c, s, latency, server)
                for k, v in zip(keys, measured):
                    out[lib][k][-1].append(v)
                bar.update()
    for result in out.values():
        found = [(v, i, j) for i, row in enumerate(result["gbps"]) for j, v in enumerate(row) if v is not None]
        _, i, j = max(found) if found else (None, None, None)
        result["best"] = {
            "gbps": result["gbps"][i][j] if found else None,
            "concurrency": concurrency[i] if found else None,
            "request_size": args.sizes[j] if found else None,
        } | {k: result[k][i][j] if found else None for k in keys[1:]}
    return out


def confirm_best(results: dict, cells: dict, latency: float, server, args, bar) -> None:
    """Each library's best cell of ``results`` again, --repeats times, the libraries in turns:
    the median (and every value) into its ``best`` as ``gbps_median`` / ``gbps_repeats``. A
    grid's maximum is the luckiest of many noisy cells; the verdict compares the medians."""
    server.control(latency=latency)
    runs: dict = {lib: [] for lib in results}
    for _ in range(args.repeats):
        for lib, result in results.items():
            best = result["best"]
            if best["gbps"] is not None:
                c, s = best["concurrency"], best["request_size"]
                rate, per_gb, _, _ = measure_cell(f"{lib}/best", cells[lib], c, s, latency, server)
                if rate is not None:
                    runs[lib].append((rate, per_gb))
            bar.update()
    for lib, values in runs.items():
        if values:
            best = results[lib]["best"]
            best["gbps_repeats"] = [v[0] for v in values]
            best["gbps_median"] = float(np.median([v[0] for v in values]))
            best["cpu_s_per_gb_median"] = float(np.median([v[1] for v in values]))


def measure_cell(name: str, cell, c: int, s: int, latency: float, server) -> tuple:
    """``(GB/s, client CPU s/GB, server cores busy, mean requests in flight at the server)``."""
    server_cpu, started = process_cpu(server.process.pid), time.perf_counter()
    before = server.stats()["in_flight_seconds"]
    where = f"  {name:<14} latency {latency * 1e3:>3.0f} ms  {c:>4} x {s / MiB:>3g} MiB"
    try:
        rate, per_gb = cell(c, s)
    except Exception as exc:
        log(f"{where}  {error_text(exc)}")
        return None, None, None, None
    elapsed = time.perf_counter() - started
    cores = (process_cpu(server.process.pid) - server_cpu) / elapsed
    in_flight = (server.stats()["in_flight_seconds"] - before) / elapsed
    log(f"{where}  {rate:7.3f} GB/s  {per_gb:6.2f} CPU s/GB  server {cores:4.2f} cores  {in_flight:5.1f} in flight")
    return rate, per_gb, cores, in_flight


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` and its children (a server's forked
    event loops) have used (Linux /proc; 0 elsewhere)."""
    total = 0.0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure_cap(server, url: str, size: int, args) -> float:
    """The cap in bytes/s: --cap, or 60% of the uncapped loopback rate at 64 x 16 MiB."""
    if args.cap != "auto":
        try:
            return float(args.cap)
        except ValueError:
            return float(parse_size(args.cap))
    server.control(latency=0, bandwidth=0)
    uncapped, _ = fastload_cell(url, size, 64, 16 * MiB, max(0.5, args.min_seconds))
    log(f"  uncapped loopback: {uncapped:.3f} GB/s (fastload 64 x 16 MiB) -> cap {0.6 * uncapped:.3f} GB/s")
    return 0.6 * uncapped * 1e9


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "remote-data")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--size", default=None, help="object bytes, e.g. 1GiB [1GiB / 256MiB quick]")
    parser.add_argument("--latencies", type=float_list, default=[0.01, 0.05], help="seconds per request [0.01,0.05]")
    parser.add_argument("--cap", default="auto", help="bandwidth cap in bytes/s (1e9, 500M) or 'auto'")
    parser.add_argument("--concurrency", type=positive_int_list, default=None)
    parser.add_argument("--sizes", type=size_list, default=None, help="request sizes, e.g. 1MiB,4MiB,16MiB")
    parser.add_argument("--min-seconds", type=float, default=None)
    parser.add_argument("--batch", type=int, default=256, help="rows per batch in the loader epochs")
    parser.add_argument("--epochs", type=int, default=8, help="cache-hit and local epochs, taken in turns [8]")
    parser.add_argument(
        "--uncapped-from", type=int, default=UNCAPPED_FROM, help="fewest requests in flight in the uncapped grids [16]"
    )
    parser.add_argument("--skip-uncapped", action="store_true", help="only the capped grids")
    parser.add_argument("--skip-epochs", action="store_true", help="no cache-hit / local loader epochs")
    parser.add_argument(
        "--loader-concurrency",
        type=positive_int_list,
        default=None,
        help="requests in flight of the capped loader row [the --concurrency values from --uncapped-from up]",
    )
    parser.add_argument(
        "--loader-batch", type=parse_size, default=64 * MiB, help="bytes a batch in the capped loader row [64MiB]"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of each library's best uncapped cell, median judged [3]"
    )
    parser.add_argument(
        "--server-processes",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 4),
        help="the loopback server's event loops (processes): enough that it is not the limit [a quarter of the cores]",
    )
    parser.add_argument("--skip-boto3", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, code paths only")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    preset = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    args.size = parse_size(args.size) if args.size else preset["size"]
    args.concurrency = args.concurrency or preset["concurrency"]
    args.sizes = args.sizes or preset["sizes"]
    args.min_seconds = args.min_seconds or preset["min_seconds"]
    args.repeats = args.repeats or preset["repeats"]
    if args.cpu_smoke:
        args.latencies, args.batch, args.epochs = args.latencies[:1], 32, 1
    return args


def libraries_here(args, report: dict) -> list:
    """fastload, and boto3 / kvikio where they run (why not recorded in the report)."""
    libraries = ["fastload"]
    if args.skip_boto3:
        report["boto3_skipped"] = "--skip-boto3"
    else:
        try:
            import boto3  # noqa: F401

            libraries.append("boto3")
        except ImportError:
            report["boto3_skipped"] = "boto3 is not installed (pip install boto3)"
    from torch_fastload.remote.kvikio_backend import unavailable_reason

    report["kvikio_skipped"] = unavailable_reason()
    if not report["kvikio_skipped"]:
        libraries.append("kvikio")
    return libraries


def measure(server, args, report: dict, libraries: list, device) -> None:
    """The cap, the loader epochs, the capped then the uncapped grids at every latency: into
    ``report`` as they come (a run stopped early keeps what it measured)."""
    size, url = args.size, f"s3://{BUCKET}/{KEY}"
    cells = {
        "fastload": lambda c, s: fastload_cell(url, size, c, s, args.min_seconds),
        "boto3": lambda c, s: boto3_cell(server.endpoint, size, c, s, args.min_seconds),
        "kvikio": lambda c, s: fastload_cell(url, size, c, s, args.min_seconds, backend="kvikio"),
        "loader": lambda c, s: loader_cell(url, size, c, s, args.min_seconds, device, args.loader_batch),
    }
    report["cap_bps"] = measure_cap(server, url, size, args)
    if "boto3" in libraries:  # what boto3 moves here uncapped: its ceiling on this CPU
        rate, _ = boto3_cell(server.endpoint, size, 64, 16 * MiB, max(0.5, args.min_seconds))
        report["boto3_uncapped_gbps"] = rate
        log(f"  uncapped loopback: {rate:.3f} GB/s (boto3 64 x 16 MiB)")
    if not args.skip_epochs:
        report["epochs"] = loader_epochs(server, args.dir, args, device)
    uncapped = [c for c in args.concurrency if c >= args.uncapped_from] or args.concurrency[-1:]
    loader_rows = args.loader_concurrency or uncapped  # fewer requests in flight: latency-bound
    total = len(args.latencies) * len(args.sizes) * (len(libraries) * len(args.concurrency) + len(loader_rows))
    if not args.skip_uncapped:
        total += len(libraries) * len(args.latencies) * (len(uncapped) * len(args.sizes) + args.repeats)
    bar = Progress(total, "cells", enabled=not args.no_progress)
    server.control(bandwidth=report["cap_bps"])
    here = {lib: cells[lib] for lib in libraries}
    for lat in args.latencies:
        report["grids"]["loader"][str(lat)] = grids({"loader": cells["loader"]}, lat, server, args, bar, loader_rows)[
            "loader"
        ]
        for lib, result in grids(here, lat, server, args, bar).items():
            report["grids"].setdefault(lib, {})[str(lat)] = result
    if not args.skip_uncapped:
        server.control(bandwidth=0)
        for lat in args.latencies:
            results = grids(here, lat, server, args, bar, uncapped, "/nocap")
            confirm_best(results, here, lat, server, args, bar)
            for lib, result in results.items():
                report["uncapped"].setdefault(lib, {})[str(lat)] = result
    bar.close()


def _stop(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log(f"remote benchmark: {args.size / MiB:g} MiB object, latencies {args.latencies}, device {device}")
    make_data(args.dir, args.size)
    report = {
        "command": " ".join(sys.argv),
        "machine": machine_info(device.type == "cuda"),
        "size": args.size,
        "latencies": args.latencies,
        "concurrency": args.concurrency,
        "sizes": args.sizes,
        "min_seconds": args.min_seconds,
        "grids": {"fastload": {}, "loader": {}},
        "uncapped": {},
        "failures": [],
    }
    libraries = libraries_here(args, report)
    # fastload signs its requests like boto3 does (the server accepts any signature)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    report["server_processes"] = args.server_processes
    with (
        LoopbackServer(args.dir, processes=args.server_processes) as server,
        config.override(s3_endpoint_url=server.endpoint),
    ):
        remote.reset()
        signal.signal(signal.SIGTERM, _stop)  # timeout(1): what was measured is still reported
        try:
            measure(server, args, report, libraries, device)
        except (Exception, KeyboardInterrupt) as exc:
            report["failures"].append(error_text(exc) or type(exc).__name__)
            traceback.print_exc()
    report["verdicts"] = [{"check": c, "pass": p, "value": v} for c, p, v in verdicts(report)]
    report["seconds"] = time.perf_counter() - started
    print_report(report)
    write_json(args.out / "remote.json", report)
    plot(report, args.out / "remote.png")
    log(f"\nwrote {args.out / 'remote.json'} and remote.png; total time {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
