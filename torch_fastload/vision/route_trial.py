"""Which decoder feeds a training run faster, measured on the run itself.

Neither route wins everywhere. On the 16-core H100 machine, decoding every JPEG on the CPU took
a ResNet-50 step from 1.10x to 1.02-1.03x of the device-resident step, because nvJPEG's work
sits beside the step's kernels on the GPU. A ResNet-18 step outruns twelve CPU decode threads
(30.5 ms a step with nvJPEG, 31-43 ms without). Which one a model needs depends on the model,
the GPU and the cores, so ``cpu_decode_share="auto"`` measures on the run's first batches.

The CPU route goes first: it leaves the GPU to the step, and a process that has used nvJPEG
keeps paying for it. On the H100, all-CPU decode after an nvJPEG trial ran 69-74 ms a ResNet-50
step, against 66-68 ms from the start. So if the training loop hardly waited for CPU-decoded
batches, nvJPEG is never tried. But only if the step ran at its GPU's pace (``step_probe.py``):
a step limited by its host thread (decode threads beside it) does not make the loop wait
either, and a route that frees the CPU may speed it up. On an H200 that shortcut kept the CPU
route for ResNet-18 at 59.7 ms a batch against DALI's 26.6 ms step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from .settings import (
    BALANCE_EVERY,
    BALANCE_GAIN,
    BALANCE_HISTORY,
    BALANCE_SHARES,
    TRIAL_BUSY_GPU,
    TRIAL_CAUGHT_UP,
    TRIAL_KEEP_UP,
    TRIAL_MARGIN,
    TRIAL_SETTLE,
    TRIAL_WARMUP,
    TRIAL_WINDOW,
)
from .step_probe import DELIVERED, REQUESTED, StepReading

log = logging.getLogger("torch_fastload")

__all__ = [
    "RouteTrial",
    "ShareBalancer",
    "is_split",
    "log_choice",
    "EngineRoute",
    "ThreeWayRoute",
    "cpu_share_of",
    "engine_share_of",
    "on_engines",
    "route_name",
    "split_share",
    "with_cpu_share",
    "lighter_share",
    "three_way_shares",
]


@dataclass(frozen=True)
class EngineRoute:
    """A route whose GPU part goes to the GPU's hardware JPEG engines (jpeg_engines.py) instead of
    nvJPEG on CUDA cores: ``cpu_share`` of each batch's JPEGs (its last) on the CPU, the rest on
    the engines. A plain float is the nvJPEG route at that CPU share."""

    cpu_share: float


@dataclass(frozen=True)
class ThreeWayRoute:
    """Each batch's GPU-decodable JPEGs split three ways, all decoding at once: ``cpu_share`` (the
    batch's last) on the CPU, ``engine_share`` on the JPEG engines, the rest on nvJPEG (its CUDA
    decodes then take fewer SMs from the step than with the CPU alone beside it)."""

    cpu_share: float
    engine_share: float

    @property
    def nvjpeg_share(self) -> float:
        return round(1.0 - self.cpu_share - self.engine_share, 6)


def cpu_share_of(route) -> float:
    """The share of a batch's GPU-decodable JPEGs that ``route`` decodes on the CPU."""
    return route.cpu_share if isinstance(route, (EngineRoute, ThreeWayRoute)) else float(route)


def engine_share_of(route) -> float:
    """The share of a batch's GPU-decodable JPEGs that ``route`` decodes on the JPEG engines."""
    if isinstance(route, ThreeWayRoute):
        return route.engine_share
    return 1.0 - route.cpu_share if isinstance(route, EngineRoute) else 0.0


def on_engines(route) -> bool:
    """Whether ``route``'s whole GPU part goes to the hardware JPEG engines (an ``EngineRoute``)."""
    return isinstance(route, EngineRoute)


def route_name(route) -> str:
    """``route`` in words: 'cpu', 'nvjpeg', 'engines', 'cpu S + nvjpeg' / 'cpu S + engines', or
    'cpu S + engines E + nvjpeg N' (a ``ThreeWayRoute``)."""
    if isinstance(route, ThreeWayRoute):
        return f"cpu {route.cpu_share:g} + engines {route.engine_share:g} + nvjpeg {route.nvjpeg_share:g}"
    share, gpu = cpu_share_of(route), "engines" if on_engines(route) else "nvjpeg"
    return "cpu" if share == 1 else gpu if share == 0 else f"cpu {share:g} + {gpu}"


class RouteTrial:
    """Gives the CPU share each batch decodes with: the first candidate for ``warmup`` batches
    (a model's first steps are slow: cuDNN autotuning, compilation), then each candidate in turn
    for ``settle`` batches and at least ``window`` more that are timed (until the loop has taken
    ``window`` batches in them too), then the faster one for good. If
    the loop waited less than ``keep_up`` of its step for the first candidate's batches, and the
    GPU was still busy with the step when the loop asked for the next batch (``steps``, a
    ``step_probe.GpuStepProbe``: its median caught-up ratio below ``caught_up``), that candidate
    is kept at once: the step ran at the GPU's pace. Without a probe (or too few events passed)
    the loop's wait alone decides, as before. Otherwise it must beat the others by ``margin`` to
    stay. The later route is timed right after a switch, with its own start-up inside its window (the
    first nvJPEG decodes set up its buffers), and a CPU route that makes the loop wait is near
    its limit. On the H100, ResNet-18's CPU route timed 34.6 ms a batch against nvJPEG's 35.3,
    then ran 39.0 ms a step, where nvJPEG alone ran 29.1.

    Two clocks time a route: the starts of decodes (``next_share``) and the batches handed to
    the training loop (``consumed``). The loader's queues hold a few batches between them, so
    over a short window one clock can run fast. If the queues fill, decodes start faster than
    batches leave, and the training loop's pace is the real one. If they drain, the loop runs
    ahead on stored batches, and the decoder's pace is the real one. In both cases the real
    pace is the slower clock, so a route's time is the larger of the two.
    Each clock's estimate is the median of its gaps over two batches. Two stage threads decode
    side by side, so a single gap can be short or long. The median also ignores an epoch
    boundary or a slow step inside the window; a mean does not.

    A candidate is a route: a float, the CPU share with the rest on nvJPEG (1.0: every JPEG on
    the CPU, 0.0: nvJPEG), or an ``EngineRoute`` (the rest on the JPEG engines). With ``split``
    and ``balance`` (the option ``balance_split``), once every route was timed alone and the CPU route
    did not beat the best GPU route by ``margin``, each batch is split between the CPU and that
    GPU route in the ratio of their rates and the share balanced online from then on
    (``_balanced_start``, ``ShareBalancer``). With ``split`` alone (the default), once every
    route was timed alone, each GPU route is timed once more beside the CPU, each
    batch split in the ratio of their rates, nvJPEG's split then at half that CPU share
    (``lighter_share``). Where the JPEG engines and nvJPEG were both timed
    (and ``three_way``), the engines' split with the CPU gives way to a ``ThreeWayRoute``: the
    CPU, the engines and nvJPEG on one batch at once, in the ratio of their three rates. The
    CPU's split with nvJPEG is still timed after it, so a three-way split that does worse
    (the engines' part delaying its batches) cannot cost the run the route kept without them.
    """

    def __init__(
        self,
        candidates: Sequence = (1.0, 0.0),
        warmup: int = TRIAL_WARMUP,
        settle: int = TRIAL_SETTLE,
        window: int = TRIAL_WINDOW,
        keep_up: float = TRIAL_KEEP_UP,
        margin: float = TRIAL_MARGIN,
        clock: Callable[[], float] = time.perf_counter,
        on_choice: Callable[[RouteTrial], None] | None = None,
        steps=None,
        caught_up: float = TRIAL_CAUGHT_UP,
        split: bool = False,
        three_way: bool = True,
        balance: bool = False,
    ):
        if len(candidates) < 2 or warmup < 0 or settle < 0 or window < 3:
            raise ValueError("a route trial needs two candidates, warmup >= 0, settle >= 0 and window >= 3")
        self.warmup = int(warmup)
        self.settle = int(settle)
        self.window = int(window)
        self.keep_up = float(keep_up)
        self.margin = float(margin)
        self.clock = clock
        self.on_choice = on_choice
        self.steps = steps  # marks next()'s entry and return on the GPU (step_probe.GpuStepProbe)
        self.caught_up = float(caught_up)
        self.candidates = [c if isinstance(c, EngineRoute) else float(c) for c in candidates]
        # Every route timed: the CPU and each GPU route at once, each batch split in the ratio of
        # their rates, timed after them (``split_share``)
        self.split = bool(split) and self._splittable(self.candidates)
        self.three_way = bool(three_way)  # the engines and nvJPEG both timed: split the three at once
        self._splits_added = False
        self._alone = 1 << 30  # candidates[:_alone] are routes alone, the rest splits (once added)
        self.periods: dict = {}  # candidate -> seconds a batch (the slower clock)
        self.clocks: dict = {}  # candidate -> (decodes, deliveries)
        self.waited: dict = {}  # candidate -> the loop's wait for a batch, share of its period
        self.gpu: dict = {}  # candidate -> the steps seen from the GPU
        self.choice = None  # the route kept (a float, an EngineRoute or a ThreeWayRoute)
        # a kept split's CPU share follows the batches' own times from then on (``balance``)
        self.balancing = bool(balance)
        self.balancer: ShareBalancer | None = None
        self.batches_to_choose: int | None = None  # batches decoded until the choice (warm-up included)
        self._lock = threading.Lock()
        self._calls = 0
        self._turn = 0  # which candidate is being timed
        self._position = 0  # its batches so far
        self._starts: list[float] = []
        self._deliveries: list[float] = []
        self._waits: list[float] = []

    def next_share(self):
        """The route for the decode that starts now (thread-safe; one call per batch): a float
        CPU share (the rest on nvJPEG) or an ``EngineRoute``."""
        with self._lock:
            if self.choice is not None:
                return self.choice
            self._calls += 1
            if self._calls <= self.warmup:
                return self.candidates[0]
            share = self.candidates[self._turn]
            position = self._position
            self._position += 1
            if position >= self.settle:
                self._starts.append(self.clock())
            chosen = False
            # a window closes once the loop took `window` of its batches too (decodes may run
            # ahead to fill the queue), or after 4 windows' decodes (a loop that never reports)
            if position >= self.settle + self.window and (
                len(self._deliveries) >= self.window or position >= self.settle + 4 * self.window
            ):
                chosen = self._close_window(share)
                if chosen:
                    self.batches_to_choose = self._calls
        if chosen and self.on_choice is not None:
            self.on_choice(self)
        return share

    def _close_window(self, share: float) -> bool:
        """Record the window's times (lock held); True once a route is chosen."""
        decodes = _median_two_gap(self._starts)
        deliveries = _median_two_gap(self._deliveries) if len(self._deliveries) >= 3 else None
        self.clocks[share] = (decodes, deliveries)
        self.periods[share] = max(decodes, deliveries or 0.0)
        waits = sorted(self._waits)[:-1]  # the mean wait without the longest (an epoch's first batch)
        self.waited[share] = sum(waits) / len(waits) / self.periods[share] if waits else 1.0
        gpu = self.gpu[share] = self.steps.take() if self.steps is not None else None
        self._starts, self._deliveries, self._waits = [], [], []
        self._position = 0
        at_gpu_pace = gpu is None or gpu.caught_up < self.caught_up
        if self._turn == 0 and self.waited[share] < self.keep_up and at_gpu_pace:
            self.choice = share  # the loop hardly waits at the GPU's pace: no other route can do better
        elif self._turn == len(self.candidates) - 1 and self._split_next() and self.balancing:
            self.choice = self._balanced_start()
        elif self._turn == len(self.candidates) - 1 and self._split_next():
            self._splits_added = True
            self._alone = len(self.candidates)
            self.candidates.extend(self._splits())
            self._turn += 1
        elif self._turn == len(self.candidates) - 1:
            self.choice = self._fastest()
        else:
            self._turn += 1
        return self.choice is not None

    def _fastest(self):
        """The route kept once every candidate was timed, splits in windows of their own
        (``balance=False``; lock held): the CPU route where it beats the best of the others by
        ``margin``. Between the best GPU route alone and the best split, a 10-batch window is
        worth about +-15%, so a tie within ``margin`` goes to the side that the GPU's load
        favours (``_gpu_busy``): beside a step that keeps the GPU busy, the split (H100
        ResNet-18: kept nvJPEG alone fed 27.5-32.2 ms a step, kept splits 25.6-27.6); on an idle
        GPU, the GPU route alone (H100, the loader alone: splits timed 2-4% faster than nvJPEG
        were kept and fed 14.5k and 18.5k images/s; nvJPEG alone fed 16.7-21.0k in five
        processes). Without the probe's readings the GPU counts as idle."""
        period = self.periods.__getitem__
        first = self.candidates[0]
        others = min(self.candidates[1 : self._alone], key=period)
        splits = self.candidates[self._alone :]
        if splits:
            split = min(splits, key=period)
            if self._gpu_busy(others):
                if not period(others) < (1 - self.margin) * period(split):
                    others = split
            elif period(split) < (1 - self.margin) * period(others):
                others = split
        return first if period(first) < (1 - self.margin) * period(others) else others

    def _gpu_busy(self, route) -> bool:
        """Whether the step kept the GPU busy for ``TRIAL_BUSY_GPU`` of ``route``'s batch period
        in its window (the probe's median GPU step; lock held)."""
        reading = self.gpu.get(route)
        return reading is not None and reading.gpu_step >= TRIAL_BUSY_GPU * self.periods[route]

    def _balanced_start(self):
        """The route kept once every route was timed alone, where kept splits are balanced online
        (lock held): the CPU route where it beats the best GPU route alone by ``margin``; else
        each batch split between the CPU and the GPU in the ratio of their rates alone (three
        ways where the engines and nvJPEG were both timed), its share then balanced by
        ``ShareBalancer``. Splits are not timed in windows of their own: beside a ResNet-18 step
        on an H100 the windows of splits and of nvJPEG alone ranked them either way (nvJPEG's
        26.0 ms against 31.2 at share 0.41, then nvJPEG ran 32.2 ms a step), while every kept
        split, balanced, ran 25.6-27.2 ms. The loader alone fed 12-15% less this way than with
        the windows' lighter split (benchmarks/RESULTS.md, twentieth session), so it is opt-in."""
        period = self.periods.__getitem__
        cpu = self.candidates[0]
        gpu = min(self.candidates[1:], key=period)
        if period(cpu) < (1 - self.margin) * period(gpu):
            return cpu
        engines, nvjpeg = EngineRoute(0.0), 0.0
        if self.three_way and engines in self.periods and nvjpeg in self.periods:
            shares = three_way_shares(period(cpu), period(engines), period(nvjpeg))
            return ThreeWayRoute(shares[0], shares[1])
        share = split_share(period(cpu), period(gpu))
        return EngineRoute(share) if on_engines(gpu) else share

    def _split_next(self) -> bool:
        """Whether the splits are timed next: every route was timed alone, so the CPU route alone
        did not keep the step at its GPU's pace (lock held). The loop's wait is no test here: with
        nvJPEG a step can be slowed on its GPU by the decodes beside it (H200 ResNet-18: 27.8 ms
        a batch against a 19.5 ms step, the loop waiting 9%)."""
        return self.split and not self._splits_added

    def _splits(self) -> list:
        """The splits timed once every route alone was (lock held): the three-way split then the
        CPU beside nvJPEG where the engines and nvJPEG were both timed, else each GPU route
        beside the CPU, each in the ratio of the rates measured alone; nvJPEG's split also at
        ``lighter_share`` of that, as the two slow each other down when they decode at once."""
        cpu, engines = self.periods[1.0], EngineRoute(0.0)
        if self.three_way and engines in self.periods and 0.0 in self.periods:
            shares = three_way_shares(cpu, self.periods[engines], self.periods[0.0])
            return [ThreeWayRoute(shares[0], shares[1]), *_with_lighter(split_share(cpu, self.periods[0.0]))]
        splits = []
        for gpu in self.candidates[1:]:
            if on_engines(gpu):
                splits.append(EngineRoute(split_share(cpu, self.periods[gpu])))
            else:
                splits.extend(_with_lighter(split_share(cpu, self.periods[gpu])))
        return splits

    @staticmethod
    def _splittable(candidates: list) -> bool:
        """The CPU route first, then routes that put every GPU-decodable JPEG on a GPU decoder."""
        return candidates[0] == 1.0 and all(cpu_share_of(c) == 0 for c in candidates[1:])

    def add_candidate(self, route) -> bool:
        """Time ``route`` too, next after the route timed now (at the earliest right after the CPU
        route, before nvJPEG: a process that has used nvJPEG keeps paying for it), before any
        split. True if added; False where it is listed or every route alone was timed (the trial
        moved on to the splits or chose). The decoder adds the JPEG engines once found usable."""
        route = route if isinstance(route, EngineRoute) else float(route)
        with self._lock:
            if self.choice is not None or self._splits_added or route in self.candidates:
                return False
            self.candidates.insert(self._turn + 1, route)
            self.split = self.split and self._splittable(self.candidates)
            return True

    def balance(self, cpu_images: int, cpu_span: tuple, gpu_images: int, gpu_span: tuple) -> None:
        """One batch of a kept split decoded: ``cpu_images`` on the CPU, whose decoder worked on
        them over ``cpu_span`` ((start, end) in perf_counter seconds), and ``gpu_images`` on the
        GPU over ``gpu_span``. The ``ShareBalancer`` moves the split's CPU share toward where
        both decoders are equally busy; later batches get the moved route (thread-safe; the
        decoder calls it once a batch)."""
        if not self.balancing or self.choice is None or not is_split(self.choice):
            return
        with self._lock:
            if self.balancer is None:
                self.balancer = ShareBalancer(self.choice)
            moved = self.balancer.add(cpu_images, cpu_span, gpu_images, gpu_span)
            if moved is not None:
                self.choice = moved

    def requested(self) -> None:
        """The training loop asked for a batch now (its step's work is queued): on its thread."""
        if self.choice is not None or self.steps is None:
            return
        with self._lock:
            if self._starts:
                self.steps.mark(REQUESTED)

    def consumed(self, waited: float = 0.0) -> None:
        """The loader handed a batch to the training loop now; the loop waited ``waited`` s."""
        if self.choice is not None:
            return
        with self._lock:
            if self._starts:  # inside a timed window
                self._deliveries.append(self.clock())
                self._waits.append(waited)
                if self.steps is not None:
                    self.steps.mark(DELIVERED)

    def describe(self) -> str:
        parts = []
        for c in self.candidates:
            if c in self.periods:
                decodes, deliveries = self.clocks[c]
                seen = (
                    f"; decodes {decodes * 1e3:.1f}, deliveries "
                    + (f"{deliveries * 1e3:.1f}" if deliveries is not None else "untimed")
                    + f", loop waited {100 * self.waited[c]:.0f}%"
                    + _gpu_seen(self.gpu.get(c))
                )
                parts.append(f"{self.periods[c] * 1e3:.1f} ms a batch {_describe_route(c)}{seen}")
        if self.balancer is not None:
            parts.append(self.balancer.describe())
        return ", ".join(parts)


class ShareBalancer:
    """Keeps a kept split's CPU share where the CPU and the GPU decoders are equally busy, from
    the batches' own decodes.

    A route trial's windows rank routes to within about 15% and time each split at one share; the
    best share also moves with what runs beside the loader (beside a ResNet-18 step nvJPEG's
    batch takes 2x its time alone, the CPU decoder's no longer). Each decoded batch gives the
    span each decoder worked on it (its C++ call; the GPU part's call). Over the last
    ``history`` batches, a decoder's rate is its images over the time at least one of its spans
    ran (spans of batches decoding at once overlap and count once; time a decoder sat idle does
    not count). The share that would keep both equally busy is the CPU's part of the two rates;
    every ``every`` batches the share moves ``gain`` of the way there, within ``shares``, and
    not for less than a hundredth. Each batch's own ratio of its two parts' times would not do:
    with three batches at once the busier decoder's parts also wait behind other batches', and
    in a simulation of that pipeline a share steered by it swung between 0.2 and 0.7.

    Equal busy time is the loader's best rate only where the decoders do not slow each other.
    With the loader alone on an H100 they do (nvJPEG's call is host-bound, and the CPU's decode
    threads share its cores): the balance sat at ~0.31 and fed 12-15% less than a share of 0.16."""

    def __init__(
        self,
        route,
        every: int = BALANCE_EVERY,
        history: int = BALANCE_HISTORY,
        gain: float = BALANCE_GAIN,
        shares: tuple = BALANCE_SHARES,
    ):
        if every < 1 or history < every or not 0 < gain <= 1 or not 0 < shares[0] < shares[1] < 1:
            raise ValueError("a share balancer needs every >= 1, history >= every, gain in (0, 1], shares in (0, 1)")
        self.first = self.route = route
        self.every, self.history, self.gain, self.shares = int(every), int(history), float(gain), shares
        self.recent: list[tuple] = []  # (cpu images, cpu span, gpu images, gpu span) of recent batches
        self.batches = 0
        self.moves = 0

    def add(self, cpu_images: int, cpu_span: tuple, gpu_images: int, gpu_span: tuple):
        """One batch: each decoder's images and the (start, end) its work on them ran; the moved
        route, or None where it stays."""
        if min(cpu_images, gpu_images) <= 0 or cpu_span[1] <= cpu_span[0] or gpu_span[1] <= gpu_span[0]:
            return None  # a side with nothing to decode tells nothing about its rate
        self.recent = [*self.recent[1 - self.history :], (cpu_images, cpu_span, gpu_images, gpu_span)]
        self.batches += 1
        if self.batches % self.every or len(self.recent) < self.every:
            return None
        cpu_rate = sum(r[0] for r in self.recent) / _covered([r[1] for r in self.recent])
        gpu_rate = sum(r[2] for r in self.recent) / _covered([r[3] for r in self.recent])
        share = cpu_share_of(self.route)
        low, high = self.shares
        target = cpu_rate / (cpu_rate + gpu_rate)
        moved = round(min(high, max(low, share + self.gain * (target - share))), 2)
        if abs(moved - share) < 0.01:
            return None
        self.route = with_cpu_share(self.route, moved)
        self.moves += 1
        return self.route

    def describe(self) -> str:
        return (
            f"balanced online from {route_name(self.first)} to {route_name(self.route)} "
            f"({self.moves} moves over {self.batches} batches)"
        )


def _covered(spans: list[tuple]) -> float:
    """The time at least one of ``spans`` ((start, end) each) ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def is_split(route) -> bool:
    """Whether ``route`` decodes part of each batch on the CPU and the rest on the GPU."""
    return 0.0 < cpu_share_of(route) < 1.0


def with_cpu_share(route, share: float):
    """``route`` with its CPU share ``share``: the same GPU decoders, and on a three-way split the
    engines' and nvJPEG's parts of the rest in the same ratio as before."""
    if isinstance(route, ThreeWayRoute):
        rest = 1.0 - route.cpu_share
        engines = route.engine_share * (1.0 - share) / rest if rest > 0 else 0.0
        return ThreeWayRoute(share, round(min(1.0 - share, engines), 2))
    return EngineRoute(share) if isinstance(route, EngineRoute) else float(share)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


_NAMES = {0.0: "with nvJPEG", 1.0: "with every JPEG on the CPU", EngineRoute(0.0): "on the JPEG engines"}


def _describe_route(route) -> str:
    if isinstance(route, ThreeWayRoute):
        return f"split three ways ({route_name(route)})"
    if route in _NAMES:
        return _NAMES[route]
    return f"at share {cpu_share_of(route):g}" + (" beside the JPEG engines" if on_engines(route) else "")


def split_share(cpu_period: float, gpu_period: float) -> float:
    """The CPU share of each batch that would keep both decoders equally busy, were they
    independent: s * cpu = (1 - s) * gpu. Rounded to a percent, within [0.1, 0.9]."""
    share = gpu_period / (cpu_period + gpu_period) if cpu_period + gpu_period > 0 else 0.5
    return round(min(0.9, max(0.1, share)), 2)


def lighter_share(share: float) -> float:
    """Half the CPU share of a split in the ratio of the rates measured alone: decoding at once,
    the CPU's threads and nvJPEG's host work slow each other (H200, 256 JPEGs: nvJPEG 10.6 ms
    alone, 13.2 beside 12 CPU decode threads), so the ratio overloads the CPU side (the
    loader alone: share 0.2 fed 15.8-17.8k images/s, 0.3 12.4-13.1k, nvJPEG alone 15.2-15.8k)."""
    return round(max(0.05, share / 2), 2)


def _with_lighter(share: float) -> list:
    lighter = lighter_share(share)
    return [share, lighter] if lighter != share else [share]


def three_way_shares(cpu_period: float, engines_period: float, nvjpeg_period: float) -> tuple:
    """``(cpu, engines, nvjpeg)``: the shares of each batch that keep the three decoders equally
    busy, were they independent: each in the ratio of its rate (a batch over its period alone).
    Rounded to a percent, the CPU's and the engines' at least 0.05, the three summing to 1."""
    rates = [1.0 / p if p > 0 else 0.0 for p in (cpu_period, engines_period, nvjpeg_period)]
    total = sum(rates)
    if total <= 0:
        return (0.34, 0.33, 0.33)
    cpu, engines = (round(max(0.05, r / total), 2) for r in rates[:2])
    return (cpu, engines, round(1.0 - cpu - engines, 2))


def _gpu_seen(reading: StepReading | None) -> str:
    if reading is None:
        return ""
    return f", GPU {reading.gpu_step * 1e3:.1f} ms a step, caught up {100 * reading.caught_up:.0f}%"


def _median_two_gap(times: list[float]) -> float:
    return _median([(times[i + 2] - times[i]) / 2 for i in range(len(times) - 2)])


def log_choice(trial: RouteTrial) -> None:
    """Log the route ``trial`` kept and what it measured (its ``on_choice``)."""
    if isinstance(trial.choice, ThreeWayRoute):
        log.info(
            "torch_fastload: cpu_decode_share='auto' splits each batch's JPEGs three ways from now on: %s (%s)",
            route_name(trial.choice),
            trial.describe(),
        )
        return
    share, gpu = cpu_share_of(trial.choice), "on the GPU's JPEG engines" if on_engines(trial.choice) else "with nvJPEG"
    words = (
        "every JPEG on the CPU"
        if share == 1
        else gpu
        if share == 0
        else f"{share:.0%} of each batch's JPEGs on the CPU, the rest {gpu}"
    )
    log.info("torch_fastload: cpu_decode_share='auto' decodes %s from now on (%s)", words, trial.describe())
