"""Why a dataset tensor is pinned in place only where its last page is its own
(``resources.tail_page_private``): CUDA registers whole pages, and a host buffer that starts
inside a registered range and runs past its end fails every CUDA copy ("invalid argument"),
while one that starts before the range and runs into it copies as pageable memory. Four
4000-byte buffers around pages 2-3 of a mapping, each copied device -> host and host -> device.

  python3 benchmarks/gpu/straddle_probe.py
"""

import mmap

import torch

PAGE = 4096
mapping = mmap.mmap(-1, 8 * PAGE)
buf = torch.frombuffer(mapping, dtype=torch.uint8)
print("register page 2..4:", torch.cuda.cudart().cudaHostRegister(buf.data_ptr() + 2 * PAGE, 2 * PAGE, 0))
src = torch.arange(4000, dtype=torch.uint8, device="cuda")
cases = [
    ("inside", 2 * PAGE + 10),
    ("straddle end", 4 * PAGE - 1000),
    ("straddle start", 2 * PAGE - 1000),
    ("outside", 6 * PAGE),
]
for name, lo in cases:
    dst = buf[lo : lo + 4000]
    try:
        dst.copy_(src)
        torch.cuda.synchronize()
        print(name, "ok", bool((dst.cpu() == src.cpu()).all()))
    except Exception as e:
        print(name, "ERROR", str(e).splitlines()[0])
        torch.cuda.synchronize()
    try:
        up = src.clone()
        up.copy_(dst)
        torch.cuda.synchronize()
        print(name, "H2D ok")
    except Exception as e:
        print(name, "H2D ERROR", str(e).splitlines()[0])
