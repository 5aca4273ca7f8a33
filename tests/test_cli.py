"""The command line and the package's import: cheap until a name that needs torch is used."""

import subprocess
import sys


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_console_script_help_does_not_import_torch():
    out = run("import sys, torch_fastload.__main__ as m; m.main(['--help']); print('torch' in sys.modules)")
    assert "bench" in out and "doctor" in out and "pack" in out and out.strip().endswith("False")


def test_public_names_load_on_first_use_and_all_lists_them():
    out = run(
        "import sys, torch_fastload as t\n"
        "print('torch' in sys.modules, sorted(t.__all__) == sorted([*t._EXPORTS, 'config', '__version__']))\n"
        "from torch_fastload import DataLoader, ArrayDataset\n"
        "print('torch' in sys.modules, DataLoader.__module__, t.engine.__name__, t.__version__)"
    )
    first, second = out.splitlines()
    assert first == "False True"
    assert second.startswith("True torch_fastload.loader torch_fastload.engine ")


def test_an_unknown_name_is_an_attribute_error():
    out = run("import torch_fastload as t\ntry:\n    t.no_such_thing\nexcept AttributeError as e:\n    print(e)")
    assert "has no attribute 'no_such_thing'" in out


def test_sizes_in_help_are_binary_units_and_parse_as_such():
    """Byte sizes in the commands' help say KiB/MiB/GiB (no '4M' or '4 MB' meaning MiB), and every
    spelling parses to binary multiples (issue 19)."""
    import re

    from torch_fastload import bench, config
    from torch_fastload.doctor.cli import build_parser as doctor_parser

    pack_help = subprocess.run(
        [sys.executable, "-m", "torch_fastload", "pack", "--help"], capture_output=True, text=True
    ).stdout
    assert "usage" in pack_help
    for text in (doctor_parser().format_help(), pack_help, bench.build_parser().format_help()):
        assert not re.search(r"\b\d+ ?[KMGT]B\b", text), text  # '4 MB', '4MB'
        assert not re.search(r"\b\d+[KMGT]\b(?!iB)", text.replace("512M = 512MiB", "")), text  # '4M'
    assert "[256KiB,1MiB,4MiB,16MiB / 1MiB,4MiB]" in " ".join(doctor_parser().format_help().split())
    for text in ("4194304", "4M", "4MB", "4 mb", "4MiB", "4 mib"):
        assert config.parse_size(text) == 4 << 20, text
    assert config.parse_size("1GiB") == config.parse_size("1G") == 1 << 30
