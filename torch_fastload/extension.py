"""What the optional C++ extension (``torch_fastload._C``) brings here, and what its absence costs.

The package runs without it (an install with no compiler) and without libjpeg built into it
(no ``jpeglib.h`` at build time), on Python fallbacks that are correct but slower. ``doctor``
and ``loader.io`` say so through ``status()``, naming what is missing, what it costs and how
to get it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExtensionStatus", "status"]

NOT_BUILT_COST = (
    "the Python fallbacks run instead: file reads one range at a time with os.pread (no batched "
    "multi-threaded reads, no O_DIRECT, no pinned ring into GPU memory), batches staged by Python "
    "threads (no native loop), image headers probed in Python and JPEGs decoded by PIL (no batched "
    "libjpeg-turbo decode into pinned memory, no crop-region decode, no CPU/nvJPEG route trial)"
)
NOT_BUILT_FIX = (
    "install a C++ compiler (and libjpeg-turbo's dev package: libjpeg-turbo8-dev / libjpeg62-turbo-dev), "
    "then reinstall (pip install --force-reinstall --no-binary torch_fastload torch_fastload) or run "
    "`python setup.py build_ext --inplace` in a checkout"
)
NO_LIBJPEG_COST = (
    "JPEGs decoded on the CPU go through PIL one at a time (no batched libjpeg-turbo decode into pinned "
    "memory, no crop-region decode), and on a GPU every JPEG nvJPEG takes stays on nvJPEG (no "
    "cpu_decode_share route trial or work stealing)"
)
NO_LIBJPEG_FIX = "install libjpeg-turbo's dev package (libjpeg-turbo8-dev / libjpeg62-turbo-dev) and rebuild"


@dataclass(frozen=True)
class ExtensionStatus:
    """The extension's parts in this process: ``built`` (it imports), ``libjpeg`` (its batch JPEG
    decoder), ``regions`` (libjpeg-turbo's crop-region decode); ``error``: why it did not import."""

    built: bool
    libjpeg: bool
    regions: bool
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.built and self.libjpeg

    def missing(self) -> list[str]:
        """One sentence per missing part: what, what it costs, how to get it (empty: nothing)."""
        if not self.built:
            why = f" ({self.error})" if self.error else ""
            return [
                f"the C++ extension torch_fastload._C is not built{why}: {NOT_BUILT_COST}. To build it: {NOT_BUILT_FIX}"
            ]
        if not self.libjpeg:
            return [f"the C++ extension was built without libjpeg: {NO_LIBJPEG_COST}. To add it: {NO_LIBJPEG_FIX}"]
        return []

    def short(self) -> str:
        """A few words: 'built, libjpeg-turbo', 'built, no libjpeg', 'NOT built'."""
        if not self.built:
            return "NOT built (Python fallbacks)"
        if not self.libjpeg:
            return "built, without libjpeg (PIL decodes CPU JPEGs)"
        return "built, with libjpeg" + ("-turbo regions" if self.regions else " (no region decode)")

    def as_dict(self) -> dict:
        return {
            "built": self.built,
            "libjpeg": self.libjpeg,
            "regions": self.regions,
            "error": self.error,
            "missing": self.missing(),
        }


def status() -> ExtensionStatus:
    """The extension as ``engine`` imported it (tests replace ``engine._C`` to simulate a missing one)."""
    from . import engine

    module = engine._C
    if module is None:
        error = engine._IMPORT_ERROR
        return ExtensionStatus(False, False, False, f"{type(error).__name__}: {error}" if error else None)
    return ExtensionStatus(
        True, bool(getattr(module, "HAVE_LIBJPEG", False)), bool(getattr(module, "JPEG_REGIONS", False))
    )
