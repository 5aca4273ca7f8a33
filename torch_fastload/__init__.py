"""torch_fastload: a drop-in PyTorch DataLoader whose batches arrive on the GPU without waiting.

from torch_fastload import DataLoader      # instead of torch.utils.data.DataLoader
loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=8)
for x, y in loader:                         # x, y are already CUDA tensors
    ...
print(loader.stats())                       # input-wait time, per-stage GB/s

Names are imported on first use (PEP 562): ``import torch_fastload`` and the command line's
``--help`` do not import torch (several seconds); ``from torch_fastload import DataLoader``
does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

#: public name -> the module that defines it
_EXPORTS = {
    "DataLoader": "loader",
    "DistributedSampler": "distributed",
    "shard_indices": "distributed",
    "ResumeError": "resume",
    "batch_generator": "resume",
    "batch_numpy_rng": "resume",
    "ArrayDataset": "sources",
    "ArrayFile": "sources",
    "RecordDataset": "sources",
    "RecordBatch": "sources",
    "pack": "packing",
    "pack_image_folder": "packing",
    "PinnedPool": "pool",
    "StatsSnapshot": "stats",
    "FastloadError": "errors",
    "BatchTooLargeError": "errors",
    "PoolError": "errors",
    "LoaderShutdownError": "errors",
}

__all__ = [  # the names of _EXPORTS, written out for static tools
    "DataLoader",
    "DistributedSampler",
    "shard_indices",
    "ResumeError",
    "batch_generator",
    "batch_numpy_rng",
    "ArrayDataset",
    "ArrayFile",
    "RecordDataset",
    "RecordBatch",
    "pack",
    "pack_image_folder",
    "PinnedPool",
    "StatsSnapshot",
    "FastloadError",
    "BatchTooLargeError",
    "PoolError",
    "LoaderShutdownError",
    "config",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    else:  # a submodule: torch_fastload.config, .engine, .sources, ...
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # static checkers and IDEs see the names eagerly
    from . import config
    from .distributed import DistributedSampler, shard_indices
    from .errors import BatchTooLargeError, FastloadError, LoaderShutdownError, PoolError
    from .loader import DataLoader
    from .packing import pack, pack_image_folder
    from .pool import PinnedPool
    from .resume import ResumeError, batch_generator, batch_numpy_rng
    from .sources import ArrayDataset, ArrayFile, RecordBatch, RecordDataset
    from .stats import StatsSnapshot
