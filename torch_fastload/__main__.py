"""``torch-fastload <command> [args]`` (or ``python -m torch_fastload``): the command line.

Importing this module does not import torch (the package's names load lazily), so ``--help``
answers at once; a command's module is imported only when it runs.

Commands are looked up in ``COMMANDS`` (name -> (module, one-line help)); each module has a
``main(argv, prog)`` returning an exit code, so new ones (``doctor``, ...) are one line here.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("torch_fastload.packing", "pack an image folder or a folder of files into record shards"),
    "bench": (
        "torch_fastload.bench",
        "torch DataLoader vs torch_fastload on a generated dataset (samples/s, input wait, GB/s)",
    ),
    "doctor": (
        "torch_fastload.doctor",
        "measure GPU link, H2D, GDS, storage and the I/O engine; --save the best settings",
    ),
}


def _prog() -> str:
    name = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else ""
    return "torch-fastload" if name == "torch-fastload" else "python -m torch_fastload"


def usage() -> str:
    lines = [f"usage: {_prog()} <command> [args]   (<command> --help for its options)", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{_prog()}: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest, prog=f"{_prog()} {name}") or 0)


if __name__ == "__main__":
    sys.exit(main())
