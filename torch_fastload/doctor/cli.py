"""``python -m torch_fastload doctor``'s command line: arguments, the sections in order, the
tuning file (``--save``) and the JSON record (``--json``)."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from torch_fastload import config, engine
from torch_fastload._benchutil import log, machine_basics, size_arg, write_json
from torch_fastload.extension import status as extension_status

from . import remote
from .common import GiB, KiB, MiB, error_text
from .render import render
from .storage import scratch_file

__all__ = ["build_parser", "main"]


def _positive_ints(text: str) -> list[int]:
    """'1,2,4': integers >= 1."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    """'1MiB,4MiB,16MiB': positive byte counts."""
    values = [size_arg(v) for v in str(text).split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts, got {text!r}")
    return values


def parquet_arena_status() -> str | None:
    """Whether Parquet rows delivered to a GPU decode into the pinned arena (torch_fastload._arrow),
    or why not and how to get it; None where pyarrow is not installed (no Parquet source)."""
    try:
        from ..sources import parquet_arena
    except ImportError:
        return None
    reason = parquet_arena.unavailable_reason()
    if reason is None:
        return "built (rows delivered to a GPU decode into pinned memory)"
    return (
        f"NOT available ({reason}): Parquet batches are staged through a pinned slot (one more host "
        "copy). To build it against the installed pyarrow: pip install --no-build-isolation --no-deps ."
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "python -m torch_fastload doctor",
        description="Measure this machine's input path (GPU link, H2D copies, GDS, storage, the C++ "
        "engine's threads x task size) and recommend io_threads / io_task_size. "
        "Defaults in [brackets] are full / --quick.",
    )
    p.add_argument(
        "--dir",
        default=tempfile.gettempdir(),
        help="directory whose filesystem to test, e.g. the data disk; the test file written there is "
        "unlinked as soon as it is created, so no exit leaves it [the temporary directory: $TMPDIR or /tmp]",
    )
    p.add_argument(
        "--size",
        type=size_arg,
        default=None,
        help="test file size (binary: 512M = 512MiB), e.g. 512MiB, 1GiB [1GiB / 256MiB]",
    )
    p.add_argument("--h2d-size", type=size_arg, default=None, help="bytes per H2D copy [256MiB / 64MiB]")
    p.add_argument(
        "--threads",
        type=_positive_ints,
        default=None,
        help="sweep thread counts, comma-separated [1,2,4,8,16,32 / 1,4,16]",
    )
    p.add_argument(
        "--tasks",
        type=_sizes,
        default=None,
        help="sweep task sizes, comma-separated [256KiB,1MiB,4MiB,16MiB / 1MiB,4MiB]",
    )
    p.add_argument("--quick", action="store_true", help="smaller file, copies and sweep")
    p.add_argument(
        "--save",
        action="store_true",
        help=f"write the recommended io_threads / io_task_size to the tuning file "
        f"(TORCH_FASTLOAD_TUNING_FILE, now {config.tuning_file()})",
    )
    remote.add_arguments(p)
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not a directory")
    if any(t > engine.MAX_THREADS for t in args.threads or []):
        parser.error(f"--threads must be at most {engine.MAX_THREADS}, got {args.threads}")
    return args


@dataclass
class Plan:
    """What the sections measure: the arguments with the full or ``--quick`` defaults filled in."""

    directory: str
    size: int
    h2d_size: int
    threads: list
    tasks: list
    min_seconds: float  # each sweep cell is timed at least this long
    progress: bool
    save: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        quick = args.quick
        return cls(
            directory=args.dir,
            size=args.size or (256 * MiB if quick else GiB),
            h2d_size=args.h2d_size or (64 * MiB if quick else 256 * MiB),
            threads=args.threads or ([1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]),
            tasks=args.tasks or ([MiB, 4 * MiB] if quick else [256 * KiB, MiB, 4 * MiB, 16 * MiB]),
            min_seconds=0.1 if quick else 0.3,
            progress=args.progress,
            save=args.save,
        )


def _section(fn: Callable[..., dict], *args, **kwargs) -> dict:
    """``fn(*args)``, or ``{"error": "Type: message"}``: one section never ends the report."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"error": error_text(exc)}


def _measure(plan: Plan) -> dict:
    """Every section, each printed as it finishes."""
    # the sections are looked up on the package: one replaced there (a test) is the one that runs
    from torch_fastload import doctor

    results: dict = {}

    def run(name: str, fn: Callable[..., dict], *fn_args) -> None:
        results[name] = _section(fn, *fn_args)
        render(name, results[name], results)

    run("gpu", doctor.gpu_info)
    run("h2d", doctor.measure_h2d, plan.h2d_size)
    run("gds", doctor.gds_info)
    with scratch_file(plan.directory) as path:
        run("storage", doctor.measure_storage, path, plan.size, plan.directory)
        run("sweep", doctor.sweep, path, plan.size, plan.threads, plan.tasks, plan.min_seconds, plan.progress)
    if plan.save:
        recommended = results["sweep"].get("recommended")
        if recommended:
            run("save", doctor.save_tuning, recommended, dict(results))
        else:
            results["save"] = {"skipped": "the sweep failed, so there is nothing to record"}
            render("save", results["save"], results)
    return results


def _write_report(path: Path, results: dict, args: argparse.Namespace) -> None:
    try:
        write_json(
            path,
            {
                **results,
                "machine": {**machine_basics(), "cuda_available": torch.cuda.is_available()},
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            },
        )
        log(f"\nwrote {path}")
    except Exception as exc:
        log(f"\njson: failed: {error_text(exc)}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Exit code: 0, or 2 for bad arguments."""
    parser = build_parser(prog)
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # argparse: 2 for bad arguments, 0 for --help
        return int(exc.code or 0)
    if args.url:
        return remote.run(args)
    extension = extension_status()
    log(f"torch_fastload doctor: torch {torch.__version__}, C++ extension {extension.short()}, {os.cpu_count()} CPUs")
    for line in extension.missing():
        log(f"  missing: {line}")
    arena = parquet_arena_status()
    if arena is not None:
        log(f"  Parquet decode arena: {arena}")
    results = {"extension": extension.as_dict(), "parquet_arena": arena, **_measure(Plan.of(args))}
    if args.json:
        _write_report(args.json, results, args)
    return 0
