"""The GPU JPEG decode's library (vision/gpu_backend.py): nvImageCodec where usable, torchvision's
nvJPEG as the fallback; the choice and its errors on the CPU, with the import monkeypatched."""

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
def fresh_choice():
    gpu_backend._reset_for_tests()
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

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "nvidia.nvimgcodec" else real(name, *a)
    )
    monkeypatch.setattr(gpu_backend, "_load_nvjpeg", lambda: False)
    reason = gpu_backend.nvimgcodec_missing()
    assert "libnvjpeg.so.13" in reason and "nvidia-nvjpeg" in reason


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
