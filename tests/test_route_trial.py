"""The route trial's keep-up shortcut judged by the step's own pace (vision/step_probe.py).

A loader and a training loop are simulated on a fake clock, with the GPU's stream beside the
host: each step queues ``gpu_ms`` of GPU work in ``host_ms`` of host time, and the host cannot
finish queueing a step before the GPU finished the one before (CUDA's launch queue holds about
a step). The probe's events are placed where that GPU would pass them.
"""

from __future__ import annotations

import time

import pytest
import torch

from torch_fastload.vision import route_trial
from torch_fastload.vision.route_trial import RouteTrial
from torch_fastload.vision.settings import TRIAL_CAUGHT_UP
from torch_fastload.vision.step_probe import DELIVERED, REQUESTED, GpuStepProbe, StepReading, read_marks

NEXT_MS = 0.1  # next()'s own host time (the H200's main job: 154 us)


class SimulatedProbe:
    """``GpuStepProbe`` on the simulation: each mark at ``at = (gpu seconds, host seconds)``;
    ``take()`` reads the marks the simulated GPU has passed by the fake clock."""

    def __init__(self, clock):
        self.clock = clock
        self.at = (0.0, 0.0)
        self._marks = []

    def mark(self, kind):
        self._marks.append((kind, *self.at))

    def take(self):
        marks, self._marks = self._marks, []
        passed = []
        for mark in marks:
            if mark[1] > self.clock[0]:
                break
            passed.append(mark)
        return read_marks(passed)


def simulated_run(decode_ms: dict, host_ms: dict, gpu_ms: dict, depth=4, probe=True) -> RouteTrial:
    """The trial once it chose, over a loader whose decodes take ``decode_ms[share]`` (up to
    ``depth`` batches ahead of the loop) and a loop whose steps take ``host_ms[share]`` on the
    host and ``gpu_ms[share]`` on the GPU while that route decodes. ``probe=False``: the rule
    before the probe (the loop's wait alone)."""
    clock = [0.0]
    steps = SimulatedProbe(clock) if probe else None
    trial = RouteTrial(warmup=8, settle=4, window=10, clock=lambda: clock[0], steps=steps)
    ready: list[float] = []
    taken: list[float] = []
    decode_free = loop_free = gpu_free = 0.0
    share = 1.0
    while trial.choice is None:
        blocked = len(ready) >= depth and len(taken) <= len(ready) - depth
        start = None if blocked else max(decode_free, taken[len(ready) - depth] if len(ready) >= depth else 0.0)
        take = max(loop_free, ready[len(taken)]) + NEXT_MS / 1e3 if len(taken) < len(ready) else None
        if take is not None and (start is None or take < start):
            clock[0] = take
            taken.append(take)
            asked_gpu = max(loop_free, gpu_free)  # the GPU passes next()'s entry once the step ran
            if steps is not None:
                steps.at = (asked_gpu, loop_free)
            trial.requested()
            handed_gpu = max(take, asked_gpu)
            if steps is not None:
                steps.at = (handed_gpu, take)
            trial.consumed(max(0.0, take - loop_free - NEXT_MS / 1e3))
            loop_free = max(take + host_ms[share] / 1e3, gpu_free)  # the launch queue: about a step ahead
            gpu_free = max(handed_gpu + gpu_ms[share] / 1e3, loop_free)
        else:
            clock[0] = start
            share = trial.next_share()
            decode_free = start + decode_ms[share] / 1e3
            ready.append(decode_free)
    return trial


# H200, ResNet-18 (benchmarks/JOURNAL.md, 2026-11-26): the CPU route's decode threads slowed the
# step's host thread to ~56 ms, its GPU work is ~22 ms; nvJPEG's decodes leave the host alone.
SLOWED = dict(decode_ms={0.0: 20.0, 1.0: 50.0}, host_ms={0.0: 20.0, 1.0: 56.0}, gpu_ms={0.0: 24.0, 1.0: 21.5})
# H100, ResNet-50: a 66 ms GPU step queued in 15 ms; nvJPEG's GPU work slows it to 71.
RESNET50 = dict(decode_ms={0.0: 20.0, 1.0: 40.0}, host_ms={0.0: 15.0, 1.0: 15.0}, gpu_ms={0.0: 71.0, 1.0: 66.0})


def test_a_step_slowed_on_its_host_thread_gets_nvjpeg_timed_too():
    """The loop hardly waits for the CPU route (the step itself is slow), yet the GPU had caught
    up at every hand-off: nvJPEG is timed and kept. The old rule (the loop's wait alone,
    negative control) keeps the CPU route at 56 ms a batch."""
    old = simulated_run(**SLOWED, probe=False)
    assert old.choice == 1.0 and list(old.periods) == [1.0] and old.waited[1.0] < 0.1
    assert old.periods[1.0] == pytest.approx(0.056, rel=0.03)
    trial = simulated_run(**SLOWED)
    assert trial.waited[1.0] < 0.1 and trial.gpu[1.0].caught_up > 0.9  # the shortcut's old reason still held
    # the GPU time between next() calls is the slowed pace itself: beside the period it tells nothing
    assert trial.gpu[1.0].gpu_step == pytest.approx(trial.periods[1.0], rel=0.03)
    assert trial.choice == 0.0 and trial.periods[0.0] == pytest.approx(0.024, rel=0.05)
    assert "caught up 100%" in trial.describe()


def test_a_step_at_its_gpus_pace_keeps_the_cpu_route_without_trying_nvjpeg():
    """ResNet-50: the GPU is still busy with the step at every hand-off and the loop never
    waits: the CPU route is kept at once, as before the probe, and nvJPEG never starts."""
    trial = simulated_run(**RESNET50)
    assert trial.choice == 1.0 and list(trial.periods) == [1.0]
    assert trial.gpu[1.0].caught_up < 0.1 and trial.gpu[1.0].gpu_step == pytest.approx(0.066, rel=0.02)
    assert trial.periods[1.0] == pytest.approx(0.066, rel=0.02)
    assert simulated_run(**RESNET50, probe=False).choice == 1.0


def test_a_loop_that_waits_times_both_routes_whatever_the_gpu_says():
    """A small model the CPU route cannot feed: the loop waits, so nvJPEG is timed (as before)."""
    trial = simulated_run({0.0: 15.0, 1.0: 38.0}, {0.0: 10.0, 1.0: 10.0}, {0.0: 22.0, 1.0: 20.0})
    assert trial.waited[1.0] > 0.3 and trial.choice == 0.0 and set(trial.periods) == {0.0, 1.0}


def test_read_marks_tells_a_busy_gpu_from_one_that_waited():
    busy, waited = [], []
    for k in range(5):  # the GPU passes next()'s markers 40 ms after the host set them, both at once
        t = 0.05 * k
        busy += [(REQUESTED, t + 0.040, t), (DELIVERED, t + 0.040, t + 0.0002)]
        waited += [(REQUESTED, t, t), (DELIVERED, t + 0.003, t + 0.003)]  # the loop waited 3 ms
    seen = read_marks(busy)
    assert seen.caught_up == pytest.approx(0.0) and seen.gpu_step == pytest.approx(0.050)
    seen = read_marks(waited)
    assert seen.caught_up == pytest.approx(1.0) and seen.gpu_step == pytest.approx(0.047)
    assert read_marks(waited[:4]) is None  # too few spans to judge
    assert isinstance(seen, StepReading) and TRIAL_CAUGHT_UP == 0.5


def test_a_trial_without_probe_data_falls_back_to_the_loops_wait():
    """A probe whose events the GPU had not passed by the window's end (None): the rule before."""

    class Blind:
        def mark(self, kind):
            pass

        def take(self):
            return None

    now = [0.0]
    trial = RouteTrial(warmup=0, settle=0, window=5, clock=lambda: now[0], steps=Blind())
    while trial.choice is None:
        trial.next_share()
        trial.requested()
        trial.consumed(waited=0.0)
        now[0] += 0.03
    assert trial.choice == 1.0 and trial.gpu[1.0] is None


@pytest.mark.cuda
def test_gpu_step_probe_on_the_gpu_sees_a_busy_stream_and_an_idle_one():
    """Real events: a 30 ms GPU sleep queued before next()'s entry keeps the GPU busy through
    the 2 ms next() (caught up ~0); with the host sleeping instead, the GPU waits (~1)."""
    device = torch.device("cuda")
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cycles_per_ms = _cycles_per_ms()

    def run(gpu_busy: bool) -> StepReading:
        probe = GpuStepProbe(device)
        for _ in range(5):
            if gpu_busy:
                torch.cuda._sleep(int(30 * cycles_per_ms))
            else:
                time.sleep(0.030)
            probe.mark(REQUESTED)
            time.sleep(0.002)
            probe.mark(DELIVERED)
        torch.cuda.synchronize()
        return probe.take()

    busy, idle = run(True), run(False)
    assert busy.caught_up < TRIAL_CAUGHT_UP < idle.caught_up
    assert busy.gpu_step > 0.015 and idle.gpu_step > 0.015


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def test_the_default_decoder_probes_the_step_and_the_source_passes_next_calls_on(monkeypatch, tmp_path):
    """BatchDecoder's trial carries a GpuStepProbe (nothing touches the GPU until a timed
    window), and ImageFolder hands next()'s entry to its decoder's trial."""
    import torch_fastload
    from torch_fastload.sources import ImageFolder
    from torch_fastload.vision import decode

    monkeypatch.setattr(decode, "_native_jpeg", lambda: True)
    monkeypatch.setattr(torch_fastload.config, "cpus_per_process", lambda: 16)
    decoder = decode.BatchDecoder("cuda")
    assert isinstance(decoder.trial.steps, GpuStepProbe) and decoder.trial.steps.device.type == "cuda"
    decoder.requested()  # outside a timed window: no mark, no CUDA call

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(b"\xff\xd8\xff\xd9")
    folder = ImageFolder(tmp_path)
    seen = []

    class Decoder:
        def requested(self):
            seen.append("requested")

        def delivered(self, waited):
            seen.append("delivered")

    folder._decoders[torch.device("cuda", 0)] = Decoder()
    folder.__fastload_requested__(torch.device("cuda", 0))
    folder.__fastload_delivered__("cuda:0", 0.0)
    folder.__fastload_requested__(torch.device("cuda", 1))  # no decoder there: nothing
    assert seen == ["requested", "delivered"]


def run_trial(trial: RouteTrial, decode_ms, step_ms, depth=4) -> RouteTrial:
    """A loader whose decode of a batch on ``route`` takes ``decode_ms(route)`` beside a loop
    whose step takes ``step_ms(route)`` meanwhile; the trial once it chose."""
    clock = [0.0]
    trial.clock = lambda: clock[0]
    ready: list[float] = []
    taken: list[float] = []
    routes: list = []
    decode_free = loop_free = 0.0
    while trial.choice is None:
        blocked = len(ready) >= depth and len(taken) <= len(ready) - depth
        start = None if blocked else max(decode_free, taken[len(ready) - depth] if len(ready) >= depth else 0.0)
        take = max(loop_free, ready[len(taken)]) if len(taken) < len(ready) else None
        if take is not None and (start is None or take < start):
            clock[0] = take
            trial.consumed(take - loop_free)
            loop_free = take + step_ms(routes[len(taken)]) / 1e3
            taken.append(take)
        else:
            clock[0] = start
            routes.append(trial.next_share())
            decode_free = start + decode_ms(routes[-1]) / 1e3
            ready.append(decode_free)
    return trial


def _split_run(decode_ms, step_ms: float, split=True, depth=4, balance=False) -> RouteTrial:
    """``run_trial`` of a trial with the split candidate (or not), beside a step of ``step_ms``
    whatever the route; its splits timed in windows of their own (``balance=False``) or the
    split started at once and balanced online (the decoder's default)."""
    trial = RouteTrial(warmup=8, settle=4, window=10, split=split, balance=balance)
    return run_trial(trial, decode_ms, lambda route: step_ms, depth)


def test_neither_route_feeding_the_loop_times_both_at_once_split_by_their_rates():
    """H200 ResNet-18: the CPU route ran 29.7 ms a batch and nvJPEG 28.9 beside a 19.5 ms step.
    Splitting each batch in the ratio of their rates (49% on the CPU) is timed third, the
    lighter split (half that share) fourth, and the first kept. Without the split (negative
    control) nvJPEG stays at ~29 ms."""

    def decode(share):  # both decoders at once, each on its part of the batch
        return max(share * 29.7, (1 - share) * 28.9) + 1.0

    trial = _split_run(decode, 19.5)
    share = route_trial.split_share(29.7 + 1.0, 28.9 + 1.0)
    assert share == pytest.approx(0.49, abs=0.01)
    assert list(trial.periods) == [1.0, 0.0, share, route_trial.lighter_share(share)] and trial.choice == share
    assert trial.periods[share] == pytest.approx(0.0195, rel=0.05)
    assert "at share 0.49" in trial.describe()
    old = _split_run(decode, 19.5, split=False)
    assert old.choice == 0.0 and old.periods[0.0] == pytest.approx(0.0299, rel=0.03)


def test_with_balance_the_split_starts_at_once_in_the_ratio_of_the_rates_alone():
    """The decoder's default: once the CPU route and nvJPEG were timed alone and neither fed the
    loop, the split in the ratio of their rates is kept without a window of its own (its share
    then balanced online, tests/test_share_balancer.py): two windows fewer. Where the CPU route
    beat nvJPEG by the margin, it is kept; where it kept up with the step, nothing else is timed."""

    def decode(share):
        return max(share * 29.7, (1 - share) * 28.9) + 1.0

    trial = _split_run(decode, 19.5, balance=True)
    share = route_trial.split_share(29.7 + 1.0, 28.9 + 1.0)
    assert list(trial.periods) == [1.0, 0.0] and trial.choice == share
    windowed = _split_run(decode, 19.5)
    assert trial.batches_to_choose <= windowed.batches_to_choose - 2 * (4 + 10)
    assert _split_run(lambda s: {1.0: 20.0, 0.0: 25.0}[s], 10.0, balance=True).choice == 1.0  # 20% faster
    assert _split_run(lambda s: {1.0: 40.0, 0.0: 20.0}[s], 66.0, balance=True).choice == 1.0  # keeps up


def test_a_split_is_timed_even_where_the_loop_hardly_waited_for_nvjpeg():
    """H200 ResNet-18 again: nvJPEG's decodes slowed the step on its GPU (27.8 ms a batch, the
    loop waiting 9%); the split is still timed, and kept."""
    gpu_step = {1.0: 19.5, 0.0: 27.8}

    def decode(share):
        return max(share * 30.9, (1 - share) * 12.0) + 1.0

    clock = [0.0]
    trial = RouteTrial(warmup=8, settle=4, window=10, clock=lambda: clock[0], split=True, balance=False)
    share = 1.0
    while trial.choice is None:  # with nvJPEG the loop hardly waits: the step is the pace, slowed by its decodes
        share = trial.next_share()
        step = max(19.5, (1 - share) * gpu_step[0.0] if share < 1 else gpu_step[1.0], decode(share))
        trial.consumed(waited=(0.26 if share == 1.0 else 0.08) * step / 1e3)  # as that run's windows
        clock[0] += step / 1e3
    assert len(trial.periods) == 4 and trial.choice not in (0.0, 1.0)
    assert trial.waited[0.0] < trial.keep_up


def test_a_split_slower_than_nvjpeg_alone_is_not_kept_and_a_cpu_that_keeps_up_skips_it():
    trial = _split_run(lambda s: {1.0: 40.0, 0.0: 25.0}.get(s, 45.0), 10.0)  # the two decoders collide
    assert len(trial.periods) == 4 and trial.choice == 0.0
    trial = _split_run(lambda s: {1.0: 40.0, 0.0: 20.0}.get(s, 15.0), 66.0)  # ResNet-50: the CPU keeps up
    assert trial.choice == 1.0 and list(trial.periods) == [1.0]


@pytest.mark.parametrize("split_ms,kept", [(14.4, 0.0), (13.0, "split")])
def test_a_split_must_beat_nvjpeg_alone_by_the_margin(split_ms, kept):
    """The loader alone on the H100: nvJPEG 14.3-14.9 ms a batch, and a split timed 2-4% faster in
    its 10-batch window (the windows are worth +-15%) kept more cores busy for no gain. A split
    is kept only where it beats the best GPU route alone by the trial's margin (5%), as the CPU
    route must; 13.0 against 14.9 (13% faster) still is."""
    trial = _split_run(lambda s: {1.0: 32.0, 0.0: 14.9}.get(s, split_ms), 1.0)
    assert len(trial.periods) == 4
    assert trial.choice == 0.0 if kept == 0.0 else trial.choice not in (0.0, 1.0)


class FixedProbe:
    """A ``GpuStepProbe`` that reads the same GPU step in every window."""

    def __init__(self, gpu_step_ms: float):
        self.reading = StepReading(gpu_step_ms / 1e3, 0.2)

    def mark(self, kind):
        pass

    def take(self):
        return self.reading


@pytest.mark.parametrize(
    "gpu_step_ms,split_ms,kept",
    [(25.6, 28.1, "split"), (0.1, 28.1, 0.0), (25.6, 30.0, 0.0), (None, 28.1, 0.0)],
)
def test_a_tie_between_nvjpeg_alone_and_a_split_goes_to_the_split_beside_a_busy_gpu(gpu_step_ms, split_ms, kept):
    """H100 ResNet-18 (2026-11-28): the windows timed nvJPEG alone at 27.4 ms a batch and the
    split at 0.22 at 28.1, the GPU busy 25.6 ms of it; nvJPEG alone was kept and fed 30.1 ms a
    step against DALI's 28.8, where kept splits fed 26.7-27.6. Beside a busy GPU a split within
    the margin is kept; on an idle GPU (the loader alone, 0.1 ms) or without the probe's
    readings nvJPEG alone is, as before; and nvJPEG alone 9% faster than the split still wins."""
    trial = RouteTrial(
        warmup=8, settle=4, window=10, split=True, steps=FixedProbe(gpu_step_ms) if gpu_step_ms else None
    )
    run_trial(trial, lambda s: {1.0: 34.6, 0.0: 27.4}.get(s, split_ms), lambda route: 22.0)
    assert len(trial.periods) == 4
    if kept == "split":
        assert trial.choice not in (0.0, 1.0) and trial.periods[trial.choice] > trial.periods[0.0]
    else:
        assert trial.choice == 0.0


def test_the_lighter_split_is_kept_where_the_decoders_slow_each_other_at_once():
    """The loader alone on the H200 (CPU 32.2 ms a batch alone, nvJPEG 14.9): at share 0.3 a
    batch took ~20 ms where 0.3 x 32.2 was expected, so the CPU side ran ~2x slower beside
    nvJPEG (nvJPEG ~1.1x), and the ratio of the rates alone (32% on the CPU) overloads the CPU;
    half of it beats nvJPEG alone. Negative control: where nothing slows, the ratio wins."""

    def contended(share):
        both = 0 < share < 1
        return max(share * 32.2 * (2.0 if both else 1.0), (1 - share) * 14.9 * (1.1 if both else 1.0)) + 0.5

    trial = _split_run(contended, 1.0)
    ratio = route_trial.split_share(32.2 + 0.5, 14.9 + 0.5)
    lighter = route_trial.lighter_share(ratio)
    assert list(trial.periods) == [1.0, 0.0, ratio, lighter]
    assert trial.choice == lighter and trial.periods[lighter] < trial.periods[0.0] < trial.periods[ratio]

    def independent(share):
        return max(share * 32.2, (1 - share) * 14.9) + 0.5

    assert _split_run(independent, 1.0).choice == ratio


def test_split_share_balances_the_two_rates():
    assert route_trial.split_share(30.0, 30.0) == 0.5
    assert route_trial.split_share(60.0, 20.0) == 0.25
    assert route_trial.split_share(1.0, 100.0) == 0.9 and route_trial.split_share(100.0, 1.0) == 0.1
    assert route_trial.lighter_share(0.32) == 0.16 and route_trial.lighter_share(0.1) == 0.05
