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
