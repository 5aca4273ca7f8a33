"""The command line every benchmark shares: argparse types with the package's meaning of a
size (a bare number is bytes), one parent parser, one device rule, one way to pick defaults."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..config import parse_size


def _number_list(text: str, cast, noun: str, minimum, bound: str) -> list:
    try:
        values = [cast(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"expected {bound}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """'0,4,8': integers >= 0."""
    return _number_list(text, int, "integers", 0, "integers >= 0")


def positive_int_list(text: str) -> list[int]:
    """'1,2,4': integers >= 1."""
    return _number_list(text, int, "integers", 1, "positive integers")


def float_list(text: str) -> list[float]:
    """'0,1.5,2': numbers >= 0."""
    return _number_list(text, float, "numbers", 0, "numbers >= 0")


def size_arg(text: str) -> int:
    """'4194304', '4M', '4MiB', '256KiB': a positive byte count (torch_fastload.config.parse_size)."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 512MiB, 4MiB or 1GiB (K, M, G: binary), got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """'1MiB,4MiB,16MiB': positive byte counts."""
    values = [size_arg(v) for v in str(text).split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts, got {text!r}")
    return values


def study_parser(doc: str, out: Path) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes; ``doc`` is the script's docstring (its
    first paragraph is the description, the rest the epilog)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=out, help="directory for the JSON, PNG and data [%(default)s]")
    p.add_argument("--json", type=Path, default=None, help="the JSON's path [OUT/<benchmark>.json]")
    p.add_argument("--quick", action="store_true", help="a shorter run (on the CPU every run is tiny)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cuda | cuda:N | cpu")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    return p


def resolve_device(text: str) -> torch.device:
    """``auto`` (a GPU if there is one, else the CPU), ``cuda[:N]`` or ``cpu``; made current. A
    GPU without an index is the process's own: LOCAL_RANK under torchrun, else the current one."""
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {text}: CUDA is not available here (use --device cpu)")
        if device.index is None:
            local = os.environ.get("LOCAL_RANK")
            device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise SystemExit(f"--device must be cuda[:N] or cpu, got {text!r}")
    return device


def parse_study(parser: argparse.ArgumentParser, argv=None, **defaults) -> argparse.Namespace:
    """Parse, resolve ``--device`` and fill every option left at None from ``defaults``:
    ``name=(full, quick, cpu)``, the value for a full GPU run, a ``--quick`` one, and a CPU run
    (always tiny: the numbers only mean something on a GPU)."""
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    args.scale = "cpu" if args.device.type == "cpu" else ("quick" if args.quick else "full")
    column = {"full": 0, "quick": 1, "cpu": 2}[args.scale]
    for name, values in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, values[column])
    return args


def needs_cuda(args: argparse.Namespace, what: str) -> bool:
    """False (and why, on stderr) where ``args.device`` is not a GPU: ``what`` measures one."""
    if args.device.type == "cuda":
        return True
    sys.stderr.write(
        f"{what} needs CUDA (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
        f"available: {torch.cuda.is_available()}): nothing to measure on {args.device}.\n"
    )
    return False
