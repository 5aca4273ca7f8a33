"""Builds csrc/*.cpp as ``torch_fastload._C`` with pybind11.

No torch headers are used, so ``pip install .`` works in an isolated build environment.
Where jpeglib.h and -ljpeg are found (libjpeg-turbo's dev package), the batched CPU JPEG
decoder is built in (``_C.HAVE_LIBJPEG``).
``TORCH_FASTLOAD_ASAN=1`` builds with AddressSanitizer (used by tests/test_engine.py's fuzz test).
"""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

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


define_macros, libraries = [], []
if _libjpeg_builds():
    define_macros.append(("TFL_WITH_LIBJPEG", "1"))
    libraries.append("jpeg")

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

setup(
    name="torch_fastload",
    version="0.1.0",
    description="A PyTorch DataLoader extension whose training loop never waits for input",
    packages=find_packages(include=["torch_fastload", "torch_fastload.*"]),
    package_data={"torch_fastload.vision": ["photos/*.jpg", "photos/README.md"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "test": [
            "pytest",
            "tqdm",
            "psutil",
            "pybind11>=2.10",
            "setuptools>=64",
            "matplotlib",
            "torchvision",
            "pillow",
            "torch_geometric",
            "moto[server]",  # tests/test_remote_s3.py: a loopback S3 server checking SigV4
            "boto3",
        ],
        "bench": ["matplotlib", "tqdm", "boto3"],  # boto3: benchmarks/remote.py's baseline
        "remote": ["botocore"],  # the AWS credential chain (config files, SSO, roles) for s3:// URLs
        "vision": ["torchvision", "pillow"],
        "gnn": ["torch_geometric", "tqdm"],
    },
    zip_safe=False,
)
