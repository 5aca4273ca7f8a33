"""A kept split's CPU share balanced online (vision/route_trial.py ShareBalancer).

The trial's windows rank routes to within about 15% and time a split at one share; the balancer
then moves the share to where both decoders are equally busy, from the batches' own decodes.
Simulated here: a loader with three batches decoding at once over two first-come-first-served
decoders (the C++ decoder's calls and nvJPEG's, each one batch's part at a time), so a side that
is overloaded also makes its parts wait behind other batches'.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from torch_fastload.vision import decode
from torch_fastload.vision.route_trial import (
    EngineRoute,
    RouteTrial,
    ShareBalancer,
    ThreeWayRoute,
    cpu_share_of,
    engine_share_of,
    is_split,
    with_cpu_share,
)

BATCH = 256


def kept_split(share: float, balance: bool = True) -> RouteTrial:
    """A trial that kept the split at ``share`` (as ``_fastest`` would have)."""
    trial = RouteTrial(warmup=0, settle=0, window=3, split=True, balance=balance)
    trial.choice = share
    return trial


def pipelined(trial: RouteTrial, cpu_rate: float, gpu_rate: float, batches: int, at_once=3, noise=0.0, seed=0):
    """Decode ``batches`` batches, ``at_once`` in flight, each split by ``trial.next_share()``:
    the CPU's part on one first-come-first-served decoder at ``cpu_rate`` images/s, the rest on
    another at ``gpu_rate``; each part's time off by up to ``noise`` (uniform). Each decoder's
    span is when it worked on the part. Returns the images/s of the last half and the shares the
    batches were given."""
    rng = random.Random(seed)
    cpu_free = gpu_free = 0.0
    slots = [0.0] * at_once  # when each stage slot is free for its next batch
    ends, shares = [], []
    for _ in range(batches):
        slot = min(range(at_once), key=slots.__getitem__)
        start = slots[slot]
        share = trial.next_share()
        shares.append(share)
        cpu_images = round(cpu_share_of(share) * BATCH)
        gpu_images = BATCH - cpu_images
        cpu_start, gpu_start = max(start, cpu_free), max(start, gpu_free)
        cpu_end = cpu_start + cpu_images / cpu_rate * (1 + noise * rng.uniform(-1, 1))
        gpu_end = gpu_start + gpu_images / gpu_rate * (1 + noise * rng.uniform(-1, 1))
        cpu_free, gpu_free = cpu_end, gpu_end
        slots[slot] = max(cpu_end, gpu_end)
        ends.append(slots[slot])
        trial.balance(cpu_images, (cpu_start, cpu_end), gpu_images, (gpu_start, gpu_end))
    ends.sort()
    half = batches // 2
    return BATCH * (batches - half - 1) / (ends[-1] - ends[half]), shares


@pytest.mark.parametrize("start", [0.1, 0.24, 0.8])
def test_a_kept_split_moves_to_where_both_decoders_finish_together(start):
    """Beside a ResNet-18 step on the H100 nvJPEG's batch took ~2x its time alone and the CPU's
    did not slow: say 4.3k images/s on the CPU and 4.6k on nvJPEG, so 48% on the CPU keeps both
    busy and feeds ~8.9k. From a split the trial kept at 0.1, 0.24 or 0.8 the share settles
    there and the loader feeds within 5% of it. Negative control: unbalanced, each feeds under
    70% of it."""
    best = 4300 + 4600
    trial = kept_split(start)
    fed, shares = pipelined(trial, 4300, 4600, 300)
    assert abs(cpu_share_of(trial.choice) - 0.48) <= 0.03 and fed >= 0.95 * best
    assert trial.balancer.moves >= 1 and shares[0] == start
    assert "balanced online from cpu " + f"{start:g}" in trial.describe()
    fixed, _ = pipelined(kept_split(start, balance=False), 4300, 4600, 300)
    assert fixed < 0.7 * best


def test_the_share_follows_a_change_of_pace_and_noise_does_not_shake_it():
    """The loader alone (nvJPEG at 17k images/s, the CPU at 8k: 32% on the CPU), then beside a
    step that halves nvJPEG's rate (48%); each part's time off by up to 30%. The share follows
    within a few hundredths and, once settled, moves less than 0.1 over 100 batches."""
    trial = kept_split(0.5)
    pipelined(trial, 8000, 17000, 200, noise=0.3, seed=1)
    assert abs(cpu_share_of(trial.choice) - 0.32) <= 0.04
    _, shares = pipelined(trial, 8000, 8500, 300, noise=0.3, seed=2)
    settled = [cpu_share_of(s) for s in shares[-100:]]
    assert abs(np.median(settled) - 0.485) <= 0.04 and max(settled) - min(settled) < 0.1


def test_only_a_kept_split_is_balanced():
    """The CPU route or nvJPEG alone kept, or no choice yet: nothing moves. So is a balancer that
    is told a side decoded nothing, and the share stays within its bounds."""
    for route in (0.0, 1.0, EngineRoute(0.0)):
        trial = kept_split(0.5)
        trial.choice = route
        pipelined(trial, 4000, 4000, 40)
        assert trial.choice == route and trial.balancer is None
    undecided = RouteTrial(warmup=100, settle=0, window=3, split=True)
    undecided.balance(100, (0.0, 0.01), 156, (0.0, 0.02))
    assert undecided.balancer is None and undecided.choice is None
    balancer = ShareBalancer(0.5)
    assert all(balancer.add(0, (0.0, 0.0), 256, (0.0, 0.01)) is None for _ in range(20)) and balancer.batches == 0
    trial = kept_split(0.5)
    pipelined(trial, 100000, 100, 200)  # a GPU decoder that barely decodes
    assert cpu_share_of(trial.choice) == 0.95
    with pytest.raises(ValueError):
        ShareBalancer(0.5, every=4, history=2)


def test_a_three_way_split_keeps_the_engines_and_nvjpeg_in_their_ratio():
    route = with_cpu_share(ThreeWayRoute(0.3, 0.28), 0.44)
    assert isinstance(route, ThreeWayRoute) and cpu_share_of(route) == 0.44
    assert engine_share_of(route) == pytest.approx(0.22, abs=0.01)  # 0.28 / 0.70 of the rest, as before
    assert with_cpu_share(EngineRoute(0.3), 0.5) == EngineRoute(0.5) and with_cpu_share(0.3, 0.5) == 0.5
    assert is_split(ThreeWayRoute(0.3, 0.3)) and is_split(0.2) and not is_split(0.0) and not is_split(1.0)


def test_the_decoder_reports_each_batchs_parts_to_its_trial(monkeypatch):
    """BatchDecoder.decode: the C++ decoder's images and when its call ran (timed inside the
    call), the GPU's images (nvJPEG's and the engines') and when their part ran; a work-stealing
    batch is not reported."""
    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(decode.config, "cpus_per_process", lambda: 16)
    decoder = decode.BatchDecoder("cuda:0")
    reports = []
    monkeypatch.setattr(decoder.trial, "balance", lambda *a: reports.append(a))

    class Plan:
        native, gpu, engine_part, steal, routes, failed = [5, 6, 7], [0, 1, 2, 3], [4], [], [None] * 8, {}

    def start_cpu(plan, data, offsets):
        span: list = []

        def native():  # as _decode_native: its own start and end
            started = time.perf_counter()
            time.sleep(0.05)
            span[:] = [started, time.perf_counter()]

        return decode.CpuSide(None, {}, decoder._executor().submit(native), None, None, span)

    monkeypatch.setattr(decoder, "_route", lambda data, offsets, crop: Plan())
    monkeypatch.setattr(decoder, "_start_cpu", start_cpu)
    monkeypatch.setattr(decoder, "_decode_on_gpu", lambda plan, job, images, failed: time.sleep(0.01))
    monkeypatch.setattr(decoder, "_cpu_results", lambda plan, cpu: {})
    monkeypatch.setattr(decoder, "_place", lambda *a: None)
    monkeypatch.setattr(decoder, "_assemble", lambda *a: "assembled")
    assert decoder.decode(None, None, None, {}) == "assembled"
    ((cpu_images, (cpu_start, cpu_end), gpu_images, (gpu_start, gpu_end)),) = reports
    assert (cpu_images, gpu_images) == (3, 5) and 0.04 < cpu_end - cpu_start < 0.5
    assert 0.005 < gpu_end - gpu_start < 0.05 and cpu_start < gpu_end and gpu_start < cpu_end  # at once
    Plan.steal = [0, 1]
    decoder.decode(None, None, None, {})
    assert len(reports) == 1
    decoder.close()


def test_balance_split_option_reaches_the_trial(monkeypatch):
    """``balance_split`` (off by default: the loader alone fed 12-15% less balanced) makes the
    decoder's trial start a split at once and balance it; off, splits are timed in windows."""
    import torch_fastload

    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: 16)
    assert decode.BatchDecoder("cuda:0").trial.balancing is False
    with torch_fastload.config.override(balance_split=True):
        assert decode.BatchDecoder("cuda:0").trial.balancing is True
    monkeypatch.setenv("TORCH_FASTLOAD_BALANCE_SPLIT", "1")
    assert decode.BatchDecoder("cuda:0").trial.balancing is True
