"""The GPU JPEG decode's library (vision/gpu_backend.py): nvImageCodec where usable, torchvision's
nvJPEG as the fallback; the choice and its errors on the CPU, with the import monkeypatched."""

import ctypes
import io
import types

import numpy as np
import pytest
import torch
from PIL import Image

import torch_fastload
from torch_fastload.vision import gpu_backend
from torch_fastload.vision.cpu import Refusal
from torch_fastload.vision.gpu_backend import DecodeBackendError, NvImageCodec, TorchvisionNvjpeg
from torch_fastload.vision.nvjpeg import decode_gpu

GPU = torch.device("cuda", 0)  # only named: nothing below touches a device


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """A fresh choice a test, and nvJPEG called directly not usable unless a test says so (a GPU
    box would otherwise set up the real one)."""
    gpu_backend._reset_for_tests()
    monkeypatch.setattr(gpu_backend, "_direct_nvjpeg", lambda device: "not in these tests")
    yield
    gpu_backend._reset_for_tests()


def fake_nvimgcodec():
    """The names NvImageCodec.__init__ reads, without the library."""
    enum = types.SimpleNamespace
    return types.SimpleNamespace(
        __version__="0.9.0-fake",
        DecodeParams=lambda **kw: kw,
        ColorSpec=enum(SRGB="srgb"),
        SampleFormat=enum(P_RGB="planar"),
    )


class FakeCodeStream:
    """nvimgcodec.CodeStream over host bytes: the header parsed at once (PIL here)."""

    def __init__(self, array):
        try:
            self.pixels = Image.open(io.BytesIO(array.tobytes())).convert("RGB")
            self.pixels.load()
        except Exception as exc:
            raise RuntimeError(f"Could not parse input bitstream: {exc}") from None
        self.width, self.height = self.pixels.size


class FakeImage:
    """nvimgcodec.as_image over a caller's buffer: the buffer and the stream it was wrapped on."""

    def __init__(self, tensor, cuda_stream, sample_format):
        self.tensor, self.cuda_stream, self.sample_format = tensor, cuda_stream, sample_format


class FakeDecoder:
    """nvimgcodec.Decoder: decodes into the images given, else allocates its own (counted)."""

    made = []

    def __init__(self, **kw):
        self.kw, self.calls, self.library_images = kw, [], 0
        FakeDecoder.made.append(self)

    def decode(self, codes, images=None, params=None, cuda_stream=0, image=None):
        single = not isinstance(codes, list)
        codes, images = ([codes], [image]) if single else (codes, images or [None] * len(codes))
        self.calls.append(dict(batch=len(codes), images=images, cuda_stream=cuda_stream, params=params))
        out = []
        for code, target in zip(codes, images):
            planar = torch.from_numpy(np.array(code.pixels)).permute(2, 0, 1)
            if target is None:
                self.library_images += 1
                out.append(planar.contiguous())  # exported to torch by DLPack
                continue
            assert target.cuda_stream == cuda_stream, "wrapped on another stream: nvImageCodec syncs the host"
            assert target.sample_format == "planar" and tuple(target.tensor.shape) == tuple(planar.shape)
            target.tensor.copy_(planar)
            out.append(target)
        return out[0] if single else out


def fake_nvimgcodec_decoding():
    """fake_nvimgcodec() with the decode path: CodeStream, as_images, Decoder, Backend."""
    nv = fake_nvimgcodec()
    nv.CodeStream = FakeCodeStream
    nv.as_images = lambda views, cuda_stream=0, *, sample_format=None: [
        FakeImage(view, cuda_stream, sample_format) for view in views
    ]
    nv.Decoder = FakeDecoder
    nv.Backend = lambda kind, load_hint=1.0: kind if load_hint == 1.0 else (kind, load_hint)
    nv.BackendKind = types.SimpleNamespace(HW_GPU_ONLY="hw", GPU_ONLY="cuda")
    FakeDecoder.made = []
    return nv


def missing(monkeypatch, reason="nvidia.nvimgcodec is not installed (pip install nvidia-nvimgcodec-cu13)"):
    def fail():
        raise ImportError(reason)

    monkeypatch.setattr(gpu_backend, "_import_nvimgcodec", fail)


def test_auto_falls_back_to_torchvision_when_nvimgcodec_is_missing(monkeypatch):
    missing(monkeypatch)
    assert isinstance(gpu_backend.gpu_backend(GPU, "auto"), TorchvisionNvjpeg)
    with pytest.raises(DecodeBackendError, match=r"not installed.*pip install nvidia-nvimgcodec-cu13"):
        gpu_backend.gpu_backend(GPU, "nvimgcodec")


def test_auto_prefers_torchvision_nvjpeg_while_it_exists(monkeypatch):
    """Measured faster on the GPU (RESULTS.md): auto takes it even where nvImageCodec works."""
    monkeypatch.setattr(gpu_backend, "_import_nvimgcodec", fake_nvimgcodec)
    monkeypatch.setattr(gpu_backend, "_self_test", lambda backend: None)
    monkeypatch.setattr(gpu_backend, "torchvision_nvjpeg_available", lambda: True)
    assert isinstance(gpu_backend.gpu_backend(GPU, "auto"), TorchvisionNvjpeg)
    assert isinstance(gpu_backend.gpu_backend(GPU, "nvimgcodec"), NvImageCodec)


def test_auto_takes_nvimgcodec_when_torchvision_lacks_nvjpeg(monkeypatch):
    monkeypatch.setattr(gpu_backend, "torchvision_nvjpeg_available", lambda: False)
    monkeypatch.setattr(gpu_backend, "_import_nvimgcodec", fake_nvimgcodec)
    monkeypatch.setattr(gpu_backend, "_self_test", lambda backend: None)
    chosen = gpu_backend.gpu_backend(GPU, "auto")
    assert isinstance(chosen, NvImageCodec) and chosen.name == "nvimgcodec"
    assert chosen.params == dict(
        apply_exif_orientation=False, color_spec="srgb", allow_any_depth=False, sample_format="planar"
    )
    assert gpu_backend.gpu_backend(GPU, "auto") is chosen  # made once
    assert isinstance(gpu_backend.gpu_backend(GPU, "torchvision"), TorchvisionNvjpeg)  # never tries it


def test_nvimgcodec_that_cannot_decode_is_not_used(monkeypatch):
    monkeypatch.setattr(gpu_backend, "torchvision_nvjpeg_available", lambda: False)
    monkeypatch.setattr(gpu_backend, "_import_nvimgcodec", fake_nvimgcodec)
    monkeypatch.setattr(gpu_backend, "_self_test", lambda backend: "nvImageCodec decoded no JPEG")
    assert isinstance(gpu_backend.gpu_backend(GPU, "auto"), TorchvisionNvjpeg)
    with pytest.raises(DecodeBackendError, match="decoded no JPEG"):
        gpu_backend.gpu_backend(GPU, "nvimgcodec")


def test_missing_nvjpeg_library_is_named(monkeypatch):
    """nvImageCodec without libnvjpeg imports but registers no JPEG decoder: said, not silent."""
    import importlib.util
    import sys

    # a GPU box that has nvImageCodec imported it in an earlier test: the import is cached there
    monkeypatch.delitem(sys.modules, "nvidia.nvimgcodec", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "nvidia.nvimgcodec" else real(name, *a)
    )
    monkeypatch.setattr(gpu_backend, "_load_nvjpeg", lambda: False)
    reason = gpu_backend.nvimgcodec_missing()
    assert "libnvjpeg.so.13" in reason and "nvidia-nvjpeg" in reason


class FakeDirect:
    name = "nvjpeg"
    library = "libnvjpeg-fake.so"


def test_nvjpeg_called_directly_is_taken_when_asked_not_by_auto(monkeypatch):
    """'nvjpeg' takes it; auto does not (faster alone, not faster inside the loader or beside a
    step: RESULTS.md); 'torchvision' never tries it."""
    direct = FakeDirect()
    monkeypatch.setattr(gpu_backend, "_direct_nvjpeg", lambda device: direct)
    monkeypatch.setattr(gpu_backend, "torchvision_nvjpeg_available", lambda: True)
    assert gpu_backend.gpu_backend(GPU, "nvjpeg") is direct
    assert isinstance(gpu_backend.gpu_backend(GPU, "auto"), TorchvisionNvjpeg)
    assert isinstance(gpu_backend.gpu_backend(GPU, "torchvision"), TorchvisionNvjpeg)


def test_nvjpeg_that_cannot_be_used_is_named(monkeypatch):
    monkeypatch.setattr(gpu_backend, "_direct_nvjpeg", lambda device: "libnvjpeg was not found")
    with pytest.raises(DecodeBackendError, match=r"decode_backend='nvjpeg': libnvjpeg was not found.*nvidia-nvjpeg"):
        gpu_backend.gpu_backend(GPU, "nvjpeg")


def test_direct_nvjpeg_is_not_tried_off_the_gpu(monkeypatch):
    monkeypatch.undo()  # the real _direct_nvjpeg
    reason = gpu_backend._direct_nvjpeg(torch.device("cpu"))
    assert isinstance(reason, str) and "CUDA device" in reason


class FakeNvjpegLibrary:
    """libnvjpeg's batched calls, recorded: what DirectNvjpeg hands nvJPEG, checked on the CPU."""

    def __init__(self, fail_batches_over: int = 1 << 30):
        self.fail_batches_over = fail_batches_over
        self.batches = []

    def nvjpegDecodeBatchedInitialize(self, handle, state, n, threads, output_format):
        self.initialized = (n, threads, output_format)
        return 0

    def nvjpegDecodeBatched(self, handle, state, data, lengths, images, stream):
        from torch_fastload.vision.nvjpeg_direct import IMAGE_T

        n = self.initialized[0]
        as_array = lambda address, dtype: np.frombuffer(  # noqa: E731
            (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(address), dtype=dtype
        ).copy()
        self.batches.append((as_array(data, np.uint64), as_array(lengths, np.uint64), as_array(images, IMAGE_T)))
        return 3 if n > self.fail_batches_over else 0  # NVJPEG_STATUS_BAD_JPEG for a batch with a bad one


def test_direct_nvjpeg_hands_planar_rgb_planes_and_bitstreams_in_place():
    """Each image's three planes (R, G, B) one after another in its view, pitch its width, and
    the bitstreams read where they lie (no copy)."""
    from torch_fastload.vision.nvjpeg_direct import _OUTPUT_RGB, DirectNvjpeg

    direct = DirectNvjpeg.__new__(DirectNvjpeg)
    direct.lib, direct.handle = FakeNvjpegLibrary(), None
    slab = torch.arange(40, dtype=torch.uint8)
    encoded = [slab[0:10], slab[10:25]]
    block = torch.empty(3 * 4 * 6 + 3 * 2 * 5, dtype=torch.uint8)
    views = [block[:72].view(3, 4, 6), block[72:].view(3, 2, 5)]
    stream = types.SimpleNamespace(cuda_stream=0)
    assert direct._decode_batch(None, stream, encoded, views) == 0
    assert direct.lib.initialized == (2, 1, _OUTPUT_RGB)
    data, lengths, images = direct.lib.batches[0]
    assert data.tolist() == [slab.data_ptr(), slab.data_ptr() + 10] and lengths.tolist() == [10, 15]
    base = block.data_ptr()
    assert images["channel"][0].tolist() == [base, base + 24, base + 48, 0]
    assert images["channel"][1].tolist() == [base + 72, base + 82, base + 92, 0]
    assert images["pitch"][0].tolist() == [6, 6, 6, 0] and images["pitch"][1].tolist() == [5, 5, 5, 0]
    direct.lib = FakeNvjpegLibrary(fail_batches_over=1)
    assert direct._decode_batch(None, stream, encoded, views) == 3  # the caller then decodes each alone
    assert direct._decode_batch(None, stream, encoded[:1], views[:1]) == 0


def test_direct_nvjpeg_lanes_one_per_call_at_once_reused_by_later_threads():
    """Calls at once each hold a lane (an nvJPEG state holds one batch); a lane given back is
    taken by the next call whichever thread makes it, so threads made anew each epoch add none."""
    import threading

    from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg

    direct = DirectNvjpeg.__new__(DirectNvjpeg)
    direct._lanes_lock, direct._free_lanes, direct._lanes, direct.lanes_made = threading.Lock(), [], [], 0
    direct._new_lane = lambda: object()
    first, second = direct._take_lane(), direct._take_lane()
    assert first is not second and direct.lanes_made == 2
    direct._give_back(first)
    direct._give_back(second)
    taken = []
    for _ in range(4):  # four short-lived threads, one after another
        thread = threading.Thread(target=lambda: (taken.append(direct._take_lane()), direct._give_back(taken[-1])))
        thread.start()
        thread.join()
    assert all(lane is second for lane in taken) and direct.lanes_made == 2
    assert direct._lanes == [first, second]  # synchronize() waits on each


def test_decode_backend_option_and_environment(monkeypatch):
    assert torch_fastload.config.get("decode_backend") == "auto"
    monkeypatch.setenv("TORCH_FASTLOAD_DECODE_BACKEND", "torchvision")
    assert torch_fastload.config.get("decode_backend") == "torchvision"
    with pytest.raises(ValueError, match="decode_backend"):
        torch_fastload.config.resolve("decode_backend", "dali")
    decoder = torch_fastload.vision.decode.BatchDecoder("cpu", decode_backend="nvimgcodec")
    assert decoder.decode_backend == "nvimgcodec"


def jpeg(color) -> torch.Tensor:
    out = io.BytesIO()
    Image.new("RGB", (24, 16), color).save(out, format="JPEG", quality=95)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def test_what_the_gpu_refuses_is_decoded_on_the_cpu():
    """A backend's None (nvImageCodec's per-image refusal) sends that image to the CPU decoders."""

    class RefusesTheSecond:
        name = "fake"

        def decode(self, encoded):
            return [torch.zeros(3, 16, 24, dtype=torch.uint8), None, torch.zeros(3, 16, 24, dtype=torch.uint8)]

    encoded = [jpeg((10, 20, 30)), jpeg((200, 100, 50)), jpeg((0, 0, 0))]
    encoded_bad = encoded[:2] + [torch.zeros(10, dtype=torch.uint8)]
    routes = ["nvjpeg"] * 3
    out = decode_gpu(encoded, [0, 1, 2], routes, torch.device("cpu"), 1 << 24, RefusesTheSecond())
    assert routes == ["nvjpeg", "cpu:nvjpeg-error", "nvjpeg"]
    assert out[1].shape == (3, 16, 24) and np.abs(out[1][:, 8, 12].int().numpy() - [200, 100, 50]).max() <= 4

    class RefusesAll:
        name = "fake"

        def decode(self, encoded):
            return [None] * len(encoded)

    routes = ["nvjpeg"] * 3
    out = decode_gpu(encoded_bad, [4, 5, 6], ["x"] * 7, torch.device("cpu"), 1 << 24, RefusesAll())
    assert isinstance(out[2], Refusal) and out[2].kind in ("empty", "undecodable", "bad-header", "truncated")


def sized_jpeg(color, size) -> torch.Tensor:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="JPEG", quality=95)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def test_nvimgcodec_decodes_into_one_torch_block():
    """The batch's pixels go into torch memory nvImageCodec is handed (as_images + images=), on the
    same stream: nvImageCodec allocates no output image (a cudaMallocAsync each, from a pool that
    gives its memory back at every synchronisation); what it cannot parse is None."""
    nv = fake_nvimgcodec_decoding()
    backend = NvImageCodec(torch.device("cpu"), module=nv)
    colors = [(10, 20, 30), (200, 100, 50), (0, 120, 240)]
    sizes = [(24, 16), (40, 8), (17, 33)]
    encoded = [sized_jpeg(c, s) for c, s in zip(colors, sizes)]
    encoded.insert(2, torch.zeros(10, dtype=torch.uint8))  # not a JPEG
    out = backend.decode(encoded)
    assert out[2] is None
    decoded = [out[0], out[1], out[3]]
    for image, color, (w, h) in zip(decoded, colors, sizes):
        assert image.shape == (3, h, w) and image.dtype == torch.uint8 and image.is_contiguous()
        assert (image[:, h // 2, w // 2].int() - torch.tensor(color)).abs().max() <= 8
    assert len({image.untyped_storage().data_ptr() for image in decoded}) == 1  # one block a batch
    (decoder,) = FakeDecoder.made
    assert decoder.library_images == 0
    assert [call["batch"] for call in decoder.calls] == [3]
    assert decoder.kw["backends"] == ["hw", "cuda"] and "options" not in decoder.kw  # the library's defaults


def test_nvimgcodec_library_output_is_kept_to_measure_against():
    """output='library' (the earlier behaviour, for benchmarks): the same pixels, in images
    nvImageCodec allocated itself."""
    nv = fake_nvimgcodec_decoding()
    encoded = [sized_jpeg((200, 100, 50), (24, 16)), torch.zeros(10, dtype=torch.uint8)]
    library = NvImageCodec(torch.device("cpu"), module=nv, output="library").decode(encoded)
    into_torch = NvImageCodec(torch.device("cpu"), module=nv).decode(encoded)
    assert library[1] is None and into_torch[1] is None
    assert torch.equal(library[0], into_torch[0])
    assert [d.library_images for d in FakeDecoder.made] == [1, 0]
    with pytest.raises(ValueError, match="output must be"):
        NvImageCodec(torch.device("cpu"), module=nv, output="dlpack")


def test_nvimgcodec_that_cannot_wrap_torch_tensors_uses_its_own_images(caplog):
    """An nvImageCodec whose as_images refuses planar tensors still decodes (its own images), said once."""
    nv = fake_nvimgcodec_decoding()

    def refuse(views, cuda_stream=0, *, sample_format=None):
        raise ValueError("sample_format P_RGB requires an HWC-shaped input")

    nv.as_images = refuse
    backend = NvImageCodec(torch.device("cpu"), module=nv)
    encoded = [sized_jpeg((200, 100, 50), (24, 16))]
    with caplog.at_level("WARNING", logger="torch_fastload"):
        first, second = backend.decode(encoded), backend.decode(encoded)
    assert first[0].shape == (3, 16, 24) and torch.equal(first[0], second[0])
    assert FakeDecoder.made[0].library_images == 2
    assert sum("cannot decode into torch tensors" in r.message for r in caplog.records) == 1
