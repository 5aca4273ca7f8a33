"""Sources: datasets that describe a whole batch as reads, so no per-sample Python runs.

A source is an ordinary map-style ``Dataset`` (``__getitem__`` works, so torch's DataLoader
can read it too) with a ``__fastload_batch__(indices)`` method returning what the default
collate would produce, but with each field left as a read plan (``staging.Pending``) that the
stager executes straight into the pinned slot. A source may also define
``__fastload_finish__(batch, device, counts)``: the loader then reads the batch into a slot
and calls it on a stage thread, copy stream current, to build the batch on the device (image
sources decode and augment there).
"""

from .arrays import ArrayDataset, ArrayFile, ArrayFormatError, read_npy_header
from .features import FeatureStore, FeatureStoreError
from .images import EncodedImages, ImageFolder, PackedImageFolder
from .records import RecordBatch, RecordDataset, RecordFormatError

__all__ = [
    "ArrayDataset",
    "ArrayFile",
    "ArrayFormatError",
    "read_npy_header",
    "RecordDataset",
    "RecordBatch",
    "RecordFormatError",
    "ImageFolder",
    "PackedImageFolder",
    "EncodedImages",
    "FeatureStore",
    "FeatureStoreError",
    "ParquetDataset",
    "ParquetSampler",
    "ParquetBatchSampler",
]


def __getattr__(name: str):
    """The Parquet source is imported on first use: pyarrow is an optional dependency."""
    if name in ("ParquetDataset", "ParquetSampler", "ParquetBatchSampler"):
        from . import parquet

        return getattr(parquet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
