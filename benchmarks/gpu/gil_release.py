"""Which torch calls release the GIL (and so queue for it again on return).

A thread spinning Python holds the GIL; the switch interval is set to 50 ms. A call that
releases the GIL then waits for the spinner to be forced off it (~50 ms) whenever the spinner
woke in time to take it (not every time), against microseconds for one that keeps the GIL.
docs/architecture.md (rule 10) says why it matters: each such call on a pipeline thread waits
up to the switch interval beside a training loop.

    python3 benchmarks/gpu/gil_release.py      (CUDA calls too where a GPU is present)
"""

import sys
import threading
import time

import numpy as np
import torch

REPS = 12


def calls() -> dict:
    t = torch.empty(1 << 10, dtype=torch.uint8)
    a = np.zeros(16, np.uint8)
    out = {
        "slice t[1:5]": lambda: t[1:5],
        "index t[3]": lambda: t[3],
        "view(-1)": lambda: t.view(-1),
        "view(dtype)": lambda: t.view(torch.int64),
        "reshape(-1)": lambda: t.reshape(-1),
        "narrow": lambda: t.narrow(0, 1, 3),
        "detach": lambda: t.detach(),
        "torch.empty": lambda: torch.empty(16, dtype=torch.uint8),
        "copy_": lambda: t.copy_(t),
        "split_with_sizes": lambda: torch.split_with_sizes(t, [512, 512]),
        "data_ptr": lambda: t.data_ptr(),
        "shape": lambda: t.shape,
        "is_contiguous": lambda: t.is_contiguous(),
        "from_numpy": lambda: torch.from_numpy(a),
        "untyped_storage": lambda: t.untyped_storage(),
    }
    if torch.cuda.is_available():
        from torch_fastload import _C

        d = torch.device("cuda")
        s, cur = torch.cuda.Stream(), torch.cuda.current_stream()
        x = torch.empty(1 << 20, dtype=torch.uint8, device=d)
        h = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        e, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e.record(s), e2.record(s)
        torch.cuda.synchronize()

        def device_context():
            with torch.cuda.device(d):
                pass

        def stream_context():
            with torch.cuda.stream(s):
                pass

        out.update(
            {
                "cuda: torch.cuda.device ctx": device_context,
                "cuda: torch.cuda.stream ctx": stream_context,
                "cuda: Event()": lambda: torch.cuda.Event(enable_timing=True),
                "cuda: Event.record": lambda: e.record(s),
                "cuda: Event.query": lambda: e.query(),
                "cuda: Event.elapsed_time": lambda: e.elapsed_time(e2),
                "cuda: Stream.wait_event": lambda: cur.wait_event(e),
                "cuda: current_stream()": lambda: torch.cuda.current_stream(d),
                "cuda: torch.empty": lambda: torch.empty(1024, dtype=torch.uint8, device=d),
                "cuda: copy_ H2D non_blocking": lambda: x.copy_(h, non_blocking=True),
                "cuda: record_stream": lambda: x.record_stream(cur),
                "cuda: view(dtype)": lambda: x.view(torch.int64),
                "cuda: _C.stream_wait_stream": lambda: _C.stream_wait_stream(s.cuda_stream, cur.cuda_stream),
            }
        )
    return out


def main() -> None:
    table = calls()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(100))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.05)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        for name, call in table.items():
            waits = 0
            for _ in range(REPS):
                started = time.perf_counter()
                call()
                waits += time.perf_counter() - started > 0.01
            print(f"{name:32s} waited for the GIL in {waits:2d} of {REPS} calls  {'RELEASES it' if waits else ''}")
    finally:
        sys.setswitchinterval(old)
        stop.set()


if __name__ == "__main__":
    main()
