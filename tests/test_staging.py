"""The staging layer: batch layout in a slot, deferred collate, threaded copies (both backends)."""

import pytest
import torch
from torch.utils.data import default_collate

from torch_fastload import staging
from torch_fastload.staging import (
    ALIGN,
    ParallelCopier,
    PendingConcat,
    PendingStack,
    deferred_collate,
    materialize,
    plan_batch,
)


@pytest.fixture(params=["native", "numpy"])
def copier_factory(request, monkeypatch):
    if request.param == "native" and staging._native_copy is None:
        pytest.skip("torch_fastload._C is not built")
    if request.param == "numpy":
        monkeypatch.setattr(staging, "_native_copy", None)
    return ParallelCopier


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("nontemporal", [False, True])
def test_copy_into_matches_sources(copier_factory, threads, nontemporal):
    sources = [
        torch.randn(700_001),  # odd size, several MiB-chunks
        torch.randn(50_001)[1:],  # source not 16-byte aligned
        torch.randint(0, 255, (3, 5), dtype=torch.uint8),
        torch.randn(64, 48).t(),  # strided: goes through Tensor.copy_
        torch.randn(0),  # empty
        torch.randn(1000).to(torch.bfloat16),
        torch.tensor(7, dtype=torch.int64),  # 0-d
    ]
    offsets, cursor = [], 0
    for src in sources:
        cursor = (cursor + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(cursor)
        cursor += src.numel() * src.element_size()
    dst = torch.full((cursor + 512,), 0xAB, dtype=torch.uint8)
    copier = copier_factory(threads, nontemporal)
    assert copier.copy_into(dst, list(zip(offsets, sources))) == sum(s.numel() * s.element_size() for s in sources)
    for offset, src in zip(offsets, sources):
        got = dst[offset : offset + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        assert torch.equal(got, src.contiguous())
    assert torch.all(dst[cursor:] == 0xAB)  # nothing written past the last range
    copier.close()


def test_copy_into_refuses_out_of_bounds(copier_factory):
    dst = torch.zeros(100, dtype=torch.uint8)
    copier = copier_factory(2)
    with pytest.raises(ValueError, match=r"staging range \[96, 104\) is outside the 100-byte destination"):
        copier.copy_into(dst, [(96, torch.zeros(2, dtype=torch.float32))])
    with pytest.raises(ValueError, match="outside"):
        copier.copy_into(dst, [(-4, torch.zeros(1))])
    assert torch.all(dst == 0)


def test_deferred_collate_has_default_collate_structure():
    samples = [
        {"x": torch.full((2, 3), float(i)), "y": i, "name": f"s{i}", "pair": (torch.tensor([i]), 1.5)} for i in range(4)
    ]
    deferred = deferred_collate(samples)
    assert isinstance(deferred["x"], PendingStack) and deferred["x"].shape == (4, 2, 3)
    plan = plan_batch(deferred)
    slot = torch.empty(plan.total_bytes, dtype=torch.uint8)
    ParallelCopier(2).copy_into(slot, plan.copy_list())
    rebuilt = plan.unpack(slot, lambda t: t)
    expected = default_collate(samples)
    assert torch.equal(rebuilt["x"], expected["x"]) and torch.equal(rebuilt["y"], expected["y"])
    assert rebuilt["name"] == expected["name"] and torch.equal(rebuilt["pair"][0], expected["pair"][0])
    assert all(leaf is None or leaf.offset % ALIGN == 0 for leaf in plan.leaves)


def test_unstackable_samples_fall_back_to_torch_errors():
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        deferred_collate([torch.zeros(2), torch.zeros(3)])


def test_pending_concat_is_written_back_to_back_like_torch_cat(copier_factory):
    pieces = [torch.randn(300_001, 2), torch.randn(0, 2), torch.randn(64, 2)[::2], torch.randn(5, 2)]
    batch = {"x": PendingConcat(pieces), "n": torch.arange(3)}
    assert batch["x"].shape == (300_038, 2)
    plan = plan_batch(batch)
    flat = torch.full((plan.total_bytes,), 0xAB, dtype=torch.uint8)
    copier = copier_factory(2)
    copier.copy_into(flat, plan.copy_list())
    out = plan.unpack(flat, lambda tensor: tensor)
    assert torch.equal(out["x"], torch.cat(pieces)) and torch.equal(out["n"], torch.arange(3))
    assert torch.equal(materialize(batch)["x"], torch.cat(pieces))
    copier.close()
    with pytest.raises(ValueError, match="differ in dtype"):
        PendingConcat([torch.zeros(2), torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="at least one"):
        PendingConcat([])


class _ViewCounter(torch.overrides.TorchFunctionMode):
    """Counts the torch calls that release the GIL in ``unpack`` (``view``; slicing keeps it)."""

    def __init__(self):
        super().__init__()
        self.views = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "view":
            self.views += 1
        return func(*args, **(kwargs or {}))


def _unpack_views(batch) -> tuple[int, dict]:
    plan = staging.plan_batch(batch)
    flat = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    staging.ParallelCopier(2).copy_into(flat, plan.copy_list())
    with _ViewCounter() as counter:
        out = plan.unpack(flat, lambda tensor: tensor)
    return counter.views, out


def _many_fields() -> dict:
    batch = {f"i{k}": torch.arange(k, k + 50, dtype=torch.int64) for k in range(10)}
    batch.update({f"u{k}": torch.arange(40, dtype=torch.uint8) + k for k in range(10)})
    batch.update({f"b{k}": torch.arange(30) % (k + 2) == 0 for k in range(10)})
    batch["matrix"] = torch.randn(4, 6)
    batch["scalar"] = torch.tensor(2.5)
    return batch


def test_unpack_makes_one_view_per_dtype_not_per_field():
    """NOTE [GIL-free views]: each ``view`` releases the GIL and queues for it again; 32 fields of
    four dtypes take a view per dtype other than the slot's and one for the 2-D field."""
    batch = _many_fields()
    views, out = _unpack_views(batch)
    for key, value in batch.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape and torch.equal(out[key], value), key
    assert views <= 4, views  # int64, bool, float32 bases + the matrix's shape


def test_negative_control_unpack_view_count_sees_per_field_views(monkeypatch):
    monkeypatch.setattr(staging, "_typed_view", lambda flat, dtype: False)  # the per-field route
    batch = _many_fields()
    views, out = _unpack_views(batch)
    assert views >= 2 * 30, views  # the counter sees per-field views (the values stay right)
    assert all(torch.equal(out[key], value) for key, value in batch.items())
