"""Fuzz the image decode paths with mutated PNG, JPEG, GIF, WebP and BMP files.

Seeded mutants of small valid images (bit flips, flips in the header, flips with the PNG chunk
CRCs fixed so the damage reaches the decoder, truncations, size fields rewritten, bytes cut or
repeated) go into an ImageFolder, then through
- ``ds[i]`` for every file,
- torch_fastload's DataLoader with ``on_error="skip"`` (every batch),
- the same with ``on_error="raise"`` (restarted after each refused file).
Each file must decode to a ``(3, H, W)`` uint8 tensor or be refused with ``ImageDecodeError``
naming it; any other exception is a failure, and a crash kills this process (run it in a
subprocess: tests/test_image_fuzz.py). Data memory is capped (``--memory-limit``), so a file
that makes a decoder allocate gigabytes fails with MemoryError instead of taking the machine.

Exit status 0 means no failure; the last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import sys
import time
import zlib

import numpy as np

EXTENSIONS = (".png", ".jpg", ".gif", ".webp", ".bmp")


def base_images(seed: int) -> list[tuple[str, bytes]]:
    """(extension, bytes) of small valid images in the formats and modes the fuzz mutates."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    h, w = 48, 64
    ramp = np.linspace(0, 255, h * w * 3).reshape(h, w, 3)
    rgb = Image.fromarray((ramp + rng.normal(0, 12, ramp.shape)).clip(0, 255).astype(np.uint8))

    def save(image, **kwargs) -> bytes:
        out = io.BytesIO()
        image.save(out, **kwargs)
        return out.getvalue()

    frames = [rgb.convert("P"), rgb.rotate(90, expand=False).convert("P")]
    return [
        (".jpg", save(rgb, format="JPEG", quality=90)),
        (".jpg", save(rgb, format="JPEG", quality=75, progressive=True)),
        (".jpg", save(rgb, format="JPEG", quality=90, subsampling=0)),
        (".jpg", save(rgb.convert("L"), format="JPEG")),
        (".jpg", save(rgb.convert("CMYK"), format="JPEG")),
        (".png", save(rgb, format="PNG")),
        (".png", save(rgb.convert("P"), format="PNG")),
        (".png", save(rgb.convert("L"), format="PNG")),
        (".png", save(rgb.convert("RGBA"), format="PNG")),
        (".png", save(rgb, format="PNG", compress_level=0)),
        (".gif", save(rgb.convert("P"), format="GIF")),
        (".gif", save(frames[0], format="GIF", save_all=True, append_images=frames[1:])),
        (".webp", save(rgb, format="WEBP", quality=80)),
        (".webp", save(rgb, format="WEBP", lossless=True)),
        (".bmp", save(rgb, format="BMP")),
    ]


def _png_fix_crcs(data: bytearray) -> bytearray:
    """Recompute every chunk's CRC, so a decoder reads the damaged chunk instead of refusing it."""
    i = 8
    while i + 12 <= len(data):
        length = int.from_bytes(data[i : i + 4], "big")
        end = i + 8 + length
        if end + 4 > len(data):
            break
        data[end : end + 4] = zlib.crc32(bytes(data[i + 4 : end])).to_bytes(4, "big")
        i = end + 4
    return data


def _rewrite_size(ext: str, data: bytearray, rng: random.Random) -> bytearray:
    """Size fields set to random (often huge) values: PNG's IHDR, GIF's screen, BMP's, JPEG's SOF."""
    big = rng.choice([0, 1, 255, 32000, 65535, rng.randrange(1 << 16)])
    if ext == ".png" and len(data) >= 24:
        data[16 + 4 * rng.randrange(2) : 20 + 4 * rng.randrange(2)] = big.to_bytes(4, "big")
        return _png_fix_crcs(data)
    if ext == ".gif" and len(data) >= 10:
        data[6 + 2 * rng.randrange(2) : 8 + 2 * rng.randrange(2)] = big.to_bytes(2, "little")
    elif ext == ".bmp" and len(data) >= 26:
        data[18 + 4 * rng.randrange(2) : 22 + 4 * rng.randrange(2)] = big.to_bytes(4, "little")
    elif ext == ".jpg":
        sof = next((k for k in range(2, len(data) - 9) if data[k] == 0xFF and data[k + 1] in (0xC0, 0xC2)), None)
        if sof is not None:
            data[sof + 5 + 2 * rng.randrange(2) : sof + 7 + 2 * rng.randrange(2)] = big.to_bytes(2, "big")
    elif ext == ".webp" and len(data) >= 30:
        data[26:30] = rng.randrange(1 << 32).to_bytes(4, "little")
    return data


def mutate(ext: str, blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    """(kind, mutant) of one valid image."""
    data = bytearray(blob)
    kind = rng.choice(["flip", "flip", "flip-header", "flip-crc", "truncate", "size", "splice"])
    if kind == "flip-crc" and ext != ".png":
        kind = "flip"
    if kind in ("flip", "flip-crc"):
        for _ in range(rng.randint(1, 8)):
            k = rng.randrange(len(data))
            data[k] ^= 1 << rng.randrange(8)
        if kind == "flip-crc":
            data = _png_fix_crcs(data)
    elif kind == "flip-header":
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(min(64, len(data)))
            data[k] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "size":
        data = _rewrite_size(ext, data, rng)
    else:  # splice: a stretch cut out or repeated
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 256))
        data = data[:a] + data[b:] if rng.random() < 0.5 else data[:b] + data[a:b] + data[b:]
    return kind, bytes(data)


def write_folder(root: str, count: int, seed: int) -> list[str]:
    """``count`` mutants as ``root/mutants/NNNNN-<kind>.<ext>`` (an ImageFolder of one class)."""
    rng = random.Random(seed)
    bases = base_images(seed)
    os.makedirs(os.path.join(root, "mutants"), exist_ok=True)
    paths = []
    for n in range(count):
        ext, blob = bases[n % len(bases)]
        kind, data = mutate(ext, blob, rng)
        path = os.path.join(root, "mutants", f"{n:05d}-{kind}{ext}")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


class Findings:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.failures: list[str] = []
        self.counts: dict = {}

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def fail(self, where: str, exc: BaseException) -> None:
        self.failures.append(f"{where}: {type(exc).__name__}: {exc}")
        print(f"FAIL {where}: {type(exc).__name__}: {exc}", flush=True)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def check_image(image) -> None:
    import torch

    if not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3):
        raise AssertionError(f"not a (3, H, W) uint8 tensor: {getattr(image, 'shape', type(image))}")
    if image.shape[0] != 3 or image.shape[1] < 1 or image.shape[2] < 1:
        raise AssertionError(f"decoded shape {tuple(image.shape)}")


def check_refusal(exc, names: set, where: str, findings: Findings) -> None:
    if exc.name not in names or exc.name not in str(exc):
        findings.fail(where, AssertionError(f"ImageDecodeError does not name its file: {exc}"))


def sample_path(ds, paths: list[str], findings: Findings) -> None:
    """``ds[i]`` for every file."""
    from torch_fastload.vision import ImageDecodeError

    for i, path in enumerate(paths):
        if findings.out_of_time():
            return
        print(f"ds[{i}] {path}", flush=True)  # the last line names the file if this process dies
        try:
            image, _ = ds[i]
            check_image(image)
            findings.count("sample:decoded")
        except ImageDecodeError as exc:
            findings.count("sample:refused")
            check_refusal(exc, {path}, f"ds[{i}] {path}", findings)
        except Exception as exc:
            findings.fail(f"ds[{i}] {path}", exc)


def batch_path(ds, paths: list[str], device: str, on_error: str, findings: Findings) -> None:
    """torch_fastload's DataLoader over every file; with on_error='raise', a fresh loader starts
    after each refused file."""
    from torch_fastload import DataLoader
    from torch_fastload.vision import ImageDecodeError

    ds.on_error = on_error
    ds._decoders.clear()  # decoders are made with the dataset's on_error
    left = list(range(len(paths)))
    while left and not findings.out_of_time():
        print(f"batch on_error={on_error} from {left[0]} {paths[left[0]]}", flush=True)
        loader = DataLoader(ds, batch_size=16, sampler=left, device=device)
        taken = 0
        try:
            for images, labels in loader:
                for image in images:
                    check_image(image.cpu())
                taken += len(labels)
                findings.count(f"batch-{on_error}:decoded", len(labels))
            findings.count(f"batch-{on_error}:skipped", loader.stats().decoded.get("skipped", 0))
            if on_error == "skip" and taken + loader.stats().decoded.get("skipped", 0) != len(left):
                raise AssertionError(f"{taken} images kept + skipped of {len(left)}")
            return
        except ImageDecodeError as exc:
            findings.count(f"batch-{on_error}:refused")
            check_refusal(exc, {paths[i] for i in left}, f"batch on_error={on_error}", findings)
            if on_error == "skip" or exc.index not in left:
                findings.fail(f"batch on_error={on_error}", exc)
                return
            left = left[left.index(exc.index) + 1 :]
        except Exception as exc:
            findings.fail(f"batch on_error={on_error} from {paths[left[0]]}", exc)
            return


def _data_bytes(device: str) -> int:
    """The process's data memory (VmData) with the device's runtime up: the cap is set above it.
    A CUDA context, torch's and nvJPEG's libraries and ~200 driver threads' stacks hold ~4 GB of
    it on the H100 machine, so a fixed 6 GiB cap left new threads no room: thread creation then
    failed ("can't start new thread") or the process aborted, in 4 of 4 runs at ca1c48d."""
    if device.startswith("cuda"):
        import torch

        torch.empty(1, device=device)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="where the mutants are written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=300, help="mutant files")
    p.add_argument("--seconds", type=float, default=120.0, help="stop checking after this long")
    p.add_argument("--device", default="cpu", help="the batch path's device (cpu or cuda)")
    p.add_argument(
        "--memory-limit",
        type=int,
        default=6 << 30,
        help="data memory allowed beyond the process's own once CUDA is up, in bytes (0: no cap)",
    )
    args = p.parse_args(argv)
    if args.memory_limit:
        cap = _data_bytes(args.device) + args.memory_limit
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    from torch_fastload.sources import ImageFolder

    started = time.monotonic()
    paths = write_folder(args.dir, args.count, args.seed)
    ds = ImageFolder(args.dir, transform=None, extensions=EXTENSIONS)
    assert ds.paths == paths, "the folder lists other files than the mutants"
    findings = Findings(started + args.seconds)
    sample_path(ds, paths, findings)
    batch_path(ds, paths, args.device, "skip", findings)
    batch_path(ds, paths, args.device, "raise", findings)
    summary = {
        "seed": args.seed,
        "files": len(paths),
        "seconds": round(time.monotonic() - started, 1),
        "out_of_time": findings.out_of_time(),
        "failures": len(findings.failures),
        **findings.counts,
    }
    print(json.dumps(summary), flush=True)
    return 1 if findings.failures else 0


if __name__ == "__main__":
    sys.exit(main())
