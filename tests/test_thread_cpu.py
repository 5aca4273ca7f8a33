"""The benchmarks' per-thread CPU accounting (``_benchutil.timing.ThreadCpu``) and the decode
threads' lowered priority (``torch_fastload.priority``)."""

import os
import sys
import threading
import time

import pytest

from torch_fastload._benchutil.timing import ThreadCpu
from torch_fastload.priority import lower_thread_priority


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_seconds_are_grouped_by_thread_name_without_the_suffix():
    cpu = ThreadCpu()
    cpu.snapshot()
    release = threading.Event()
    spinners = [threading.Thread(target=lambda: (_spin(0.2), release.wait(5)), name=f"spinner_{k}") for k in range(2)]
    for t in spinners:
        t.start()
    time.sleep(0.3)  # both have spun and now wait, still alive
    groups = cpu.since()
    release.set()
    for t in spinners:
        t.join()
    assert groups["spinner"]["threads"] == 2
    assert groups["spinner"]["cpu_s"] >= 0.1  # two threads x 0.2 s of spinning, on a busy box
    assert "native" in groups and groups["native"]["cpu_s"] >= 0
    assert groups["MainThread"]["cpu_s"] < groups["spinner"]["cpu_s"]


def test_an_idle_thread_counts_no_cpu():
    cpu = ThreadCpu()
    release = threading.Event()
    idle = threading.Thread(target=release.wait, args=(5,), name="sleeper_0")
    idle.start()
    cpu.snapshot()
    time.sleep(0.1)
    groups = cpu.since()
    release.set()
    idle.join()
    assert groups["sleeper"]["cpu_s"] < 0.02


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_lowering_a_threads_priority_leaves_the_others_alone():
    seen = {}

    def lowered():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["took"] = lower_thread_priority(5)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(5)  # again (a thread started by a lowered one): no lower still
        seen["again"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["before"] = before

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    if seen["took"]:
        assert seen["after"] == max(seen["before"], 5) and seen["again"] == seen["after"]
    assert lower_thread_priority(0) is False  # nothing asked, nothing changed
