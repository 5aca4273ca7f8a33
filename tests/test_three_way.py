"""The three-way split (vision/route_trial.py ThreeWayRoute): the CPU, the GPU's JPEG engines and
nvJPEG on one batch at once, each image to one of them, in the ratio of the rates each route
measured alone. On the CPU with fakes: the shares, the plan and delivery of a batch, and the
route trial offering it only where the engines work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gpu_backend import FakeDecoder
from test_jpeg_engines import OddWidthsRefused, _run, _trial_decoder, fake_engines, jpeg

from torch_fastload.vision import decode
from torch_fastload.vision.cpu import decode_cpu
from torch_fastload.vision.route_trial import (
    EngineRoute,
    RouteTrial,
    ThreeWayRoute,
    cpu_share_of,
    engine_share_of,
    lighter_share,
    route_name,
    split_share,
    three_way_shares,
)

CPU = torch.device("cpu")


def test_three_way_shares_follow_the_rates_measured_alone():
    """H200 ResNet-18's windows: CPU 36.0 ms a batch, engines 37.9, nvJPEG 27.7: 7.1k, 6.8k and
    9.2k images/s, so 31%, 29% and 40% of each batch."""
    assert three_way_shares(36.0, 37.9, 27.7) == (0.31, 0.29, 0.4)
    assert three_way_shares(30.0, 30.0, 30.0) == (0.33, 0.33, 0.34)
    cpu, engines, nvjpeg = three_way_shares(400.0, 400.0, 10.0)  # two slow decoders keep a part each
    assert (cpu, engines) == (0.05, 0.05) and nvjpeg == 0.9
    route = ThreeWayRoute(0.31, 0.29)
    assert cpu_share_of(route) == 0.31 and engine_share_of(route) == 0.29 and route.nvjpeg_share == 0.4
    assert route_name(route) == "cpu 0.31 + engines 0.29 + nvjpeg 0.4"
    assert engine_share_of(EngineRoute(0.25)) == 0.75 and engine_share_of(0.5) == 0.0


class FakeNvjpeg:
    """nvJPEG on CUDA cores, faked with PIL on the CPU: the images it was given, counted."""

    name = "torchvision"

    def __init__(self):
        self.given = 0

    def decode(self, encoded):
        self.given += len(encoded)
        return [decode_cpu(t) for t in encoded]


def test_a_three_way_split_delivers_every_image_in_order_each_decoder_its_share(monkeypatch):
    """20 JPEGs at (0.3, 0.3, 0.4): the batch's last 6 on the CPU, 6 baseline ones on the
    engines (one refused there: decoded on the CPU in its place), the rest on nvJPEG, the
    progressive one among them (the engines take baseline JPEGs only). Every image comes back
    in order with its own colour, and ``stats().decoded``'s counts name each decoder."""
    sizes = [(32, 24)] * 20
    sizes[2] = (33, 24)  # an odd width: the fake engines refuse it
    blobs = [jpeg((10 * k, 200 - 5 * k, 90), sizes[k]) for k in range(20)]
    blobs[0] = jpeg((0, 0, 200), (32, 24), progressive=True)
    data = torch.cat(blobs)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)

    decoder = decode.BatchDecoder("cuda:0", cpu_share=0.3)  # probe and plan only touch no GPU
    decoder.fixed_route = ThreeWayRoute(0.3, 0.3)
    plan = decoder._route(data, offsets, None)
    assert sorted(plan.cpu) == list(range(14, 20)) and {plan.routes[i] for i in plan.cpu} == {"cpu:share"}
    assert plan.engine_part == [1, 2, 3, 4, 5, 6] and not plan.engines  # the first six baseline JPEGs
    assert plan.gpu == [0, *range(7, 14)] and plan.routes[0] == "nvjpeg"  # progressive: nvJPEG's
    assert sorted(plan.gpu + plan.engine_part + plan.cpu) == list(range(20))

    nvjpeg = FakeNvjpeg()
    engines = fake_engines(OddWidthsRefused)
    monkeypatch.setattr(decoder, "gpu_backend", lambda batch=None: nvjpeg)
    monkeypatch.setattr(decode, "jpeg_engines", lambda device, batch=None: engines)
    decoder.device = CPU  # the GPU's part decoded by the fakes on the CPU
    images, failed = [None] * 20, {}
    decoder._decode_on_gpu(plan, None, images, failed)
    for i in plan.cpu:  # the CPU side, as the decode threads would
        images[i] = decode_cpu(plan.slices[i])
    counts: dict = {}
    out = decoder._assemble(plan, images, failed, lambda i: (f"{i}.jpg", i), counts, None)
    assert failed == {} and out.kept.tolist() == list(range(20)) and nvjpeg.given == 8
    assert [call["batch"] for call in FakeDecoder.made[-1].calls] == [6]  # the engines: one call, their part
    assert counts == {"cpu:share": 6, "engines": 5, "cpu:engines-refused": 1, "nvjpeg": 8}
    for k, image in enumerate(out.images):
        w, h = sizes[k]
        color = (0, 0, 200) if k == 0 else (10 * k, 200 - 5 * k, 90)
        assert image.shape == (3, h, w)
        assert (image[:, h // 2, w // 2].int() - torch.tensor(color)).abs().max() <= 8, k


# Decoders slower than the step (ms a batch alone): nvJPEG's CUDA decodes slow a 19.5 ms step
# by 3 ms at its whole share, the engines' and the CPU's by nothing. Two decoders split a batch
# at 23-28 ms; the three of them at once keep up with the step but for nvJPEG's part.
ALONE_MS = {"cpu": 60.0, "engines": 50.0, "nvjpeg": 35.0}
STEP_MS, NVJPEG_SLOWS_MS = 19.5, 3.0


def _decode_ms(route) -> float:
    cpu, engines = cpu_share_of(route), engine_share_of(route)
    nvjpeg = 1.0 - cpu - engines
    return max(cpu * ALONE_MS["cpu"], engines * ALONE_MS["engines"], nvjpeg * ALONE_MS["nvjpeg"]) + 1.0


def _step_ms(route) -> float:
    return STEP_MS + (1.0 - cpu_share_of(route) - engine_share_of(route)) * NVJPEG_SLOWS_MS


def _decoders_trial(monkeypatch, missing, backend="auto") -> RouteTrial:
    """The trial a BatchDecoder makes (engines offered at its first batch), without its GPU probe."""
    trial = _trial_decoder(monkeypatch, missing, backend).trial
    trial.steps = None
    return trial


def test_the_trial_times_the_three_way_split_where_the_engines_work_and_keeps_it_where_fastest(monkeypatch):
    """Where the engines work (offered at the first batch), the splits timed after the routes
    alone are the three-way one, then the CPU beside nvJPEG (the engines' split with the CPU
    is not timed: still five windows); the three-way split is kept at ~20.9 ms a batch. Where
    they are missing, the trial is as before: the CPU, nvJPEG, their split. Negative control:
    the same timings without the three-way split keep a two-way split, over 10% slower. (With
    ``balance_split`` the three-way split starts at once instead.)"""
    trial = _run(_decoders_trial(monkeypatch, None), _decode_ms, _step_ms)
    three = ThreeWayRoute(*three_way_shares(*(trial.periods[r] for r in (1.0, EngineRoute(0.0), 0.0)))[:2])
    assert list(trial.periods) == [
        1.0,
        EngineRoute(0.0),
        0.0,
        three,
        split_share(trial.periods[1.0], trial.periods[0.0]),
        lighter_share(split_share(trial.periods[1.0], trial.periods[0.0])),
    ]
    assert trial.choice == three and three.nvjpeg_share > 0.35 and min(three.cpu_share, three.engine_share) > 0.2
    assert trial.periods[three] == pytest.approx((STEP_MS + three.nvjpeg_share * NVJPEG_SLOWS_MS) / 1e3, rel=0.05)
    assert "split three ways (cpu " in trial.describe() and route_name(trial.choice).startswith("cpu 0.")

    missing = _run(_decoders_trial(monkeypatch, "nvidia.nvimgcodec is not installed"), _decode_ms, _step_ms)
    assert list(missing.periods)[:2] == [1.0, 0.0] and len(missing.periods) == 4  # + the lighter split
    assert not any(isinstance(r, (ThreeWayRoute, EngineRoute)) for r in missing.periods)

    balanced = _decoders_trial(monkeypatch, None)
    balanced.balancing = True
    balanced = _run(balanced, _decode_ms, _step_ms)
    assert list(balanced.periods) == [1.0, EngineRoute(0.0), 0.0]
    assert balanced.choice == ThreeWayRoute(*three_way_shares(*(balanced.periods[r] for r in balanced.periods))[:2])

    old = RouteTrial(warmup=8, settle=4, window=10, split=True, three_way=False, balance=False)
    old.add_candidate(EngineRoute(0.0))
    old = _run(old, _decode_ms, _step_ms)
    assert not any(isinstance(r, ThreeWayRoute) for r in old.periods) and len(old.periods) == 6
    assert old.periods[old.choice] > 1.1 * trial.periods[three]


def test_engine_only_trials_keep_the_engines_split_with_the_cpu(monkeypatch):
    """decode_backend='hardware': no nvJPEG candidate, so no three-way split: the engines beside
    the CPU, as before: timed in a window of its own, or started at once and balanced online."""
    trial = _run(_decoders_trial(monkeypatch, None, "hardware"), _decode_ms, _step_ms)
    assert len(trial.periods) == 3 and isinstance(list(trial.periods)[2], EngineRoute)
    balanced = _decoders_trial(monkeypatch, None, "hardware")
    balanced.balancing = True
    balanced = _run(balanced, _decode_ms, _step_ms)
    assert list(balanced.periods) == [1.0, EngineRoute(0.0)]
    assert balanced.choice == EngineRoute(split_share(balanced.periods[1.0], balanced.periods[EngineRoute(0.0)]))


def test_engine_decode_share_fixes_a_three_way_split(monkeypatch):
    """The option (or its environment variable) beside a numeric cpu_decode_share: every batch
    split three ways, as the trial would; not with the engines alone, nor over a whole batch."""
    assert decode.BatchDecoder("cuda:0", cpu_share=0.31, engine_share=0.29).fixed_route == ThreeWayRoute(0.31, 0.29)
    monkeypatch.setenv("TORCH_FASTLOAD_ENGINE_DECODE_SHARE", "0.4")
    assert decode.BatchDecoder("cuda:0", cpu_share=0.2).fixed_route == ThreeWayRoute(0.2, 0.4)
    assert decode.BatchDecoder("cuda:0", cpu_share=0.2, decode_backend="hardware").fixed_route == EngineRoute(0.2)
    monkeypatch.delenv("TORCH_FASTLOAD_ENGINE_DECODE_SHARE")
    assert decode.BatchDecoder("cuda:0", cpu_share=0.2).fixed_route == 0.2
    with pytest.raises(ValueError, match="over 1"):
        decode.BatchDecoder("cuda:0", cpu_share=0.8, engine_share=0.3)


@pytest.mark.cuda
def test_a_three_way_split_on_the_gpu_decodes_like_the_cpu_and_leaves_nothing_out(tmp_path):
    """The real engines and nvJPEG beside the CPU (skipped with the reason where the GPU has no
    engines): every image of a folder with every edge case, in order, within nvJPEG's tolerance
    of libjpeg-turbo's pixels, each decoder counted."""
    import torchvision as tv

    import torch_fastload
    from torch_fastload import DataLoader
    from torch_fastload.sources import ImageFolder
    from torch_fastload.vision import jpeg_engines
    from torch_fastload.vision.sample_data import make_image_folder

    why = jpeg_engines.jpeg_engines_missing(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        pytest.skip(why)
    train, _ = make_image_folder(str(tmp_path / "s"), classes=4, train_per_class=16, val_per_class=1, progress=False)
    ds = ImageFolder(train, transform=None)
    with torch_fastload.config.override(cpu_decode_share=0.3, engine_decode_share=0.3):
        loader = DataLoader(ds, batch_size=16, device="cuda")
        decoded = [image for images, _ in loader for image in images]
        counts = loader.stats().decoded
    print("routes on the three-way run:", counts)
    assert len(decoded) == len(ds) and counts.get("engines", 0) > 0 and counts.get("nvjpeg", 0) > 0
    assert counts.get("cpu:share", 0) > 0 and {"cpu:cmyk", "cpu:png"} <= set(counts)
    for path, image in zip(ds.paths, decoded):
        cpu = tv.io.decode_image(tv.io.read_file(path), mode=tv.io.ImageReadMode.RGB)
        assert image.is_cuda and image.shape == cpu.shape, path
        d = (image.cpu().int() - cpu.int()).abs().float()
        assert d.mean() <= 1.5 and (d.numel() >= 16e6 or d.flatten().quantile(0.999) <= 16), path
