"""The copy engine: slot -> device on the loader's own stream, and the hand-off to the consumer.

Rules (docs/architecture.md, rule 2): the H2D copy is non_blocking on a dedicated stream and an event is
recorded after it; the consumer's current stream waits on that event (no host synchronize on
the hot path); handed-out tensors are ``record_stream``'d for the consumer stream, so the
caching allocator never reuses their memory while the consumer may still read it.

Output buffers are fresh allocations made on the copy stream, never reused device slots:
users may keep a batch as long as they like.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["CopyEngine", "InFlightCopy"]


@dataclass
class InFlightCopy:
    flat: torch.Tensor | None  # the batch's bytes on the target device (None: built by ``run``)
    batch: Any  # the batch, its staged tensors being typed views of ``flat``
    done: object | None  # torch.cuda.Event recorded after the copy (None: already complete)
    timing: tuple | None  # (start, end) CUDA events for the stats
    seconds: float = 0.0  # host-measured copy time where no events exist (CPU path)
    moved: list = field(default_factory=list)  # unstaged tensors moved on the copy stream
    home: object | None = None  # the stream ``flat`` was allocated on (the consumer's), if not the copy stream

    def copy_seconds(self) -> float | None:
        """The copy's duration once it has finished; None while it is still running."""
        if self.timing is None:
            return self.seconds
        start, end = self.timing
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3


class CopyEngine:
    """Copies one staged byte span to ``device`` per batch."""

    def __init__(self, device: torch.device, *, pin_cpu_output: bool = False, output_stream: str = "copy"):
        self.device = device
        self.output_stream = output_stream  # where batches are allocated: 'copy' or 'consumer'
        self.is_cuda = device.type == "cuda"
        self.pin_cpu_output = pin_cpu_output
        self.stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self._index = self.stream.device_index if self.is_cuda else -1
        self._streams: dict = {}  # raw handle -> torch.cuda.Stream: stream_of()
        self.debug_delay_cycles = 0  # tests: delay every copy to widen race windows

    def start(
        self,
        span: torch.Tensor | None,
        unpack: Callable[[torch.Tensor], Any],
        *,
        nbytes: int | None = None,
        copies: Sequence[tuple[int, int, int]] | None = None,
        fill: Callable[[torch.Tensor], None] | None = None,
        consumer=None,
        reserved: torch.Tensor | None = None,
    ) -> InFlightCopy:
        """Enqueue the batch's copy to the device and return without waiting.

        The batch occupies ``nbytes`` (default ``span.numel()``) on the device. ``copies``:
        ``(span offset, batch offset, bytes)`` pieces of the host ``span`` (default: all of it,
        1:1). ``fill(flat)`` then writes the rest straight into device memory (file reads);
        it runs with the copy stream current, so stream-ordered writes follow the allocation.
        ``unpack(flat)`` builds the batch from the device bytes; it runs on the copy stream
        before the completion event, so tensors it moves itself are covered by that event.
        ``consumer``: the stream the training loop runs on; the batch is allocated there
        (``reserved``: already allocated there by ``reserve``).
        """
        nbytes = span.numel() if nbytes is None else nbytes
        if copies is None:
            copies = [(0, 0, nbytes)] if nbytes else []
        if not self.is_cuda:
            if fill is not None:
                raise ValueError("device reads need a CUDA device")
            started = time.perf_counter()
            flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_cpu_output)
            for src, dst, n in copies:
                flat[dst : dst + n].copy_(span[src : src + n])
            return InFlightCopy(flat, unpack(flat), None, None, time.perf_counter() - started)
        flat, home = self._batch_memory(nbytes, consumer, reserved)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if self.debug_delay_cycles:
                torch.cuda._sleep(self.debug_delay_cycles)
            start.record(self.stream)
            for src, dst, n in copies:
                flat[dst : dst + n].copy_(span[src : src + n], non_blocking=True)
            if fill is not None:
                fill(flat)
            batch = unpack(flat)
            end.record(self.stream)
        return InFlightCopy(flat, batch, end, (start, end), home=home)

    def _batch_memory(self, nbytes: int, consumer, reserved) -> tuple:
        """``(the batch's device bytes, the stream they were allocated on or None)``: ``reserved``
        (made by ``reserve`` on the consumer's stream), else allocated on the copy stream (None;
        ``hand_off`` gives them to the consumer with record_stream), or with ``output_stream`` at
        ``consumer`` on the consumer's stream."""
        if reserved is not None:
            return reserved, consumer
        if consumer is not None and self.output_stream == "consumer":
            # The batch lives on the consumer's stream, as a ``.to(non_blocking=True)`` made
            # there would: next() then needs no record_stream, and frees need no events. The
            # copy stream first waits for the consumer's work up to the allocation (rule 2).
            flat = self._empty_on(consumer, nbytes)
            if not UNSAFE_SKIP_ALLOCATION_WAIT:
                _order_after(self.stream, consumer)
            return flat, consumer
        return self._empty_on(self.stream, nbytes), None

    def _empty_on(self, stream: torch.cuda.Stream, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory allocated on ``stream``."""
        return self.allocate_on(stream, [((nbytes,), torch.uint8)])[0]

    def allocate_on(self, stream: torch.cuda.Stream, shapes: Sequence[tuple]) -> list:
        """One device tensor per ``(shape, dtype)``, allocated on ``stream`` (the caching
        allocator keys blocks by the current stream). Set and reset through torch's own calls,
        not its context managers: those cost ~10x as much, and on a stage thread every Python
        call beside the training loop may queue for the GIL again."""
        device = self.device
        if torch._C._cuda_getDevice() != self._index:  # another device current on this thread
            with torch.cuda.device(device), torch.cuda.stream(stream):
                return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        prior = torch._C._cuda_getCurrentStream(self._index)
        torch._C._cuda_setStream(
            stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
        )
        try:
            return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        finally:
            torch._C._cuda_setStream(stream_id=prior[0], device_index=prior[1], device_type=prior[2])

    @property
    def stages_in_one_call(self) -> bool:
        """Whether ``start_staged`` can run (a CUDA device and the C++ engine built)."""
        return self.is_cuda and ONE_CALL_STAGE and _stage_host_batch is not None

    def _one_call_start(self, nbytes: int, consumer, reserved) -> tuple:
        """What a one-call stage needs before its call: the batch's device memory and the stream
        it was allocated on, the copy stream's handle and the copy's two events."""
        flat, home = self._batch_memory(nbytes, consumer, reserved)
        if self.debug_delay_cycles:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                torch.cuda._sleep(self.debug_delay_cycles)
        handle = self.stream.cuda_stream
        return flat, home, handle, _CopyEvent(handle), _CopyEvent(handle)

    def start_staged(self, span: torch.Tensor, unpack, host_plan, *, nontemporal: bool, consumer=None, reserved=None):
        """``start`` for a slot whose host copies are still to run (``host_plan``, from
        ``ParallelCopier.plan_copy``): the copies into the slot, the offsets' rebase, the
        slot -> device copy and its two events in one C++ call without the GIL (NOTE [GIL-free
        views] in staging.py: each torch call here would queue for the GIL again). Fields of
        ``host_plan.direct`` go to the device from where they lie, in the same call; the caller
        keeps them alive until the returned copy's event completes."""
        nbytes = span.numel()
        flat, home, handle, start, end = self._one_call_start(nbytes, consumer, reserved)
        (copy_dst, copy_src, copy_sizes), rebase, direct = host_plan.native
        _stage_host_batch(
            copy_dst,
            copy_src,
            copy_sizes,
            *rebase,
            host_plan.threads,
            host_plan.task_bytes,
            nontemporal,
            span.data_ptr(),
            flat.data_ptr(),
            nbytes,
            handle,
            start,
            end,
            *(direct or ()),
        )
        return InFlightCopy(flat, unpack(flat), end, (start, end), home=home)

    @property
    def plans_in_one_call(self) -> bool:
        """Whether ``start_planned`` can run (a CUDA device and the extension's range planner)."""
        return self.is_cuda and ONE_CALL_STAGE and _stage_range_plan is not None

    def start_planned(
        self,
        slot: torch.Tensor,
        batch,
        *,
        threads: int,
        task_bytes: int,
        nontemporal: bool,
        consumer=None,
        reserved=None,
    ) -> InFlightCopy:
        """``start_staged`` of a ``PlannedBatch``: its copies and rebases into ``slot``, the slot
        and the fields lying in direct regions to the device, and the two events, in one C++ call
        without the GIL (``_C.stage_range_plan``). The caller keeps ``batch.keep`` alive until the
        returned copy's event completes."""
        flat, home, handle, start, end = self._one_call_start(batch.plan.total, consumer, reserved)
        _stage_range_plan(
            batch.plan, threads, task_bytes, nontemporal, slot.data_ptr(), flat.data_ptr(), handle, start, end
        )
        return InFlightCopy(flat, batch.unpack(flat), end, (start, end), home=home)

    def reserve(self, nbytes: int, consumer) -> torch.Tensor | None:
        """With ``output_stream='consumer'``: the batch's device bytes, allocated on the
        consumer's stream, with the copy stream ordered after that stream up to now; for
        ``start(reserved=...)`` (None with the default copy-stream allocation). Call it before the
        batch waits for a slot: ordered later, the copy would also wait for the steps enqueued
        meanwhile and queue behind the very step it should overlap (a host running ahead of the
        GPU then serialises every copy with the latest step)."""
        if not self.is_cuda or consumer is None or self.output_stream != "consumer":
            return None  # allocated on the copy stream at start: no order to set up
        return self._batch_memory(nbytes, consumer, None)[0]

    def run(self, produce: Callable[[], Any]) -> InFlightCopy:
        """``produce()`` with the copy stream current, its batch covered by the completion event:
        for sources that build their batch on the device themselves (image decode + augment).
        Every tensor of the batch is ``record_stream``'d for the consumer at hand-off."""
        if not self.is_cuda:
            started = time.perf_counter()
            batch = produce()
            return InFlightCopy(None, batch, None, None, time.perf_counter() - started)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            batch = produce()
            end.record(self.stream)
        copy = InFlightCopy(None, batch, end, (start, end))
        copy.moved = _device_tensors(batch)
        return copy

    def fence(self):
        """An event recorded on the copy stream now (None on the CPU): what a slot waits on when
        a batch failed halfway, so work already enqueued from it finishes before reuse."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hand_off(self, copy: InFlightCopy) -> None:
        """Make the consumer's current stream wait for the copy; called on the consumer thread.

        A copy that already completed needs no stream wait at all. That matters beyond the
        microseconds: a stream call blocks while the stream's command queue is full (a long
        step just enqueued), which would show up as time in ``next()``."""
        if not self.is_cuda:
            return
        raw = raw_current_stream(self._index)  # no torch.cuda.Stream built unless one is needed
        done = copy.done
        if done is not None and not done.query():
            if _CopyEvent is not None and isinstance(done, _CopyEvent):
                done.wait(raw)
            else:
                done.wait(self.stream_of(raw))
        home = copy.home
        foreign = copy.flat is not None and (home is None or home.cuda_stream != raw)
        if foreign or copy.moved:
            consumer = self.stream_of(raw)
            if foreign and not UNSAFE_SKIP_HANDOVER:
                copy.flat.record_stream(consumer)
            for tensor in copy.moved:
                tensor.record_stream(consumer)

    def stream_of(self, raw: int) -> torch.cuda.Stream:
        """The ``torch.cuda.Stream`` of the current stream, whose raw handle is ``raw`` (for
        ``record_stream``), built once per handle: ``current_stream()`` costs several times the
        raw getter on the training thread."""
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def move_passthrough(self, tensor: torch.Tensor, moved: list) -> torch.Tensor:
        """A tensor that was not staged (sparse, nested, on another GPU): moved on the copy stream.

        Call inside ``start``'s ``unpack`` so the completion event covers the move.
        """
        if not self.is_cuda or tensor.device == self.device:
            return tensor
        out = tensor.to(self.device, non_blocking=True)
        moved.append(out)
        return out

    def synchronize(self, timeout: float) -> bool:
        """Wait (polling, bounded) until every copy issued so far has finished."""
        if not self.is_cuda:
            return True
        deadline = time.monotonic() + timeout
        while not self.stream.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True


def _device_tensors(batch: Any) -> list:
    """The CUDA tensors of a nested batch (tuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return [batch] if batch.is_cuda else []
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _device_tensors(item)]
    return []


def _order_after(waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
    """``waiter.wait_stream(producer)``, without the GIL where the C++ engine is built: this
    thread records on the training loop's stream, whose queue a long step may have filled, and
    blocking there while holding the GIL would stall the training thread itself."""
    if _stream_wait_stream is not None:
        _stream_wait_stream(waiter.cuda_stream, producer.cuda_stream)
    else:
        waiter.wait_stream(producer)


def raw_current_stream(device_index: int) -> int:
    """The current CUDA stream's handle (0: the legacy default) without building a
    ``torch.cuda.Stream``: torch's raw getter costs a fraction of ``current_stream()``, and
    next() runs on the training thread, where every microsecond delays a launch-bound step."""
    return torch._C._cuda_getCurrentRawStream(device_index)


if not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a torch without the raw getter

    def raw_current_stream(device_index: int) -> int:  # noqa: F811
        return torch.cuda.current_stream(device_index).cuda_stream


#: Stage with ``start_staged`` where it can run (benchmarks flip it to measure the Python route).
ONE_CALL_STAGE = True

try:
    from ._C import CopyEvent as _CopyEvent
    from ._C import stage_host_batch as _stage_host_batch
except ImportError:  # a source tree without the built extension, or one built before them
    _CopyEvent = _stage_host_batch = None
try:
    from ._C import stage_range_plan as _stage_range_plan
except ImportError:
    _stage_range_plan = None
#: Tests only: copies skip their wait for the consumer's stream up to the batch's allocation
#: (the negative control: the caching allocator's recycled blocks then take copies early).
UNSAFE_SKIP_ALLOCATION_WAIT = False
#: Tests only: hand_off gives copy-stream memory to the consumer without record_stream (the
#: allocator may then give it to the next batch's copy while the training stream still reads it).
UNSAFE_SKIP_HANDOVER = False

try:
    from ._C import stream_wait_stream as _stream_wait_stream
except ImportError:  # a source tree without the built extension
    _stream_wait_stream = None
