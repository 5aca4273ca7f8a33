"""Bad image files (issue 18): no crash on damaged files, decompression bombs refused from their
header, and every refusal a typed ImageDecodeError naming the file, on ``ds[i]`` and on the
batch path (``on_error="raise"`` and ``"skip"``)."""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import torch_fastload
from torch_fastload import DataLoader
from torch_fastload.sources import ImageFolder
from torch_fastload.vision import ImageDecodeError
from torch_fastload.vision.decode import decode_cpu

pytest.importorskip("torchvision")

FUZZ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_images.py")
BOMB = 32000  # the case: a 1.4 KB JPEG declaring 32000x32000 took a minute and 6.5 GB in ds[i]


def run_fuzz(tmp_path, *args) -> dict:
    """tests/fuzz_images.py in a subprocess (a crash there fails this test, not pytest): its summary."""
    res = subprocess.run(
        [sys.executable, FUZZ, "--dir", str(tmp_path / "fuzz"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = "\n".join((res.stdout + res.stderr).splitlines()[-40:])
    assert res.returncode == 0, f"exit status {res.returncode} (negative: killed by that signal); last lines:\n{tail}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_fuzzed_images_never_crash_and_are_decoded_or_refused_by_name(tmp_path):
    """300 seeded mutants of PNG, JPEG, GIF, WebP and BMP files (bit flips, truncations, size
    fields rewritten, ...) through ds[i] and the DataLoader with on_error='skip' and 'raise'."""
    summary = run_fuzz(tmp_path, "--seed", "0", "--count", "300", "--seconds", "120")
    assert summary["failures"] == 0 and summary["files"] == 300
    checked = summary.get("sample:decoded", 0) + summary.get("sample:refused", 0)
    assert checked == 300 or summary["out_of_time"]
    # both outcomes occur: the mutants reach the decoders, not only the probe
    assert summary["sample:decoded"] > 0 and summary["sample:refused"] > 0
    assert summary.get("batch-skip:skipped", 0) > 0 and summary.get("batch-raise:refused", 0) > 0


@pytest.mark.cuda
def test_fuzzed_images_through_the_gpu_batch_path(tmp_path):
    """The same mutants with the batch path on CUDA (nvJPEG, pinned buffers, the C++ decoder)."""
    summary = run_fuzz(tmp_path, "--seed", "1", "--count", "300", "--seconds", "180", "--device", "cuda")
    assert summary["failures"] == 0 and summary.get("batch-skip:skipped", 0) > 0


# -- decompression bombs ------------------------------------------------------------------------


def jpeg_declaring(height: int, width: int) -> bytes:
    """A valid 16x16 JPEG whose frame header declares ``height`` x ``width`` (632 bytes)."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(out, format="JPEG")
    data = bytearray(out.getvalue())
    sof = next(k for k in range(2, len(data)) if data[k] == 0xFF and data[k + 1] == 0xC0)
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def png_declaring(height: int, width: int) -> bytes:
    """A PNG whose IHDR declares ``height`` x ``width`` RGB, with one small IDAT (69 bytes)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def photo_folder(root, count: int = 6) -> list[str]:
    """``root/a/NN.jpg``: small valid JPEGs."""
    os.makedirs(root / "a")
    paths = []
    rng = np.random.default_rng(0)
    for k in range(count):
        path = str(root / "a" / f"{k:02d}.jpg")
        Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(path, format="JPEG")
        paths.append(path)
    return paths


class PeakRSS:
    """The largest resident set size seen while the ``with`` block runs (sampled every 2 ms)."""

    def __enter__(self):
        psutil = pytest.importorskip("psutil")
        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


@pytest.mark.parametrize("make", [jpeg_declaring, png_declaring], ids=["jpeg", "png"])
def test_a_decompression_bomb_is_refused_from_its_header(tmp_path, make, caplog):
    """A tiny file declaring 32000x32000 pixels: ds[i] and both batch paths refuse it with an
    ImageDecodeError naming the file and the declared size, without allocating its pixels."""
    paths = photo_folder(tmp_path)
    bomb = paths[2]
    with open(bomb, "wb") as f:
        f.write(make(BOMB, BOMB))
    ds = ImageFolder(tmp_path, transform=None, extensions=(".jpg",))
    with PeakRSS() as rss:
        with pytest.raises(ImageDecodeError, match=f"{BOMB}x{BOMB}.*max_pixels=178,956,970") as info:
            ds[2]
    assert info.value.name == bomb and bomb in str(info.value) and info.value.index == 2
    assert rss.growth < 64 << 20, f"RSS grew {rss.growth >> 20} MiB"  # the pixels: 3 GB

    with PeakRSS() as rss, pytest.raises(ImageDecodeError, match=f"{BOMB}x{BOMB}") as info:
        for _ in DataLoader(ds, batch_size=4, device="cpu"):
            pass
    assert info.value.name == bomb and rss.growth < 64 << 20

    skipping = ImageFolder(tmp_path, transform=None, extensions=(".jpg",), on_error="skip")
    loader = DataLoader(skipping, batch_size=4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="torch_fastload"):
        kept = sum(len(labels) for _, labels in loader)
    decoded = loader.stats().decoded
    assert kept == len(paths) - 1
    assert decoded["skipped"] == 1 and decoded["skipped:max-pixels"] == 1
    assert any(bomb in r.getMessage() and f"{BOMB}x{BOMB}" in r.getMessage() for r in caplog.records)


def test_max_pixels_is_an_option_and_an_argument(tmp_path, monkeypatch):
    """TORCH_FASTLOAD_MAX_PIXELS and max_pixels= lower the limit (a 56x40 image is 2,240
    pixels); a bad value is refused naming the option."""
    photo_folder(tmp_path, 2)
    assert torch_fastload.config.get("max_pixels") == 178_956_970
    monkeypatch.setenv("TORCH_FASTLOAD_MAX_PIXELS", "2000")
    with pytest.raises(ImageDecodeError, match="56x40 pixels.*max_pixels=2,000"):
        ImageFolder(tmp_path, transform=None)[0]
    assert ImageFolder(tmp_path, transform=None, max_pixels=2240)[0][0].shape == (3, 40, 56)
    monkeypatch.delenv("TORCH_FASTLOAD_MAX_PIXELS")
    with pytest.raises(ImageDecodeError, match="max_pixels=2,239"):
        next(iter(DataLoader(ImageFolder(tmp_path, transform=None, max_pixels=2239), batch_size=2, device="cpu")))
    with pytest.raises(ValueError, match="max_pixels"):
        ImageFolder(tmp_path, max_pixels=0)


def test_a_size_the_probe_cannot_read_is_checked_from_pils_header_parse():
    """WebP sizes are not probed: PIL reads the header, and the limit applies before decoding."""
    out = io.BytesIO()
    Image.new("RGB", (100, 80), (1, 2, 3)).save(out, format="WEBP")
    encoded = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    assert decode_cpu(encoded).shape == (3, 80, 100)
    with pytest.raises(ValueError, match="100x80 pixels"):
        decode_cpu(encoded, max_pixels=7999)


# -- empty files and on_error on ds[i] ------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_empty_file_through_ds_i_is_a_typed_error_naming_it(tmp_path, on_error):
    """ds[i] on an empty file raised numpy's 'buffer length (0)' without the file's name. A
    sample cannot be dropped from torch's DataLoader, so on_error='skip' raises too and says so;
    the batch path skips the file."""
    paths = photo_folder(tmp_path, 5)
    open(paths[1], "wb").close()
    ds = ImageFolder(tmp_path, transform=None, on_error=on_error)
    with pytest.raises(ImageDecodeError, match="empty file") as info:
        ds[1]
    assert info.value.name == paths[1] and paths[1] in str(info.value) and info.value.index == 1
    assert ("ds[i] cannot drop its sample" in str(info.value)) == (on_error == "skip")
    if on_error == "skip":
        loader = DataLoader(ds, batch_size=2, device="cpu")
        assert sum(len(labels) for _, labels in loader) == 4
        assert loader.stats().decoded["skipped:empty"] == 1
