"""Decoding a batch of encoded images: nvJPEG on the GPU where it can, the CPU where it cannot.

Every image's header is probed first (``probe``: the C++ engine, GIL released; a Python
twin where the engine is not built). The probe routes each image:

- ``nvjpeg``: 8-bit Huffman JPEGs with 1 or 3 components up to ``gpu_max_pixels``, decoded
  as one batch by ``torchvision.io.decode_jpeg(device='cuda')`` (nvJPEG; baseline JPEGs on the
  hardware decoder of A100/H100-class GPUs);
- the CPU (torchvision's libjpeg-turbo / libpng, then PIL), counted by reason: ``cmyk``
  (4-component JPEGs: ImageNet's train set has 22), ``png``/``gif``/``webp``/``bmp`` (a PNG
  named .JPEG: ImageNet has one), ``jpeg-unsupported`` (arithmetic, lossless, 12-bit),
  ``huge`` (above ``gpu_max_pixels``), ``nvjpeg-error`` (nvJPEG refused a file the probe
  passed), ``device-cpu`` (the loader's device is the CPU);
- an error: empty, truncated (no end-of-image marker: a cut download) or unreadable files raise
  ``ImageDecodeError`` naming the file, or with ``on_error="skip"`` are dropped from the batch,
  each skip counted and logged.

The encoded bytes stay in the loader's pinned slot: nvJPEG's API takes host bitstreams and
DMAs them itself, so the slab needs no separate host-to-device copy.
"""

from __future__ import annotations

import io as _io
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import config
from ..errors import FastloadError
from .route_trial import RouteTrial

__all__ = ["ImageDecodeError", "BatchDecoder", "probe", "FORMATS", "PROBE_COLUMNS"]

log = logging.getLogger("torch_fastload")

FORMATS = {0: "unknown", 1: "jpeg", 2: "png", 3: "gif", 4: "webp", 5: "bmp"}
JPEG, PNG = 1, 2
PROGRESSIVE, ARITHMETIC, LOSSLESS, HIGH_PRECISION, ADOBE = 1, 2, 4, 8, 16
OK, EMPTY, TRUNCATED, BAD_HEADER = 0, 1, 2, 3
STATUS_TEXT = {
    EMPTY: "empty file",
    TRUNCATED: "truncated: the file ends before its end-of-image marker",
    BAD_HEADER: "not a readable image: bad or missing header",
}
PROBE_COLUMNS = 6  # format, height, width, components, flags, status
RGB = 3  # torchvision.io.ImageReadMode.RGB


class ImageDecodeError(FastloadError, ValueError):
    """An image that cannot be decoded: names the file, its index in the dataset and why."""

    def __init__(self, name: str, index: int | None, reason: str):
        self.name = name
        self.index = index
        self.reason = reason
        where = f"image {index} " if index is not None else "image "
        super().__init__(f"{where}'{name}': {reason}")


# ------------------------------------------------------------------------------------------
# header probe
# ------------------------------------------------------------------------------------------


def probe(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """int64 ``(N, 6)``: format, height, width, components, flags, status of every image
    ``data[offsets[i]:offsets[i + 1]]`` (``data``: 1-D uint8, contiguous)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    try:
        from .. import _C
    except ImportError:
        return probe_python(data, offsets)
    raw = _C.probe_images(data.ctypes.data, data.size, offsets)
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, PROBE_COLUMNS).copy()


def probe_python(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The probe in Python (the engine's twin, used where it is not built and to test it)."""
    out = np.zeros((len(offsets) - 1, PROBE_COLUMNS), dtype=np.int64)
    buf = data.tobytes()
    for k in range(len(offsets) - 1):
        out[k] = _probe_one(buf[int(offsets[k]) : int(offsets[k + 1])])
    return out


def _probe_one(p: bytes) -> tuple:
    n = len(p)
    if n == 0:
        return (0, 0, 0, 0, 0, EMPTY)
    if p[:3] == b"\xff\xd8\xff":
        return _probe_jpeg(p)
    if p[:8] == b"\x89PNG\r\n\x1a\n":
        if n < 26 or p[12:16] != b"IHDR":
            return (PNG, 0, 0, 0, 0, TRUNCATED if n < 26 else BAD_HEADER)
        width, height = int.from_bytes(p[16:20], "big"), int.from_bytes(p[20:24], "big")
        comps = {0: 1, 2: 3, 3: 3, 4: 2}.get(p[25], 4)
        flags = HIGH_PRECISION if p[24] != 8 else 0
        status = TRUNCATED if n < 45 or p[n - 8 : n - 4] != b"IEND" else OK
        return (PNG, height, width, comps, flags, status)
    if p[:6] in (b"GIF87a", b"GIF89a"):
        if n < 10:
            return (3, 0, 0, 0, 0, TRUNCATED)
        return (3, int.from_bytes(p[8:10], "little"), int.from_bytes(p[6:8], "little"), 3, 0, OK)
    if n >= 12 and p[:4] == b"RIFF" and p[8:12] == b"WEBP":
        return (4, 0, 0, 0, 0, TRUNCATED if int.from_bytes(p[4:8], "little") + 8 > n else OK)
    if p[:2] == b"BM":
        width = height = 0
        if n >= 26:
            width = int.from_bytes(p[18:22], "little")
            height = int.from_bytes(p[22:26], "little")
            if height >= 1 << 31:
                height = (1 << 32) - height
        return (5, height, width, 0, 0, TRUNCATED if n < 14 or int.from_bytes(p[2:6], "little") > n else OK)
    return (0, 0, 0, 0, 0, BAD_HEADER)


def _skip_entropy(p: bytes, i: int) -> int:
    n = len(p)
    while i < n:
        i = p.find(b"\xff", i)
        if i < 0 or i + 1 >= n:
            return n
        nxt = p[i + 1]
        if nxt == 0 or 0xD0 <= nxt <= 0xD7 or nxt == 0xFF:
            i += 1 if nxt == 0xFF else 2
            continue
        return i
    return n


def _probe_jpeg(p: bytes) -> tuple:
    n = len(p)
    height = width = comps = flags = 0
    have_frame = False
    i = 2
    while True:
        if i >= n:
            return (JPEG, height, width, comps, flags, TRUNCATED)
        if p[i] != 0xFF:
            i = p.find(b"\xff", i)
            if i < 0:
                return (JPEG, height, width, comps, flags, TRUNCATED)
            continue
        while i < n and p[i] == 0xFF:
            i += 1
        if i >= n:
            return (JPEG, height, width, comps, flags, TRUNCATED)
        marker = p[i]
        i += 1
        if marker == 0xD9:
            return (JPEG, height, width, comps, flags, OK if have_frame else BAD_HEADER)
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            continue
        if i + 2 > n:
            return (JPEG, height, width, comps, flags, TRUNCATED)
        length = int.from_bytes(p[i : i + 2], "big")
        if length < 2:
            return (JPEG, height, width, comps, flags, BAD_HEADER)
        if i + length > n:
            return (JPEG, height, width, comps, flags, TRUNCATED)
        seg = p[i + 2 : i + length]
        is_sof = 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC)
        if is_sof and not have_frame:
            if len(seg) < 6:
                return (JPEG, height, width, comps, flags, BAD_HEADER)
            have_frame = True
            if seg[0] != 8:
                flags |= HIGH_PRECISION
            height, width, comps = int.from_bytes(seg[1:3], "big"), int.from_bytes(seg[3:5], "big"), seg[5]
            if marker in (0xC2, 0xC6, 0xCA, 0xCE):
                flags |= PROGRESSIVE
            if marker >= 0xC9:
                flags |= ARITHMETIC
            if marker == 0xC3 or 0xC5 <= marker <= 0xC7 or marker == 0xCB or marker >= 0xCD:
                flags |= LOSSLESS
        elif marker == 0xEE and seg[:5] == b"Adobe":
            flags |= ADOBE
        i += length
        if marker == 0xDA:
            if not have_frame:
                return (JPEG, height, width, comps, flags, BAD_HEADER)
            i = _skip_entropy(p, i)


# ------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------


def route(info: np.ndarray, device: torch.device, gpu_max_pixels: int) -> list[str]:
    """Where each probed image is decoded: 'nvjpeg', 'cpu:<reason>' or 'error:<reason>'."""
    routes = []
    cuda = device.type == "cuda"
    for fmt, height, width, comps, flags, status in info.tolist():
        if status != OK:
            routes.append("error:" + STATUS_TEXT[status])
        elif fmt != JPEG:
            routes.append("cpu:" + FORMATS[fmt])
        elif not cuda:
            routes.append("cpu:device-cpu")
        elif comps == 4 or (flags & ADOBE and comps != 3 and comps != 1):
            routes.append("cpu:cmyk")
        elif flags & (ARITHMETIC | LOSSLESS | HIGH_PRECISION) or comps not in (1, 3):
            routes.append("cpu:jpeg-unsupported")
        elif height * width > gpu_max_pixels or height == 0 or width == 0:
            routes.append("cpu:huge" if height * width > gpu_max_pixels else "cpu:jpeg-unsupported")
        else:
            routes.append("nvjpeg")
    return routes


def _ops():
    """torchvision's decode ops (torch.ops: no per-call deprecation warning, GIL released)."""
    import torchvision  # noqa: F401  (registers torch.ops.image)

    return torch.ops.image


def decode_cpu(encoded: torch.Tensor) -> torch.Tensor:
    """``(3, H, W)`` uint8 on the CPU: torchvision (libjpeg-turbo, libpng, ...), then PIL."""
    try:
        image = _ops().decode_image(encoded, RGB, False)
    except RuntimeError as first:
        try:
            from PIL import Image

            with Image.open(_io.BytesIO(encoded.numpy().tobytes())) as pil:
                array = np.asarray(pil.convert("RGB"))
        except Exception as exc:
            raise ValueError(f"undecodable ({first}; PIL: {exc})") from None
        image = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    return image.contiguous()


class BatchDecoder:
    """Decodes a batch's slab of encoded images to ``(3, H, W)`` uint8 tensors on ``device``.

    ``cpu_share`` (default: the ``cpu_decode_share`` option, ``"auto"``) splits the images nvJPEG
    could take between nvJPEG and the CPU. ``"auto"``: the first batches go to the C++ decoder
    (libjpeg-turbo, GIL released), and it keeps them all if the training loop hardly waited;
    otherwise nvJPEG is timed too and the faster route kept (``route_trial.py``; ``self.trial``
    holds the measurements). ``"steal"``: work stealing,
    nvJPEG claiming chunks from the front of the batch while the C++ decoder's threads take
    images from the back, so each gets the share its speed earns (a training step that saturates
    the GPU slows nvJPEG ~9x); which decoder gets an image then varies from run to run. A number
    sends that fixed share, the batch's last images, to the CPU. Every CPU-decoded image of a
    batch is written into one pinned buffer and reaches the GPU in one copy."""

    def __init__(
        self,
        device,
        *,
        on_error: str = "raise",
        gpu_max_pixels: int = 8192 * 8192,
        cpu_threads: int | None = None,
        cpu_share: float | None = None,
    ):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.device = torch.device(device)
        self.on_error = on_error
        self.gpu_max_pixels = int(gpu_max_pixels)
        share = config.resolve("cpu_decode_share", cpu_share)
        cpus = config.cpus_per_process()
        native = self.device.type == "cuda" and _native_jpeg()
        # "steal": nvJPEG and the C++ decoder split every batch by work stealing
        self.work_stealing = share == "steal" and native
        # "auto": the run's first batches try every JPEG on the C++ decoder, then nvJPEG if the
        # training loop waited for them
        self.trial = (
            RouteTrial(warmup=TRIAL_WARMUP, settle=TRIAL_SETTLE, window=TRIAL_WINDOW, on_choice=_log_choice)
            if share == "auto" and native and cpus >= CORES_FOR_A_TRIAL
            else None
        )
        self.cpu_share = share if isinstance(share, float) else 0.0
        self.cpu_threads = (
            cpu_threads
            or config.resolve("cpu_decode_threads", None)
            or default_cpu_threads(1.0 if self.trial else self.cpu_share, cpus)
        )
        # the C++ decoder decodes only the rows and columns a crop reads (decode's ``crop``)
        self.decode_regions = bool(config.resolve("cpu_decode_regions", None)) and _native_regions()
        self._pool: ThreadPoolExecutor | None = None
        self._staging = threading.local()  # per stage thread: pinned buffers and their copies' events
        self.seconds = {"probe": 0.0, "nvjpeg": 0.0, "cpu": 0.0}  # host wall time per step (diagnostics)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.cpu_threads, thread_name_prefix="fastload-decode", initializer=_lower_priority
            )
        return self._pool

    def decode(self, data: torch.Tensor, offsets: np.ndarray, name, counts: dict, crop=None):
        """Decode ``data[offsets[i]:offsets[i+1]]`` for every i.

        ``name(i)`` is ``(file name, dataset index)`` of image i, for errors and the log.
        ``crop(heights, widths)``, if given, draws the batch's transform geometry
        (``transforms.Geometry``) from the probed sizes before anything is decoded: the C++
        decoder then decodes only each crop's rows and columns (exactly those pixels of a whole
        decode), and that image's crop is rebased to the region it returns.
        Returns ``(images, kept, info, geometry)``: the decoded images of the kept positions
        (all of them unless ``on_error="skip"`` dropped some), the probe rows, and the geometry
        of the kept images (None without ``crop``). ``counts`` gains one count per image per route.
        """
        started = time.perf_counter()
        cpu_share = self.trial.next_share() if self.trial is not None else self.cpu_share
        view = data.numpy() if data.device.type == "cpu" else data.cpu().numpy()
        info = probe(view, offsets)
        routes = route(info, self.device, self.gpu_max_pixels)
        n = len(routes)
        geometry = crop(info[:, 1].copy(), info[:, 2].copy()) if crop is not None else None
        images: list = [None] * n
        failed: dict[int, str] = {}
        slices = [data[int(offsets[i]) : int(offsets[i + 1])] for i in range(n)]
        for i, r in enumerate(routes):
            if r.startswith("error:"):
                failed[i] = r[len("error:") :]
        gpu = [i for i, r in enumerate(routes) if r == "nvjpeg"]
        steal = gpu if self.work_stealing and len(gpu) > 1 else []  # split with the CPU as they go
        if steal:
            gpu = []
        shared = int(round(cpu_share * len(gpu))) if len(gpu) > 1 or cpu_share == 1 else 0
        for i in gpu[len(gpu) - shared :] if shared else ():
            routes[i] = "cpu:share"  # the batch's last images: the same ones every time it is decoded
        gpu = gpu[: len(gpu) - shared]
        cpu = [i for i, r in enumerate(routes) if r.startswith("cpu:")]
        # CPU-decoded images go straight into one pinned buffer (each thread writes its own image
        # there), then to the GPU in one copy; the probed size places every image. Work-stealing
        # candidates are laid out last to first: the CPU takes them from the back, so what it
        # decoded is one run of bytes after the other CPU images.
        laid_out = cpu + steal[::-1]
        cuda = self.device.type == "cuda"
        # JPEGs nvJPEG could take go to the C++ batch decoder (one call, no GIL per image), the
        # rest (PNG, CMYK, ...) to Python threads; all beside nvJPEG
        native = (
            [i for i in cpu if routes[i] in _NATIVE_ROUTES and info[i, 1] and info[i, 2]]
            if cuda and laid_out and _native_jpeg()
            else []
        )
        boxes = self._boxes(info, geometry, native + steal)
        packed = self._pinned_places(boxes, laid_out) if laid_out and cuda else None
        place = {i: k for k, i in enumerate(laid_out)} if packed else {}
        native_set = set(native)
        pending = {
            i: self._executor().submit(_try_decode_cpu, slices[i], packed[1][place[i]] if packed else None)
            for i in cpu
            if i not in native_set
        }
        native_job = (
            self._executor().submit(
                self._decode_native,
                data,
                offsets,
                info,
                boxes,
                native,
                packed[0],
                [packed[2][place[i]][0] for i in native],
            )
            if native
            else None
        )
        job = back = None
        if steal:
            job = self._split_job(data, offsets, info, boxes, steal, packed[0], [packed[2][place[i]][0] for i in steal])
            back = self._executor().submit(job.run_back, self.cpu_threads)
        now = time.perf_counter()
        self.seconds["probe"] += now - started
        try:
            for chunk in self._front_chunks(job, steal) if job is not None else ([gpu] if gpu else []):
                for i, image in zip(chunk, self._decode_gpu([slices[i] for i in chunk], chunk, routes)):
                    if isinstance(image, str):  # refused by nvJPEG and the CPU: the reason
                        failed[i] = image
                    else:
                        images[i] = image
        finally:  # the CPU side reads the slot and writes the pinned buffer: never leave it running
            for future in (back, native_job, *pending.values()):
                if future is not None:
                    future.exception()
        started, now = now, time.perf_counter()
        self.seconds["nvjpeg"] += now - started
        results = {i: future.result() for i, future in pending.items()}
        # what the C++ decoder refused, Python decodes whole (or names the reason it fails)
        done = list(zip(native, native_job.result())) if native_job is not None else []
        if job is not None:
            back.result()
            messages = job.messages
            for k in range(job.split, len(steal)):
                routes[steal[k]] = "cpu:share"
                done.append((steal[k], messages[k]))
        for i, message in done:
            results[i] = _PACKED if not message else _try_decode_cpu(slices[i], packed[1][place[i]])
        packed_end = max(
            (
                packed[2][place[i]][0] + int(np.prod(packed[2][place[i]][1]))
                for i, result in results.items()
                if result is _PACKED
            ),
            default=0,
        )
        flat = self._upload(packed, packed_end) if packed_end else None
        for i, result in results.items():
            if isinstance(result, str):
                failed[i] = result
            elif result is _PACKED:
                start, shape = packed[2][place[i]]
                images[i] = flat[start : start + int(np.prod(shape))].view(shape)
            elif cuda:  # a size the probe did not foresee (rare): its own copy
                images[i] = result.pin_memory().to(self.device, non_blocking=True)
            else:
                images[i] = result
        self.seconds["cpu"] += time.perf_counter() - now
        for i, r in enumerate(routes):
            if i not in failed:
                counts[r] = counts.get(r, 0) + 1
        if failed:
            if self.on_error == "raise":
                i = min(failed)
                raise ImageDecodeError(*name(i), failed[i])
            for i in sorted(failed):
                log.warning("torch_fastload: skipped image %d '%s': %s", name(i)[1], name(i)[0], failed[i])
            counts["skipped"] = counts.get("skipped", 0) + len(failed)
        kept = np.array([i for i in range(n) if i not in failed], dtype=np.int64)
        if geometry is not None:
            geometry = self._fit_geometry(geometry, images, info, boxes, crop, kept, counts)
        return [images[i] for i in kept], kept, info, geometry

    def _boxes(self, info: np.ndarray, geometry, which: list) -> np.ndarray:
        """int64 ``(N, 4)``: the part of each image decoded (top, left, height, width): the
        whole image, or for the C++ decoder's images ``which`` the crop of ``geometry``."""
        boxes = np.zeros((len(info), 4), dtype=np.int64)
        boxes[:, 2:] = info[:, 1:3]
        if geometry is not None and self.decode_regions and which:
            pick = np.asarray(which, dtype=np.int64)
            boxes[pick] = np.stack(
                [geometry.top[pick], geometry.left[pick], geometry.height[pick], geometry.width[pick]], axis=1
            )
        return boxes

    @staticmethod
    def _fit_geometry(
        geometry, images: list, info: np.ndarray, boxes: np.ndarray, crop, kept: np.ndarray, counts: dict
    ):
        """The kept images' geometry: a decoded region's crop rebased to the region, and any
        image whose decoded size is not the probed one (a WebP, a region refused and decoded
        whole) given geometry drawn from its real size."""
        shapes = np.array([images[i].shape[1:] for i in kept], dtype=np.int64).reshape(-1, 2)
        geometry = geometry.take(kept)
        region = (
            (shapes[:, 0] == boxes[kept, 2])
            & (shapes[:, 1] == boxes[kept, 3])
            & ((boxes[kept, 2] != info[kept, 1]) | (boxes[kept, 3] != info[kept, 2]))
        )
        if region.any():
            geometry.top[region] = 0
            geometry.left[region] = 0
            counts["cpu-region"] = counts.get("cpu-region", 0) + int(region.sum())
        redraw = ~region & ((shapes[:, 0] != info[kept, 1]) | (shapes[:, 1] != info[kept, 2]))
        if redraw.any():
            geometry.put(redraw, crop(shapes[redraw, 0], shapes[redraw, 1]))
        return geometry

    def _pinned_places(self, boxes: np.ndarray, cpu: list):
        """``(buffer, views, places, turn, total)`` for the images ``cpu`` of a batch: this stage
        thread's pinned buffer, a ``(3, H, W)`` view of it for each image's box (``_boxes``: the
        probed size, or a region; None where the probe gave no size), its ``(start, shape)``,
        which of the two buffers, and the bytes laid out. The two buffers of a thread alternate;
        one is refilled only after the copy out of it completed."""
        local = self._staging
        if not hasattr(local, "buffers"):
            local.buffers, local.events, local.turn = [None, None], [None, None], 0
        turn = local.turn = 1 - local.turn
        places, total = [], 0
        for i in cpu:
            height, width = int(boxes[i, 2]), int(boxes[i, 3])
            shape = (3, height, width)
            places.append((total, shape))
            total += 3 * height * width
        if local.events[turn] is not None:
            local.events[turn].synchronize()
        buffer = local.buffers[turn]
        if buffer is None or buffer.numel() < total:
            buffer = local.buffers[turn] = torch.empty(max(total, 1 << 24), dtype=torch.uint8, pin_memory=True)
        views = [
            buffer[start : start + int(np.prod(shape))].view(shape) if shape[1] and shape[2] else None
            for start, shape in places
        ]
        return buffer, views, places, turn, total

    def _decode_native(
        self,
        data: torch.Tensor,
        offsets: np.ndarray,
        info: np.ndarray,
        boxes: np.ndarray,
        which: list,
        buffer: torch.Tensor,
        starts: list,
    ) -> list:
        """The C++ batch decoder over images ``which`` (their ``boxes``) into the pinned
        ``buffer`` at ``starts``; one message an image ('' where decoded)."""
        from .. import _C

        args, regions = _native_args(data, offsets, info, boxes, which, buffer, starts)
        return _C.decode_jpegs_planar(*args, self.cpu_threads, regions)

    @staticmethod
    def _split_job(
        data: torch.Tensor,
        offsets: np.ndarray,
        info: np.ndarray,
        boxes: np.ndarray,
        which: list,
        buffer: torch.Tensor,
        starts: list,
    ):
        from .. import _C

        args, regions = _native_args(data, offsets, info, boxes, which, buffer, starts)
        return _C.JpegSplitJob(*args, regions)

    @staticmethod
    def _front_chunks(job, steal: list):
        """nvJPEG's side of a work-stealing split: chunks claimed from the front until the CPU
        threads' end is reached (a chunk a call: each call waits on the GPU twice)."""
        size = max(16, len(steal) // 8)
        while True:
            first, last = job.claim_front(size)
            if first == last:
                return
            yield steal[first:last]

    def _upload(self, packed, end: int) -> torch.Tensor:
        """The packed buffer's first ``end`` bytes on the GPU: one copy on the current stream, an
        event guarding the buffer's reuse."""
        buffer, _, _, turn, _ = packed
        flat = buffer[:end].to(self.device, non_blocking=True)
        event = self._staging.events[turn] = torch.cuda.Event()
        event.record()
        return flat

    def _decode_gpu(self, encoded: list, positions: list, routes: list) -> list:
        """nvJPEG for the whole list; where it refuses the batch, one by one, the refused on the CPU."""
        ops = _ops()
        try:
            return ops.decode_jpegs_cuda(encoded, RGB, self.device)
        except RuntimeError:
            pass
        out = []
        for k, tensor in enumerate(encoded):
            try:
                out.append(ops.decode_jpegs_cuda([tensor], RGB, self.device)[0])
            except RuntimeError:
                routes[positions[k]] = "cpu:nvjpeg-error"
                result = _try_decode_cpu(tensor)
                out.append(result.to(self.device) if isinstance(result, torch.Tensor) else result)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


_NATIVE_ROUTES = ("cpu:share", "cpu:huge")  # 8-bit 1- or 3-component JPEGs: libjpeg decodes them as torchvision does


def _native_args(
    data: torch.Tensor,
    offsets: np.ndarray,
    info: np.ndarray,
    boxes: np.ndarray,
    which: list,
    buffer: torch.Tensor,
    starts: list,
) -> tuple:
    """The C++ decoder's arguments for images ``which`` of ``data`` (probed sizes ``info``) into
    the pinned ``buffer`` at ``starts``, and their regions (``boxes``), flattened."""
    pick = np.asarray(which, dtype=np.int64)
    begin = offsets[pick]
    return (
        (
            data.data_ptr(),
            data.numel(),
            begin,
            offsets[pick + 1] - begin,
            buffer.data_ptr(),
            buffer.numel(),
            np.asarray(starts, dtype=np.int64),
            info[pick, 1].astype(np.int64),
            info[pick, 2].astype(np.int64),
        ),
        np.ascontiguousarray(boxes[pick]).reshape(-1),
    )


# cpu_decode_share="auto" (the default): after TRIAL_WARMUP batches on the CPU, each route for
# TRIAL_SETTLE batches and at least TRIAL_WINDOW + 1 timed ones, nvJPEG only if the loop waited
# for the CPU's (route_trial.py); a process with fewer CPUs than this keeps nvJPEG without a trial.
CORES_FOR_A_TRIAL = 8
TRIAL_WARMUP, TRIAL_SETTLE, TRIAL_WINDOW = 8, 4, 10
CORES_LEFT_TO_THE_STEP = 4  # the training thread, the loader's read and stage threads


def default_cpu_threads(share: float, cpus: int) -> int:
    """``cpu_decode_threads=0``: all but a few cores when every JPEG may go to the CPU, else
    min(8, CPUs) for the images nvJPEG cannot take and a fixed share."""
    if share == 1:
        return max(min(8, cpus), cpus - CORES_LEFT_TO_THE_STEP)
    return min(8, cpus)


def _log_choice(trial: RouteTrial) -> None:
    log.info(
        "torch_fastload: cpu_decode_share='auto' decodes %s from now on (%s)",
        "every JPEG on the CPU" if trial.choice == 1 else "with nvJPEG",
        trial.describe(),
    )


def _native_jpeg() -> bool:
    """Whether the extension has the C++ batch JPEG decoder (built against libjpeg)."""
    try:
        from .. import _C
    except ImportError:
        return False
    return bool(getattr(_C, "HAVE_LIBJPEG", False))


def _native_regions() -> bool:
    """Whether the C++ decoder skips what lies outside a region (libjpeg-turbo)."""
    try:
        from .. import _C
    except ImportError:
        return False
    return bool(getattr(_C, "JPEG_REGIONS", False))


def _lower_priority() -> None:
    """nice +10 for this thread (Linux: per thread): decoding yields its core to the training
    thread, whose kernel launches slow ~2x when decode threads take its core (H100 machine)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


_PACKED = object()  # _try_decode_cpu's result when the image went into the place it was given


def _try_decode_cpu(encoded: torch.Tensor, place: torch.Tensor | None = None):
    """The decoded image (or ``_PACKED`` once copied into ``place``, where its shape is
    ``place``'s), or the reason it failed (a string) for the caller to raise or skip."""
    try:
        image = decode_cpu(encoded)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    if place is not None and image.shape == place.shape:
        place.copy_(image)
        return _PACKED
    return image
