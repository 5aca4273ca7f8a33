"""``python -m torch_fastload doctor``: what this machine's input path can do, measured.

    python -m torch_fastload doctor                    # ~1 min: GPU, H2D, GDS, storage, sweep
    python -m torch_fastload doctor --quick            # smaller file and sweep
    python -m torch_fastload doctor --dir /data --save # measure the data disk; record the best
                                                       # io_threads / io_task_size for the loader
    python -m torch_fastload doctor --url s3://b/k     # remote reads instead (remote/sweep.py)

Sections, each measured by one function returning a dict and printed by ``render``:

    gpu       name, memory, driver, PCIe link (current / max) via pynvml or nvidia-smi  (gpu.py)
    h2d       pinned and pageable host -> device copies (CUDA events, median of 5)     (gpu.py)
    gds       kvikio / cuFile status and the read path io_mode='auto' picks here       (gpu.py)
    storage   a test file in --dir: write + fsync, cold O_DIRECT, cold buffered, hot    (storage.py)
              reads; the filesystem and block device under it
    sweep     the C++ engine's threads x task size on the page-cached test file (file  (sweep.py)
              -> GPU through the engine's pinned ring where CUDA is available), and the
              recommended setting

Every section fails soft: an exception prints ``<section>: failed: <Type: message>`` and the
report goes on (``render.py``). ``--save`` writes the recommended setting to
``config.tuning_file()``, which ``config.get('io_threads')`` / ``config.get('io_task_size')``
then use unless an override or TORCH_FASTLOAD_NUM_THREADS / TORCH_FASTLOAD_TASK_SIZE says
otherwise. The test file never outlives the run (``storage.scratch_file``). Exit code: 0, or 2
for bad arguments (``cli.py``).
"""

from __future__ import annotations

from .cli import build_parser, main
from .common import NEAR_BEST
from .gpu import gds_info, gpu_info, measure_h2d
from .render import render
from .storage import filesystem_of, measure_storage, scratch_file, write_test_file
from .sweep import recommend, save_tuning, sweep

__all__ = [
    "main",
    "build_parser",
    "gpu_info",
    "measure_h2d",
    "gds_info",
    "measure_storage",
    "filesystem_of",
    "write_test_file",
    "scratch_file",
    "sweep",
    "recommend",
    "save_tuning",
    "render",
    "NEAR_BEST",
]
