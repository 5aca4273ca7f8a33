"""Images on the GPU: batched decode (``decode``) and batched augmentation (``transforms``)."""

from .decode import BatchDecoder, ImageDecodeError, probe
from .transforms import IMAGENET_MEAN, IMAGENET_STD, EvalTransform, Geometry, TrainTransform, kernel_available

__all__ = [
    "BatchDecoder",
    "ImageDecodeError",
    "probe",
    "TrainTransform",
    "EvalTransform",
    "Geometry",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "kernel_available",
]
