"""The library behind the GPU's JPEG decode: nvJPEG called directly, NVIDIA nvImageCodec, or
torchvision's nvJPEG op.

torchvision 0.29 deprecates its image decoding, so the GPU route does not depend on it alone.
nvImageCodec (``pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg``) decodes a batch with the
GPU's hardware JPEG engines (A100/H100-class: baseline JPEGs) and its CUDA decoder for the rest
(progressive), writes planar RGB straight into torch tensors (as_images: torch's caching allocator
owns the memory, nvImageCodec allocates no output image): no host copy, no layout change. Its
IDCT and chroma upsampling may round differently from nvJPEG's in torchvision and from
libjpeg-turbo's; tests compare it with the CPU decode within a tolerance.

``decode_backend`` (option, ``TORCH_FASTLOAD_DECODE_BACKEND``): 'auto' takes torchvision's
nvJPEG while torchvision offers it (measured faster than nvImageCodec on an H200: 21,012 against
14,177 decoded images/s alone and 9,388 against 2,268 images/s through the loader); else
nvImageCodec, if it imports, finds libnvjpeg and decodes a test image on the device. 'nvjpeg'
calls nvJPEG directly (nvjpeg_direct.py: no process-wide lock, no host wait; faster alone, not
faster inside the loader or beside a step), 'nvimgcodec' and 'torchvision' take that library ('nvjpeg'
and 'nvimgcodec' raise ``DecodeBackendError`` saying what is missing).
Every backend returns, per image, a ``(3, H, W)`` uint8 CUDA tensor or None where refused (the
caller decodes those on the CPU).
"""

from __future__ import annotations

import ctypes
import glob
import io
import logging
import os
import sys
import tempfile
import threading
from contextlib import contextmanager

import torch

from .. import config
from ..errors import FastloadError
from .cpu import RGB, torchvision_ops
from .settings import NVIMGCODEC_CPU_THREADS

__all__ = ["DecodeBackendError", "TorchvisionNvjpeg", "NvImageCodec", "gpu_backend", "nvimgcodec_missing"]

log = logging.getLogger("torch_fastload")

NVJPEG_SONAME = "libnvjpeg.so.13"  # the CUDA 13 nvJPEG nvImageCodec's cu13 build loads


class DecodeBackendError(FastloadError, ImportError):
    """decode_backend names a GPU decode library that cannot be used here, and why."""


class TorchvisionNvjpeg:
    """``torch.ops.image.decode_jpegs_cuda``: one call a batch; a batch it refuses is retried one
    image at a time, so one bad file costs only itself."""

    name = "torchvision"

    def __init__(self, device: torch.device):
        self.device = device

    def decode(self, encoded: list) -> list:
        ops = torchvision_ops()
        try:
            return list(ops.decode_jpegs_cuda(encoded, RGB, self.device))
        except RuntimeError:
            pass
        out = []
        for tensor in encoded:
            try:
                out.append(ops.decode_jpegs_cuda([tensor], RGB, self.device)[0])
            except RuntimeError:
                out.append(None)
        return out


class NvImageCodec:
    """nvImageCodec's batched decode on ``device``: hardware engines first, then its CUDA decoder;
    one decoder per calling thread (a Decoder keeps per-call state for its caller, so the loader's
    stage threads each get their own), on the thread's current stream (the loader's copy stream),
    EXIF orientation not applied (as the other routes).

    The pixels land in torch tensors (``output='torch'``, the default): one caching-allocator block
    a batch, each image a planar view of it, wrapped with ``as_images`` and handed to
    ``Decoder.decode(images=...)``, which decodes into them. Left to itself (``output='library'``,
    kept to measure against) nvImageCodec allocates every output image with ``cudaMallocAsync`` from
    the device's default memory pool, whose release threshold of 0 hands the memory back to the
    driver at each synchronisation, so every batch maps fresh device memory and unmaps it again;
    on an H200 that slowed a ResNet-50 step beside the loader 4.19x. Wrapping and decoding on the
    same stream also keeps nvImageCodec's reuse path from synchronising the host with the buffer's
    stream."""

    name = "nvimgcodec"

    def __init__(
        self,
        device: torch.device,
        module=None,
        output: str = "torch",
        options: str = "",
        backends: tuple = ("HW_GPU_ONLY", "GPU_ONLY"),
    ):
        if output not in ("torch", "library"):
            raise ValueError(f"NvImageCodec output must be 'torch' or 'library', not {output!r}")
        self.nv = module if module is not None else _import_nvimgcodec()
        self.device = device
        self.output = output
        self.options = options  # nvImageCodec decoder options, e.g. nvjpeg_hw_decoder:preallocate_batch_size=256
        # nvImageCodec BackendKind names, each given every image it takes (load_hint 1): the
        # hardware engines, then the CUDA decoder for the rest; ("HW_GPU_ONLY",) for the engines alone
        self.backends = tuple(backends)
        nv = self.nv
        self.params = nv.DecodeParams(
            apply_exif_orientation=False,
            color_spec=nv.ColorSpec.SRGB,
            allow_any_depth=False,
            sample_format=nv.SampleFormat.P_RGB,
        )
        self._local = threading.local()
        self._warned = False

    def _decoder(self):
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            nv = self.nv
            extra = {"options": self.options} if self.options else {}  # else the library's default options
            decoder = self._local.decoder = nv.Decoder(
                device_id=self.device.index if self.device.index is not None else 0,
                max_num_cpu_threads=NVIMGCODEC_CPU_THREADS,
                backends=[nv.Backend(getattr(nv.BackendKind, kind), load_hint=1.0) for kind in self.backends],
                **extra,
            )
        return decoder

    def _stream(self) -> int:
        """The calling thread's current stream as nvImageCodec takes it (0 off the GPU: tests)."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    def decode(self, encoded: list) -> list:
        return self.decode_parsed(self.parse(encoded))

    def parse(self, encoded: list) -> list:
        """Each image's nvImageCodec CodeStream (its header parsed; None where unreadable): host
        work a caller can do before handing the batch to another thread (jpeg_engines.py)."""
        return [self._code_stream(tensor) for tensor in encoded]

    def decode_parsed(self, codes: list) -> list:
        """``decode`` of what ``parse`` gave."""
        if self.output == "library":
            return self._decode_to_library_images(codes)
        return self._decode_to_torch(codes)

    def _code_stream(self, tensor):
        try:
            return self.nv.CodeStream(tensor.numpy())  # host bytes, read in place; parses the header
        except (RuntimeError, ValueError):
            return None

    def _decode_to_torch(self, codes: list) -> list:
        """Each parsed JPEG decoded into a (3, H, W) view of one torch block; None where refused."""
        out = [None] * len(codes)
        shapes = {}
        for i, code in enumerate(codes):
            try:
                if code is not None:
                    shapes[i] = (3, int(code.height), int(code.width))
            except (RuntimeError, ValueError):
                continue
        if not shapes:
            return out
        block = torch.empty(sum(c * h * w for c, h, w in shapes.values()), dtype=torch.uint8, device=self.device)
        views, offset = {}, 0
        for i, (c, h, w) in shapes.items():
            views[i] = block[offset : offset + c * h * w].view(c, h, w)
            offset += c * h * w
        index = list(views)
        stream = self._stream()
        nv = self.nv
        try:
            targets = nv.as_images([views[i] for i in index], cuda_stream=stream, sample_format=nv.SampleFormat.P_RGB)
        except (RuntimeError, ValueError, TypeError) as exc:  # an nvImageCodec that cannot wrap planar tensors
            if not self._warned:
                self._warned = True
                log.warning("torch_fastload: nvImageCodec cannot decode into torch tensors (%s); using its own", exc)
            return self._decode_to_library_images(codes)
        try:
            decoded = self._decoder().decode(
                [codes[i] for i in index], images=targets, params=self.params, cuda_stream=stream
            )
        except (RuntimeError, ValueError):  # the batch as a whole: each image alone
            decoded = [self._decode_one(codes[i], target) for i, target in zip(index, targets)]
        for i, image in zip(index, decoded):
            if image is not None:
                out[i] = views[i]
        return out

    def _decode_to_library_images(self, codes: list) -> list:
        """nvImageCodec's own output images (one cudaMallocAsync each), shared with torch by DLPack."""
        out = [None] * len(codes)
        index = [i for i, code in enumerate(codes) if code is not None]
        if not index:
            return out
        try:
            images = self._decoder().decode([codes[i] for i in index], params=self.params, cuda_stream=self._stream())
        except (RuntimeError, ValueError):
            images = [self._decode_one(codes[i]) for i in index]
        for i, image in zip(index, images):
            out[i] = None if image is None else self._tensor(image)
        return out

    def _decode_one(self, code, target=None):
        try:
            if target is None:
                return self._decoder().decode(code, params=self.params, cuda_stream=self._stream())
            return self._decoder().decode(code, image=target, params=self.params, cuda_stream=self._stream())
        except (RuntimeError, ValueError):
            return None

    def _tensor(self, image) -> torch.Tensor:
        """A library-allocated planar image as a torch tensor over the same device memory (DLPack,
        synchronised with the current stream); copied only where rows are padded."""
        try:
            tensor = torch.from_dlpack(image)
        except (TypeError, RuntimeError, BufferError):
            tensor = torch.as_tensor(image, device=self.device)  # __cuda_array_interface__
        if tensor.dim() == 3 and tensor.shape[0] == 1:  # a gray plane, should the codec keep one
            tensor = tensor.expand(3, -1, -1)
        return tensor if tensor.is_contiguous() else tensor.contiguous()


_lock = threading.Lock()
_chosen: dict = {}  # (choice, device) -> backend
_import_error: list = []  # why nvImageCodec is unusable, once found


def gpu_backend(device: torch.device, choice: str | None = None):
    """The GPU decode backend for ``device`` by ``choice`` (default: the ``decode_backend``
    option), made once a process."""
    choice = config.resolve("decode_backend", choice)
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        backend = _chosen.get((choice, device))
        if backend is None:
            backend = _chosen[(choice, device)] = _make(choice, device)
        return backend


def _make(choice: str, device: torch.device):
    if choice == "nvjpeg":
        made = _direct_nvjpeg(device)
        if isinstance(made, str):
            raise DecodeBackendError(
                f"decode_backend='nvjpeg': {made}. It needs a libnvjpeg (torchvision's CUDA wheels ship one; "
                "else pip install nvidia-nvjpeg) and a CUDA device"
            )
        log.info("torch_fastload: GPU JPEG decode by nvJPEG (%s) on %s", made.library, device)
        return made
    if choice == "torchvision" or (choice == "auto" and torchvision_nvjpeg_available()):
        return TorchvisionNvjpeg(device)
    reason = nvimgcodec_missing()
    backend = None
    if reason is None:
        try:
            backend = NvImageCodec(device)
            reason = _self_test(backend)
        except Exception as exc:  # noqa: BLE001 - any failure to set it up means: not here
            reason = f"nvImageCodec could not decode on {device}: {type(exc).__name__}: {exc}"
    if reason is None:
        log.info("torch_fastload: GPU JPEG decode by nvImageCodec %s on %s", backend.nv.__version__, device)
        return backend
    if choice == "nvimgcodec":
        raise DecodeBackendError(
            f"decode_backend='nvimgcodec': {reason}. Install it with `pip install nvidia-nvimgcodec-cu13 "
            "nvidia-nvjpeg` (CUDA 13), or set decode_backend='auto' to fall back to torchvision's nvJPEG"
        )
    log.info("torch_fastload: GPU JPEG decode by torchvision's nvJPEG (nvImageCodec not used: %s)", reason)
    return TorchvisionNvjpeg(device)


def _direct_nvjpeg(device: torch.device):
    """nvJPEG called directly on ``device`` (nvjpeg_direct.py), set up and self-tested; or why
    it cannot be used here (str)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"nvJPEG decodes on a CUDA device, not on {device}"
    from .nvjpeg_direct import DirectNvjpeg

    try:
        backend = DirectNvjpeg(device)
        reason = _self_test(backend)
    except (OSError, RuntimeError) as exc:  # NvjpegError is a RuntimeError
        return f"nvJPEG could not be set up on {device}: {exc}"
    return backend if reason is None else reason


def torchvision_nvjpeg_available() -> bool:
    """Whether this torchvision still registers its batched nvJPEG op (deprecated since 0.29)."""
    try:
        return hasattr(torchvision_ops(), "decode_jpegs_cuda")
    except Exception:  # noqa: BLE001 - no torchvision, or one that fails to import
        return False


def nvimgcodec_missing() -> str | None:
    """Why nvImageCodec cannot decode JPEGs in this process, or None where it can be imported with
    its nvJPEG found (it loads nvJPEG itself and, without it, registers no JPEG decoder)."""
    try:
        _import_nvimgcodec()
    except ImportError as exc:
        return str(exc)
    return None


def _import_nvimgcodec():
    """``nvidia.nvimgcodec``, with libnvjpeg loaded first (from the ``nvidia-nvjpeg`` wheel or
    the system) and the messages its import prints about optional codecs (JPEG 2000, TIFF) kept
    out of the user's terminal (logged at debug level)."""
    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"]
    if _import_error:
        raise ImportError(_import_error[0])
    try:
        import importlib.util

        if importlib.util.find_spec("nvidia.nvimgcodec") is None:
            raise ModuleNotFoundError
    except (ModuleNotFoundError, ValueError):
        _import_error.append("nvidia.nvimgcodec is not installed (pip install nvidia-nvimgcodec-cu13)")
        raise ImportError(_import_error[0]) from None
    if not _load_nvjpeg():
        _import_error.append(f"{NVJPEG_SONAME} was not found (pip install nvidia-nvjpeg)")
        raise ImportError(_import_error[0])
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "1")  # errors only
    try:
        with _stderr_to_log():
            from nvidia import nvimgcodec
    except (ImportError, OSError) as exc:
        _import_error.append(f"nvidia.nvimgcodec failed to import: {exc}")
        raise ImportError(_import_error[0]) from exc
    return nvimgcodec


def _load_nvjpeg() -> bool:
    """Load libnvjpeg (global symbols) so nvImageCodec's nvJPEG extension finds it by name."""
    candidates = [
        path
        for entry in sys.path
        for path in glob.glob(os.path.join(entry or ".", "nvidia", "cu13", "lib", NVJPEG_SONAME))
    ]
    for name in (*candidates, NVJPEG_SONAME):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


@contextmanager
def _stderr_to_log():
    """File descriptor 2 into a temporary file for the block (C libraries print there), then its
    text logged at debug level."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace").strip()
            if text:
                log.debug("torch_fastload: nvImageCodec's import said: %s", text)


def _self_test(backend) -> str | None:
    """Decode a small JPEG on the device: None where it decodes, else why not (no JPEG decoder
    registered, no hardware engine and no CUDA decoder, a driver problem). Its size is the
    backend's ``self_test_size`` where it has one (the JPEG engines are tested at ImageNet's)."""
    from PIL import Image

    who = "nvImageCodec" if backend.name == "nvimgcodec" else "nvJPEG"
    width, height = getattr(backend, "self_test_size", (32, 16))
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(out, format="JPEG", quality=95)
    encoded = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    image = backend.decode([encoded])[0]
    torch.cuda.current_stream(backend.device).synchronize()
    if image is None:
        return f"{who} decoded no JPEG (no nvJPEG decoder registered)"
    if tuple(image.shape) != (3, height, width) or not image.is_cuda:
        return f"{who} decoded a {width}x{height} JPEG to {tuple(image.shape)} on {image.device}"
    centre = image[:, height // 2, width // 2]
    if (centre.cpu().int() - torch.tensor([200, 40, 90])).abs().max() > 8:
        return f"{who} decoded (200, 40, 90) as {centre.tolist()}"
    return None


def _reset_for_tests() -> None:
    """Forget the backends chosen and the import's outcome (tests monkeypatch the import)."""
    with _lock:
        _chosen.clear()
        _import_error.clear()
