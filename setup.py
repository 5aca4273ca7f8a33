"""Builds csrc/*.cpp as ``torch_fastload._C`` with pybind11 (the package's metadata is in
pyproject.toml; this file only describes the optional C++ extension).

No torch headers are used, so ``pip install .`` works in an isolated build environment.
Where jpeglib.h and -ljpeg are found (libjpeg-turbo's dev package), the batched CPU JPEG
decoder is built in (``_C.HAVE_LIBJPEG``).
``TORCH_FASTLOAD_ASAN=1`` builds with AddressSanitizer (used by tests/test_engine.py's fuzz test).
"""

import glob
import os
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

compile_args = ["-O3", "-pthread", "-Wall", "-Wextra"]
link_args = ["-pthread"]
if os.environ.get("TORCH_FASTLOAD_ASAN", "") not in ("", "0"):
    compile_args += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
    link_args += ["-fsanitize=address"]


def _libjpeg_builds() -> bool:
    """Whether a program including jpeglib.h links with -ljpeg here (TORCH_FASTLOAD_LIBJPEG=0/1
    forces it). Without it the batched CPU JPEG decoder is left out and Python threads decode."""
    forced = os.environ.get("TORCH_FASTLOAD_LIBJPEG", "")
    if forced in ("0", "1"):
        return forced == "1"
    import subprocess
    import tempfile

    program = (
        "#include <stdio.h>\n#include <jpeglib.h>\n"
        "int main(void) { struct jpeg_error_mgr e; jpeg_std_error(&e); return 0; }\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write(program)
        try:
            result = subprocess.run(
                [os.environ.get("CC", "cc"), source, "-ljpeg", "-o", os.path.join(tmp, "probe")], capture_output=True
            )
        except OSError:
            return False
        return result.returncode == 0


class OptionalBuildExt(build_ext):
    """The C++ engine is optional: without a compiler (or with a failing build) the package still
    installs, runs on its pure-Python fallbacks, and says so here and at run time
    (``python -m torch_fastload doctor``, ``loader.io``)."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all: distutils' CompileError / DistutilsPlatformError
            _missing_engine(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            _missing_engine(exc)


def _missing_engine(exc: Exception) -> None:
    print(
        "\n*** torch_fastload: the C++ engine (torch_fastload._C) was NOT built: "
        f"{type(exc).__name__}: {exc}\n"
        "*** The package works without it, slower: file reads go through os.pread, staging through\n"
        "*** numpy copies, the GIL-free native loop and the C++ JPEG decoder are off. Install a C++17\n"
        "*** compiler (g++ >= 9) and reinstall to get them.\n",
        file=sys.stderr,
    )


define_macros, libraries = [], []
if _libjpeg_builds():
    define_macros.append(("TFL_WITH_LIBJPEG", "1"))
    libraries.append("jpeg")
else:
    print(
        "*** torch_fastload: jpeglib.h / -ljpeg not found: the batched C++ JPEG decoder is left out; JPEGs\n"
        "*** decoded on the CPU go through PIL, ~2-3x slower per image (nvJPEG on the GPU is unaffected).\n"
        "*** Install libjpeg-turbo's development package (libjpeg-turbo8-dev / libjpeg62-turbo-dev) to add it.",
        file=sys.stderr,
    )

ext_modules = [
    Pybind11Extension(
        "torch_fastload._C",
        # Relative paths: setuptools refuses absolute source paths in sdists.
        sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp"))),
        include_dirs=["csrc"],
        depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),
        cxx_std=17,
        define_macros=define_macros,
        libraries=libraries,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
]

# Metadata lives in pyproject.toml; this file only describes the optional extension.
setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
