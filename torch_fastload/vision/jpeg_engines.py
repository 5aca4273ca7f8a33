"""The GPU's hardware JPEG engines (NVJPG: A100, H100/H200-class), which leave the SMs to the step.

nvJPEG on CUDA cores (torchvision's ``decode_jpegs_cuda``) decodes faster alone, but its kernels
share the GPU with the training step: beside a ResNet-18 step on an H100 it ran ~30 ms a batch
and slowed the step (benchmarks/RESULTS.md). DALI's mixed decoder sends most JPEGs to the
engines instead (``hw_decoder_load``, 0.9 by default). This route does the same through
nvImageCodec with its ``HW_GPU_ONLY`` backend alone: nothing falls through to its CUDA decoder.

One decoder, on one thread of its own, takes whole batches: nvImageCodec's decoders serialise
across threads (8 threads with a decoder each decoded 2,959 images/s against 14,177 for one),
and the engines are one resource of the GPU. A stage thread parses its batch's headers (host
work, off the engines' thread), hands the batch over and waits; its CPU share decodes on the
decode threads meanwhile (a three-way split's nvJPEG on the stage thread too).

The engines decode on a CUDA stream of their own, not the stage thread's. nvImageCodec's hardware
decoder orders each decode after all the work queued on the stream it is given, makes that
stream wait for the decode, and waits on the host for its previous decode before starting the
next (its hw_decoder.cpp). On the loader's copy stream, shared by every stage thread, each engine
decode would wait for the crops and resizes of the batches queued before it (slowed by the
step beside them), and those of later batches for it: the engines' batches ran 37.9 ms beside an
H200's ResNet-18 step, 16.2 ms alone. On their own stream they wait for nothing; the stage
thread's stream waits for the decode when it takes the images (an event), and the images,
allocated on the engines' stream, are marked used on the stage thread's (``record_stream``)
so their memory is not reused under it. What the engines refuse (odd chroma
sampling, a size they do not take) comes back None, and the caller decodes it on the CPU;
progressive JPEGs never reach them (``decode.route`` sends them to the CPU on this route).

Usable where nvImageCodec imports with nvJPEG and decodes a test JPEG with the engines alone
(a GPU without engines registers no hardware decoder and decodes nothing).
"""

from __future__ import annotations

import io
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .gpu_backend import DecodeBackendError, NvImageCodec, nvimgcodec_missing
from .settings import ENGINE_BATCH_HINT

__all__ = ["JpegEngines", "jpeg_engines", "jpeg_engines_missing", "ENGINES"]

ENGINES = "hardware"  # the decode_backend value, and the backend's name

log = logging.getLogger("torch_fastload")


class JpegEngines:
    """nvImageCodec's hardware decoder fed whole batches by one thread (``decode`` is thread-safe:
    callers queue). ``decode`` returns, per image, a ``(3, H, W)`` uint8 tensor on ``device``
    written on the caller's current stream, or None where the engines refused it."""

    name = ENGINES

    def __init__(self, device: torch.device, module=None, batch_hint: int = ENGINE_BATCH_HINT):
        self.device = torch.device(device)
        hint = max(1, int(batch_hint))
        self.codec = NvImageCodec(
            self.device,
            module=module,
            backends=("HW_GPU_ONLY",),
            options=f"nvjpeg_hw_decoder:preallocate_batch_size={hint}",  # as DALI sets it: its batch size
        )
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fastload-jpeg-engines")
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self.batches = 0  # batches decoded (diagnostics, tests)

    def decode(self, encoded: list) -> list:
        return self.submit(encoded).result()

    def submit(self, encoded: list) -> EngineDecode:
        """``decode``'s result to come: the caller goes on meanwhile (a three-way split's nvJPEG)
        and takes it with ``.result()`` on the same thread (its stream then waits for the decode)."""
        caller = torch.cuda.current_stream(self.device) if self.stream is not None else None
        codes = self.codec.parse(encoded)  # the headers on the caller's thread: the engines' thread only decodes
        return EngineDecode(self._thread.submit(self._decode, codes), caller)

    def _decode(self, codes: list):
        """On the engines' thread: ``(images, event recorded after them)`` (no event off the GPU)."""
        self.batches += 1
        if self.stream is None:
            return self.codec.decode_parsed(codes), None
        with torch.cuda.stream(self.stream):  # the block and the decode on the engines' own stream
            images = self.codec.decode_parsed(codes)
            done = torch.cuda.Event()
            done.record(self.stream)
        return images, done

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class EngineDecode:
    """A batch handed to the engines (``JpegEngines.submit``)."""

    def __init__(self, future: Future, caller):
        self.future = future
        self.caller = caller  # the submitting thread's stream, or None off the GPU

    def result(self) -> list:
        """The images (None where refused), the caller's stream ordered after their decode and
        their memory marked used on it."""
        images, done = self.future.result()
        if done is not None:
            self.caller.wait_event(done)
            seen = set()
            for image in images:  # views of one block: one mark a block
                block = image.untyped_storage().data_ptr() if image is not None else None
                if block is not None and block not in seen:
                    seen.add(block)
                    image.record_stream(self.caller)
        return images


_lock = threading.Lock()
_made: dict = {}  # device -> JpegEngines, or the reason they cannot be used (str)


def jpeg_engines(device, batch_hint: int = ENGINE_BATCH_HINT) -> JpegEngines:
    """The engines' decoder for ``device``, made and self-tested once a process; raises
    ``DecodeBackendError`` saying why where they cannot be used."""
    made = _engines(device, batch_hint)
    if isinstance(made, str):
        raise DecodeBackendError(
            f"decode_backend='{ENGINES}': {made}. It needs nvImageCodec (`pip install nvidia-nvimgcodec-cu13 "
            "nvidia-nvjpeg`) and a GPU with hardware JPEG engines (A100, H100, H200)"
        )
    return made


def jpeg_engines_missing(device, batch_hint: int = ENGINE_BATCH_HINT) -> str | None:
    """Why the engines cannot decode on ``device`` in this process, or None where they can."""
    made = _engines(device, batch_hint)
    return made if isinstance(made, str) else None


def _engines(device, batch_hint: int):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _made:
            _made[device] = _make(device, batch_hint)
        return _made[device]


def _make(device: torch.device, batch_hint: int):
    if device.type != "cuda":
        return f"the JPEG engines decode on a GPU, not on {device}"
    reason = nvimgcodec_missing()
    if reason is not None:
        return reason
    try:
        engines = JpegEngines(device, batch_hint=batch_hint)
        reason = self_test(engines)
    except Exception as exc:  # noqa: BLE001 - any failure to set them up means: not here
        return f"nvImageCodec's hardware decoder failed on {device}: {type(exc).__name__}: {exc}"
    if reason is not None:
        engines.close()
        return reason
    return engines


def self_test(engines: JpegEngines) -> str | None:
    """Decode a baseline 4:2:0 JPEG of ImageNet's size on the engines alone: None where it decodes
    right, else why not (no engines: nvImageCodec registers no hardware decoder and returns None)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (320, 240), (200, 40, 90)).save(out, format="JPEG", quality=90)
    encoded = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    image = engines.decode([encoded])[0]
    if image is None and engines.codec.output == "torch":  # a build that decodes only into its own images
        engines.codec.output = "library"
        image = engines.decode([encoded])[0]
        if image is not None:
            log.warning("torch_fastload: the JPEG engines decode into nvImageCodec's own images, not torch's")
    if engines.device.type == "cuda":
        torch.cuda.current_stream(engines.device).synchronize()
    if image is None:
        return (
            "nvImageCodec's hardware decoder decoded nothing (this GPU has no JPEG engines, or its driver hides them)"
        )
    if tuple(image.shape) != (3, 240, 320):
        return f"the JPEG engines decoded a 320x240 JPEG to {tuple(image.shape)}"
    if (image[:, 120, 160].cpu().int() - torch.tensor([200, 40, 90])).abs().max() > 8:
        return f"the JPEG engines decoded (200, 40, 90) as {image[:, 120, 160].tolist()}"
    return None


def _reset_for_tests(device=None, engines=None) -> None:
    """Forget what was made (or set ``device``'s outcome: tests fake the engines)."""
    with _lock:
        if device is None:
            _made.clear()
        else:
            _made[torch.device(device)] = engines
