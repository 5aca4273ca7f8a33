"""torch_fastload: a drop-in PyTorch DataLoader whose batches arrive on the GPU without waiting.

from torch_fastload import DataLoader      # instead of torch.utils.data.DataLoader
loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=8)
for x, y in loader:                         # x, y are already CUDA tensors
    ...
print(loader.stats())                       # input-wait time, per-stage GB/s
"""

from . import config
from .distributed import DistributedSampler, shard_indices
from .errors import BatchTooLargeError, FastloadError, LoaderShutdownError, PoolError
from .loader import DataLoader
from .packing import pack, pack_image_folder
from .pool import PinnedPool
from .resume import ResumeError, batch_generator, batch_numpy_rng
from .sources import ArrayDataset, ArrayFile, RecordBatch, RecordDataset
from .stats import StatsSnapshot

__version__ = "0.1.0"

__all__ = [
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
    "config",
    "FastloadError",
    "BatchTooLargeError",
    "PoolError",
    "LoaderShutdownError",
    "__version__",
]
