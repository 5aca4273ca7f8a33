"""The loaders users would pick instead of torch_fastload (NVIDIA DALI, Meta's SPDL, torchdata's
StatefulDataLoader, FFCV), built the way their own examples and documentation build them, for
the benchmarks' side-by-side rows. Each is optional: ``status(name)`` says whether it imports
and, when it does not, why, so a benchmark prints "<peer>: not installed (...)" instead of
silently leaving the row out. Every builder yields ``(images_or_rows, labels)`` on the GPU, so a
benchmark times each peer with the same loop it times ours with.

TORCH_FASTLOAD_HIDE_PEERS=dali,spdl,... makes those peers report "not installed" (the CPU
smoke tests check the rows without uninstalling anything)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
HIDE_ENV = "TORCH_FASTLOAD_HIDE_PEERS"

# name -> (the module the builders import, the distribution to install, what users call it)
PEERS = {
    "dali": ("nvidia.dali", "nvidia-dali-cuda130", "DALI"),
    "spdl": ("spdl.io", "spdl-io", "SPDL"),
    "torchdata": ("torchdata.stateful_dataloader", "torchdata", "torchdata StatefulDataLoader"),
    "ffcv": ("ffcv", "ffcv", "FFCV"),
}
FFCV_REASON = (
    "not installable here: ffcv 1.0.2 has no wheel for any Python, and its sdist's setup.py stops "
    'before building ("Could not find required package: opencv4"): it compiles against OpenCV '
    "and libturbojpeg found through pkg-config, which the GPU machine lacks, with no network to fetch them"
)


@dataclass(frozen=True)
class PeerStatus:
    name: str
    label: str
    installed: bool
    version: str | None
    reason: str | None

    def line(self) -> str:
        """``DALI 2.4.0`` or ``DALI: not installed (ModuleNotFoundError: ...)``."""
        if self.installed:
            return f"{self.label} {self.version}"
        return f"{self.label}: {self.reason}"

    def as_dict(self) -> dict:
        return {"name": self.name, "installed": self.installed, "version": self.version, "reason": self.reason}


def _import_module(module: str):
    """The import every guard goes through (tests replace it to simulate an absent peer)."""
    return importlib.import_module(module)


def status(name: str) -> PeerStatus:
    """Whether ``name`` (a key of PEERS) imports here, its version, or why not."""
    module, dist, label = PEERS[name]
    hidden = {p.strip() for p in os.environ.get(HIDE_ENV, "").split(",")}
    try:
        if name in hidden:
            raise ModuleNotFoundError(f"hidden by {HIDE_ENV}")
        _import_module(module)
    except Exception as exc:  # an import that fails on a broken install is "not installed" too
        reason = FFCV_REASON if name == "ffcv" else f"not installed ({type(exc).__name__}: {exc}; pip install {dist})"
        return PeerStatus(name, label, False, None, reason)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return PeerStatus(name, label, True, version, None)


def all_status() -> dict[str, dict]:
    """Every peer's status, for a study's JSON."""
    return {name: status(name).as_dict() for name in PEERS}


def require(name: str, device: torch.device | None = None) -> PeerStatus:
    """The peer's status; raises PeerUnavailable when it is not installed (or needs a GPU that
    ``device`` is not), so a benchmark logs one line and moves on."""
    st = status(name)
    if not st.installed:
        raise PeerUnavailable(st.line())
    if device is not None and device.type != "cuda" and name in ("dali", "spdl"):
        raise PeerUnavailable(f"{st.label}: needs CUDA (its GPU decode and transfer), not run on {device}")
    return st


class PeerUnavailable(RuntimeError):
    """A peer is not installed or cannot run here: a reported row, not a failure."""


# -- DALI ------------------------------------------------------------------------------------


class DaliLoader:
    """A DALI pipeline behind ``for x, y in loader`` and ``len(loader)``: its PyTorch iterator
    (DALIGenericIterator, last batch dropped like ours, auto reset for the next epoch), the
    outputs as torch tensors on the pipeline's GPU."""

    def __init__(self, pipe, outputs: list[str], batches: int, convert):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.pipe, self.batches, self.convert = pipe, batches, convert
        self.iterator = DALIGenericIterator(
            [pipe], outputs, reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
        )

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for out in self.iterator:
            yield self.convert(out[0])

    def set_epoch(self, epoch: int) -> None:
        """The reader reshuffles each epoch on its own (its seed); nothing to forward."""

    def close(self) -> None:
        del self.iterator, self.pipe


def dali_image_loader(
    train_dir,
    batch: int,
    threads: int,
    device: torch.device,
    *,
    half_nhwc: bool = False,
    training: bool = True,
    seed: int = 12,
    shard_id: int = 0,
    num_shards: int = 1,
    prefetch: int = 2,
) -> DaliLoader:
    """The ImageNet pipeline of DALI's ResNet-50 PyTorch example: fn.readers.file (shuffled,
    sharded), fn.decoders.image_random_crop on device="mixed" (nvJPEG with the hardware decoder
    at its default load, the example's preallocation hints, its crop ranges), fn.resize to 224
    (triangular), fn.crop_mirror_normalize with a random flip on the GPU. ``training`` False:
    the example's validation branch (decode, resize shorter side 256, centre crop 224).
    Output: float32 NCHW, or with ``half_nhwc`` float16 NHWC memory returned as an NCHW view
    (channels_last), which is what DALI can emit closest to our bf16 channels_last (DALI has no
    bfloat16 output). ``threads`` is DALI's num_threads (the CPU budget);
    ``prefetch`` its prefetch_queue_depth (2: the documented default)."""
    from nvidia.dali import fn, pipeline_def, types

    cuda = device.type == "cuda"  # on the CPU: the example's --dali_cpu branch (code-path checks)
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    decoder, ops = ("mixed", "gpu") if cuda else ("cpu", "cpu")

    @pipeline_def(
        batch_size=batch, num_threads=threads, device_id=index, seed=seed + shard_id, prefetch_queue_depth=prefetch
    )
    def pipeline():
        jpegs, labels = fn.readers.file(
            file_root=str(train_dir),
            shard_id=shard_id,
            num_shards=num_shards,
            random_shuffle=training,
            pad_last_batch=True,
            name="Reader",
        )
        if training:
            images = fn.decoders.image_random_crop(
                jpegs,
                device=decoder,
                output_type=types.RGB,
                preallocate_width_hint=5980 if cuda else 0,
                preallocate_height_hint=6430 if cuda else 0,
                random_aspect_ratio=[0.8, 1.25],
                random_area=[0.1, 1.0],
                num_attempts=100,
            )
            images = fn.resize(images, device=ops, resize_x=224, resize_y=224, interp_type=types.INTERP_TRIANGULAR)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
            images = fn.resize(images, device=ops, size=256, mode="not_smaller", interp_type=types.INTERP_TRIANGULAR)
            mirror = False
        images = fn.crop_mirror_normalize(
            images.gpu() if cuda else images,
            dtype=types.FLOAT16 if half_nhwc else types.FLOAT,
            output_layout="HWC" if half_nhwc else "CHW",
            crop=(224, 224),
            mean=[m * 255 for m in MEAN],
            std=[s * 255 for s in STD],
            mirror=mirror,
        )
        return images, labels.gpu() if cuda else labels

    pipe = pipeline()
    pipe.build()
    size = pipe.epoch_size("Reader")
    per_shard = size // num_shards

    def convert(out: dict):
        x, y = out["images"], out["labels"].view(-1).long()
        return (x.permute(0, 3, 1, 2) if half_nhwc else x), y

    return DaliLoader(pipe, ["images", "labels"], per_shard // batch, convert)


def write_rows_as_files(features: Path, root: Path, limit: int | None = None) -> list[str]:
    """The rows of one (N, ...) .npy as one .npy file each under ``root`` (DALI's numpy reader
    takes a sample per file); written once, reused while the count matches."""
    import numpy as np

    rows = np.load(features, mmap_mode="r")
    n = len(rows) if limit is None else min(limit, len(rows))
    names = [f"row{i:07d}.npy" for i in range(n)]
    root.mkdir(parents=True, exist_ok=True)
    if not (root / names[-1]).exists() or len(list(root.glob("row*.npy"))) != n:
        for i, name in enumerate(names):
            np.save(root / name, np.ascontiguousarray(rows[i]))
    return names


def dali_numpy_loader(
    root: Path, files: list[str], batch: int, threads: int, device: torch.device, *, gpu_reader: bool, seed: int = 0
) -> DaliLoader:
    """fn.readers.numpy over one-row .npy files, shuffled: device="gpu" (cuFile reads into GPU
    memory; what DALI's docs recommend where GPUDirect Storage is available), else the CPU
    reader and .gpu() (a copy through DALI's pinned staging)."""
    from nvidia.dali import fn, pipeline_def

    cuda = device.type == "cuda"  # on the CPU: the CPU reader alone (code-path checks)
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=index, seed=seed)
    def pipeline():
        rows = fn.readers.numpy(
            device="gpu" if gpu_reader and cuda else "cpu",
            file_root=str(root),
            files=files,
            random_shuffle=True,
            name="Reader",
        )
        return rows if gpu_reader or not cuda else rows.gpu()

    pipe = pipeline()
    pipe.build()

    def convert(out: dict):
        return (out["rows"],)

    return DaliLoader(pipe, ["rows"], len(files) // batch, convert)


# -- SPDL ------------------------------------------------------------------------------------


class SpdlLoader:
    """An SPDL pipeline (PipelineBuilder: source -> per-stage concurrency -> sink) rebuilt each
    epoch over a reshuffled list, behind ``for x, y in loader``; normalization to float32 NCHW
    on the GPU (SPDL's example does it in the model's first module) so its output matches ours."""

    def __init__(self, samples: list[tuple[str, int]], batch: int, build, device: torch.device, seed: int = 0):
        self.samples, self.batch, self.build, self.device = samples, batch, build, device
        self.rng = random.Random(seed)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.samples) // self.batch

    def __iter__(self):
        order = list(self.samples)
        self.rng.shuffle(order)
        pipeline, batches = self.build(order), 0
        with pipeline.auto_stop():
            for images, labels in pipeline:
                batches += 1
                yield (images.float() - self.mean) / self.std, labels
        if batches < len(self):  # a failing stage logs and drops its items: never time a short epoch
            raise RuntimeError(f"the SPDL pipeline yielded {batches} of {len(self)} batches: a stage failed (its log)")


def spdl_image_loader(
    samples: list[tuple[str, int]], batch: int, threads: int, device: torch.device, *, nvjpeg: bool, buffer: int = 16
) -> SpdlLoader:
    """SPDL's image-classification pipeline (examples/imagenet_classification.py, on 0.8's
    PipelineBuilder). CPU: one FFmpeg decode a file (resize 256x256, centre crop 224, rgb24;
    ``threads`` concurrent), aggregated, merged into one batch (convert_frames) and sent to the
    GPU by spdl.io.transfer_tensor_h2d in its own single-thread stage (SPDL 0.8's transfer for
    torch). nvJPEG: batches of encoded files decoded and resized to 224x224 by
    spdl.io.load_image_batch_nvjpeg (``threads`` batches concurrent). ``buffer`` is the sink's
    depth (the example's --buffer-size 16). Its augmentation is the example's fixed resize + crop,
    lighter than RandomResizedCrop + flip: noted beside its rows. On the CPU (code-path checks):
    the CPU decode alone."""
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    cuda = device.type == "cuda"
    filter_desc = spdl.io.get_video_filter_desc(
        scale_width=256, scale_height=256, crop_width=224, crop_height=224, pix_fmt="rgb24"
    )

    def decode_cpu(item):
        path, label = item
        return spdl.io.decode_packets(spdl.io.demux_image(path), filter_desc=filter_desc), label

    def batch_cpu(items):
        images = spdl.io.to_torch(spdl.io.convert_frames([f for f, _ in items])).permute(0, 3, 1, 2)
        return images, torch.tensor([y for _, y in items])

    config = []  # the CUDA config, made on first use (CPU runs never make one)

    def batch_nvjpeg(items):
        if not config:
            index = device.index if device.index is not None else torch.cuda.current_device()
            alloc = (torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete)
            config.append(spdl.io.cuda_config(device_index=index, allocator=alloc))
        buffer_ = spdl.io.load_image_batch_nvjpeg(
            [p for p, _ in items], device_config=config[0], width=224, height=224, pix_fmt="rgb"
        )
        return spdl.io.to_torch(buffer_), torch.tensor([y for _, y in items], device=device)

    def build(order):
        builder = PipelineBuilder().add_source(order)
        if nvjpeg:
            builder.aggregate(batch, drop_last=True).pipe(batch_nvjpeg, concurrency=threads)
        else:
            builder.pipe(decode_cpu, concurrency=threads).aggregate(batch, drop_last=True).pipe(batch_cpu)
            if cuda:
                builder.pipe(spdl.io.transfer_tensor_h2d)
        return builder.add_sink(buffer).build(num_threads=threads)

    return SpdlLoader(samples, batch, build, device)


def check_spdl_nvjpeg(path: str, device: torch.device) -> None:
    """SPDL's PyPI wheels may be built without nvJPEG: one decode says so, as a 'not available'
    row rather than a pipeline whose every stage fails."""
    import spdl.io

    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        spdl.io.load_image_batch_nvjpeg(
            [path], device_config=spdl.io.cuda_config(device_index=index), width=224, height=224, pix_fmt="rgb"
        )
    except RuntimeError as exc:
        if "not built with nvjpeg" in str(exc).lower():
            raise PeerUnavailable(f"SPDL {status('spdl').version}: {exc} (its PyPI wheel)") from None
        # any other refusal is this file's (the pipeline runs on the files nvJPEG takes)


# -- torchdata -------------------------------------------------------------------------------


def stateful_loader(dataset, batch: int, **kwargs):
    """torchdata.stateful_dataloader.StatefulDataLoader: torch's DataLoader with state_dict()."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=batch, **kwargs)


def image_samples(train_dir) -> list[tuple[str, int]]:
    """(path, class index) of an ImageFolder, in torchvision's class order."""
    root = Path(train_dir)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    return [(str(p), i) for i, c in enumerate(classes) for p in sorted((root / c).iterdir()) if p.is_file()]
