"""Image pipeline: header probe, routing, decode, transforms, ImageFolder / packs through the loader.

CPU tests run in CI; the ``cuda`` tests check nvJPEG against the CPU decode and the fused
transform kernel against its torchvision reference on the GPU machine.
"""

import io
import logging
import os
import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import torch_fastload
from torch_fastload import DataLoader
from torch_fastload.sources import ImageFolder, PackedImageFolder
from torch_fastload.vision import EvalTransform, TrainTransform, decode, route_trial, transforms
from torch_fastload.vision.decode import ImageDecodeError, probe, probe_python, route
from torch_fastload.vision.route_trial import RouteTrial
from torch_fastload.vision.sample_data import make_image_folder

tv = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """10 classes x 4 train images of real photographs, with a gray, CMYK, PNG-named-.JPEG and
    progressive file (the 4000x3000 one is left to the GPU tests: slow on a 2-core CPU)."""
    root = tmp_path_factory.mktemp("images")
    train, val = make_image_folder(
        str(root),
        classes=10,
        train_per_class=4,
        val_per_class=2,
        edge_cases=("gray", "cmyk", "png", "progressive"),
        progress=False,
    )
    return train, val


def encoded(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, **save)
    return out.getvalue()


def photo(size=(64, 48)) -> Image.Image:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, size[0] * size[1] * 3).reshape(size[1], size[0], 3)
    return Image.fromarray((base + rng.normal(0, 10, base.shape)).clip(0, 255).astype(np.uint8))


def torchvision_decode(encoded: torch.Tensor) -> torch.Tensor:
    """torchvision's CPU decode (libjpeg-turbo), the reference the C++ decoder matches bit for
    bit (on valid files only: the package never calls it, it crashes on damaged PNGs)."""
    return tv.io.decode_image(encoded, mode=tv.io.ImageReadMode.RGB)


def slab(blobs):
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return np.frombuffer(b"".join(blobs), dtype=np.uint8).copy(), offsets


# -- probe ---------------------------------------------------------------------------------


def test_probe_reads_format_size_components_and_flags():
    img = photo()
    blobs = [
        encoded(img, format="JPEG"),
        encoded(img, format="JPEG", progressive=True),
        encoded(img.convert("L"), format="JPEG"),
        encoded(img.convert("CMYK"), format="JPEG"),
        encoded(img, format="PNG"),
        encoded(img, format="GIF"),
        encoded(img, format="BMP"),
        encoded(img, format="WEBP"),
        b"",
        b"not an image at all",
    ]
    data, offsets = slab(blobs)
    info = probe(data, offsets)
    fmt, h, w, comps, flags, status = info.T
    assert fmt.tolist() == [1, 1, 1, 1, 2, 3, 5, 4, 0, 0]
    assert (h[:7] == 48).all() and (w[:7] == 64).all()
    assert comps[:4].tolist() == [3, 3, 1, 4]
    assert flags[1] & decode.PROGRESSIVE and not flags[0] & decode.PROGRESSIVE
    assert flags[3] & decode.ADOBE  # PIL writes CMYK JPEGs with an Adobe segment
    assert status.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, decode.EMPTY, decode.BAD_HEADER]


def test_probe_finds_truncation_anywhere():
    jpeg = encoded(photo((200, 150)), format="JPEG", quality=90)
    png = encoded(photo(), format="PNG")
    cuts = [jpeg[:n] for n in (3, 20, 200, len(jpeg) // 2, len(jpeg) - 2, len(jpeg) - 1)] + [png[: len(png) - 5]]
    info = probe(*slab(cuts))
    assert (info[:, 5] == decode.TRUNCATED).all(), info
    assert probe(*slab([jpeg + b"trailing junk after EOI"]))[0, 5] == 0  # real files carry trailers


def test_probe_engine_matches_python_twin_on_damaged_files():
    """The C++ probe and its Python twin agree on thousands of cut and bit-flipped images."""
    pytest.importorskip("torch_fastload._C")
    rng = np.random.default_rng(7)
    sources = [
        encoded(photo((96, 64)), format="JPEG", progressive=p, quality=q) for p in (False, True) for q in (50, 95)
    ] + [encoded(photo(), format="PNG"), encoded(photo(), format="GIF")]
    blobs = []
    for _ in range(3000):
        blob = bytearray(sources[int(rng.integers(len(sources)))])
        if rng.random() < 0.5:
            blob = blob[: int(rng.integers(0, len(blob) + 1))]
        for _ in range(int(rng.integers(0, 4))):
            if blob:
                blob[int(rng.integers(len(blob)))] = int(rng.integers(256))
        blobs.append(bytes(blob))
    data, offsets = slab(blobs)
    assert np.array_equal(probe(data, offsets), probe_python(data, offsets))


def test_probe_rejects_offsets_outside_the_buffer():
    pytest.importorskip("torch_fastload._C")
    from torch_fastload import _C

    data = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside the 16-byte buffer"):
        _C.probe_images(data.ctypes.data, 16, np.array([0, 8, 32]))


def test_routes_send_what_nvjpeg_cannot_take_to_the_cpu():
    img = photo()
    blobs = [
        encoded(img, format="JPEG"),
        encoded(img.convert("CMYK"), format="JPEG"),
        encoded(img, format="PNG"),
        encoded(img.convert("L"), format="JPEG"),
        encoded(img, format="JPEG")[:100],
    ]
    info = probe(*slab(blobs))
    cuda = torch.device("cuda")
    assert route(info, cuda, 1 << 30) == [
        "nvjpeg",
        "cpu:cmyk",
        "cpu:png",
        "nvjpeg",
        "error:" + decode.STATUS_TEXT[decode.TRUNCATED],
    ]
    assert route(info[:1], cuda, 100)[0] == "cpu:huge"
    assert route(info[:1], torch.device("cpu"), 1 << 30)[0] == "cpu:device-cpu"


# -- decode and transforms on the CPU ---------------------------------------------------------


def test_cpu_decode_handles_cmyk_gray_and_png_as_rgb():
    img = photo()
    for blob in (
        encoded(img.convert("CMYK"), format="JPEG"),
        encoded(img.convert("L"), format="JPEG"),
        encoded(img, format="PNG"),
    ):
        out = decode.decode_cpu(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        assert out.shape == (3, 48, 64) and out.dtype == torch.uint8 and out.is_contiguous()
    png = decode.decode_cpu(torch.frombuffer(bytearray(encoded(img, format="PNG")), dtype=torch.uint8))
    assert torch.equal(png, torch.from_numpy(np.array(img)).permute(2, 0, 1))


def _native():
    from torch_fastload import _C

    return _C if getattr(_C, "HAVE_LIBJPEG", False) else None


def _laid_back_to_back(folder):
    """The training files of ``folder`` as one byte buffer: (dataset, bytes, offsets, probe rows)."""
    ds = ImageFolder(folder[0], transform=None)
    blobs = [ds.read_bytes(i).numpy().tobytes() for i in range(len(ds))]
    data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    offsets = np.cumsum([0] + [len(b) for b in blobs])
    return ds, data, offsets, probe(data, offsets)


def _planar_places(info, which):
    heights, widths = info[which, 1], info[which, 2]
    places = np.concatenate([[0], np.cumsum(3 * heights * widths)])
    return heights, widths, places


@pytest.mark.skipif(_native() is None, reason="the extension was built without libjpeg (no jpeglib.h at build time)")
def test_native_jpeg_decoder_is_bit_exact_with_torchvision(folder):
    """The C++ batch decoder (libjpeg-turbo, planar output) gives torchvision's CPU decode
    exactly, gray and progressive files included; CMYK is refused with a reason."""
    ds, data, offsets, info = _laid_back_to_back(folder)
    jpegs = [i for i in range(len(ds)) if info[i, 0] == 1 and info[i, 5] == 0]
    assert len(jpegs) >= len(ds) - 3
    heights, widths, places = _planar_places(info, jpegs)
    out = torch.full((int(places[-1]),), 7, dtype=torch.uint8)
    messages = _native().decode_jpegs_planar(
        data.ctypes.data,
        data.size,
        offsets[jpegs],
        np.diff(offsets)[jpegs],
        out.data_ptr(),
        out.numel(),
        places[:-1],
        heights,
        widths,
        3,
    )
    cmyk = [k for k, i in enumerate(jpegs) if info[i, 3] == 4]
    assert cmyk and all("CMYK" in messages[k] for k in cmyk)
    checked = 0
    for k, i in enumerate(jpegs):
        if k in cmyk:
            continue
        assert messages[k] == "", (ds.paths[i], messages[k])
        got = out[places[k] : places[k + 1]].view(3, int(heights[k]), int(widths[k]))
        assert torch.equal(got, torchvision_decode(torch.from_numpy(data[offsets[i] : offsets[i + 1]].copy()))), (
            ds.paths[i]
        )
        checked += 1
    assert checked >= len(ds) - 4 and any(info[i, 3] == 1 for i in jpegs)  # a grayscale one among them


@pytest.mark.skipif(_native() is None, reason="the extension was built without libjpeg (no jpeglib.h at build time)")
def test_native_decoder_regions_are_exactly_the_whole_decodes_pixels(folder):
    """A decoded region (the rows and columns a random crop reads) equals that part of a whole
    decode exactly: 4:2:0, 4:2:2, 4:4:4, gray and progressive files, boxes touching every edge
    and boxes of one row or column. Bad regions are refused before any work."""
    ds, data, offsets, info = _laid_back_to_back(folder)
    blobs = [
        data[offsets[i] : offsets[i + 1]].tobytes()
        for i in range(len(ds))
        if info[i, 0] == 1 and info[i, 5] == 0 and info[i, 3] in (1, 3)
    ][:12]
    picture = Image.open(io.BytesIO(blobs[0])).convert("RGB")
    blobs += [encoded(picture, format="JPEG", quality=90, subsampling=s) for s in (0, 1, 2)]  # 4:4:4, 4:2:2, 4:2:0
    blobs.append(encoded(picture.crop((0, 0, 203, 157)), format="JPEG", quality=85))  # sizes off the iMCU grid
    source, bounds = slab(blobs)
    rows = probe(source, bounds)
    rng = np.random.default_rng(0)
    native = _native()
    checked = 0
    for _ in range(6):
        heights, widths = rows[:, 1], rows[:, 2]
        top = (rng.random(len(blobs)) * heights * 0.8).astype(np.int64)
        left = (rng.random(len(blobs)) * widths * 0.8).astype(np.int64)
        height = np.maximum(1, (rng.random(len(blobs)) * (heights - top)).astype(np.int64))
        width = np.maximum(1, (rng.random(len(blobs)) * (widths - left)).astype(np.int64))
        height[0], width[1], left[2], top[3] = 1, 1, 0, 0  # one row, one column, the left and top edges
        left[4], width[4] = widths[4] - 7, 7  # the right edge
        regions = np.stack([top, left, height, width], axis=1)
        places = np.concatenate([[0], np.cumsum(3 * height * width)])
        out = torch.full((int(places[-1]),), 7, dtype=torch.uint8)
        messages = native.decode_jpegs_planar(
            source.ctypes.data,
            source.size,
            bounds[:-1],
            np.diff(bounds),
            out.data_ptr(),
            out.numel(),
            places[:-1],
            heights,
            widths,
            2,
            regions.reshape(-1),
        )
        assert messages == [""] * len(blobs)
        for k, blob in enumerate(blobs):
            whole = torchvision_decode(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            top, left, h, w = (int(v) for v in regions[k])
            got = out[places[k] : places[k + 1]].view(3, h, w)
            assert torch.equal(got, whole[:, top : top + h, left : left + w]), (k, regions[k].tolist())
            checked += 1
    assert checked == 6 * len(blobs)
    h, w = int(rows[0, 1]), int(rows[0, 2])
    out = torch.empty(3 * h * w, dtype=torch.uint8)
    for bad in ([0, 0, h + 1, w], [-1, 0, 2, 2], [0, w - 1, 1, 2], [0, 0, 0, 5]):
        with pytest.raises(ValueError, match="outside its"):
            native.decode_jpegs_planar(
                source.ctypes.data,
                source.size,
                bounds[:1],
                np.diff(bounds)[:1],
                out.data_ptr(),
                out.numel(),
                [0],
                [h],
                [w],
                1,
                bad,
            )
    with pytest.raises(ValueError, match="4 entries"):
        native.decode_jpegs_planar(
            source.ctypes.data,
            source.size,
            bounds[:1],
            np.diff(bounds)[:1],
            out.data_ptr(),
            out.numel(),
            [0],
            [h],
            [w],
            1,
            [0, 0, 1],
        )


@pytest.mark.skipif(_native() is None, reason="the extension was built without libjpeg (no jpeglib.h at build time)")
def test_native_jpeg_decoder_reports_damage_and_refuses_bad_places(folder):
    train, _ = folder
    blob = np.frombuffer(ImageFolder(train, transform=None).read_bytes(5).numpy().tobytes(), dtype=np.uint8)
    info = probe(blob, np.array([0, blob.size]))
    h, w = int(info[0, 1]), int(info[0, 2])
    out = torch.empty(3 * h * w, dtype=torch.uint8)
    native = _native()
    # a probed size the file does not have: refused, nothing claimed decoded
    [message] = native.decode_jpegs_planar(
        blob.ctypes.data, blob.size, [0], [blob.size], out.data_ptr(), out.numel(), [0], [h - 1], [w], 1
    )
    assert "not the probed" in message
    garbage = np.concatenate([blob[:200], np.full(4000, 0x55, dtype=np.uint8)])
    [message] = native.decode_jpegs_planar(
        garbage.ctypes.data, garbage.size, [0], [garbage.size], out.data_ptr(), out.numel(), [0], [h], [w], 1
    )
    assert message.startswith("libjpeg")
    with pytest.raises(ValueError, match="runs past"):
        native.decode_jpegs_planar(
            blob.ctypes.data, blob.size, [0], [blob.size], out.data_ptr(), out.numel() - 1, [0], [h], [w], 1
        )
    with pytest.raises(ValueError, match="outside"):
        native.decode_jpegs_planar(
            blob.ctypes.data, blob.size, [0], [blob.size + 1], out.data_ptr(), out.numel(), [0], [h], [w], 1
        )


@pytest.mark.skipif(_native() is None, reason="the extension was built without libjpeg (no jpeglib.h at build time)")
def test_split_job_gives_the_cpu_only_what_the_front_left(folder):
    """JpegSplitJob: what nvJPEG's side claims from the front is never touched by the CPU
    threads; they decode the rest from the back, bit-exact, and ``split`` says where they met."""
    ds, data, offsets, info = _laid_back_to_back(folder)
    jpegs = [i for i in range(len(ds)) if info[i, 0] == 1 and info[i, 5] == 0 and info[i, 3] in (1, 3)][:40]
    n = len(jpegs)
    assert n >= 30
    heights, widths, places = _planar_places(info, jpegs)
    out = torch.full((int(places[-1]),), 7, dtype=torch.uint8)
    job = _native().JpegSplitJob(
        data.ctypes.data,
        data.size,
        offsets[jpegs],
        np.diff(offsets)[jpegs],
        out.data_ptr(),
        out.numel(),
        places[:-1],
        heights,
        widths,
    )
    assert job.claim_front(15) == (0, 15) and job.claim_front(10) == (15, 25)
    job.run_back(3)
    assert job.split == 25 and job.claim_front(10) == (25, 25)  # the ends met: nothing left to claim
    assert (out[: places[25]] == 7).all()  # the front's places untouched
    for k in range(25, n):
        i = jpegs[k]
        assert job.messages[k] == ""
        got = out[places[k] : places[k + 1]].view(3, int(heights[k]), int(widths[k]))
        assert torch.equal(got, torchvision_decode(torch.from_numpy(data[offsets[i] : offsets[i + 1]].copy())))


@pytest.mark.skipif(_native() is None, reason="the extension was built without libjpeg (no jpeglib.h at build time)")
def test_batch_decoder_drives_the_cpp_decoder_into_its_places(folder):
    """BatchDecoder's wrappers of the C++ decoder (the fixed-share call and the work-stealing
    job) on host memory: every image lands whole and exact at its place."""
    ds, data, offsets, info = _laid_back_to_back(folder)
    jpegs = [i for i in range(len(ds)) if info[i, 0] == 1 and info[i, 5] == 0 and info[i, 3] in (1, 3)][:12]
    places, total = [], 0
    for i in jpegs:
        shape = (3, int(info[i, 1]), int(info[i, 2]))
        places.append((total, shape))
        total += 3 * shape[1] * shape[2]
    decoder = decode.BatchDecoder("cpu", cpu_threads=2)
    source = torch.from_numpy(data.copy())
    boxes = decoder._boxes(info, None, jpegs)  # whole images
    starts = [start for start, _ in places]
    for run in ("call", "job"):
        buffer = torch.zeros(total, dtype=torch.uint8)
        if run == "call":
            messages = decoder._decode_native(source, offsets, info, boxes, jpegs, buffer, starts)
        else:
            job = decoder._split_job(source, offsets, info, boxes, jpegs, buffer, starts)
            job.run_back(2)
            messages = job.messages
            assert job.split == 0
        assert messages == [""] * len(jpegs)
        for i, (start, shape) in zip(jpegs, places):
            whole = torchvision_decode(torch.from_numpy(data[offsets[i] : offsets[i + 1]].copy()))
            assert torch.equal(buffer[start : start + whole.numel()].view(shape), whole), (run, ds.paths[i])


def test_geometry_is_rebased_to_decoded_regions_and_redrawn_for_surprise_sizes():
    """After decoding: a region's crop starts at its (0, 0); an image that decoded whole in a
    region's stead keeps its crop; one whose size the probe did not know gets a crop drawn
    from its real size; the rest are untouched."""
    transform = TrainTransform()
    rng = np.random.default_rng(3)
    info = np.zeros((4, decode.PROBE_COLUMNS), dtype=np.int64)
    info[:, 1:3] = [(300, 400), (300, 400), (300, 400), (0, 0)]  # the last: a WebP (no probed size)
    geometry = transform.geometry(info[:, 1].copy(), info[:, 2].copy(), rng)
    before = transform.geometry(info[:, 1].copy(), info[:, 2].copy(), np.random.default_rng(3))
    boxes = np.zeros((4, 4), dtype=np.int64)
    boxes[:, 2:] = info[:, 1:3]
    boxes[:2] = np.stack([geometry.top[:2], geometry.left[:2], geometry.height[:2], geometry.width[:2]], axis=1)
    images = [
        torch.empty(3, int(boxes[0, 2]), int(boxes[0, 3]), dtype=torch.uint8),  # decoded as its region
        torch.empty(3, 300, 400, dtype=torch.uint8),  # the C++ decoder refused: decoded whole
        torch.empty(3, 300, 400, dtype=torch.uint8),
        torch.empty(3, 64, 48, dtype=torch.uint8),
    ]
    counts: dict = {}
    fitted = decode.BatchDecoder._fit_geometry(
        geometry, images, info, boxes, lambda h, w: transform.geometry(h, w, rng), np.arange(4), counts
    )
    assert (fitted.top[0], fitted.left[0]) == (0, 0) and fitted.height[0] == before.height[0]
    assert counts == {"cpu-region": 1}
    for k in (1, 2):
        assert (fitted.top[k], fitted.left[k], fitted.height[k], fitted.width[k]) == (
            before.top[k],
            before.left[k],
            before.height[k],
            before.width[k],
        )
    assert 0 < fitted.height[3] <= 64 and 0 < fitted.width[3] <= 48
    transforms._check_geometry(fitted.table(), np.array([(0, *im.shape[1:]) for im in images]), 224)


def test_work_stealing_and_route_trial_only_on_the_gpu():
    for share in ("steal", "auto"):
        decoder = decode.BatchDecoder("cpu", cpu_share=share)
        assert not decoder.work_stealing and decoder.trial is None and decoder.cpu_share == 0.0
    assert not decode.BatchDecoder("cpu").work_stealing
    fixed = decode.BatchDecoder("cpu", cpu_share=0.3)
    assert not fixed.work_stealing and fixed.cpu_share == 0.3
    with torch_fastload.config.override(cpu_decode_threads=3):
        assert decode.BatchDecoder("cpu").cpu_threads == 3
    assert decode.BatchDecoder("cpu", cpu_threads=5).cpu_threads == 5
    with pytest.raises(ValueError, match="cpu_decode_share"):
        decode.BatchDecoder("cpu", cpu_share="sometimes")


def test_train_geometry_follows_random_resized_crop_rules():
    t = TrainTransform(size=224)
    rng = np.random.default_rng(0)
    h = rng.integers(100, 1000, 5000)
    w = rng.integers(100, 1000, 5000)
    g = t.geometry(h, w, np.random.default_rng(1))
    assert (g.top >= 0).all() and (g.left >= 0).all()
    assert (g.top + g.height <= h).all() and (g.left + g.width <= w).all()
    area = g.height * g.width / (h * w)
    assert area.min() >= 0.08 * 0.95 and area.max() <= 1.0
    aspect = g.width / g.height
    assert aspect.min() > 0.70 and aspect.max() < 1.40  # 3/4 .. 4/3 after rounding
    assert 0.45 < g.flip.mean() < 0.55
    again = t.geometry(h, w, np.random.default_rng(1))
    assert np.array_equal(again.table(), g.table())


def test_train_geometry_falls_back_to_a_central_crop_for_extreme_shapes():
    g = TrainTransform(size=224, scale=(0.99, 1.0)).geometry(np.array([10]), np.array([1000]), np.random.default_rng(0))
    assert g.height[0] == 10 and g.width[0] == round(10 * 4 / 3) and g.left[0] == (1000 - 13) // 2


def test_eval_transform_matches_torchvision_resize_center_crop():
    """Our geometry + arithmetic vs torchvision's own Resize(256) + CenterCrop(224) pipeline."""
    from torchvision.transforms import v2

    image = torch.from_numpy(np.array(photo((500, 375)))).permute(2, 0, 1).contiguous()
    t = EvalTransform()
    ours = t.apply([image], t.geometry(np.array([375]), np.array([500])), torch.device("cpu"))[0]
    pipeline = v2.Compose([v2.ToDtype(torch.float32, scale=False), v2.Resize(256, antialias=True), v2.CenterCrop(224)])
    theirs = pipeline(image) / 255.0
    theirs = (theirs - torch.tensor(t.mean).view(3, 1, 1)) / torch.tensor(t.std).view(3, 1, 1)
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_transform_dtype_and_channels_last():
    image = torch.randint(0, 256, (3, 60, 80), dtype=torch.uint8)
    t = TrainTransform(size=32, dtype=torch.bfloat16, channels_last=True)
    out = t.apply(
        [image, image],
        t.geometry(np.array([60, 60]), np.array([80, 80]), np.random.default_rng(1)),
        torch.device("cpu"),
    )
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 32, 32)
    assert out.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrainTransform(dtype=torch.int32)


def test_geometry_outside_the_image_is_refused():
    image = torch.zeros((3, 10, 10), dtype=torch.uint8)
    bad = transforms.Geometry(*(np.array([v]) for v in (5, 0, 10, 10, 8, 8, 0, 0, 0)), 8)
    with pytest.raises(ValueError, match="outside the image"):
        transforms.apply([image], bad, torch.device("cpu"))


# -- ImageFolder through the loader (CPU) ------------------------------------------------------


def test_image_folder_matches_torchvision_classes_and_order(folder):
    train, _ = folder
    ours = ImageFolder(train)
    theirs = tv.datasets.ImageFolder(train)
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    assert ours.samples == [(p, t) for p, t in theirs.samples]
    assert ours.targets == theirs.targets


def test_loader_yields_decoded_transformed_batches_with_labels(folder, no_leaked_threads):
    _, val = folder
    ds = ImageFolder(val, "val")
    loader = DataLoader(ds, batch_size=8, device="cpu")
    images, labels = [], []
    for x, y in loader:
        assert x.shape[1:] == (3, 224, 224) and x.dtype == torch.float32
        images.append(x)
        labels.append(y)
    images, labels = torch.cat(images), torch.cat(labels)
    assert labels.tolist() == ds.targets
    for i in (0, 1, 5, len(ds) - 1):  # the sample path (ds[i]) computes the same pixels
        x, y = ds[i]
        assert y == labels[i] and torch.allclose(x, images[i], atol=1e-5)
    stats = loader.stats()
    assert sum(stats.decoded.values()) == len(ds) and set(stats.decoded) <= {"cpu:device-cpu", "cpu:png"}
    assert "nvJPEG takes host bitstreams" in stats.io


@pytest.mark.parametrize("option, threads", [(None, 3), (2, 2), (8, 3)])
def test_image_batches_are_staged_three_at_once(folder, no_leaked_threads, option, threads):
    """An image batch's stage is serial (probe, nvJPEG's call, the CPU share, the kernel): the
    loader stages ``image_batches_staged`` (3) of them at once, at most prefetch + 1, and
    delivers them in order all the same."""
    _, val = folder
    ds = ImageFolder(val, "val")
    settings = {} if option is None else {"image_batches_staged": option}
    with torch_fastload.config.override(**settings):
        loader = DataLoader(ds, batch_size=4, device="cpu")
        it = iter(loader)
        labels = [next(it)[1]]
    assert len([t for t in threading.enumerate() if t.name.startswith("fastload-stage")]) == threads
    labels += [y for _, y in it]
    assert torch.cat(labels).tolist() == ds.targets


def test_train_batches_are_deterministic_per_seed(folder):
    train, _ = folder

    def run(seed, threads):
        torch.manual_seed(0)
        ds = ImageFolder(train, "train", seed=seed)
        loader = DataLoader(ds, batch_size=8, shuffle=True, device="cpu", io_threads=threads)
        return [x for x, _ in loader]

    a, b, c = run(3, 1), run(3, 8), run(4, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_edge_cases_decode_on_cpu_and_are_counted(folder):
    train, _ = folder
    ds = ImageFolder(train, transform=None)
    batch = next(iter(DataLoader(ds, batch_size=len(ds), device="cpu")))
    images, labels = batch
    assert len(images) == len(ds) and all(im.shape[0] == 3 and im.dtype == torch.uint8 for im in images)
    for path, image in zip(ds.paths, images):  # the same pixels as torchvision's CPU decode
        reference = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert torch.equal(image, reference), path


def test_torch_dataloader_reads_the_same_dataset(folder):
    _, val = folder
    ds = ImageFolder(val, "val")
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    ours_x, ours_y = next(iter(DataLoader(ds, batch_size=4, device="cpu")))
    assert torch.allclose(x, ours_x, atol=1e-5) and torch.equal(y, ours_y)


def test_packed_folder_gives_the_same_batches(folder, tmp_path):
    _, val = folder
    torch_fastload.pack_image_folder(val, tmp_path / "pack", progress=False)
    folder_batches = list(DataLoader(ImageFolder(val, "val"), batch_size=6, device="cpu"))
    packed = PackedImageFolder(tmp_path / "pack", "val")
    assert packed.classes == ImageFolder(val).classes
    packed_batches = list(DataLoader(packed, batch_size=6, device="cpu"))
    for (x1, y1), (x2, y2) in zip(folder_batches, packed_batches, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def corrupt_copy(src, dst, damage):
    shutil.copytree(src, dst)
    victim = sorted(os.path.join(d, f) for d, _, fs in os.walk(dst) for f in fs if f.endswith(".JPEG"))[3]
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(damage(data))
    return victim


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: b"\0" * len(d), "bad or missing header"),
        (lambda d: b"", "empty file"),
    ],
)
def test_bad_file_raises_a_typed_error_naming_it(folder, tmp_path, damage, reason, no_leaked_threads):
    _, val = folder
    victim = corrupt_copy(val, tmp_path / "val", damage)
    loader = DataLoader(ImageFolder(tmp_path / "val", "val"), batch_size=4, device="cpu")
    with pytest.raises(ImageDecodeError, match=reason) as info:
        for _ in loader:
            pass
    assert victim in str(info.value) and info.value.name == victim
    assert ImageFolder(tmp_path / "val").paths[info.value.index] == victim


def test_on_error_skip_drops_counts_and_logs_every_bad_file(folder, tmp_path, caplog):
    _, val = folder
    victim = corrupt_copy(val, tmp_path / "val", lambda d: d[:1000])
    ds = ImageFolder(tmp_path / "val", "val", on_error="skip")
    loader = DataLoader(ds, batch_size=4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="torch_fastload"):
        labels = torch.cat([y for _, y in loader])
    assert len(labels) == len(ds) - 1
    expected = [t for p, t in ds.samples if p != victim]
    assert labels.tolist() == expected
    assert loader.stats().decoded["skipped"] == 1
    assert any(victim in record.getMessage() for record in caplog.records)


def test_missing_file_names_it(folder, tmp_path):
    _, val = folder
    shutil.copytree(val, tmp_path / "val")
    ds = ImageFolder(tmp_path / "val", "val")
    os.remove(ds.paths[2])
    with pytest.raises(FileNotFoundError) as info:
        for _ in DataLoader(ds, batch_size=4, device="cpu"):
            pass
    assert ds.paths[2] in str(info.value)


def test_bad_arguments_are_refused(folder, tmp_path):
    _, val = folder
    with pytest.raises(ValueError, match="on_error"):
        ImageFolder(val, on_error="ignore")
    with pytest.raises(ValueError, match="transform must be"):
        ImageFolder(val, transform="augment")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolder(tmp_path / "nowhere")
    with pytest.raises(IndexError, match="out of range"):
        ImageFolder(val)[10_000]


# -- GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-images")
    return make_image_folder(str(root), classes=8, train_per_class=24, val_per_class=4, progress=False)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["nvjpeg", "torchvision"])
def test_nvjpeg_decode_matches_cpu_decode(gpu_folder, backend):
    """nvJPEG, called directly (decode_backend='nvjpeg') or through torchvision's op (auto's
    choice), vs libjpeg-turbo on the CPU, same files: nvJPEG's IDCT and
    chroma upsampling differ slightly, so the tolerance is on the mean and the 99.9th percentile."""
    means, tails = gpu_decode_errors(gpu_folder, backend)
    print(f"nvJPEG ({backend}) vs CPU: mean |diff| max {means.max():.3f}, 99.9th percentile max {tails.max():.1f}")
    assert means.max() <= 1.5 and tails.max() <= 16


@pytest.mark.cuda
def test_a_kept_split_is_balanced_on_the_gpu_and_every_image_stays_right(gpu_folder):
    """A route trial that kept a split at CPU share 0.1: every batch reports its C++ decoder's
    and its GPU part's spans, the share moves, and every image (whichever decoder it went to,
    the share changing under the loader) matches the CPU decode within nvJPEG's tolerance."""
    train, _ = gpu_folder
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(cpu_decode_share="auto", balance_split=True):
        loader = DataLoader(ds, batch_size=32, device="cuda")
        trial = ds.decoder(loader.device).trial
        assert trial is not None, "the route trial needs 8 cores"
        trial.choice = 0.1
        decoded, batches = [], 0
        for epoch in range(4):
            for images, _ in loader:
                batches += 1
                if epoch == 3:
                    decoded.extend(image.cpu() for image in images)
    assert trial.balancer is not None and trial.balancer.batches == batches == 4 * len(loader)
    assert trial.balancer.moves >= 1 and trial.choice != 0.1, trial.describe()
    print(trial.describe())
    assert {"cpu:share", "nvjpeg"} <= set(loader.stats().decoded)
    for path, image in zip(ds.paths, decoded):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.shape == cpu.shape, path
        assert (image.int() - cpu.int()).abs().float().mean() <= 1.5, path


@pytest.mark.cuda
def test_direct_nvjpeg_does_not_wait_for_the_callers_stream(gpu_folder):
    """The loader's copy stream, shared by every stage thread, holds other batches' crops and
    resizes; a decode ordered after it waits for all of them (so ordered, the loader fed a third
    of torchvision's rate on an H100). With the caller's stream held ~1 s by a sleeping kernel
    (one block: the SMs stay free for nvJPEG), the decode completes long before the sleep ends,
    and the caller's stream still sees its images (ordered after the decode by an event)."""
    import time

    from torch_fastload.vision.gpu_backend import gpu_backend

    train, _ = gpu_folder
    paths = [p for p in ImageFolder(train, transform=None).paths if p.lower().endswith((".jpeg", ".jpg"))][:16]
    encoded = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths]
    direct = gpu_backend(torch.device("cuda", torch.cuda.current_device()), "nvjpeg")
    expected = direct.decode(encoded)  # also sets up this thread's state and stream
    torch.cuda.synchronize()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clocks on one block
        t0 = time.perf_counter()
        out = direct.decode(encoded)
        direct.synchronize()  # this decode's own completion
        took = time.perf_counter() - t0
        still_busy = not busy.query()
        copies = [image.clone() for image in out if image is not None]  # on the busy stream: after the decode
    busy.synchronize()
    assert still_busy, "the sleep ended before the decode did: the test proves nothing on this GPU"
    assert took < 0.5, f"the decode waited {took:.2f} s for the caller's stream"
    assert [image is None for image in out] == [image is None for image in expected]
    assert all(torch.equal(a, b) for a, b in zip(copies, [e for e in expected if e is not None]))


@pytest.mark.cuda
def test_direct_nvjpeg_reuses_its_states_across_short_lived_threads(gpu_folder):
    """The loader's stage threads are made anew each epoch: one nvJPEG state (with its device
    and pinned buffers) a thread would be made again every epoch and never freed. Five threads
    one after another share one state; the decode is right from each."""
    from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg

    train, _ = gpu_folder
    paths = [p for p in ImageFolder(train, transform=None).paths if p.lower().endswith((".jpeg", ".jpg"))][:8]
    encoded = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths]
    direct = DirectNvjpeg(torch.device("cuda", torch.cuda.current_device()))
    expected = [image.clone() for image in direct.decode(encoded)]
    results = []
    for _ in range(5):
        thread = threading.Thread(target=lambda: results.append([i.clone() for i in direct.decode(encoded)]))
        thread.start()
        thread.join()
    torch.cuda.synchronize()
    assert direct.lanes_made == 1
    assert len(results) == 5 and all(all(torch.equal(a, b) for a, b in zip(r, expected)) for r in results)


@pytest.mark.cuda
def test_direct_nvjpeg_gives_torchvisions_pixels_from_threads_at_once_and_refuses_only_the_bad(gpu_folder):
    """The same library as torchvision's op, so the same pixels; three threads decoding at once
    (a state and a stream each) give what one does; a damaged JPEG in a batch costs only itself
    (the batch fails as a whole in nvJPEG, then each image is decoded alone)."""
    from torch_fastload.vision.cpu import RGB, torchvision_ops
    from torch_fastload.vision.gpu_backend import gpu_backend

    train, _ = gpu_folder
    paths = [p for p in ImageFolder(train, transform=None).paths if p.lower().endswith((".jpeg", ".jpg"))][:48]
    encoded = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths]
    ops = torchvision_ops()
    reference = []
    for tensor in encoded:
        try:
            reference.append(ops.decode_jpegs_cuda([tensor], RGB, torch.device("cuda"))[0])
        except RuntimeError:
            reference.append(None)
    direct = gpu_backend(torch.device("cuda", torch.cuda.current_device()), "nvjpeg")
    assert direct.name == "nvjpeg"
    results = [None] * 3

    def decode(k):
        out = direct.decode(encoded)
        torch.cuda.current_stream().synchronize()
        results[k] = out

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compared = 0
    for out in results:
        for image, expected in zip(out, reference):
            if expected is not None and image is not None:
                assert torch.equal(image, expected)
                compared += 1
    assert compared >= 3 * 40
    damaged = list(encoded)
    cut = damaged[5].numel() // 3
    damaged[5] = torch.cat([damaged[5][:cut], torch.zeros(64, dtype=torch.uint8)])  # truncated mid-scan
    damaged[9] = torch.zeros(100, dtype=torch.uint8)  # not a JPEG
    out = direct.decode(damaged)
    torch.cuda.current_stream().synchronize()
    assert out[9] is None
    for k in range(len(damaged)):
        if k not in (5, 9) and reference[k] is not None:
            assert out[k] is not None and torch.equal(out[k], reference[k]), k


def gpu_decode_errors(gpu_folder, backend: str) -> tuple[np.ndarray, np.ndarray]:
    """Per image of the folder decoded on the GPU by ``backend`` (every JPEG it can take): the
    mean and the 99.9th percentile of |GPU - CPU| (libjpeg-turbo, torchvision's CPU decode)."""
    train, _ = gpu_folder
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(cpu_decode_share=0, decode_backend=backend):
        loader = DataLoader(ds, batch_size=64, device="cuda")
        decoded = []
        for images, _ in loader:
            assert all(im.is_cuda for im in images)
            decoded.extend(images)
    assert ds.decoder(loader.device).gpu_backend().name == backend
    assert loader.stats().decoded.get("nvjpeg", 0) >= len(ds) - 5
    assert {"cpu:cmyk", "cpu:png"} <= set(loader.stats().decoded)
    errors = []
    for path, image in zip(ds.paths, decoded):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.shape == cpu.shape and image.dtype == torch.uint8, path
        d = (image.cpu().int() - cpu.int()).abs().float()
        errors.append((d.mean().item(), d.flatten().quantile(0.999).item() if d.numel() < 16e6 else 0.0))
    return tuple(np.array(errors).T)


@pytest.mark.cuda
def test_nvimgcodec_decode_matches_cpu_decode(gpu_folder):
    """nvImageCodec (hardware engines, then its CUDA decoder) vs libjpeg-turbo: its IDCT and chroma
    upsampling round differently, so the same tolerance as nvJPEG's: mean |diff| <= 1.5 a pixel,
    99.9th percentile <= 16 (of 255), per image."""
    from torch_fastload.vision.gpu_backend import nvimgcodec_missing

    if (reason := nvimgcodec_missing()) is not None:
        pytest.skip(reason)
    means, tails = gpu_decode_errors(gpu_folder, "nvimgcodec")
    print(f"nvImageCodec vs CPU: mean |diff| max {means.max():.3f}, 99.9th percentile max {tails.max():.1f}")
    assert means.max() <= 1.5 and tails.max() <= 16


@pytest.mark.cuda
def test_nvimgcodec_output_is_a_device_tensor_without_a_host_copy(gpu_folder):
    """Planar (3, H, W) uint8 on the device, contiguous, decoded on the calling thread's stream."""
    from torch_fastload.vision.gpu_backend import NvImageCodec, nvimgcodec_missing

    if (reason := nvimgcodec_missing()) is not None:
        pytest.skip(reason)
    train, _ = gpu_folder
    paths = [p for p in ImageFolder(train, transform=None).paths if "_0." not in p][:8]  # no edge cases
    encoded = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8).pin_memory() for p in paths]
    backend = NvImageCodec(torch.device("cuda", torch.cuda.current_device()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        images = backend.decode(encoded)
    stream.synchronize()
    for path, image in zip(paths, images):
        reference = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.is_cuda and image.is_contiguous() and image.shape == reference.shape, path
        assert (image.cpu().int() - reference.int()).abs().float().mean() <= 1.5, path


@pytest.mark.cuda
def test_nvimgcodec_decodes_into_torch_memory_with_its_own_pixels(gpu_folder):
    """The batch lands in one block of torch's caching allocator (nvImageCodec allocates no output
    image: a cudaMallocAsync each, from a pool that hands its memory back at every sync, slowed the
    training step beside the loader), with exactly the pixels of nvImageCodec's own output images
    (output='library'); a file it cannot parse is None, not a failed batch."""
    from torch_fastload.vision.gpu_backend import NvImageCodec, nvimgcodec_missing

    if (reason := nvimgcodec_missing()) is not None:
        pytest.skip(reason)
    train, _ = gpu_folder
    paths = [p for p in ImageFolder(train, transform=None).paths if "_0." not in p][:16]
    encoded = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8).pin_memory() for p in paths]
    encoded.insert(3, torch.zeros(64, dtype=torch.uint8))  # not a JPEG
    device = torch.device("cuda", torch.cuda.current_device())
    into_torch, library = NvImageCodec(device), NvImageCodec(device, output="library")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        before = torch.cuda.memory_allocated(device)
        images = into_torch.decode(encoded)
        grew = torch.cuda.memory_allocated(device) - before
        reference = library.decode(encoded)
    stream.synchronize()
    assert images[3] is None and reference[3] is None
    images, reference = images[:3] + images[4:], reference[:3] + reference[4:]
    assert all(image is not None for image in images)
    assert len({image.untyped_storage().data_ptr() for image in images}) == 1
    assert grew >= sum(image.numel() for image in images)
    for path, image, theirs in zip(paths, images, reference):
        assert image.is_cuda and image.is_contiguous() and torch.equal(image, theirs), path


@pytest.mark.cuda
def test_decode_backend_nvimgcodec_without_the_package_says_what_to_install(gpu_folder, monkeypatch):
    from torch_fastload.vision import gpu_backend

    def fail():
        raise ImportError("nvidia.nvimgcodec is not installed (pip install nvidia-nvimgcodec-cu13)")

    gpu_backend._reset_for_tests()
    monkeypatch.setattr(gpu_backend, "_import_nvimgcodec", fail)
    try:
        train, _ = gpu_folder
        with torch_fastload.config.override(decode_backend="nvimgcodec", cpu_decode_share=0):
            with pytest.raises(gpu_backend.DecodeBackendError, match="pip install nvidia-nvimgcodec-cu13"):
                next(iter(DataLoader(ImageFolder(train, transform=None), batch_size=8, device="cuda")))
        with torch_fastload.config.override(decode_backend="auto", cpu_decode_share=0):
            loader = DataLoader(ImageFolder(train, transform=None), batch_size=8, device="cuda")
            assert len(next(iter(loader))[0]) == 8  # torchvision's nvJPEG instead
            assert loader.dataset.decoder(loader.device).gpu_backend().name == "torchvision"
    finally:
        gpu_backend._reset_for_tests()


@pytest.mark.cuda
def test_cpu_decode_share_decodes_the_batch_tail_on_cpu_threads(gpu_folder):
    """cpu_decode_share: the last images of each batch go to CPU threads beside nvJPEG and reach
    the GPU in one packed copy; their pixels are libjpeg-turbo's exactly, in their places."""
    train, _ = gpu_folder
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(cpu_decode_share=0.25):
        loader = DataLoader(ds, batch_size=64, device="cuda")
        images = [im for batch, _ in loader for im in batch]
    decoded = loader.stats().decoded
    assert decoded.get("cpu:share", 0) >= 0.2 * len(ds) and decoded.get("nvjpeg", 0) >= 0.6 * len(ds)
    assert len(images) == len(ds)
    for k, (path, image) in enumerate(zip(ds.paths, images)):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.is_cuda and image.shape == cpu.shape, path
        if k % 64 >= 64 - 14:  # the tail of every full batch of 64: CPU-decoded, bit-exact
            assert torch.equal(image.cpu(), cpu), path


@pytest.mark.cuda
def test_region_decoding_gives_the_same_batches(gpu_folder):
    """Decoding only each crop's rows and columns changes no pixel of a training batch: the
    same seed with cpu_decode_regions on and off gives equal batches, most of them decoded
    as regions by the C++ decoder."""
    if _native() is None or not getattr(_native(), "JPEG_REGIONS", False):
        pytest.skip("the extension was built without libjpeg-turbo's region decoding")
    train, _ = gpu_folder
    batches, stats = {}, {}
    for regions in (True, False):
        with torch_fastload.config.override(cpu_decode_share=0.75, cpu_decode_regions=regions):
            torch.manual_seed(0)  # the loader's base seed, part of each batch's augmentation key
            ds = ImageFolder(train, TrainTransform(), seed=5)
            loader = DataLoader(ds, batch_size=32, device="cuda")
            batches[regions] = [(x.cpu(), y.cpu()) for x, y in loader]
            stats[regions] = loader.stats().decoded
            ds.close()
    assert stats[True].get("cpu-region", 0) >= 0.6 * len(ds) and "cpu-region" not in stats[False]
    assert len(batches[True]) == len(batches[False]) > 0
    for (a, ya), (b, yb) in zip(batches[True], batches[False]):
        assert torch.equal(ya, yb) and torch.equal(a, b)


@pytest.mark.cuda
def test_work_stealing_split_keeps_every_image_in_its_place(gpu_folder):
    """cpu_decode_share='steal': each image comes from nvJPEG (within its tolerance of libjpeg) or
    from the C++ decoder (libjpeg exactly), in sampler order, and at least the CPU-counted ones
    are exact."""
    if _native() is None:
        pytest.skip("the extension was built without libjpeg: 'steal' is nvJPEG alone")
    train, _ = gpu_folder
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(cpu_decode_share="steal"):
        loader = DataLoader(ds, batch_size=48, device="cuda")
        images = [im for batch, _ in loader for im in batch]
    decoded = loader.stats().decoded
    assert len(images) == len(ds) and decoded.get("cpu:share", 0) > 0
    exact = 0
    for path, image in zip(ds.paths, images):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.is_cuda and image.shape == cpu.shape, path
        d = (image.cpu().int() - cpu.int()).abs().float()
        assert d.mean() <= 1.5, path
        exact += bool(torch.equal(image.cpu(), cpu))
    cpu_decoded = sum(v for k, v in decoded.items() if k.startswith("cpu:"))
    assert exact >= cpu_decoded


def test_cpu_decode_share_is_validated():
    for bad in (1.5, -0.1, "most"):
        with pytest.raises(ValueError, match="cpu_decode_share"):
            decode.BatchDecoder("cpu", cpu_share=bad)
    assert decode.BatchDecoder("cpu", cpu_share=0.3).cpu_share == 0.3
    assert decode.BatchDecoder("cpu", cpu_share=1).cpu_share == 1.0  # every JPEG on the CPU
    assert decode.BatchDecoder("cpu", cpu_share=" Steal ").cpu_share == 0.0  # no GPU: nothing to share


def test_default_tries_both_routes_where_it_has_the_cores(monkeypatch):
    """cpu_decode_share='auto' (the default) runs a route trial for a GPU loader whose process
    has CORES_FOR_A_TRIAL CPUs and the C++ decoder; DDP's processes on a node share its CPUs,
    and the decode threads leave a few cores to the step."""
    assert torch_fastload.config.OPTIONS["cpu_decode_share"].default == "auto"
    enough = decode.CORES_FOR_A_TRIAL
    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2 * enough)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert torch_fastload.config.cpus_per_process() == enough
    tried = decode.BatchDecoder("cuda")  # nothing touches the GPU before a batch is decoded
    assert tried.trial is not None and tried.trial.candidates == [1.0, 0.0] and not tried.work_stealing
    assert tried.cpu_threads == max(min(8, enough), enough - decode.CORES_LEFT_TO_THE_STEP)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert decode.BatchDecoder("cuda").trial is None  # too few cores: nvJPEG alone
    assert decode.BatchDecoder("cuda").cpu_share == 0.0
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: 16)
    assert decode.BatchDecoder("cuda").cpu_threads == 16 - decode.CORES_LEFT_TO_THE_STEP
    assert decode.BatchDecoder("cuda", cpu_share=0).cpu_threads == 8
    with torch_fastload.config.override(cpu_decode_threads=5):
        assert decode.BatchDecoder("cuda").cpu_threads == 5
    monkeypatch.setattr(decode, "_native_jpeg", lambda: False)
    assert decode.BatchDecoder("cuda").trial is None  # Python threads cannot stand in for nvJPEG


def _trial_on(gaps_ms: dict, warmup=8, settle=4, window=10, extra_gap_ms: dict | None = None):
    """Drive a RouteTrial with a fake clock: each candidate's decodes start ``gaps_ms[share]``
    apart; ``extra_gap_ms[(share, k)]`` delays its k-th timed start (an epoch boundary)."""
    now = [0.0]
    trial = RouteTrial(warmup=warmup, settle=settle, window=window, clock=lambda: now[0])
    shares = []
    while trial.choice is None:
        share = trial.next_share()
        shares.append(share)
        k = sum(1 for s in shares[warmup:] if s == share) - 1 - settle
        gap = (gaps_ms[share] + (extra_gap_ms or {}).get((share, k), 0)) / 1e3
        trial.consumed(waited=gap)  # the loop waits for every batch: each route is timed
        now[0] += gap
    return trial, shares


def test_route_trial_keeps_the_route_whose_batches_come_faster():
    trial, shares = _trial_on({0.0: 30.0, 1.0: 40.0})  # a small model: the CPU cannot keep up
    assert trial.choice == 0.0 and trial.next_share() == 0.0
    assert shares == [1.0] * (8 + 15) + [0.0] * 15  # the CPU first; no deliveries: as if the loop waited
    assert trial.periods[0.0] == pytest.approx(0.030) and trial.periods[1.0] == pytest.approx(0.040)
    trial, _ = _trial_on({0.0: 70.0, 1.0: 66.0})  # a big model: nvJPEG's GPU work slows the step
    assert trial.choice == 1.0 and "66.0 ms a batch with every JPEG on the CPU" in trial.describe()
    # a CPU route the loop waited for must win by the margin: 34.6 vs 35.3 ms keeps nvJPEG
    assert _trial_on({0.0: 35.3, 1.0: 34.6})[0].choice == 0.0


def test_route_trial_shrugs_off_an_epoch_boundary_that_a_mean_would_not(monkeypatch):
    """A 2 s gap (an epoch boundary with validation) inside the faster route's window: the
    median of two-batch gaps still picks it; the mean of the same gaps (negative control) would
    pick the slower route."""
    boundary = {(1.0, 4): 2000.0}
    trial, _ = _trial_on({0.0: 70.0, 1.0: 66.0}, extra_gap_ms=boundary)
    assert trial.choice == 1.0 and trial.periods[1.0] == pytest.approx(0.066)
    monkeypatch.setattr(route_trial, "_median_two_gap", lambda times: (times[-1] - times[0]) / (len(times) - 1))
    broken, _ = _trial_on({0.0: 70.0, 1.0: 66.0}, extra_gap_ms=boundary)
    assert broken.choice == 0.0


def _pipeline_trial(decode_ms: dict, step_ms: dict, depth=4, decode_only=False) -> RouteTrial:
    """A loader and a training loop, simulated: a decode takes ``decode_ms[share]`` and may run
    ``depth`` batches ahead of the loop, whose step takes ``step_ms[share]`` (the route decoding
    meanwhile slows it or not). Returns the trial once it chose. ``decode_only``: the loop's
    deliveries are not reported (the trial sees only one clock)."""
    clock = [0.0]
    trial = RouteTrial(warmup=8, settle=4, window=10, clock=lambda: clock[0])
    ready: list[float] = []  # when each decoded batch is ready
    taken: list[float] = []  # when the loop took each batch
    decode_free = loop_free = 0.0
    share = 0.0
    while trial.choice is None:
        blocked = len(ready) >= depth and len(taken) <= len(ready) - depth  # the queue is full
        start = None if blocked else max(decode_free, taken[len(ready) - depth] if len(ready) >= depth else 0.0)
        take = max(loop_free, ready[len(taken)]) if len(taken) < len(ready) else None
        if take is not None and (start is None or take < start):
            clock[0] = take
            taken.append(take)
            if not decode_only:
                trial.consumed(take - loop_free)
            loop_free = take + step_ms[share] / 1e3
        else:
            clock[0] = start
            share = trial.next_share()
            decode_free = start + decode_ms[share] / 1e3
            ready.append(decode_free)
    return trial


def test_route_trial_picks_the_faster_pipeline():
    """ResNet-50: on the CPU route the step stays at 66 ms and the loop never waits, so nvJPEG
    (which would slow the step to 71 ms) is never tried. A small model's step outruns the CPU
    route: the loop waits, nvJPEG is timed and keeps up."""
    decode_ms, step_ms = {0.0: 20.0, 1.0: 40.0}, {0.0: 71.0, 1.0: 66.0}
    trial = _pipeline_trial(decode_ms, step_ms)
    assert trial.choice == 1.0 and list(trial.periods) == [1.0] and trial.waited[1.0] < 0.01
    assert trial.periods[1.0] == pytest.approx(0.066, rel=0.02)
    trial = _pipeline_trial({0.0: 15.0, 1.0: 38.0}, {0.0: 30.0, 1.0: 22.0})
    assert trial.choice == 0.0 and trial.waited[1.0] > 0.3
    assert trial.periods[1.0] == pytest.approx(0.038, rel=0.02) and trial.periods[0.0] == pytest.approx(0.030, rel=0.02)
    # a CPU that nearly keeps up (the loop waits 6%): still kept without trying nvJPEG
    assert _pipeline_trial({0.0: 15.0, 1.0: 68.0}, {0.0: 71.0, 1.0: 64.0}).periods.keys() == {1.0}


def test_route_trial_needs_both_clocks_when_the_queue_is_deep():
    """Twelve batches of slack (the loop's Python runs ahead of its GPU work). A slow CPU route
    (72 ms a batch, the loop waits) empties the queue, so in nvJPEG's window decodes refill it
    and look faster than nvJPEG's 80 ms step. Deliveries show the real pace; the decodes' own
    clock, recorded beside them, would have kept the wrong route. nvJPEG's window lasts until
    the loop took enough batches."""
    decode_ms, step_ms = {0.0: 20.0, 1.0: 72.0}, {0.0: 80.0, 1.0: 60.0}
    trial = _pipeline_trial(decode_ms, step_ms, depth=12)
    assert trial.choice == 1.0 and trial.clocks[0.0][0] < 0.072 < trial.periods[0.0]
    blind = _pipeline_trial(decode_ms, step_ms, depth=12, decode_only=True)  # a loop that never reports
    assert blind.choice is not None and blind.clocks[1.0][1] is None and blind.waited[1.0] == 1.0


def test_route_trial_waits_out_a_models_slow_first_steps():
    """Nine 1 s first steps (cuDNN autotuning) while the CPU route is the faster: the warm-up
    batches absorb them; with no warm-up (negative control) they land in the CPU's window."""

    def run(warmup):
        now, calls = [0.0], [0]
        trial = RouteTrial(warmup=warmup, settle=3, window=10, clock=lambda: now[0])
        while trial.choice is None:
            share = trial.next_share()
            calls[0] += 1
            gap = 1.0 if calls[0] <= 9 else (0.030 if share == 1.0 else 0.040)
            trial.consumed(waited=gap)
            now[0] += gap
        return trial.choice

    assert run(warmup=8) == 1.0
    assert run(warmup=0) == 0.0


def test_route_trial_with_two_threads_alternating_short_and_long_gaps():
    """Two stage threads decode side by side: starts may come in pairs (1 ms, then 2 periods - 1
    ms); the two-batch gap still measures the period."""
    now = [0.0]
    trial = RouteTrial(warmup=0, settle=0, window=9, clock=lambda: now[0])
    period = {0.0: 0.030, 1.0: 0.025}
    toggle = 0
    while trial.choice is None:
        share = trial.next_share()
        now[0] += 0.001 if toggle == 0 else 2 * period[share] - 0.001
        toggle ^= 1
    assert trial.choice == 1.0
    assert trial.periods[0.0] == pytest.approx(0.030) and trial.periods[1.0] == pytest.approx(0.025)


def test_route_trial_refuses_a_trial_that_cannot_measure():
    with pytest.raises(ValueError):
        RouteTrial(candidates=(0.0,))
    with pytest.raises(ValueError):
        RouteTrial(window=2)
    with pytest.raises(ValueError):
        RouteTrial(warmup=-1)


@pytest.mark.cuda
def test_route_trial_on_the_gpu_decodes_every_batch_and_settles(gpu_folder, monkeypatch):
    """The default's trial on real batches: the first batches go to the C++ decoder, then to
    nvJPEG if the loop waited for them; every image arrives, and the rest of the epoch uses the
    route kept: one timed alone, or a split of the two balanced online (its share moves, every
    batch still split). (decode_backend='torchvision': the trial of the CPU and nvJPEG alone;
    where nvImageCodec's JPEG engines work, 'auto' times them too, in tests/test_jpeg_engines.py.)"""
    if _native() is None:
        pytest.skip("the extension was built without libjpeg: no trial, nvJPEG alone")
    warmup, settle, window, batch = 2, 1, 3, 6
    monkeypatch.setattr(decode, "TRIAL_WARMUP", warmup)
    monkeypatch.setattr(decode, "TRIAL_SETTLE", settle)
    monkeypatch.setattr(decode, "TRIAL_WINDOW", window)
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: max(16, decode.CORES_FOR_A_TRIAL))
    train, _ = gpu_folder
    ds = ImageFolder(train, TrainTransform(), seed=1)
    # four windows (CPU, nvJPEG, their rate ratio's split, the lighter split; with balance_split
    # the first two) of 6 batches fit the folder's 32 batches of 6 with batches to spare
    assert len(ds) // batch > 4 * (warmup + settle + window)
    with torch_fastload.config.override(cpu_decode_share="auto", decode_backend="torchvision"):
        loader = DataLoader(ds, batch_size=batch, device="cuda")
        seen = sum(len(y) for x, y in loader if x.is_cuda and torch.isfinite(x).all())
    assert seen == len(ds)
    trial = ds.decoder(loader.device).trial
    decoded = loader.stats().decoded
    assert trial.choice in trial.periods or (route_trial.is_split(trial.choice) and trial.balancer is not None)
    assert decoded["cpu:share"] >= (warmup + settle + window) * batch - 4
    cpu_gpu = trial.gpu[1.0]  # this loop queues no GPU work: the GPU waits for it at every hand-off
    if 0.0 in trial.periods:  # the loop waited for the CPU's batches, or the step was not GPU-bound
        assert trial.waited[1.0] >= 0.1 or (cpu_gpu is not None and cpu_gpu.caught_up >= route_trial.TRIAL_CAUGHT_UP)
        assert decoded["nvjpeg"] >= (settle + window) * batch - 4
    else:
        assert trial.choice == 1.0 and trial.waited[1.0] < 0.1 and "nvjpeg" not in decoded
        assert cpu_gpu is None or cpu_gpu.caught_up < route_trial.TRIAL_CAUGHT_UP
    ds.close()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype, channels_last",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True), (torch.float16, False)],
)
def test_transform_kernel_matches_reference(dtype, channels_last):
    if not transforms.kernel_available():
        pytest.skip("torch.cuda._compile_kernel is missing")
    g = torch.Generator().manual_seed(0)
    shapes = [(375, 500), (500, 333), (60, 90), (2000, 3000), (224, 224), (17, 1000)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8).cuda() for h, w in shapes]
    heights, widths = np.array([s[0] for s in shapes]), np.array([s[1] for s in shapes])
    for t in (
        TrainTransform(dtype=dtype, channels_last=channels_last),
        EvalTransform(dtype=dtype, channels_last=channels_last),
    ):
        geometry = t.geometry(heights, widths, np.random.default_rng(5))
        out = t.apply(images, geometry, torch.device("cuda"))
        assert out.dtype == dtype and out.is_contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        reference = torch.stack([transforms.reference(im, geometry, i) for i, im in enumerate(images)])
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        assert torch.allclose(out.float(), reference, atol=tol), (out.float() - reference).abs().max()


@pytest.mark.cuda
@pytest.mark.parametrize("share", [0, 1])
def test_gpu_loader_end_to_end_with_edge_cases(gpu_folder, no_leaked_threads, share):
    """Both decode routes end to end: nvJPEG, or every JPEG on the C++ decoder."""
    if share == 1 and _native() is None:
        pytest.skip("the extension was built without libjpeg: share 1 decodes in Python threads")
    train, val = gpu_folder
    ds = ImageFolder(train, TrainTransform(dtype=torch.bfloat16, channels_last=True), seed=0)
    all_cpu = share == 1
    seen = 0
    with torch_fastload.config.override(cpu_decode_share=share):  # the decoder is made at the first batch
        loader = DataLoader(ds, batch_size=32, shuffle=True, device="cuda")
        for x, y in loader:
            assert x.is_cuda and y.is_cuda and x.dtype == torch.bfloat16 and x.shape[1:] == (3, 224, 224)
            assert x.is_contiguous(memory_format=torch.channels_last)
            assert torch.isfinite(x.float()).all() and x.float().std() > 0.3
            seen += len(y)
    assert seen == len(ds)
    decoded = loader.stats().decoded
    assert decoded["cpu:cmyk"] == 1 and decoded["cpu:png"] == 1
    if all_cpu:
        assert "nvjpeg" not in decoded and decoded["cpu:share"] >= len(ds) - 3
        assert decoded.get("cpu-region", 0) >= len(ds) - 3 or not getattr(_native(), "JPEG_REGIONS", False)
    else:
        assert decoded["nvjpeg"] >= len(ds) - 3 and "cpu:share" not in decoded
    # validation on the GPU equals the CPU reference path of the same files
    vds = ImageFolder(val, "val")
    gpu = torch.cat([x.cpu() for x, _ in DataLoader(vds, batch_size=16, device="cuda")])
    cpu = torch.cat([x for x, _ in DataLoader(vds, batch_size=16, device="cpu")])
    assert (gpu - cpu).abs().mean() < 0.02  # decode differences only (nvJPEG vs libjpeg-turbo)


@pytest.mark.cuda
def test_gpu_skip_and_error_paths(gpu_folder, tmp_path):
    _, val = gpu_folder
    victim = corrupt_copy(val, tmp_path / "val", lambda d: d[: len(d) // 3])
    with pytest.raises(ImageDecodeError, match="truncated"):
        for _ in DataLoader(ImageFolder(tmp_path / "val", "val"), batch_size=8, device="cuda"):
            pass
    loader = DataLoader(ImageFolder(tmp_path / "val", "val", on_error="skip"), batch_size=8, device="cuda")
    total = sum(len(y) for _, y in loader)
    assert total == len(loader.dataset) - 1 and loader.stats().decoded["skipped"] == 1
    del victim


def test_encoded_slices_and_pinned_places_are_made_when_asked():
    """The batch's per-image byte slices and pinned places are views made on demand, the same
    bytes as slicing the slab and the buffer by hand."""
    from torch_fastload.vision.decode import EncodedSlices
    from torch_fastload.vision.pinned import Place

    data = torch.arange(100, dtype=torch.int64).to(torch.uint8)
    offsets = np.array([0, 10, 10, 45, 100])
    slices = EncodedSlices(data, offsets)
    assert len(slices) == 4 and [s.tolist() for s in (slices[i] for i in range(4))] == [
        data[a:b].tolist() for a, b in zip(offsets, offsets[1:])
    ]
    buffer = torch.arange(200, dtype=torch.int64).to(torch.uint8)
    place = Place(12, (3, 4, 5), buffer)
    assert place.end == 72 and place.view.shape == (3, 4, 5)
    assert place.view.data_ptr() == buffer[12:].data_ptr() and torch.equal(place.view.flatten(), buffer[12:72])
    assert Place(0, (3, 0, 5), buffer).view is None  # the probe gave no size
