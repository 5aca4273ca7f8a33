"""Loader defaults, overridable by TORCH_FASTLOAD_* environment variables and a context manager.

Constructor arguments default to ``None``, meaning "use the configured default"; values are
validated when they are read so a bad setting fails loudly with the value in the message.

Where a value comes from, first match wins: ``override()`` / ``set()``, the environment, the
tuning file that ``python -m torch_fastload doctor --save`` writes (I/O threads and task size
measured on this machine; ``TORCH_FASTLOAD_TUNING_FILE``, default
``$XDG_CACHE_HOME/torch_fastload/tuning.json``, ``~/.cache/...`` by default), the built-in default.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from . import fileio

__all__ = ["get", "set", "override", "describe", "resolve", "source", "tuning_file", "parse_size", "OPTIONS"]


def _int_at_least(minimum: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        try:
            as_int = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"torch_fastload option {name!r} must be an integer, got {value!r}") from None
        if as_int < minimum or as_int != float(value):
            raise ValueError(f"torch_fastload option {name!r} must be an integer >= {minimum}, got {value!r}")
        return as_int

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _int_between(minimum: int, maximum: int) -> Callable[[str, Any], int]:
    at_least = _int_at_least(minimum)

    def parse(name: str, value: Any) -> int:
        try:
            as_int = at_least(name, value)
        except ValueError:
            as_int = None
        if as_int is None or as_int > maximum:
            raise ValueError(
                f"torch_fastload option {name!r} must be an integer in [{minimum}, {maximum}], got {value!r}"
            ) from None
        return as_int

    return parse


def parse_size(text: str) -> int:
    """``'4194304'``, ``'4MiB'``, ``'4M'`` or ``'4 mb'`` -> bytes. Always binary: K, M, G, T (with or
    without B or iB) are 2**10, 2**20, 2**30, 2**40, so '4MB' is 4 MiB (4,194,304 bytes), never 4,000,000."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a byte count: {text!r}")
    return int(match.group(1)) << (10 * " kmgt".index((match.group(2) or " ").lower()))


def _byte_size(name: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError:
            raise ValueError(
                f"torch_fastload option {name!r} must be a byte count such as 4194304 or 4MiB, got {value!r}"
            ) from None
    return _positive_int(name, value)


def _byte_size_or_zero(name: str, value: Any) -> int:
    return 0 if value in (0, "0") else _byte_size(name, value)


def physical_memory() -> int:
    """Bytes of RAM (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _size_or_share_of_ram(name: str, value: Any) -> int:
    """A byte count (``0`` disables), or a share of physical memory such as ``'25%'``."""
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share <= 100:
            raise ValueError(
                f"torch_fastload option {name!r} must be a byte count or a percentage of RAM, got {value!r}"
            )
        return int(physical_memory() * share / 100)
    if text == "0":
        return 0
    return _byte_size(name, value)


def _float_within(name: str, value: Any, accepts: Callable[[float], bool], number: str, within: str) -> float:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"torch_fastload option {name!r} must be {number}, got {value!r}") from None
    if not accepts(as_float):
        raise ValueError(f"torch_fastload option {name!r} must be {within}, got {value!r}")
    return as_float


def _positive_float(name: str, value: Any) -> float:
    """A finite number > 0 (inf and nan are refused here, not by the first wait that uses them)."""
    return _float_within(name, value, lambda v: math.isfinite(v) and v > 0, "a number", "a finite number > 0")


def _share_or_word(name: str, value: Any):
    if isinstance(value, str) and value.strip().lower() in ("auto", "steal"):
        return value.strip().lower()
    return _float_within(name, value, lambda v: 0 <= v <= 1, "a number in [0, 1], 'auto' or 'steal'", "in [0, 1]")


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"torch_fastload option {name!r} must be a boolean (1/0, true/false), got {value!r}")


def _bool_or_auto(name: str, value: Any) -> bool | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return _bool(name, value)
    except ValueError:
        raise ValueError(f"torch_fastload option {name!r} must be auto, 1/0 or true/false, got {value!r}") from None


def _text(name: str, value: Any) -> str:
    return "" if value is None else str(value).strip()


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ValueError(f"torch_fastload option {name!r} must be one of {choices}, got {value!r}")
        return text

    return parse


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    help: str
    env_name: str | None = None  # where the variable is not TORCH_FASTLOAD_<NAME>
    env_aliases: tuple = ()  # older variable names still read (with a DeprecationWarning)
    tunable: bool = False  # ``doctor --save`` may record a measured value

    @property
    def env(self) -> str:
        return self.env_name or "TORCH_FASTLOAD_" + self.name.upper()


def cpus_per_process() -> int:
    """Usable CPUs (affinity) over the processes on this node: DDP runs one process per GPU
    (torchrun sets ``LOCAL_WORLD_SIZE``), and more threads than cores only add contention."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cpus // local)


# image_batches_staged's default (H100, loader alone, 4,000 JPEGs, shares 0 / 0.25: 2 at once
# 14.6k / 14.0k images/s, 3 at once 18.6k / 21.6k; benchmarks/gpu/split_probe.py)
IMAGE_BATCHES_STAGED = 3


def _default_stage_threads() -> int:
    # The pageable -> pinned memcpy is the CPU bottleneck; 8 threads reach ~40 GB/s on the
    # reference machine, more mostly burns cores.
    return max(1, min(8, (os.cpu_count() or 2)))


OPTIONS: dict[str, Option] = {
    opt.name: opt
    for opt in (
        Option(
            "prefetch",
            2,
            _non_negative_int,
            "batches fetched (and staged) ahead of the training step beyond torch's own read-ahead "
            "(none without workers, prefetch_factor x num_workers with them); 0: exactly torch's",
        ),
        Option(
            "stage_threads",
            _default_stage_threads(),
            _positive_int,
            "threads that copy a batch from pageable memory into its pinned slot",
        ),
        Option(
            "nontemporal",
            True,
            _bool,
            "stage with non-temporal stores (the slot is read by DMA, not the CPU; C++ engine only)",
        ),
        Option(
            "fetch_threads",
            1,
            _positive_int,
            "threads running per-sample Python when num_workers == 0 (map-style datasets)",
        ),
        Option("pool_slots", 3, _positive_int, "pinned staging slots in the pool"),
        Option("slot_bytes", 0, _non_negative_int, "bytes per pinned slot; 0 sizes slots exactly from the first batch"),
        Option(
            "oversize",
            "grow",
            _choice("grow", "error"),
            "a batch larger than a slot: 'grow' re-sizes the pool (counted in stats), 'error' raises",
        ),
        Option(
            "io_mode",
            "auto",
            _choice("auto", "gds", "pinned", "posix"),
            "file reads: 'gds' (kvikio into GPU memory), 'pinned' (kvikio or the engine into the pinned "
            "pool), 'posix' (the C++ engine into the pinned pool), 'auto' (gds where usable, else posix)",
        ),
        Option("o_direct", False, _bool, "the C++ engine reads with O_DIRECT (bypasses the page cache)"),
        Option(
            "io_threads",
            16,
            _int_between(1, 256),
            "threads per batched file read (C++ engine, kvikio)",
            env_aliases=("TORCH_FASTLOAD_NUM_THREADS",),
            tunable=True,
        ),
        Option(
            "io_task_size",
            4 << 20,
            _byte_size,
            "bytes per read task (reads are sliced and coalesced to it)",
            env_aliases=("TORCH_FASTLOAD_TASK_SIZE",),
            tunable=True,
        ),
        Option(
            "map_budget",
            "25%",
            _size_or_share_of_ram,
            "page cache the engine may pin by mapping files that are already resident and letting the "
            "GPU copy from them directly (no CPU copy); a byte count, a share of RAM, or 0 to never map",
        ),
        Option(
            "cpu_decode_share",
            "auto",
            _share_or_word,
            "share of each batch's GPU-decodable JPEGs decoded on the CPU instead of nvJPEG (DALI's "
            "hw_decoder_load turned around; 1: all of them); 'auto': from the 9th batch ~15 time every JPEG "
            "on the C++ decoder, which keeps them if the training loop waited < 10% of its step at its GPU's "
            "pace; else ~15 "
            "more time the GPU's hardware JPEG engines (with trial_engines) and ~15 nvJPEG, and the CPU must "
            "be 5% faster to stay, then ~15 more time each GPU route and the CPU at once, each batch split in "
            "the ratio of their rates, then nvJPEG's split at half that CPU share (the two slow each other at "
            "once) (where the engines and nvJPEG both work: the CPU, the engines and nvJPEG at once, then the "
            "CPU and nvJPEG), kept if fastest (balance_split: a split started at once and balanced online "
            "instead; nvJPEG alone below 8 CPUs per process); 'steal': both split each batch by work stealing. "
            "RESULTS.md",
        ),
        Option(
            "decode_backend",
            "auto",
            _choice("auto", "nvjpeg", "nvimgcodec", "torchvision", "hardware"),
            "the library that decodes JPEGs on the GPU: 'nvjpeg' (nvJPEG called directly: batched on the GPU's "
            "hardware JPEG engines, states pooled across stage threads, no host wait; the libnvjpeg torchvision ships "
            "or nvidia-nvjpeg's; faster alone, not faster in the loader or beside a step), 'nvimgcodec' (NVIDIA "
            "nvImageCodec: batched, the hardware JPEG engines; pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg), "
            "'torchvision' (its nvJPEG decode_jpeg, deprecated from 0.29: one batch at a time a process), "
            "'hardware' (nvImageCodec's hardware JPEG engines alone, no CUDA cores: what they refuse goes to the "
            "CPU), 'auto' (torchvision while it offers nvJPEG, measured faster; else nvImageCodec where it "
            "imports and decodes; cpu_decode_share='auto' also times the hardware engines where they work). "
            "RESULTS.md",
        ),
        Option(
            "balance_split",
            False,
            _bool,
            "cpu_decode_share='auto': once the routes alone were timed, split each batch between the CPU and the "
            "GPU at once (no split windows) and move its CPU share online to where both decoders stay equally "
            "busy. Off by default: on an H100 the loader alone fed 12-15% less that way (14.7-15.3k images/s at "
            "share ~0.31 against 16.6-18.1k at the windowed trial's 0.16: the two decoders slow each other, "
            "so equal busy time overloads the CPU); beside a ResNet-18 step it kept shares 0.35-0.59 and fed "
            "25.6-31.7 ms a step, where the windows sometimes keep nvJPEG alone (32.2 ms on one instance). "
            "RESULTS.md",
        ),
        Option(
            "trial_engines",
            False,
            _bool,
            "cpu_decode_share='auto' with decode_backend='auto' also times the GPU's hardware JPEG engines "
            "(nvImageCodec) alone and in a three-way split; off by default: beside a training step (H200, "
            "ResNet-18) the trial never kept them, and their two windows lengthen it from ~70 to ~100 batches "
            "(one, ~38 to ~55, with balance_split). RESULTS.md",
        ),
        Option(
            "engine_decode_share",
            0.0,
            lambda name, value: _float_within(name, value, lambda v: 0 <= v <= 1, "a number in [0, 1]", "in [0, 1]"),
            "with a numeric cpu_decode_share (decode_backend other than 'hardware'): the share of each batch's "
            "GPU-decodable JPEGs decoded on the GPU's hardware JPEG engines while nvJPEG decodes the rest, all at "
            "once (a three-way split beside the CPU's share; its sum with cpu_decode_share at most 1; baseline "
            "JPEGs only); 0: none",
        ),
        Option(
            "image_batches_staged",
            IMAGE_BATCHES_STAGED,
            _positive_int,
            "image batches decoded at once on the loader's stage threads (at most prefetch + 1 take effect, "
            "at least 2): a batch's decode is serial (header probe, nvJPEG's host call, the CPU decoders' share, "
            "the transform kernel), so with two at once a CPU share left nvJPEG idle. RESULTS.md",
        ),
        Option(
            "cpu_decode_threads",
            0,
            _non_negative_int,
            "threads decoding images on the CPU (the C++ decoder's and Python's, at nice +10); "
            "0 = CPUs - 4 when every JPEG may go to the CPU ('auto', 1), else min(8, CPUs); CPUs per process",
        ),
        Option(
            "cpu_decode_regions",
            True,
            _bool,
            "the C++ decoder decodes only the rows and columns each random crop reads (the same "
            "pixels; libjpeg-turbo only)",
        ),
        Option(
            "max_pixels",
            178_956_970,
            _positive_int,
            "images whose header declares more pixels (height x width) are refused before anything is "
            "allocated (ImageDecodeError, or skipped with on_error='skip'): decompression bombs. The default "
            "is PIL's own refusal threshold (2 x PIL.Image.MAX_IMAGE_PIXELS), a 512 MiB RGB image",
        ),
        Option(
            "native",
            "auto",
            _choice("auto", "off"),
            "'auto': planned sources (TensorDataset, ArrayDataset, RecordDataset) run their steady state in "
            "C++ (no pipeline thread holds the GIL); 'off': the Python pipeline threads stage every batch",
        ),
        Option(
            "mapped_copy",
            "auto",
            _choice("auto", "kernel", "dma"),
            "ranges of files mapped from the page cache reach the GPU by the gather kernel ('kernel': a few "
            "SMs read host memory) or by the copy engines ('dma': one cuMemcpyBatchAsync a batch); 'auto': "
            "the copy engines, switched to the kernel after the first ~30 batches if the step left its GPU "
            "waiting for the host (the choice memory_rows='auto' makes, made once for both)",
        ),
        Option(
            "output_stream",
            "copy",
            _choice("copy", "consumer"),
            "the CUDA stream a batch's device memory is allocated on: 'copy' (the loader's copy stream; "
            "handed to the training loop's stream with record_stream, so a copy never waits for the step), "
            "'consumer' (the training loop's stream, as .to(device, non_blocking=True) would; each copy then "
            "first waits for that stream's work up to the allocation, which a GEMM-bound step feels)",
        ),
        Option(
            "allocate_ahead",
            8,
            _positive_int,
            "planned batches (fixed-size rows) are allocated and submitted to the C++ loop this many at a "
            "time, up to 256 MiB of outputs: with output_stream='copy' one switch to the copy stream (25-40 us "
            "of the training thread's next() beside a launch-bound step) and one call and wake-up of the "
            "loop's workers for them all (main job, H200: next() 104 us mean at 4, 82 at 8); 1 submits each "
            "batch alone",
        ),
        Option(
            "output_blocks",
            "group",
            _choice("batch", "group"),
            "planned batches on output_stream='copy': 'group' allocates a field (images, labels) of "
            "allocate_ahead batches as one device block and hands out views of it, each starting on a "
            "512-byte boundary, so the training thread pays one record_stream and one allocator event per "
            "block at its free instead of one per tensor (main job, H200: 0.989x against 0.959x the "
            "device-resident samples/s); a batch kept alive then keeps its group's block of that field, and "
            "torch.save of a field writes the block (clone() first). 'batch' gives each field of each batch "
            "its own allocation, as torch's collate does",
        ),
        Option(
            "keep_loop",
            True,
            _bool,
            "an epoch of a planned source that ran to its end leaves its C++ loop (idle worker threads, "
            "pinned slots, batch plans) to the loader's next epoch instead of stopping it; an epoch left "
            "midway, a later epoch whose loop would differ, loader.close() and exit stop it (main job, "
            "H200: an epoch's edges cost the training thread 1.88 ms with a new loop each epoch, 1.36 kept)",
        ),
        Option(
            "turn_thread",
            "auto",
            _bool_or_auto,
            "planned batches' group turns (allocate outputs, submit allocate_ahead batches to the C++ loop) "
            "run on a thread of the pipeline's own instead of inside the training thread's next(): it waits "
            "without the GIL for the batches in flight to run low, then takes the GIL when the training "
            "thread lets go of it (a CUDA step's backward() does). 'auto' (on for CUDA outputs): main job, "
            "H200, input wait 2.5-2.8% against 3.4-3.9% and samples/s 0.96-1.03x the device-resident loop "
            "against 0.90-1.02x; a loop that never lets go of the GIL pays the turn mid-step instead "
            "(a launch-bound loop of tiny kernels: 0.78-0.82x its rate alone against 0.86x), so turn it "
            "off there. 1: also host outputs; 0: every turn inside next()",
        ),
        Option(
            "copy_enqueue",
            "workers",
            _choice("workers", "next"),
            "who hands a planned batch's copies to the GPU (in-memory rows, record offsets, mapped files; "
            "files read through the pinned ring always go from the reading threads): 'workers', the C++ "
            "loop's worker threads as each batch is staged; 'next', the training thread inside next(), for "
            "every batch staged by then, in order. A copy or event record made by another thread makes the "
            "training thread's own kernel launches wait in the CUDA driver: 'next' removes those waits (a "
            "launch-bound loop beside the loader: 5-12 waits per 120 steps against 268-538, launch rate "
            "0.76-0.90x alone against 0.71-0.79x, H200) but lengthens next() by the calls (the main job's "
            "input wait 3.7-4.0% against 2.6-2.8%), so it suits a step that launches many small kernels "
            "and rarely waits in next()",
        ),
        Option(
            "copy_timing_every",
            16,
            _int_at_least(0),
            "the C++ steady state times one batch's H2D copies in this many with a pair of CUDA events "
            "(stats' copy seconds are scaled from those batches by bytes); each timed batch is four driver "
            "calls more from the loader's threads beside your training thread's launches; 1 times every "
            "batch, 0 none",
        ),
        Option(
            "memory_rows",
            "auto",
            _choice("auto", "dma", "kernel", "gather"),
            "rows of in-memory datasets (TensorDataset) of 16 KiB and more reach the GPU by the copy engines "
            "out of the dataset's own pages, registered with CUDA within map_budget ('dma'), by the gather "
            "kernel reading those pages on a few SMs ('kernel': one launch a batch, for launch-bound steps), "
            "or are gathered by CPU threads into a pinned slot first ('gather'); 'auto': the copy engines, "
            "switched to the kernel after the first ~30 batches if the step left its GPU waiting for the host",
        ),
        Option(
            "remote_concurrency",
            64,
            _int_between(1, 1024),
            "range requests in flight per reader for s3:// and http(s):// objects",
            tunable=True,
        ),
        Option(
            "remote_request_size",
            16 << 20,
            _byte_size,
            "bytes per range request (larger reads are split into requests of this size)",
            tunable=True,
        ),
        Option(
            "remote_read_ahead",
            1 << 30,
            _byte_size_or_zero,
            "bytes of later batches' remote ranges a loader requests before their turn (the batches it has "
            "fetched ahead), so the connections never idle between batches (at least latency x bandwidth; the "
            "default is the 64 x 16 MiB the reader keeps in flight); 0: each batch read in its turn",
        ),
        Option("remote_retries", 5, _non_negative_int, "retries of a failed request (429, 5xx, timeout, reset)"),
        Option(
            "remote_backoff",
            0.2,
            _positive_float,
            "seconds: retry k waits a random time in [0, remote_backoff * 2**(k-1)], at most 10 s",
        ),
        Option("remote_timeout", 30.0, _positive_float, "seconds a request may wait to connect or for any bytes"),
        Option(
            "remote_wake_bytes",
            0,
            _byte_size_or_zero,
            "plain-HTTP bodies: bytes to arrive before a reading thread wakes (SO_RCVLOWAT, at most a quarter of "
            "its receive buffer), received straight into place; 0: http.client's buffered reads",
        ),
        Option(
            "remote_backend",
            "auto",
            _choice("auto", "http", "kvikio"),
            "remote reads: 'http' (torch_fastload's concurrent range reader), 'kvikio' (kvikio's "
            "RemoteFile; needs CUDA), 'auto' (http)",
        ),
        Option(
            "remote_cache_dir",
            "",
            _text,
            "directory of the on-disk shard cache for remote objects (whole objects, LRU); '' = no cache",
        ),
        Option(
            "remote_cache_limit", 64 << 30, _byte_size, "bytes the shard cache may hold (least recently used leave)"
        ),
        Option(
            "s3_endpoint_url",
            "",
            _text,
            "S3-compatible endpoint for s3:// URLs (else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS)",
        ),
        Option(
            "gather_blocks",
            32,
            _int_between(1, 65535),
            "thread blocks per launch of the page-cache gather kernel (enough 16-byte reads in flight "
            "to fill PCIe Gen5, few enough SMs to leave the rest to training; measured on the H100)",
        ),
        Option(
            "parquet_cores_left",
            6,
            _non_negative_int,
            "cores a loader over a ParquetDataset leaves out of pyarrow's CPU pool (the column decodes) for "
            "its own threads and the training thread: the pool is made the CPU count minus this (at least "
            "half the CPUs) when it is larger, never grown, while the dataset's iterators run (its size given back "
            "when the last ends); 0 leaves pyarrow's pool as it is",
        ),
        Option(
            "parquet_gather",
            "native",
            _choice("native", "arrow"),
            "how a shuffled Parquet batch's rows are cut from the decoded row groups they lie in: 'native', "
            "every column in one C++ call without the GIL (the extension's gather_rows); 'arrow', pyarrow's "
            "take, a call a column (the route before; columns not prepared, e.g. dictionary ones, always take it)",
        ),
        Option(
            "parquet_range_plan",
            True,
            _bool,
            "a Parquet batch of consecutive rows inside a loader is planned by one C++ call (the extension's "
            "plan_range) and staged by one more, instead of a few Python calls a column on the fetch and stage "
            "threads (each a GIL hand-off beside the training thread); False: the Python route",
        ),
        Option(
            "parquet_gather_threads",
            0,
            _int_between(0, 256),
            "threads of one parquet_gather='native' call (a shuffled batch's columns, in row-ordered "
            "tasks); 0: the dataset's threads, at most 16. The call took 1.2-1.4 ms a 16K-row alert batch on "
            "16 threads of the H200 against 0.77 ms on 2 of the dev machine's: fewer may wake faster",
        ),
        Option(
            "parquet_gather_pinned",
            256 << 20,
            _byte_size_or_zero,
            "bytes of pinned memory (mapped and registered once a process, on a CUDA loader's first bind) "
            "that parquet_gather='native' gathers shuffled rows into, so they go to the GPU from there "
            "without a copy into the slot; gathers that do not fit are staged through the slot. 0: off",
        ),
        Option(
            "pack_verify",
            "size",
            _choice("size", "checksum"),
            "what opening a pack checks of its shards: 'size' (sizes against meta.json; cheap) or "
            "'checksum' (also each shard's CRC-32, reading every shard once)",
        ),
        Option(
            "shutdown_timeout",
            10.0,
            _positive_float,
            "seconds to wait for in-flight reads and copies and for threads to join on shutdown",
        ),
        Option(
            "poll_interval", 0.05, _positive_float, "seconds between checks of the stop flag in every blocking wait"
        ),
    )
}

# Re-entrant: a DataLoader collected by the garbage collector while this thread holds the
# lock (GC can run at any allocation) reads the config again from its finalizer.
_lock = threading.RLock()
_overrides: list[dict[str, Any]] = []


_tuning_cache: dict[str, Any] = {}


def cache_dir() -> str:
    """The package's cache directory: ``$XDG_CACHE_HOME/torch_fastload``, else
    ``~/.cache/torch_fastload`` (generated sample data, the tuning file)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_fastload")


def tuning_file() -> str:
    """Where ``doctor --save`` writes measured settings (``TORCH_FASTLOAD_TUNING_FILE``)."""
    return os.environ.get("TORCH_FASTLOAD_TUNING_FILE") or os.path.join(cache_dir(), "tuning.json")


def _tuned() -> dict[str, Any]:
    """The tunable options recorded in the tuning file (re-read when the file changes)."""
    path = tuning_file()
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        return {}
    if _tuning_cache.get("key") != (path, stamp):
        try:
            recorded = json.loads(fileio.read_file(path)).get("settings", {})
            values = {k: OPTIONS[k].parse(k, v) for k, v in recorded.items() if k in OPTIONS and OPTIONS[k].tunable}
        except (OSError, ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(
                f"torch_fastload tuning file {path} is unreadable ({exc}); "
                "re-run `python -m torch_fastload doctor --save` or delete it"
            ) from None
        _tuning_cache.update(key=(path, stamp), values=values)
    return _tuning_cache["values"]


def _lookup(name: str) -> tuple[Any, str]:
    try:
        option = OPTIONS[name]
    except KeyError:
        raise KeyError(f"unknown torch_fastload option {name!r}; known: {sorted(OPTIONS)}") from None
    with _lock:
        for layer in reversed(_overrides):
            if name in layer:
                return layer[name], "override"
    variable = option.env
    raw = os.environ.get(variable)
    for alias in option.env_aliases if not raw else ():
        if os.environ.get(alias):
            variable, raw = alias, os.environ[alias]
            warnings.warn(f"{alias} is deprecated: set {option.env} instead", DeprecationWarning, stacklevel=3)
            break
    if raw is not None and raw != "":
        try:
            return option.parse(name, raw), variable
        except ValueError as exc:
            raise ValueError(f"{exc} (from environment variable {variable}={raw!r})") from None
    if option.tunable:
        tuned = _tuned()
        if name in tuned:
            return tuned[name], "tuning file"
    return option.parse(name, option.default), "default"


def get(name: str) -> Any:
    """The value in effect: ``override``, else the environment, else the tuning file, else the default."""
    return _lookup(name)[0]


def source(name: str) -> str:
    """Where the value of ``name`` in effect comes from: override, an env var, tuning file or default."""
    return _lookup(name)[1]


def resolve(name: str, value: Any) -> Any:
    """An explicit constructor argument, validated; ``None`` means the configured default."""
    if value is None:
        return get(name)
    return OPTIONS[name].parse(name, value)


def set(**values: Any) -> None:  # noqa: A001 - mirrors kvikio.defaults.set
    """Change defaults for the rest of the process (outermost layer)."""
    parsed = {name: resolve(name, value) for name, value in values.items()}
    with _lock:
        if not _overrides:
            _overrides.append({})
        _overrides[0].update(parsed)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily change defaults: ``with torch_fastload.config.override(stage_threads=4): ...``."""
    parsed = {name: resolve(name, value) for name, value in values.items()}
    with _lock:
        if not _overrides:
            _overrides.append({})
        _overrides.append(parsed)
        layer_index = len(_overrides) - 1
    try:
        yield
    finally:
        with _lock:
            del _overrides[layer_index]


def describe() -> str:
    """A table of every option, its value in effect and where to change it."""
    rows = [f"{'option':<18} {'value':<10} {'from':<12} {'env var':<34} meaning"]
    for option in OPTIONS.values():
        value, origin = _lookup(option.name)
        origin = "env" if origin.startswith("TORCH_FASTLOAD") else origin
        rows.append(f"{option.name:<18} {str(value):<10} {origin:<12} {option.env:<34} {option.help}")
    return "\n".join(rows)
