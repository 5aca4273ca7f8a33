"""Install like a user: the wheel built from the sdist, and a build with no C++ compiler (the
package installs, says what is missing, and runs on its Python fallbacks). Each installs into
a private directory used in a child process started outside the checkout, so the source tree
is never imported by mistake."""

import os
import site
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import build, wheel, pybind11"], capture_output=True).returncode != 0,
    reason="needs the 'build', 'wheel' and 'pybind11' packages (pip install -e '.[test]')",
)

SMOKE = r"""
import sys, numpy as np, torch, torch_fastload
from torch_fastload import ArrayDataset, DataLoader, engine
assert torch_fastload.__file__.startswith(sys.argv[1]), torch_fastload.__file__
np.save(sys.argv[2] + "/x.npy", np.arange(60, dtype=np.float32).reshape(20, 3))
loader = DataLoader(ArrayDataset(sys.argv[2] + "/x.npy"), batch_size=8, device="cpu")
got = torch.cat(list(loader))
assert torch.equal(got, torch.arange(60, dtype=torch.float32).reshape(20, 3))
print("engine", engine.available(), "io", loader.io)
"""


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


def install_and_smoke(wheel_dir: str, tmp_path, env=None) -> str:
    wheels = [os.path.join(wheel_dir, f) for f in os.listdir(wheel_dir) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    target = str(tmp_path / "site")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheels[0]])
    work = tmp_path / "work"
    work.mkdir()
    # -S: no .pth files, so a development install's import hook cannot hand out the checkout's
    # modules; the environment's packages (torch, numpy) come after the installed copy instead.
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([target, *site.getsitepackages()]), **(env or {}))
    return run([sys.executable, "-S", "-c", SMOKE, target, str(work)], cwd=str(work), env=child_env).stdout


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> str:
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), ROOT])
    return str(next(dist.glob("torch_fastload-*.tar.gz")))


def test_wheel_built_from_the_sdist_installs_and_runs_with_the_engine(sdist, tmp_path):
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    for needed in (
        "LICENSE",
        "pyproject.toml",
        "csrc/native_loop.cpp",
        "tests/conftest.py",
        "tests/resume_harness.py",
        "torch_fastload/py.typed",
        "docs/architecture.md",
    ):
        assert f"{top}/{needed}" in names, f"the sdist lacks {needed}"
    wheels = tmp_path / "wheels"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-cache-dir",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(sdist),
        ]
    )
    out = install_and_smoke(str(wheels), tmp_path)
    assert "engine True" in out, out


def test_without_a_compiler_the_package_installs_says_what_is_missing_and_works(sdist, tmp_path):
    wheels = tmp_path / "wheels"
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false", LDSHARED="/bin/false")  # no compiler, no linker
    result = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-cache-dir",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            sdist,
        ],
        env=env,
    )
    assert "the C++ engine (torch_fastload._C) was NOT built" in result.stdout + result.stderr
    out = install_and_smoke(str(wheels), tmp_path)
    assert "engine False" in out and "python-posix" in out, out
    assert "not built" in out, out  # loader.io says why the Python reader runs
