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
            if ext.name == "torch_fastload._arrow":
                print(
                    f"\n*** torch_fastload: the Parquet decode arena (torch_fastload._arrow) was NOT built: {exc}\n"
                    "*** Parquet batches are staged through a pinned slot instead (one more host copy).\n",
                    file=sys.stderr,
                )
            else:
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


def _arrow_extension():
    """``torch_fastload._arrow`` (csrc/arrow/): Parquet decoded by pyarrow's C++ into a pinned
    arena, built against the pyarrow found here (its wheel ships headers and libraries) and tied
    to that pyarrow version; None where pyarrow is not importable at build time (an isolated
    build: ``pip install --no-build-isolation .`` or ``setup.py build_ext --inplace`` builds it;
    TORCH_FASTLOAD_ARROW=0 leaves it out). Without it the Parquet source stages through a slot."""
    if os.environ.get("TORCH_FASTLOAD_ARROW", "") == "0":
        return None
    try:
        import pyarrow as pa
    except ImportError:
        print(
            "*** torch_fastload: pyarrow is not importable here: the Parquet decode arena (_arrow) is not built",
            file=sys.stderr,
        )
        return None
    libdir = pa.get_library_dirs()[0]
    libs = []
    for name in ("arrow", "parquet", "arrow_python"):
        found = sorted(
            (
                p
                for p in glob.glob(os.path.join(libdir, f"lib{name}.so.*"))
                if p.count(".so.") == 1 and p.rsplit(".so.", 1)[1].isdigit()
            ),
            key=len,
        )
        if not found:
            print(f"*** torch_fastload: lib{name}.so.* not found in {libdir}: _arrow is not built", file=sys.stderr)
            return None
        libs.append("-l:" + os.path.basename(found[0]))
    return Pybind11Extension(
        "torch_fastload._arrow",
        [os.path.join("csrc", "arrow", "arrow_decode.cpp"), os.path.join("csrc", "arrow", "page_decode.cpp")],
        include_dirs=[pa.get_include()],
        cxx_std=20,
        extra_compile_args=["-O2", "-pthread"],
        extra_link_args=["-pthread", f"-L{libdir}", *libs, f"-Wl,-rpath,{libdir}"],
    )


if (_arrow := _arrow_extension()) is not None:
    ext_modules.append(_arrow)

# Metadata lives in pyproject.toml; this file only describes the optional extension.
setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
