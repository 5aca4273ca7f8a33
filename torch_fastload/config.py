"""Loader defaults, overridable by TORCH_FASTLOAD_* environment variables and a context manager.

Constructor arguments default to ``None``, meaning "use the configured default"; values are
validated when they are read so a bad setting fails loudly with the value in the message.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["get", "set", "override", "describe", "resolve", "OPTIONS"]


def _int_at_least(minimum: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        try:
            as_int = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"torch_fastload option {name!r} must be an integer, got {value!r}") from None
        if as_int < minimum or as_int != float(value):
            raise ValueError(f"torch_fastload option {name!r} must be an integer >= {minimum}, got {value!r}")
        return as_int

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(name: str, value: Any) -> float:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"torch_fastload option {name!r} must be a number, got {value!r}") from None
    if not as_float > 0:
        raise ValueError(f"torch_fastload option {name!r} must be > 0, got {value!r}")
    return as_float


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"torch_fastload option {name!r} must be a boolean (1/0, true/false), got {value!r}")


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ValueError(f"torch_fastload option {name!r} must be one of {choices}, got {value!r}")
        return text

    return parse


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    help: str

    @property
    def env(self) -> str:
        return "TORCH_FASTLOAD_" + self.name.upper()


def _default_stage_threads() -> int:
    # The pageable -> pinned memcpy is the CPU bottleneck; 8 threads reach ~40 GB/s on the
    # reference machine, more mostly burns cores.
    return max(1, min(8, (os.cpu_count() or 2)))


OPTIONS: dict[str, Option] = {
    opt.name: opt
    for opt in (
        Option("prefetch", 2, _positive_int, "batches kept ready on the device ahead of the training step"),
        Option("stage_threads", _default_stage_threads(), _positive_int,
               "threads that copy a batch from pageable memory into its pinned slot"),
        Option("nontemporal", True, _bool,
               "stage with non-temporal stores (the slot is read by DMA, not the CPU; C++ engine only)"),
        Option("fetch_threads", 1, _positive_int,
               "threads running per-sample Python when num_workers == 0 (map-style datasets)"),
        Option("pool_slots", 3, _positive_int, "pinned staging slots in the pool"),
        Option("slot_bytes", 0, _non_negative_int,
               "bytes per pinned slot; 0 sizes slots exactly from the first batch"),
        Option("oversize", "grow", _choice("grow", "error"),
               "a batch larger than a slot: 'grow' re-sizes the pool (counted in stats), 'error' raises"),
        Option("shutdown_timeout", 10.0, _positive_float,
               "seconds to wait for in-flight reads and copies and for threads to join on shutdown"),
        Option("poll_interval", 0.05, _positive_float,
               "seconds between checks of the stop flag in every blocking wait"),
    )
}

_lock = threading.Lock()
_overrides: list[dict[str, Any]] = []


def get(name: str) -> Any:
    """The value in effect: the innermost ``override``, else the environment, else the default."""
    try:
        option = OPTIONS[name]
    except KeyError:
        raise KeyError(f"unknown torch_fastload option {name!r}; known: {sorted(OPTIONS)}") from None
    with _lock:
        for layer in reversed(_overrides):
            if name in layer:
                return layer[name]
    raw = os.environ.get(option.env)
    if raw is not None and raw != "":
        try:
            return option.parse(name, raw)
        except ValueError as exc:
            raise ValueError(f"{exc} (from environment variable {option.env})") from None
    return option.default


def resolve(name: str, value: Any) -> Any:
    """An explicit constructor argument, validated; ``None`` means the configured default."""
    if value is None:
        return get(name)
    return OPTIONS[name].parse(name, value)


def set(**values: Any) -> None:  # noqa: A001 - mirrors kvikio.defaults.set
    """Change defaults for the rest of the process (outermost layer)."""
    parsed = {name: resolve(name, value) for name, value in values.items()}
    with _lock:
        if not _overrides:
            _overrides.append({})
        _overrides[0].update(parsed)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily change defaults: ``with torch_fastload.config.override(stage_threads=4): ...``."""
    parsed = {name: resolve(name, value) for name, value in values.items()}
    with _lock:
        if not _overrides:
            _overrides.append({})
        _overrides.append(parsed)
        layer_index = len(_overrides) - 1
    try:
        yield
    finally:
        with _lock:
            del _overrides[layer_index]


def describe() -> str:
    """A table of every option, its value in effect and where to change it."""
    rows = [f"{'option':<18} {'value':<10} {'env var':<34} meaning"]
    for option in OPTIONS.values():
        rows.append(f"{option.name:<18} {str(get(option.name)):<10} {option.env:<34} {option.help}")
    return "\n".join(rows)
