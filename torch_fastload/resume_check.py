"""Validation of a checkpointed loader state before anything changes (``load_state_dict``).

A state comes from a file the user hands back: it may be stale, from another loader, or
tampered with. Every field's type and range is checked here, and every check that can be made
before ``iter()`` is made here, so a bad state is refused by ``load_state_dict`` with a
``ResumeError`` naming the field and its value, never half-applied (the generators' states are
tried on scratch generators, not set).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

from .resume import STATE_FORMAT, ResumeError, _length, describe_sampler, generators_of

__all__ = ["check_state"]

_SAMPLER_KINDS = ("map", "distributed", "iterable")


def check_state(loader, state: Any) -> dict:
    """``state`` if this loader can continue from it; ``ResumeError`` (the field, the values)
    otherwise. Nothing is changed either way."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ResumeError(f"not a torch_fastload DataLoader state (format {got!r}, expected {STATE_FORMAT!r})")
    _check_fields(state)
    length = _length(loader.dataset)
    if state["dataset_length"] != length:
        raise ResumeError(
            f"the state is for a dataset of {state['dataset_length']} samples, this loader's has {length}"
        )
    _check_rng(loader, state["rng"])
    if not state["epoch_in_progress"]:
        return state
    _check_sampler_fields(state["sampler"], length)
    kind = state["sampler"]["kind"]
    now = describe_sampler(loader)
    if kind != now["kind"]:
        raise ResumeError(f"the state's epoch was sampled by a {kind!r} sampler, this loader has a {now['kind']!r} one")
    if kind == "distributed":
        return _check_distributed(loader, state, now)
    if state["batch_size"] != loader.batch_size or state["drop_last"] != loader.drop_last:
        raise ResumeError(
            f"batch_size/drop_last were {state['batch_size']}/{state['drop_last']} in the state, "
            f"are {loader.batch_size}/{loader.drop_last} now: batches are counted, so they must match "
            "(a DistributedSampler epoch resumes by sample position instead)"
        )
    if kind == "map":
        if (state["sampler"]["sampler"], state["sampler"]["batch_sampler"]) != (now["sampler"], now["batch_sampler"]):
            raise ResumeError(
                f"the state's epoch came from sampler {state['sampler']['sampler']} / batch sampler "
                f"{state['sampler']['batch_sampler']}, this loader has {now['sampler']} / "
                f"{now['batch_sampler']}"
            )
        _check_yielded_within(loader, state)
    if kind == "iterable" and state["sampler"]["num_workers"] != loader.num_workers:
        raise ResumeError(
            f"an IterableDataset epoch is split by worker: it resumes only with the same num_workers "
            f"({state['sampler']['num_workers']}, not {loader.num_workers})"
        )
    return state


def _field(where: dict, name: str, ok, expected: str, prefix: str = "") -> Any:
    if name not in where:
        raise ResumeError(f"the state has no field {prefix + name!r} ({expected})")
    value = where[name]
    if not ok(value):
        raise ResumeError(f"state field {prefix + name!r} must be {expected}, got {value!r}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value) -> bool:
    return _is_int(value) and value >= 0


def _check_fields(state: dict) -> None:
    """The top-level fields' types and ranges (``state_of`` writes them)."""
    in_progress = _field(state, "epoch_in_progress", lambda v: isinstance(v, bool), "a bool")
    prefix = _field(state, "batches_yielded", _count, "an int >= 0")
    _field(
        state,
        "yielded_out_of_order",
        lambda v: isinstance(v, list) and all(_is_int(n) and n > prefix for n in v) and len(set(v)) == len(v),
        f"a list of distinct batch numbers > batches_yielded ({prefix})",
    )
    _field(state, "samples_yielded", _count, "an int >= 0")
    _field(state, "dataset_length", lambda v: v is None or _count(v), "an int >= 0 or None")
    _field(state, "batch_size", lambda v: v is None or (_is_int(v) and v >= 1), "an int >= 1 or None")
    _field(state, "drop_last", lambda v: isinstance(v, bool), "a bool")
    _field(state, "rng", lambda v: isinstance(v, dict), "a dict of generator name -> state")
    _field(state, "sampler", lambda v: isinstance(v, dict), "a dict describing the sampler")
    if not in_progress and (prefix or state["yielded_out_of_order"] or state["samples_yielded"]):
        raise ResumeError(
            f"the state has no epoch in progress but counts {prefix} batches / {state['samples_yielded']} "
            "samples yielded"
        )


def _check_sampler_fields(sampler: dict, length: int | None) -> None:
    kind = _field(sampler, "kind", lambda v: v in _SAMPLER_KINDS, f"one of {_SAMPLER_KINDS}", "sampler.")
    if kind == "map":
        _field(sampler, "sampler", lambda v: isinstance(v, str), "a class name", "sampler.")
        _field(sampler, "batch_sampler", lambda v: v is None or isinstance(v, str), "a class name or None", "sampler.")
    elif kind == "iterable":
        _field(sampler, "num_workers", _count, "an int >= 0", "sampler.")
    else:
        replicas = _field(sampler, "num_replicas", lambda v: _is_int(v) and v >= 1, "an int >= 1", "sampler.")
        _field(sampler, "rank", lambda v: _is_int(v) and 0 <= v < replicas, f"in [0, {replicas})", "sampler.")
        _field(sampler, "epoch", _is_int, "an int", "sampler.")
        _field(sampler, "seed", _is_int, "an int", "sampler.")
        _field(sampler, "shuffle", lambda v: isinstance(v, bool), "a bool", "sampler.")
        _field(sampler, "drop_last", lambda v: isinstance(v, bool), "a bool", "sampler.")
        bound = length if length is not None else float("inf")
        _field(sampler, "start", lambda v: _count(v) and v <= bound, f"an int in [0, {length}]", "sampler.")


def _check_rng(loader, states: dict) -> None:
    """Each generator state decodes and fits its generator: tried on a scratch generator of the
    same device, so nothing the user holds changes."""
    generators = generators_of(loader)
    missing = set(states) - set(generators)
    if missing:
        raise ResumeError(
            f"the state holds generator(s) {sorted(missing)} that this loader does not have "
            f"(it has {sorted(generators)}): build the loader with the same generator and sampler"
        )
    for name, text in states.items():
        try:
            raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except (binascii.Error, ValueError):
            raw = None
        if raw is None:
            raise ResumeError(f"state field 'rng.{name}' must be a base64 generator state, got {str(text)[:40]!r}")
        scratch = torch.Generator(device=generators[name].device)
        try:
            scratch.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
        except (RuntimeError, ValueError) as exc:
            raise ResumeError(f"state field 'rng.{name}' is not a state of this generator: {exc}") from None


def _check_distributed(loader, state: dict, now: dict) -> dict:
    for key in ("seed", "shuffle", "drop_last"):
        if state["sampler"][key] != now[key]:
            raise ResumeError(
                f"DistributedSampler {key} was {state['sampler'][key]!r} in the state, is {now[key]!r} now"
            )
    resharded = state["sampler"]["num_replicas"] != now["num_replicas"] or state["batch_size"] != loader.batch_size
    if resharded and state["yielded_out_of_order"]:
        raise ResumeError(
            "an epoch checkpointed in out-of-order mode (in_order=False: batches "
            f"{state['yielded_out_of_order'][:8]} were yielded ahead of batch {state['batches_yielded']}) "
            f"can only resume at its world size and batch size ({state['sampler']['num_replicas']} x "
            f"{state['batch_size']}), not {now['num_replicas']} x {loader.batch_size}"
        )
    return state


def _check_yielded_within(loader, state: dict) -> None:
    """A map-style epoch's yielded batches fit in this loader's epoch (where it has a length)."""
    try:
        total = len(loader._index_sampler)
    except TypeError:
        return
    yielded = state["batches_yielded"] + len(state["yielded_out_of_order"])
    if yielded > total or any(n >= total for n in state["yielded_out_of_order"]):
        raise ResumeError(
            f"state field 'batches_yielded': the state has {yielded} batches yielded "
            f"(up to number {max([state['batches_yielded'] - 1, *state['yielded_out_of_order']])}), "
            f"the epoch has {total}"
        )
