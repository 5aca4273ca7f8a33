"""``doctor --url URL``: time remote reads of one object instead of the local input path.

The sweep itself (concurrency x request size, the recommended ``remote_concurrency`` /
``remote_request_size``) is ``torch_fastload/remote/sweep.py``; this is the doctor's hook to it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="time remote reads of this s3:// or http(s):// object instead (concurrency x request size) "
        "and recommend remote_concurrency / remote_request_size",
    )


def run(args: argparse.Namespace) -> int:
    """The remote sweep, printed (and with ``--save`` / ``--json`` recorded). Exit code."""
    from torch_fastload.remote import sweep as remote_sweep

    return remote_sweep.run(args.url, quick=args.quick, json_path=args.json, do_save=args.save)
