"""nvJPEG's batched decode called directly (ctypes), for ``decode_backend='nvjpeg'``.

torchvision's ``decode_jpegs_cuda`` calls the same library with the same hardware backend, but
behind one process-wide mutex (one batch at a time however many stage threads ask), and it
waits on the host for every batch. Here calls at once each run on a lane of their own (an nvJPEG
state and a stream), lanes pooled and reused whichever thread calls next (the loader's stage
threads are made anew each epoch: a state per thread was remade every epoch, its buffers
allocated inside the next batches, and never freed; the loader then fed 0.36x torchvision's
rate). The host does not wait for its own batch: the caller's stream waits for the decode by an
event, and a lane is reused only once its previous batch is done.

Measured on H100s (RESULTS.md, 2026-11-28): alone, one thread 18.4-24.7k images/s against
torchvision's 13.1-21.3k on the same instances, the same pixels (max difference 0); in the loader
(3 stage threads) 0.68-0.97x torchvision's rate. Beside a ResNet-18 step (21.8 ms alone) its
decode slows little (37 -> 41 ms a batch; torchvision's 24 -> 55 ms), and the fed step was
27.0-30.7 ms against torchvision's 28.0-31.3: ahead on two instances, behind on a third, within
one instance's spread. Its streams run at the step's (normal) priority: at high priority it took
SMs from the step (31.3 ms against 30.7). Opt-in, not ``auto``: alone it feeds less.

What no GPU decoder escapes: the engines' decode needs the SMs too. Beside a ResNet-18 step
replayed from a CUDA graph (the SMs 100% busy), torchvision's nvJPEG decoded 1.05-1.1k images/s
(21k alone) and the engines sat idle (``nvidia-smi dmon``: jpg 0-1%). That is why the route trial
times the CPU route on the run itself.

The library is the libnvjpeg torchvision ships (``torchvision.libs``), the ``nvidia-nvjpeg``
wheel's, or the system's. ``decode`` takes what torchvision's op takes (1-D uint8 CPU tensors,
best pinned: nvJPEG reads them in place) and returns, per image, a ``(3, H, W)`` uint8 CUDA view
of one block, or None where nvJPEG refuses it (the caller decodes those on the CPU).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import numpy as np
import torch

__all__ = ["DirectNvjpeg", "NvjpegError", "find_libnvjpeg"]

_SUCCESS = 0
_ARCH_MISMATCH = 7
_BACKEND_DEFAULT = 0
_BACKEND_GPU_HYBRID = 2
_BACKEND_HARDWARE = 3
_OUTPUT_RGB = 3
_MAX_COMPONENT = 4

# nvjpegImage_t: unsigned char* channel[4]; size_t pitch[4]
IMAGE_T = np.dtype([("channel", np.uint64, (_MAX_COMPONENT,)), ("pitch", np.uint64, (_MAX_COMPONENT,))])


class NvjpegError(RuntimeError):
    """nvJPEG could not be set up (its status named)."""


def find_libnvjpeg() -> str | None:
    """The path of a libnvjpeg that loads: torchvision's bundled copy first (the one its op
    uses), then the nvidia-nvjpeg wheel's, then the loader's search path (None where none)."""
    candidates = []
    try:
        import torchvision

        libs = os.path.join(os.path.dirname(os.path.dirname(torchvision.__file__)), "torchvision.libs")
        candidates += sorted(glob.glob(os.path.join(libs, "libnvjpeg*.so*")))
    except ImportError:
        pass
    for entry in sys.path:
        candidates += glob.glob(os.path.join(entry or ".", "nvidia", "cu13", "lib", "libnvjpeg.so.13"))
        candidates += glob.glob(os.path.join(entry or ".", "nvidia", "nvjpeg", "lib", "libnvjpeg.so.1*"))
    for name in (*candidates, "libnvjpeg.so.13", "libnvjpeg.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


class _Lane:
    """One nvJPEG state (its buffers hold one batch at a time), the stream its decodes run on,
    and the event of its last batch."""

    __slots__ = ("state", "stream", "done")

    def __init__(self, state, stream):
        self.state, self.stream, self.done = state, stream, None


class DirectNvjpeg:
    """Batched nvJPEG decode on ``device``: the GPU's hardware JPEG engines where it has them
    (``engines=False``: nvJPEG's CUDA decoder, kept to measure against); calls at once each on a
    lane of their own (an nvJPEG state and a stream), lanes reused from call to call."""

    name = "nvjpeg"
    self_test_size = (320, 240)  # the engines' kind of JPEG (gpu_backend's self-test): a tiny one may go elsewhere

    def __init__(self, device: torch.device, library: str | None = None, priority: str = "normal", engines=True):
        if priority not in ("high", "normal"):
            raise ValueError(f"priority must be 'high' or 'normal', not {priority!r}")
        self.device = torch.device(device)
        path = library or find_libnvjpeg()
        if path is None:
            raise NvjpegError("libnvjpeg was not found (torchvision's copy, nvidia-nvjpeg, or the system's)")
        self.library = path
        self.lib = ctypes.CDLL(path)  # CDLL: the decode call releases the GIL
        # the header read (microseconds an image) keeps it: giving it up and taking it back 256
        # times a batch, beside the loader's other Python threads, could wait a switch interval each
        self.header = ctypes.PyDLL(path)
        self.priority = priority
        self._declare()
        self.handle = ctypes.c_void_p()
        backend = _BACKEND_HARDWARE if engines else _BACKEND_GPU_HYBRID
        status = self.lib.nvjpegCreateEx(backend, None, None, 0, ctypes.byref(self.handle))
        self.hardware = engines and status == _SUCCESS
        if status == _ARCH_MISMATCH:  # no engines on this GPU: nvJPEG's CUDA decoder
            status = self.lib.nvjpegCreateEx(_BACKEND_DEFAULT, None, None, 0, ctypes.byref(self.handle))
        if status != _SUCCESS:
            raise NvjpegError(f"nvjpegCreateEx failed: nvJPEG status {status}")
        self._lanes_lock = threading.Lock()
        self._free_lanes: list = []
        self._lanes: list = []  # every lane made, free or held by a call
        self.lanes_made = 0  # as many as calls ever ran at once
        self.failed_batches: dict = {}  # nvJPEG status -> batches it failed (then decoded one image at a time)

    def _declare(self) -> None:
        lib, p, i, u = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        for name, args in {
            "nvjpegCreateEx": (i, p, p, u, p),
            "nvjpegJpegStateCreate": (p, p),
            "nvjpegDecodeBatchedInitialize": (p, p, i, i, i),
            "nvjpegDecodeBatched": (p, p, p, p, p, p),
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        info = self.header.nvjpegGetImageInfo
        info.argtypes, info.restype = (p, p, ctypes.c_size_t, p, p, p, p), ctypes.c_int

    def _take_lane(self) -> _Lane:
        """A lane no other call holds: the last one given back (its buffers warm), or a new one.
        Lanes outlive the threads that use them: the loader's stage threads are made anew each
        epoch, and a state a thread kept would be made again (its buffers allocated again inside
        the next batches) and never freed."""
        with self._lanes_lock:
            if self._free_lanes:
                return self._free_lanes.pop()
        lane = self._new_lane()
        with self._lanes_lock:
            self.lanes_made += 1
            self._lanes.append(lane)
        return lane

    def _give_back(self, lane: _Lane) -> None:
        with self._lanes_lock:
            self._free_lanes.append(lane)

    def _new_lane(self) -> _Lane:
        state = ctypes.c_void_p()
        status = self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(state))
        if status != _SUCCESS:
            raise NvjpegError(f"nvjpegJpegStateCreate failed: nvJPEG status {status}")
        # torch maps a priority beyond the device's range to its highest
        stream = torch.cuda.Stream(device=self.device, priority=-64 if self.priority == "high" else 0)
        return _Lane(state, stream)

    def decode(self, encoded: list) -> list:
        """Each JPEG of ``encoded`` as a (3, H, W) uint8 view on the device, written before any
        later work of the caller's current stream; None where refused."""
        if not encoded:
            return []
        shapes = [self._shape(t) for t in encoded]
        index = [k for k, s in enumerate(shapes) if s is not None]
        out: list = [None] * len(encoded)
        if not index:
            return out
        lane = self._take_lane()
        try:
            return self._decode_on(lane, encoded, shapes, index, out)
        finally:
            self._give_back(lane)

    def _decode_on(self, lane: _Lane, encoded: list, shapes: list, index: list, out: list) -> list:
        stream = lane.stream
        if lane.done is not None:  # the state's buffers are free once its previous batch is decoded
            lane.done.synchronize()
        caller = torch.cuda.current_stream(self.device)
        sizes = [3 * shapes[k][0] * shapes[k][1] for k in index]
        with torch.cuda.stream(stream):  # from this stream's pool: ordered after its own earlier use
            # no wait for the caller's stream: the decode reads host bytes only, and the loader's
            # copy stream, shared by every stage thread, holds other batches' transforms
            block = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        views, offset = {}, 0
        for k, size in zip(index, sizes):
            h, w = shapes[k]
            views[k] = block[offset : offset + size].view(3, h, w)
            offset += size
        status = self._decode_batch(lane.state, stream, [encoded[k] for k in index], [views[k] for k in index])
        if status == _SUCCESS:
            for k in index:
                out[k] = views[k]
        else:  # one bad JPEG fails the batch: each alone, so it costs only itself
            with self._lanes_lock:
                self.failed_batches[status] = self.failed_batches.get(status, 0) + 1
            for k in index:
                if self._decode_batch(lane.state, stream, [encoded[k]], [views[k]]) == _SUCCESS:
                    out[k] = views[k]
        done = torch.cuda.Event()
        done.record(stream)
        lane.done = done  # recorded before synchronize() can see it
        caller.wait_event(done)
        block.record_stream(caller)
        return out

    def synchronize(self) -> None:
        """Wait until every batch whose decode call has returned is decoded."""
        with self._lanes_lock:
            events = [lane.done for lane in self._lanes if lane.done is not None]
        for event in events:
            event.synchronize()

    def _decode_batch(self, state, stream, encoded: list, views: list) -> int:
        """nvJPEG's status for decoding ``encoded`` into ``views`` on ``stream``."""
        n = len(encoded)
        data = np.array([t.data_ptr() for t in encoded], dtype=np.uint64)
        lengths = np.array([t.numel() for t in encoded], dtype=np.uint64)
        # planar RGB: three planes of H x W one after another, pitch W (whole arrays at once: a
        # per-image loop over the record fields held the GIL 0.65 ms a batch of 256, this 0.23,
        # on the 2-core build machine)
        base = np.array([v.data_ptr() for v in views], dtype=np.uint64)
        height = np.array([v.shape[1] for v in views], dtype=np.uint64)
        width = np.array([v.shape[2] for v in views], dtype=np.uint64)
        images = np.zeros(n, dtype=IMAGE_T)
        plane = height * width
        images["channel"][:, :3] = base[:, None] + plane[:, None] * np.arange(3, dtype=np.uint64)
        images["pitch"][:, :3] = width[:, None]
        status = self.lib.nvjpegDecodeBatchedInitialize(self.handle, state, n, 1, _OUTPUT_RGB)
        if status != _SUCCESS:
            return status
        return self.lib.nvjpegDecodeBatched(
            self.handle, state, data.ctypes.data, lengths.ctypes.data, images.ctypes.data, stream.cuda_stream
        )

    def _shape(self, tensor) -> tuple | None:
        """(height, width) from nvJPEG's own header read: the output block is sized by what it
        will write, never by another parser's reading."""
        comps, sampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * _MAX_COMPONENT)(), (ctypes.c_int * _MAX_COMPONENT)()
        status = self.header.nvjpegGetImageInfo(
            self.handle,
            tensor.data_ptr(),
            tensor.numel(),
            ctypes.byref(comps),
            ctypes.byref(sampling),
            widths,
            heights,
        )
        if status != _SUCCESS or widths[0] <= 0 or heights[0] <= 0 or sampling.value < 0:
            return None
        return heights[0], widths[0]
