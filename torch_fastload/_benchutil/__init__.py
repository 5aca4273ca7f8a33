"""The harness every benchmark runs on (``python -m torch_fastload.bench``, ``doctor`` and the
studies under ``benchmarks/``): one command line, one machine record, the link and disk
baselines, page-cache residency, timing helpers and one report. Private: no API promise."""

from .args import (
    float_list,
    int_list,
    needs_cuda,
    parse_study,
    positive_int_list,
    resolve_device,
    size_arg,
    size_list,
    study_parser,
)
from .baselines import disk_baseline, link_baseline
from .files import (
    PAGE,
    aligned_empty,
    drop_page_cache,
    fsync_file,
    random_npy,
    residency,
    residency_of,
    warm_page_cache,
    write_random,
)
from .machine import cpu_affinity, cpu_seconds, git_state, machine_basics, machine_info, run_quiet
from .output import GiB, KiB, MiB, Progress, error_text, fmt, fmt_size, gbps, log, pyplot, ratio, table, write_json
from .report import Study
from .timing import CudaSleeper, InflightWindow, empty_host_cache, gemm_seconds, h2d_copy_seconds, sync

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "PAGE",
    "log",
    "error_text",
    "fmt",
    "fmt_size",
    "gbps",
    "ratio",
    "table",
    "Progress",
    "write_json",
    "pyplot",
    "int_list",
    "positive_int_list",
    "float_list",
    "size_arg",
    "size_list",
    "study_parser",
    "parse_study",
    "resolve_device",
    "needs_cuda",
    "run_quiet",
    "cpu_affinity",
    "machine_basics",
    "git_state",
    "machine_info",
    "cpu_seconds",
    "sync",
    "h2d_copy_seconds",
    "gemm_seconds",
    "empty_host_cache",
    "CudaSleeper",
    "InflightWindow",
    "link_baseline",
    "disk_baseline",
    "drop_page_cache",
    "warm_page_cache",
    "fsync_file",
    "residency",
    "residency_of",
    "write_random",
    "random_npy",
    "aligned_empty",
    "Study",
]
