"""Decoding a batch of encoded images: nvJPEG on the GPU where it can, the CPU where it cannot.

Every image's header is probed first (``probe.py``: the C++ engine, GIL released; a Python
twin where the engine is not built). The probe routes each image:

- ``nvjpeg``: 8-bit Huffman JPEGs with 1 or 3 components up to ``gpu_max_pixels``, decoded
  as one batch on the GPU by nvJPEG, through nvImageCodec or torchvision's
  ``decode_jpeg(device='cuda')`` (``decode_backend``, gpu_backend.py; baseline JPEGs on the
  hardware decoder of A100/H100-class GPUs);
- the CPU (the C++ decoder for JPEGs, PIL for the rest: ``cpu.decode_cpu``), counted by reason: ``cmyk``
  (4-component JPEGs: ImageNet's train set has 22), ``png``/``gif``/``webp``/``bmp`` (a PNG
  named .JPEG: ImageNet has one), ``jpeg-unsupported`` (arithmetic, lossless, 12-bit),
  ``huge`` (above ``gpu_max_pixels``), ``nvjpeg-error`` (nvJPEG refused a file the probe
  passed), ``device-cpu`` (the loader's device is the CPU); on a route through the GPU's hardware
  JPEG engines (jpeg_engines.py) also ``progressive`` (they take baseline JPEGs only) and
  ``engines-refused`` (odd chroma sampling, a size they refuse); what they decode is counted
  ``engines`` (also on a three-way split, ``route_trial.ThreeWayRoute``: a share of the GPU's
  baseline JPEGs on the engines while nvJPEG decodes the rest and the CPU its share);
- an error: empty, truncated (no end-of-image marker: a cut download) or unreadable files, and
  files whose header declares more than ``max_pixels`` (decompression bombs: refused before
  anything is allocated) raise ``ImageDecodeError`` naming the file, or with
  ``on_error="skip"`` are dropped from the batch, each skip logged and counted (``skipped`` and
  ``skipped:<kind>``).

A batch is decoded in four steps (``BatchDecoder.decode``): route (probe, routes, the CPU's
share), the CPU side (started on decode threads), the GPU side (nvJPEG on the calling stage
thread meanwhile), and assemble (the CPU's images uploaded in one copy and put in place,
counts, errors or skips, the transform's geometry fitted to what was decoded).

The encoded bytes stay in the loader's pinned slot: nvJPEG's API takes host bitstreams and
DMAs them itself, so the slab needs no separate host-to-device copy.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from .cpu import (
    PACKED,
    ImageDecodeError,
    NativeJpegs,
    Refusal,
    decode_cpu,
    lower_priority,
    refusal_of,
    try_decode_cpu,
)
from .cpu import native_jpeg as _native_jpeg
from .cpu import native_regions as _native_regions
from .gpu_backend import gpu_backend
from .jpeg_engines import ENGINES, jpeg_engines, jpeg_engines_missing
from .nvjpeg import decode_gpu, front_chunks, refused_on_cpu
from .pinned import PinnedBuffers, PinnedPlaces
from .probe import (  # noqa: F401  (re-exported: the probe's names were decode's)
    ADOBE,
    ARITHMETIC,
    BAD_HEADER,
    EMPTY,
    FORMATS,
    HIGH_PRECISION,
    JPEG,
    LOSSLESS,
    OK,
    PNG,
    PROBE_COLUMNS,
    PROGRESSIVE,
    STATUS_TEXT,
    TRUNCATED,
    probe,
    probe_python,
)
from .route_trial import EngineRoute, RouteTrial, ThreeWayRoute, cpu_share_of, log_choice, on_engines
from .routing import NATIVE_ROUTES, BatchRoute, Decoded, EncodedSlices, engines_out, route, share_out
from .settings import (
    CORES_FOR_A_TRIAL,
    CORES_LEFT_TO_THE_STEP,
    CPU_THREADS_BESIDE_NVJPEG,
    GPU_MAX_PIXELS,
    TRIAL_SETTLE,
    TRIAL_WARMUP,
    TRIAL_WINDOW,
)
from .step_probe import GpuStepProbe

__all__ = ["ImageDecodeError", "BatchDecoder", "Decoded", "probe", "route", "decode_cpu", "FORMATS", "PROBE_COLUMNS"]

log = logging.getLogger("torch_fastload")


@dataclass
class CpuSide:
    """The CPU's work on a batch, running beside nvJPEG (``BatchDecoder._start_cpu``)."""

    packed: PinnedPlaces | None  # where the CPU's images go (None on a CPU device)
    pending: dict  # position -> Future of try_decode_cpu (Python decodes)
    native: Future | None  # the C++ batch decoder's call: one message per image of route.native
    job: object | None  # the work-stealing _C.JpegSplitJob
    back: Future | None  # its CPU threads' end (job.run_back)
    native_span: list  # when the C++ decoder's call ran: [start, end] in perf_counter() (a trial's balance)

    def wait(self) -> None:
        """Until nothing of it runs (exceptions are left in the futures)."""
        for future in (self.back, self.native, *self.pending.values()):
            if future is not None:
                future.exception()


class BatchDecoder:
    """Decodes a batch's slab of encoded images to ``(3, H, W)`` uint8 tensors on ``device``.

    ``cpu_share`` (default: the ``cpu_decode_share`` option, ``"auto"``) splits the images nvJPEG
    could take between nvJPEG and the CPU. ``"auto"``: the first batches go to the C++ decoder
    (libjpeg-turbo, GIL released), and it keeps them all if the training loop hardly waited and
    its step ran at the GPU's pace;
    otherwise nvJPEG is timed too, then splits of the two, and the fastest route kept (with
    ``balance_split``: a split started at once, its share balanced online from each decoder's
    busy time; ``route_trial.py``; ``self.trial`` holds the measurements and the current route).
    ``"steal"``: work stealing, nvJPEG claiming chunks from the front of the batch while the C++
    decoder's threads take images from the back, so each gets the share its speed earns (a
    training step that saturates the GPU slows nvJPEG ~9x); which decoder gets an image then
    varies from run to run. A number
    sends that fixed share, the batch's last images, to the CPU. Every CPU-decoded image of a
    batch is written into one pinned buffer and reaches the GPU in one copy."""

    def __init__(
        self,
        device,
        *,
        on_error: str = "raise",
        gpu_max_pixels: int = GPU_MAX_PIXELS,
        max_pixels: int | None = None,
        cpu_threads: int | None = None,
        cpu_share: float | None = None,
        decode_backend: str | None = None,
        engine_share: float | None = None,
    ):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.device = torch.device(device)
        self.on_error = on_error
        self.gpu_max_pixels = int(gpu_max_pixels)
        self.max_pixels = config.resolve("max_pixels", max_pixels)  # larger images are refused
        share = config.resolve("cpu_decode_share", cpu_share)
        cpus = config.cpus_per_process()
        native = self.device.type == "cuda" and _native_jpeg()
        # nvImageCodec or torchvision's nvJPEG (gpu_backend.py), or the JPEG engines alone
        # (jpeg_engines.py); chosen at the first GPU decode
        self.decode_backend = config.resolve("decode_backend", decode_backend)
        engines_only = self.decode_backend == ENGINES
        # "steal": nvJPEG and the C++ decoder split every batch by work stealing
        self.work_stealing = share == "steal" and native
        # "auto": the run's first batches try every JPEG on the C++ decoder, then nvJPEG (and the
        # JPEG engines where they work) if the training loop waited for them or its step was not
        # at the GPU's pace (step_probe.py)
        self.trial = (
            RouteTrial(
                candidates=(1.0, EngineRoute(0.0)) if engines_only else (1.0, 0.0),
                warmup=TRIAL_WARMUP,
                settle=TRIAL_SETTLE,
                window=TRIAL_WINDOW,
                on_choice=log_choice,
                steps=GpuStepProbe(self.device),
                split=True,
                balance=config.resolve("balance_split", None),
            )
            if share == "auto" and native and cpus >= CORES_FOR_A_TRIAL
            else None
        )
        self.cpu_share = share if isinstance(share, float) else 0.0
        # the route of every batch without a trial: the CPU share, the rest on the GPU decoder (or
        # a three-way split: engine_decode_share of it on the JPEG engines beside nvJPEG)
        self.fixed_route = EngineRoute(self.cpu_share) if engines_only else self.cpu_share
        engine_share = config.resolve("engine_decode_share", engine_share)
        if engine_share and isinstance(share, float) and not engines_only:
            if self.cpu_share + engine_share > 1 + 1e-9:
                raise ValueError(
                    f"cpu_decode_share {self.cpu_share:g} + engine_decode_share {engine_share:g} is over 1"
                )
            self.fixed_route = ThreeWayRoute(self.cpu_share, float(engine_share))
        # decode_backend='auto' and trial_engines: the trial is offered the JPEG engines at the
        # first batch (the check touches the GPU), where nvImageCodec's hardware decoder works here
        offer = self.trial is not None and self.decode_backend == "auto" and config.resolve("trial_engines", None)
        self._engines_offered = not offer
        self._offer_lock = threading.Lock()
        self.cpu_threads = (
            cpu_threads
            or config.resolve("cpu_decode_threads", None)
            or default_cpu_threads(1.0 if self.trial else self.cpu_share, cpus)
        )
        # the C++ decoder decodes only the rows and columns a crop reads (decode's ``crop``)
        self.decode_regions = bool(config.resolve("cpu_decode_regions", None)) and _native_regions()
        self._pool: ThreadPoolExecutor | None = None
        self._pinned = PinnedBuffers()  # per stage thread: pinned buffers and their copies' events
        self.seconds = {"probe": 0.0, "nvjpeg": 0.0, "cpu": 0.0}  # host wall time per step (diagnostics)

    def gpu_backend(self, batch: int | None = None):
        """The library decoding this decoder's GPU JPEGs off the engine routes (``gpu_backend.py``;
        ``.name`` says which); the JPEG engines where decode_backend='hardware'."""
        if self.decode_backend == ENGINES:
            return jpeg_engines(self.device, batch) if batch else jpeg_engines(self.device)
        return gpu_backend(self.device, self.decode_backend)

    def _offer_engines(self, batch: int) -> None:
        """The route trial times the JPEG engines too where they decode here (checked once)."""
        with self._offer_lock:
            if self._engines_offered:
                return
            self._engines_offered = True
            why = jpeg_engines_missing(self.device, batch)
        if why is None:
            self.trial.add_candidate(EngineRoute(0.0))
        else:
            log.info("torch_fastload: the route trial leaves out the GPU's JPEG engines: %s", why)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.cpu_threads, thread_name_prefix="fastload-decode", initializer=lower_priority
            )
        return self._pool

    def requested(self) -> None:
        """The training loop asked for a batch (its step's work is queued): a route trial marks it
        on the loop's stream."""
        if self.trial is not None:
            self.trial.requested()

    def delivered(self, waited: float) -> None:
        """The loader handed a batch to the training loop, which waited ``waited`` s for it: a
        route trial times it."""
        if self.trial is not None:
            self.trial.consumed(waited)

    def decode(self, data: torch.Tensor, offsets: np.ndarray, name, counts: dict, crop=None) -> Decoded:
        """Decode ``data[offsets[i]:offsets[i+1]]`` for every i.

        ``name(i)`` is ``(file name, dataset index)`` of image i, for errors and the log.
        ``crop(heights, widths)``, if given, draws the batch's transform geometry
        (``transforms.Geometry``) from the probed sizes before anything is decoded: the C++
        decoder then decodes only each crop's rows and columns (exactly those pixels of a whole
        decode), and that image's crop is rebased to the region it returns.
        ``counts`` gains one count per image per route.
        """
        if not self._engines_offered:
            self._offer_engines(len(offsets) - 1)
        started = time.perf_counter()
        plan = self._route(data, offsets, crop)
        cpu = self._start_cpu(plan, data, offsets)
        now = time.perf_counter()
        self.seconds["probe"] += now - started
        images: list = [None] * len(plan.routes)
        failed = dict(plan.failed)
        try:
            gpu_start = time.perf_counter()
            self._decode_on_gpu(plan, cpu.job, images, failed)
            gpu_span = (gpu_start, time.perf_counter())
        finally:  # the CPU side reads the slot and writes the pinned buffer: never leave it running
            cpu.wait()
        started, now = now, time.perf_counter()
        self.seconds["nvjpeg"] += now - started
        if self.trial is not None and len(cpu.native_span) == 2 and not plan.steal:
            gpu_images = len(plan.gpu) + len(plan.engine_part)
            self.trial.balance(len(plan.native), tuple(cpu.native_span), gpu_images, gpu_span)
        self._place(cpu.packed, self._cpu_results(plan, cpu), images, failed)
        self.seconds["cpu"] += time.perf_counter() - now
        return self._assemble(plan, images, failed, name, counts, crop)

    # -- route ---------------------------------------------------------------------------------
    def _route(self, data: torch.Tensor, offsets: np.ndarray, crop) -> BatchRoute:
        """Probe every image and decide where it is decoded."""
        chosen = self.trial.next_share() if self.trial is not None else self.fixed_route
        view = data.numpy() if data.device.type == "cpu" else data.cpu().numpy()
        info = probe(view, offsets)
        routes = route(info, self.device, self.gpu_max_pixels, self.max_pixels, on_engines(chosen))
        geometry = crop(info[:, 1].copy(), info[:, 2].copy()) if crop is not None else None
        slices = EncodedSlices(data, offsets)
        failed = {i: refusal_of(info[i], self.max_pixels) for i, r in enumerate(routes) if r.startswith("error:")}
        decodable = routes.count("nvjpeg")
        gpu, steal = share_out(routes, cpu_share_of(chosen), self.work_stealing)
        for i in gpu + steal if on_engines(chosen) else ():
            routes[i] = "engines"  # counted apart from nvJPEG's in loader.stats().decoded
        engine_part = []
        if isinstance(chosen, ThreeWayRoute) and len(gpu) > 1:  # the engines' share of the batch beside nvJPEG
            gpu, engine_part = engines_out(routes, info, gpu, int(round(chosen.engine_share * decodable)))
        cpu = [i for i, r in enumerate(routes) if r.startswith("cpu:")]
        # JPEGs nvJPEG could take go to the C++ batch decoder (one call, no GIL per image), the
        # rest (PNG, CMYK, ...) to Python threads; all beside nvJPEG
        native = (
            [i for i in cpu if routes[i] in NATIVE_ROUTES and info[i, 1] and info[i, 2]]
            if self.device.type == "cuda" and (cpu or steal) and _native_jpeg()
            else []
        )
        boxes = self._boxes(info, geometry, native + steal)
        return BatchRoute(
            info, routes, slices, geometry, failed, gpu, steal, cpu, native, boxes, on_engines(chosen), engine_part
        )

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

    # -- CPU side ------------------------------------------------------------------------------
    def _start_cpu(self, plan: BatchRoute, data: torch.Tensor, offsets: np.ndarray) -> CpuSide:
        """Start the CPU's decodes on the decode threads: Python decodes, the C++ batch decoder's
        call, and the work-stealing job's back end, each image into its place in the pinned
        buffer (each thread writes its own images there)."""
        laid_out = plan.laid_out
        packed = self._pinned.places(plan.boxes, laid_out) if laid_out and self.device.type == "cuda" else None
        native = set(plan.native)
        pending = {
            i: self._executor().submit(
                try_decode_cpu, plan.slices[i], packed.places[i].view if packed else None, max_pixels=self.max_pixels
            )
            for i in plan.cpu
            if i not in native
        }
        native_span: list = []
        native_call = (
            self._executor().submit(
                self._decode_native,
                data,
                offsets,
                plan.info,
                plan.boxes,
                plan.native,
                packed.buffer,
                packed.starts(plan.native),
                native_span,
            )
            if plan.native
            else None
        )
        job = back = None
        if plan.steal:
            job = self._split_job(
                data, offsets, plan.info, plan.boxes, plan.steal, packed.buffer, packed.starts(plan.steal)
            )
            back = self._executor().submit(job.run_back, self.cpu_threads)
        return CpuSide(packed, pending, native_call, job, back, native_span)

    def _decode_native(
        self,
        data: torch.Tensor,
        offsets: np.ndarray,
        info: np.ndarray,
        boxes: np.ndarray,
        which: list,
        buffer: torch.Tensor,
        starts: list,
        span: list | None = None,
    ) -> list:
        """The C++ batch decoder over images ``which`` (their ``boxes``) into the pinned
        ``buffer`` at ``starts``; one message an image ('' where decoded). ``span`` gets when the
        call started and returned (timed here: a future's waiter may wake before its callbacks)."""
        from .. import _C

        args = NativeJpegs.of(data, offsets, info, boxes, which, buffer, starts)
        started = time.perf_counter()
        try:
            return _C.decode_jpegs_planar(**args.kwargs(), num_threads=self.cpu_threads)
        finally:
            if span is not None:
                span[:] = [started, time.perf_counter()]

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
        """A work-stealing job over images ``which``: nvJPEG claims from the front
        (``claim_front``), the C++ decoder's threads from the back (``run_back``)."""
        from .. import _C

        return _C.JpegSplitJob(**NativeJpegs.of(data, offsets, info, boxes, which, buffer, starts).kwargs())

    def _cpu_results(self, plan: BatchRoute, cpu: CpuSide) -> dict:
        """Position -> ``PACKED`` (in its place), a decoded image, or a ``Refusal``. What the C++
        batch decoder refused, ``decode_cpu`` decodes whole (or names the reason it fails)."""
        results = {i: future.result() for i, future in cpu.pending.items()}
        done = list(zip(plan.native, cpu.native.result())) if cpu.native is not None else []
        if cpu.job is not None:
            cpu.back.result()
            messages = cpu.job.messages
            for k in range(cpu.job.split, len(plan.steal)):
                plan.routes[plan.steal[k]] = "cpu:share"
                done.append((plan.steal[k], messages[k]))
        for i, message in done:
            if message:
                results[i] = try_decode_cpu(plan.slices[i], cpu.packed.places[i].view, max_pixels=self.max_pixels)
            else:
                results[i] = PACKED
        return results

    # -- GPU side ------------------------------------------------------------------------------
    def _decode_on_gpu(self, plan: BatchRoute, job, images: list, failed: dict) -> None:
        """The GPU's images (nvJPEG's, or the JPEG engines' on an engine route: their one thread
        decodes the batch while this stage thread waits): all of ``plan.gpu`` in one call, or
        chunks claimed from the front of a work-stealing ``job``. On a three-way split the
        engines decode ``plan.engine_part`` on their thread meanwhile. What the GPU refuses is
        decoded on the CPU ('cpu:nvjpeg-error', 'cpu:engines-refused')."""
        beside = None
        if plan.engine_part:  # handed to the engines' thread first: it decodes while nvJPEG does
            encoded = [plan.slices[i] for i in plan.engine_part]
            beside = jpeg_engines(self.device, len(encoded)).submit(encoded)
        try:
            chunks = front_chunks(job, plan.steal) if job is not None else ([plan.gpu] if plan.gpu else [])
            refused = "cpu:engines-refused" if plan.engines else "cpu:nvjpeg-error"
            for chunk in chunks:
                encoded = [plan.slices[i] for i in chunk]
                backend = jpeg_engines(self.device, len(chunk)) if plan.engines else self.gpu_backend()
                decoded = decode_gpu(encoded, chunk, plan.routes, self.device, self.max_pixels, backend, refused)
                self._put(chunk, decoded, images, failed)
        finally:  # the engines read the slot: never leave their decode running
            out = beside.result() if beside is not None else None
        if out is not None:
            encoded = [plan.slices[i] for i in plan.engine_part]
            decoded = refused_on_cpu(
                out, encoded, plan.engine_part, plan.routes, self.device, self.max_pixels, "cpu:engines-refused"
            )
            self._put(plan.engine_part, decoded, images, failed)

    @staticmethod
    def _put(positions: list, decoded: list, images: list, failed: dict) -> None:
        for i, image in zip(positions, decoded):
            if isinstance(image, Refusal):  # refused by the GPU and the CPU
                failed[i] = image
            else:
                images[i] = image

    # -- assemble ------------------------------------------------------------------------------
    def _place(self, packed: PinnedPlaces | None, results: dict, images: list, failed: dict) -> None:
        """The CPU's images into ``images`` (or their refusals into ``failed``): what went into the
        pinned buffer reaches the device in one copy, each image a view of it."""
        packed_end = max((packed.places[i].end for i, r in results.items() if r is PACKED), default=0)
        flat = packed.upload(packed_end, self.device) if packed_end else None
        for i, result in results.items():
            if isinstance(result, Refusal):
                failed[i] = result
            elif result is PACKED:
                place = packed.places[i]
                images[i] = flat[place.start : place.end].view(place.shape)
            elif self.device.type == "cuda":  # a size the probe did not foresee (rare): its own copy
                images[i] = result.pin_memory().to(self.device, non_blocking=True)
            else:
                images[i] = result

    def _assemble(self, plan: BatchRoute, images: list, failed: dict, name, counts: dict, crop) -> Decoded:
        """Count the routes, raise or skip what failed, fit the geometry to what was decoded."""
        for i, r in enumerate(plan.routes):
            if i not in failed:
                counts[r] = counts.get(r, 0) + 1
        if failed:
            if self.on_error == "raise":
                i = min(failed)
                raise ImageDecodeError(*name(i), failed[i].reason)
            for i in sorted(failed):
                log.warning("torch_fastload: skipped image %d '%s': %s", name(i)[1], name(i)[0], failed[i].reason)
                kind = "skipped:" + failed[i].kind
                counts[kind] = counts.get(kind, 0) + 1
            counts["skipped"] = counts.get("skipped", 0) + len(failed)
        kept = np.array([i for i in range(len(images)) if i not in failed], dtype=np.int64)
        geometry = plan.geometry
        if geometry is not None:
            geometry = self._fit_geometry(geometry, images, plan.info, plan.boxes, crop, kept, counts)
        return Decoded([images[i] for i in kept], kept, plan.info, geometry)

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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def default_cpu_threads(share: float, cpus: int) -> int:
    """``cpu_decode_threads=0``: all but a few cores when every JPEG may go to the CPU, else
    min(8, CPUs) for the images nvJPEG cannot take and a fixed share."""
    beside = min(CPU_THREADS_BESIDE_NVJPEG, cpus)
    if share == 1:
        return max(beside, cpus - CORES_LEFT_TO_THE_STEP)
    return beside
