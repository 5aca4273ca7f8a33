"""Image classification data: an ImageFolder, or a pack made from one, decoded a batch at a time.

``ImageFolder(root)`` reads the standard layout ``root/<class>/<image>`` (torchvision's class
order and extensions); ``PackedImageFolder(pack)`` reads the shards that
``python -m torch_fastload pack`` writes from such a folder. With torch_fastload's
DataLoader a batch goes:

    read    the C++ engine reads every file (or record) of the batch into one pinned slab
            (many files in parallel, no GIL);
    decode  nvJPEG decodes the batch on the GPU (``vision.decode``: probed headers route CMYK,
            PNG-named-.JPEG, unusual and huge images to the CPU, counted in ``loader.stats()``);
    augment one kernel crops, resizes, flips, normalises and casts the whole batch on the GPU
            (``vision.transforms``), per-sample parameters drawn from a seeded generator;

and arrives as ``(images, labels)`` on the loader's device: ``images`` ``(N, 3, S, S)`` of the
transform's dtype (channels_last if asked), ``labels`` int64. With ``transform=None`` the
images come as a list of decoded ``(3, H, W)`` uint8 tensors. Decode and augment run on the
loader's stage threads and copy stream, so they overlap the training step like any copy.

``ds[i]`` (torch's DataLoader, or a custom ``collate_fn``) decodes and transforms one image
on the CPU with the same arithmetic. CPU decodes go through decoders that refuse damaged files
with an error (the C++ libjpeg-turbo decoder for JPEGs, PIL for the rest), and no image whose
header declares more than ``max_pixels`` pixels is decoded.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import config
from ..remote import objects as files
from ..resume import batch_key, batch_numpy_rng
from ..staging import ALIGN, PendingRead
from ..vision.decode import BatchDecoder, ImageDecodeError, decode_cpu
from ..vision.settings import GPU_MAX_PIXELS
from ..vision.transforms import EvalTransform, TrainTransform
from .records import largest_batch_bytes

__all__ = ["ImageFolder", "PackedImageFolder", "EncodedImages", "ImageDecodeError"]

Transform = Union[TrainTransform, EvalTransform, None]


class EncodedImages(NamedTuple):
    """A batch before decoding: the encoded bytes (one read plan) and what decoding needs."""

    data: object  # PendingRead of every image back to back; a uint8 slot view once read
    offsets: np.ndarray  # int64 N + 1: image i is data[offsets[i]:offsets[i + 1]]
    labels: np.ndarray  # int64 N
    indices: np.ndarray  # int64 N: the dataset indices (to name files in errors)
    seed: tuple  # the batch's augmentation key: (iterator base seed, batch number in the epoch)


def _resolve_transform(transform) -> Transform:
    if transform is None or isinstance(transform, (TrainTransform, EvalTransform)):
        return transform
    if transform == "train":
        return TrainTransform()
    if transform in ("val", "eval"):
        return EvalTransform()
    raise ValueError(f"transform must be 'train', 'val', a TrainTransform/EvalTransform or None, got {transform!r}")


class _EncodedImageSource(Dataset):
    """What folders and packs share: batches as read plans, decoding, transforms, errors."""

    @property
    def __fastload_staged_at_once__(self) -> int:
        """The ``image_batches_staged`` option: a batch's decode is serial (probe, nvJPEG's host
        call, the CPU share, the kernel), so more than two at once keep each part busy."""
        return config.resolve("image_batches_staged", None)

    def __init__(self, transform, on_error: str, seed: int | None, gpu_max_pixels: int, max_pixels: int | None):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.transform = _resolve_transform(transform)
        self.on_error = on_error
        self.gpu_max_pixels = int(gpu_max_pixels)
        # None: the max_pixels option, read when a decoder is made and at each ds[i]
        self.max_pixels = None if max_pixels is None else config.resolve("max_pixels", max_pixels)
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else int(seed)
        self._batches = 0  # outside a loader's fetch (no batch key): calls are numbered
        self._decoders: dict = {}
        self._lock = threading.Lock()

    # -- what a subclass provides --------------------------------------------------------
    labels: np.ndarray  # int64 (N,)
    classes: list

    def _ranges(self, index: np.ndarray):
        """``(paths, file_index, offsets, lengths)`` of the encoded bytes of images ``index``."""
        raise NotImplementedError

    def name(self, i: int) -> str:
        raise NotImplementedError

    # -- sizes and indices ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.labels)

    @property
    def targets(self) -> list:
        return self.labels.tolist()

    def _check(self, indices) -> np.ndarray:
        raw = np.asarray(indices, dtype=np.int64).reshape(-1)
        index = np.where(raw < 0, raw + len(self), raw)
        bad = (index < 0) | (index >= len(self))
        if bad.any():
            raise IndexError(f"image index {int(raw[bad][0])} is out of range for {self!r} ({len(self)} images)")
        return index

    # -- the sample path (torch's DataLoader) ---------------------------------------------
    def read_bytes(self, i: int) -> torch.Tensor:
        """The encoded bytes of image ``i`` (a uint8 tensor)."""
        index = self._check([i])
        paths, file_index, offsets, lengths = self._ranges(index)
        path, offset, length = paths[int(file_index[0])], int(offsets[0]), int(lengths[0])
        data = files.read(path, offset, length)  # a local file or a remote object
        if len(data) != length:
            raise ImageDecodeError(
                self.name(int(index[0])),
                int(index[0]),
                f"file ended at byte {offset + len(data)}, expected {length} bytes at {offset}",
            )
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def __getitem__(self, i):
        """``(image, label)``: decoded and transformed on the CPU (per sample, like torchvision).

        A file that cannot be decoded (empty, truncated, damaged, or declaring more than
        ``max_pixels`` pixels) raises ``ImageDecodeError`` naming it, whatever ``on_error``
        says: ``on_error="skip"`` drops images from torch_fastload's batches, but a sample
        cannot be dropped here (torch's DataLoader would collate whatever this returns), so the
        error says so rather than handing back a placeholder."""
        index = int(self._check([i])[0])
        encoded = self.read_bytes(index)
        try:
            image = decode_cpu(encoded, max_pixels=self.max_pixels)
        except ValueError as exc:
            reason = str(exc)
            if self.on_error == "skip":
                reason += (
                    " (on_error='skip' drops images from torch_fastload's batches only: ds[i] cannot drop its sample)"
                )
            raise ImageDecodeError(self.name(index), index, reason) from None
        label = int(self.labels[index])
        if self.transform is None:
            return image, label
        rng = batch_numpy_rng()  # per batch, not per thread: deterministic in fetch threads
        geometry = self.transform.geometry(np.array([image.shape[1]]), np.array([image.shape[2]]), rng)
        out = self.transform.apply([image], geometry, torch.device("cpu"))[0]
        return out, label

    # -- the batch path (torch_fastload's DataLoader) -------------------------------------
    def __fastload_batch__(self, indices) -> EncodedImages:
        index = self._check(indices)
        paths, file_index, offsets, lengths = self._ranges(index)
        bounds = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        data = PendingRead(
            paths, offsets, lengths, (int(bounds[-1]),), torch.uint8, file_index=file_index, pins=self._pins(paths)
        )
        key = batch_key()
        if key is None:
            with self._lock:
                key = (0, self._batches)
                self._batches += 1
        else:
            key = (key.base_seed, key.number)
        return EncodedImages(data, bounds, self.labels[index], index, key)

    def __fastload_slot_bytes__(self, batch_size: int) -> int:
        return largest_batch_bytes(self._sizes(), batch_size) + ALIGN

    def _sizes(self) -> np.ndarray:
        raise NotImplementedError

    def _pins(self, paths) -> list | None:
        """The identities of ``paths`` as opened (a pack's shards), or None (not pinned)."""
        return None

    def decoder(self, device: torch.device) -> BatchDecoder:
        with self._lock:
            decoder = self._decoders.get(device)
            if decoder is None:
                decoder = self._decoders[device] = BatchDecoder(
                    device, on_error=self.on_error, gpu_max_pixels=self.gpu_max_pixels, max_pixels=self.max_pixels
                )
            return decoder

    def route_trials(self) -> dict:
        """Device -> its decoder's route trial (``cpu_decode_share="auto"``), where one runs: a
        benchmark times past it (``trial.choice`` set), and ``trial.describe()`` says what it saw."""
        with self._lock:
            return {device: d.trial for device, d in self._decoders.items() if d.trial is not None}

    def __fastload_requested__(self, device: torch.device) -> None:
        """The training loop asked for a batch: a route trial marks where its GPU is."""
        decoder = self._decoders.get(torch.device(device))
        if decoder is not None:
            decoder.requested()

    def __fastload_delivered__(self, device: torch.device, waited: float) -> None:
        """The loader handed a batch to the training loop, which waited ``waited`` s for it: a
        route trial times it."""
        decoder = self._decoders.get(torch.device(device))
        if decoder is not None:
            decoder.delivered(waited)

    def __fastload_finish__(self, batch: EncodedImages, device: torch.device, counts: dict):
        """Decode and transform a batch whose bytes are in ``batch.data`` (a host slot view).

        Runs on a stage thread with the loader's copy stream current; results are new tensors
        (nothing aliases the slot, which is reused once this batch's event completes)."""
        device = torch.device(device)
        indices = batch.indices

        def describe(k: int) -> tuple[str, int]:
            return self.name(int(indices[k])), int(indices[k])

        rng = np.random.default_rng([self.seed, *(int(k) for k in batch.seed)])
        crop = None
        if isinstance(self.transform, TrainTransform) and device.type == "cuda":
            # random crops drawn from the probed sizes first: the C++ decoder decodes only them (an
            # eval transform reads whole images, and a size the probe could not give would fail it)
            def draw(heights, widths):
                return self.transform.geometry(heights, widths, rng)

            crop = draw
        decoded = self.decoder(device).decode(batch.data, batch.offsets, describe, counts, crop)
        images, geometry = decoded.images, decoded.geometry
        labels = torch.from_numpy(np.ascontiguousarray(batch.labels[decoded.kept]))
        if device.type == "cuda":  # no host wait on the copy stream (a pageable copy would sync it)
            labels = labels.pin_memory().to(device, non_blocking=True)
        if self.transform is None:
            return images, labels
        if geometry is None:
            heights = np.array([im.shape[1] for im in images], dtype=np.int64)
            widths = np.array([im.shape[2] for im in images], dtype=np.int64)
            geometry = self.transform.geometry(heights, widths, rng)
        return self.transform.apply(images, geometry, device), labels

    def state_dict(self) -> dict:
        """The augmentation seed (a loader's checkpoint carries it: resumed crops are the same)."""
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_decoders"] = {}
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the CPU-decode threads (also done at interpreter exit)."""
        for decoder in self._decoders.values():
            decoder.close()


class ImageFolder(_EncodedImageSource):
    """``root/<class>/<image>`` like ``torchvision.datasets.ImageFolder`` (same classes, order
    and extensions), read a batch at a time by torch_fastload's DataLoader.

    transform: ``"train"`` (RandomResizedCrop 224 + flip + normalize), ``"val"`` (resize 256 +
    center crop 224 + normalize), a ``TrainTransform``/``EvalTransform`` (size, dtype,
    channels_last, mean/std, ...), or None (decoded uint8 images, ragged).
    extensions: file name endings that count as images (default torchvision's).
    on_error: ``"raise"`` (default) an undecodable image fails its batch with
    ``ImageDecodeError`` naming the file; ``"skip"`` drops it from its batch, logging and
    counting each skip (``loader.stats().decoded``: ``skipped`` and ``skipped:<kind>``).
    ``ds[i]`` raises either way: a per-sample path cannot drop its sample.
    max_pixels: images whose header declares more pixels are refused before anything is
    allocated (default: the ``max_pixels`` option, ``TORCH_FASTLOAD_MAX_PIXELS``).
    seed: augmentation seed (default: drawn from torch's generator, so ``torch.manual_seed``
    makes runs repeat).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform="train",
        *,
        on_error: str = "raise",
        extensions: tuple | None = None,
        seed: int | None = None,
        gpu_max_pixels: int = GPU_MAX_PIXELS,
        max_pixels: int | None = None,
        scan_threads: int = 16,
    ):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise (FileNotFoundError if not os.path.exists(self.root) else NotADirectoryError)(
                f"image folder '{self.root}' does not exist"
                if not os.path.exists(self.root)
                else f"'{self.root}' is not a directory"
            )
        super().__init__(transform, on_error, seed, gpu_max_pixels, max_pixels)
        from ..packing import IMAGE_EXTENSIONS, find_images  # packing imports sources: import here

        self.classes, self.samples = find_images(self.root, extensions or IMAGE_EXTENSIONS)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.paths = [path for path, _ in self.samples]
        self.labels = np.array([label for _, label in self.samples], dtype=np.int64)
        with ThreadPoolExecutor(max(1, scan_threads)) as pool:  # stat() releases the GIL
            self.sizes = np.fromiter(
                pool.map(lambda p: os.stat(p).st_size, self.paths, chunksize=256), dtype=np.int64, count=len(self.paths)
            )

    def _ranges(self, index):
        paths = [self.paths[i] for i in index.tolist()]
        return paths, np.arange(len(index), dtype=np.int64), np.zeros(len(index), dtype=np.int64), self.sizes[index]

    def _sizes(self) -> np.ndarray:
        return self.sizes

    def name(self, i: int) -> str:
        return self.paths[int(i)]

    def __repr__(self) -> str:
        return f"ImageFolder('{self.root}', {len(self)} images, {len(self.classes)} classes)"


class PackedImageFolder(_EncodedImageSource):
    """A pack written by ``torch_fastload.pack_image_folder`` (or ``python -m torch_fastload
    pack``): the same images in a few large shards, so a batch is a few big reads instead of
    hundreds of file opens. Arguments as for ``ImageFolder``; ``root`` may be an ``s3://`` /
    ``http(s)://`` URL of the pack (``cache_dir``: the shard cache for its shards)."""

    def __init__(
        self,
        root: str | os.PathLike,
        transform="train",
        *,
        on_error: str = "raise",
        seed: int | None = None,
        gpu_max_pixels: int = GPU_MAX_PIXELS,
        max_pixels: int | None = None,
        cache_dir: str | None = None,
    ):
        from .records import RecordDataset, RecordFormatError

        self.records = RecordDataset(root, cache_dir=cache_dir)
        self.root = self.records.root
        self.remote_objects = self.records.remote_objects
        if self.records.labels is None:
            raise RecordFormatError(self.root, "the pack has no labels: not an image-classification pack")
        super().__init__(transform, on_error, seed, gpu_max_pixels, max_pixels)
        self.labels = self.records.labels
        self.classes = list(self.records.classes or [str(i) for i in range(int(self.labels.max()) + 1)])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def _ranges(self, index):
        rows = self.records.index[index]
        return self.records.shard_paths, rows[:, 0], rows[:, 1], rows[:, 2]

    def _sizes(self) -> np.ndarray:
        return self.records.index[:, 2]

    def _pins(self, paths) -> list | None:
        return self.records.shard_pins

    def name(self, i: int) -> str:
        """Image ``i``'s source name; a broken names.txt is said here rather than hiding the
        error this name is for (a decode error, a max_pixels refusal)."""
        from .records import RecordFormatError

        try:
            return self.records.name(int(i))
        except RecordFormatError as exc:
            return f"record {int(i)} of the pack '{self.root}' (no name: {exc})"

    def __repr__(self) -> str:
        return f"PackedImageFolder('{self.root}', {len(self)} images, {len(self.classes)} classes)"
