"""The GPU's hardware JPEG engines as a decode route (vision/jpeg_engines.py), on the CPU with a
fake nvImageCodec: the decoder asked for, one thread feeding it whole batches, what the engines
refuse decoded on the CPU in place, the engine route's plan of a batch, and the route trial
timing the engines only where they work. The real engines run in the cuda test at the end."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from test_gpu_backend import FakeDecoder, fake_nvimgcodec_decoding
from test_route_trial import run_trial as _run

import torch_fastload
from torch_fastload.vision import decode, jpeg_engines
from torch_fastload.vision.gpu_backend import DecodeBackendError
from torch_fastload.vision.jpeg_engines import JpegEngines
from torch_fastload.vision.nvjpeg import decode_gpu
from torch_fastload.vision.route_trial import (
    EngineRoute,
    RouteTrial,
    cpu_share_of,
    lighter_share,
    route_name,
    split_share,
)
from torch_fastload.vision.routing import route, share_out
from torch_fastload.vision.sample_data import make_image_folder

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_engines():
    jpeg_engines._reset_for_tests()
    yield
    jpeg_engines._reset_for_tests()


def jpeg(color, size=(24, 16), **save) -> torch.Tensor:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="JPEG", quality=95, **save)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


class OddWidthsRefused(FakeDecoder):
    """The engines' decoder refusing some images (as they refuse odd chroma sampling): None there."""

    threads: list = []

    def decode(self, codes, images=None, params=None, cuda_stream=0, image=None):
        OddWidthsRefused.threads.append(threading.current_thread().name)
        out = super().decode(codes, images=images, params=params, cuda_stream=cuda_stream, image=image)
        return [None if code.width % 2 else image for code, image in zip(codes, out)]


def fake_engines(decoder=FakeDecoder) -> JpegEngines:
    nv = fake_nvimgcodec_decoding()
    nv.Decoder = decoder
    return JpegEngines(CPU, module=nv, batch_hint=64)


def test_the_engines_route_asks_nvimgcodec_for_its_hardware_decoder_alone():
    """HW_GPU_ONLY alone (nothing falls through to the CUDA decoder), preallocated for the batch
    size as DALI does; one decoder, fed whole batches on one thread whoever calls."""
    engines = fake_engines(OddWidthsRefused)
    OddWidthsRefused.threads = []
    batch = [jpeg((10, 20, 30)), jpeg((200, 100, 50))]
    callers = [threading.Thread(target=engines.decode, args=(batch,)) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    engines.decode(batch)
    (decoder,) = FakeDecoder.made
    assert decoder.kw["backends"] == ["hw"] and "cuda" not in decoder.kw["backends"]
    assert decoder.kw["options"] == "nvjpeg_hw_decoder:preallocate_batch_size=64"
    assert [call["batch"] for call in decoder.calls] == [2] * 4 and engines.batches == 4
    assert len(set(OddWidthsRefused.threads)) == 1 and OddWidthsRefused.threads[0].startswith("fastload-jpeg-engines")
    engines.close()


def test_what_the_engines_refuse_is_decoded_on_the_cpu_every_image_in_its_place():
    colors = [(10, 20, 30), (200, 100, 50), (0, 120, 240), (90, 90, 10), (255, 255, 255)]
    sizes = [(24, 16), (25, 16), (40, 8), (17, 33), (64, 48)]  # odd widths: refused by the fake engines
    encoded = [jpeg(c, s) for c, s in zip(colors, sizes)]
    positions = [3, 5, 6, 8, 9]
    routes = ["x"] * 10
    for i in positions:
        routes[i] = "nvjpeg"
    out = decode_gpu(encoded, positions, routes, CPU, 1 << 24, fake_engines(OddWidthsRefused), "cpu:engines-refused")
    assert len(out) == len(encoded)
    for image, color, (w, h) in zip(out, colors, sizes):  # in order: each its own size and colour
        assert image.shape == (3, h, w) and (image[:, h // 2, w // 2].int() - torch.tensor(color)).abs().max() <= 8
    assert [routes[i] for i in positions] == [
        "nvjpeg",
        "cpu:engines-refused",
        "nvjpeg",
        "cpu:engines-refused",
        "nvjpeg",
    ]


def test_an_engine_route_sends_progressive_jpegs_to_the_cpu_and_splits_the_rest_by_its_share():
    """The engines take baseline JPEGs only: on their route a progressive file goes to the C++
    decoder up front (nvJPEG on CUDA cores takes it). A split gives the CPU its share of the
    rest (the batch's last images) and the engines the others."""
    blobs = [jpeg((k * 20, 50, 90), (32, 24)) for k in range(10)]
    blobs[4] = jpeg((1, 2, 3), (32, 24), progressive=True)
    data = torch.cat(blobs)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    info = decode.probe(data.numpy(), offsets)
    cuda = torch.device("cuda")
    assert route(info, cuda, 1 << 30)[4] == "nvjpeg"
    routes = route(info, cuda, 1 << 30, engines=True)
    assert routes[4] == "cpu:progressive" and routes.count("nvjpeg") == 9
    gpu, steal = share_out(routes, 1 / 3, work_stealing=False)
    assert gpu == [0, 1, 2, 3, 5, 6] and steal == [] and routes[7:] == ["cpu:share"] * 3

    decoder = decode.BatchDecoder("cuda:0", cpu_share=1 / 3, decode_backend="hardware")
    plan = decoder._route(data, offsets, None)  # probe and plan only: nothing touches the GPU
    assert plan.engines and decoder.fixed_route == EngineRoute(1 / 3)
    assert plan.gpu == [0, 1, 2, 3, 5, 6] and sorted(plan.cpu) == [4, 7, 8, 9]
    assert [plan.routes[i] for i in plan.gpu] == ["engines"] * 6 and plan.routes[4] == "cpu:progressive"
    if decode._native_jpeg():
        assert sorted(plan.native) == [4, 7, 8, 9]  # the C++ batch decoder takes the progressive one
    assert len(plan.gpu) + len(plan.cpu) == len(blobs)
    nvjpeg = decode.BatchDecoder("cuda:0", cpu_share=1 / 3)._route(data, offsets, None)
    assert not nvjpeg.engines and 4 in nvjpeg.gpu and nvjpeg.routes[0] == "nvjpeg"


def test_decode_backend_hardware_without_engines_says_why():
    with torch_fastload.config.override(decode_backend="hardware"):
        assert decode.BatchDecoder("cpu").decode_backend == "hardware"
    with pytest.raises(DecodeBackendError, match="decode_backend='hardware'.*nvidia-nvimgcodec-cu13"):
        jpeg_engines.jpeg_engines(CPU)
    assert "on a GPU" in jpeg_engines.jpeg_engines_missing(CPU)


def _trial_decoder(monkeypatch, missing, backend="auto", trial_engines=True):
    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: 16)
    monkeypatch.setattr(decode, "jpeg_engines_missing", lambda device, batch: missing)
    with torch_fastload.config.override(trial_engines=trial_engines):
        decoder = decode.BatchDecoder("cuda:0", decode_backend=backend)
    assert decoder.trial.candidates == ([1.0, EngineRoute(0.0)] if backend == "hardware" else [1.0, 0.0])
    decoder._offer_engines(256)
    return decoder


def test_the_trial_leaves_the_engines_out_unless_asked(monkeypatch):
    """trial_engines is off by default: a working nvImageCodec is not even probed, the candidates
    stay the CPU and nvJPEG (the engines never fed a measured training step fastest)."""
    calls = []
    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: 16)
    monkeypatch.setattr(decode, "jpeg_engines_missing", lambda device, batch: calls.append(1))
    decoder = decode.BatchDecoder("cuda:0", decode_backend="auto")
    decoder._offer_engines(256)
    assert decoder.trial.candidates == [1.0, 0.0] and calls == []
    assert _trial_decoder(monkeypatch, None, trial_engines=False).trial.candidates == [1.0, 0.0]


def test_the_trial_times_the_engines_only_where_they_work(monkeypatch):
    """'auto': the engines are offered at the first batch and timed right after the CPU route
    where nvImageCodec's hardware decoder works; where it does not (no package, no engines) the
    candidates stay the CPU and nvJPEG, as before; other backends are never offered them."""
    assert _trial_decoder(monkeypatch, None).trial.candidates == [1.0, EngineRoute(0.0), 0.0]
    assert _trial_decoder(monkeypatch, "nvidia.nvimgcodec is not installed").trial.candidates == [1.0, 0.0]
    calls = []
    monkeypatch.setattr(decode, "jpeg_engines_missing", lambda device, batch: calls.append(1))
    torchvision = decode.BatchDecoder("cuda:0", decode_backend="torchvision")
    torchvision._offer_engines(256)
    assert torchvision.trial.candidates == [1.0, 0.0] and calls == []
    assert _trial_decoder(monkeypatch, None, "hardware").trial.candidates == [1.0, EngineRoute(0.0)]


# ResNet-18 on an H100, as the record has it: CPU route 29.7 ms a batch, nvJPEG 28.9 (its CUDA
# decodes slowing the 19.5 ms step by up to 8 ms), the engines 24 ms a batch and no SMs taken.
CPU_MS, NVJPEG_MS, ENGINES_MS, STEP_MS, SLOWED_MS = 29.7, 28.9, 24.0, 19.5, 8.0


def _decode_ms(route) -> float:
    share = cpu_share_of(route)
    gpu = ENGINES_MS if isinstance(route, EngineRoute) else NVJPEG_MS
    return max(share * CPU_MS, (1 - share) * gpu) + 1.0


def _step_ms(route) -> float:
    return STEP_MS + (0.0 if isinstance(route, EngineRoute) else (1 - cpu_share_of(route)) * SLOWED_MS)


def test_the_engines_split_with_the_cpu_is_timed_and_kept_where_it_feeds_the_step_fastest():
    """Both GPU routes alone, then each beside the CPU in the ratio of the measured rates: the
    engines' split keeps up with the step (its decodes take no SMs). Negative control: the same
    timings without the engine candidate keep nvJPEG's split, a slower step. (``three_way=False``:
    the two-way splits as timed where the three-way split is not offered; tests/test_three_way.py)"""
    trial = RouteTrial(warmup=8, settle=4, window=10, split=True, three_way=False, balance=False)
    assert trial.add_candidate(EngineRoute(0.0)) and not trial.add_candidate(EngineRoute(0.0))
    trial = _run(trial, _decode_ms, _step_ms)
    engines_split = EngineRoute(split_share(trial.periods[1.0], trial.periods[EngineRoute(0.0)]))
    nvjpeg_split = split_share(trial.periods[1.0], trial.periods[0.0])
    lighter = lighter_share(nvjpeg_split)
    assert list(trial.periods) == [1.0, EngineRoute(0.0), 0.0, engines_split, nvjpeg_split, lighter]
    assert trial.batches_to_choose >= 8 + 6 * (4 + 10)  # the warm-up, then six windows
    assert trial.choice == engines_split and 0.4 < engines_split.cpu_share < 0.5
    assert trial.periods[engines_split] == pytest.approx(STEP_MS / 1e3, rel=0.05)
    assert route_name(trial.choice) == f"cpu {engines_split.cpu_share:g} + engines"
    assert "beside the JPEG engines" in trial.describe() and "on the JPEG engines" in trial.describe()

    old = _run(RouteTrial(warmup=8, settle=4, window=10, split=True, balance=False), _decode_ms, _step_ms)
    assert list(old.periods) == [1.0, 0.0, nvjpeg_split, lighter] and old.choice == nvjpeg_split
    assert old.periods[nvjpeg_split] > 1.15 * trial.periods[engines_split]

    balanced = RouteTrial(warmup=8, settle=4, window=10, split=True, three_way=False, balance=True)
    balanced.add_candidate(EngineRoute(0.0))
    balanced = _run(balanced, _decode_ms, _step_ms)  # the engines, fastest alone, split with the CPU at once
    assert list(balanced.periods) == [1.0, EngineRoute(0.0), 0.0]
    assert balanced.choice == EngineRoute(split_share(balanced.periods[1.0], balanced.periods[EngineRoute(0.0)]))


def test_a_candidate_comes_too_late_once_the_routes_alone_were_timed():
    trial = _run(RouteTrial(warmup=0, settle=0, window=3, split=True), _decode_ms, _step_ms)
    assert not trial.add_candidate(EngineRoute(0.0)) and EngineRoute(0.0) not in trial.candidates
    assert route_name(1.0) == "cpu" and route_name(0.0) == "nvjpeg" and route_name(EngineRoute(0.0)) == "engines"


@pytest.mark.cuda
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_the_engines_decode_like_the_cpu_and_leave_nothing_out(tmp_path, share):
    """The real engines where the GPU has them (skipped with the reason otherwise): a loader on
    decode_backend='hardware' (alone, or half of each batch's JPEGs on the CPU beside them)
    decodes every image of a folder with every edge case (CMYK, PNG, progressive, 4000x3000),
    each within nvJPEG's tolerance of libjpeg-turbo's pixels, in order."""
    import torchvision as tv

    from torch_fastload import DataLoader
    from torch_fastload.sources import ImageFolder

    why = jpeg_engines.jpeg_engines_missing(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        pytest.skip(why)
    train, _ = make_image_folder(str(tmp_path / "s"), classes=4, train_per_class=16, val_per_class=1, progress=False)
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(decode_backend="hardware", cpu_decode_share=share):
        loader = DataLoader(ds, batch_size=16, device="cuda")
        decoded = [image for images, _ in loader for image in images]
        counts = loader.stats().decoded
    assert ds.decoder(loader.device).gpu_backend().name == "hardware"
    gpu_part = counts.get("engines", 0) + counts.get("cpu:engines-refused", 0)
    assert len(decoded) == len(ds) and "nvjpeg" not in counts
    assert (
        counts.get("engines", 0) >= (1 - share) * len(ds) - 8 and gpu_part + counts.get("cpu:share", 0) >= len(ds) - 8
    )
    assert counts.get("cpu:progressive", 0) >= 1 and {"cpu:cmyk", "cpu:png"} <= set(counts)
    print("routes on the engines' run:", counts)
    for path, image in zip(ds.paths, decoded):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.is_cuda and image.shape == cpu.shape, path
        d = (image.cpu().int() - cpu.int()).abs().float()
        assert d.mean() <= 1.5 and (d.numel() >= 16e6 or d.flatten().quantile(0.999) <= 16), path


def test_the_self_test_decodes_on_the_engines_and_says_when_they_decode_nothing():
    """A usable fake passes; a decoder that returns None for everything (no engines: nvImageCodec
    registers no hardware decoder) is named as such, after a try with the library's own images."""
    assert jpeg_engines.self_test(fake_engines()) is None

    class NoEngines(FakeDecoder):
        def decode(self, codes, images=None, params=None, cuda_stream=0, image=None):
            return [None] * len(codes) if isinstance(codes, list) else None

    engines = fake_engines(NoEngines)
    assert "no JPEG engines" in jpeg_engines.self_test(engines) and engines.codec.output == "library"


def test_the_callers_stream_waits_for_the_engines_own_and_marks_each_block_used():
    """On the GPU the engines decode on their own stream: taking the result orders the caller's
    stream after their event and marks each decoded block (not each view) used on it."""
    from concurrent.futures import Future

    from torch_fastload.vision.jpeg_engines import EngineDecode

    class Stream:
        waited: list = []

        def wait_event(self, event):
            self.waited.append(event)

    class View:
        def __init__(self, block):
            self.block, self.marked = block, []

        def untyped_storage(self):
            return type("Storage", (), {"data_ptr": lambda _: self.block})()

        def record_stream(self, stream):
            self.marked.append(stream)

    caller, done = Stream(), object()
    views = [View(1000), View(1000), None, View(2000)]
    future = Future()
    future.set_result((views, done))
    assert EngineDecode(future, caller).result() is views
    assert caller.waited == [done]
    assert [len(v.marked) for v in views if v is not None] == [1, 0, 1]
    engines = fake_engines()  # off the GPU: no stream, no event
    assert engines.stream is None and engines.submit([jpeg((1, 2, 3))]).result()[0].shape == (3, 16, 24)
