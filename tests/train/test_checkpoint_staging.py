"""PinnedStager: the host copy an async checkpoint writes from (on CPU: unpinned, the same buffers and copies)."""

from __future__ import annotations

import pytest
import torch

from corpusforge.train.checkpoint_staging import PinnedStager


def test_staged_copy_is_independent_of_training_and_reuses_its_buffers() -> None:
    weight = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    state = {"model.w": weight, "optim.state.w.step": torch.tensor(3.0), "model.t": weight.t()}
    stager = PinnedStager()
    first = stager.stage(state)
    assert type(first["model.w"]) is torch.Tensor  # a parameter is staged as its data
    with torch.no_grad():
        weight.add_(100)  # the optimizer step after save() returns
    assert torch.equal(first["model.w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(first["model.t"], first["model.w"].t())  # a strided view is staged by value
    second = stager.stage(state)
    assert second["model.w"].data_ptr() == first["model.w"].data_ptr()  # the same buffer, refilled
    assert torch.equal(second["model.w"], weight.detach())
    state["model.w"] = torch.nn.Parameter(torch.zeros(5))  # a changed shape gets a new buffer
    assert stager.stage(state)["model.w"].shape == (5,)
    stager.close()


def test_one_block_holds_every_dtype_and_shape_at_its_exact_size() -> None:
    state = {
        "optim.state.w.step": torch.tensor(7.0),  # a scalar
        "model.empty": torch.zeros(0, 3),
        "model.flags": torch.tensor([True, False, True]),
        "model.half": torch.arange(5, dtype=torch.bfloat16),
        "model.ids": torch.arange(3, dtype=torch.int64),
    }
    stager = PinnedStager()
    staged = stager.stage(state)
    for name, value in state.items():
        assert staged[name].dtype == value.dtype and staged[name].shape == value.shape, name
        assert torch.equal(staged[name], value), name
        assert staged[name].data_ptr() % PinnedStager.ALIGN == 0 or staged[name].numel() == 0, name
        # a storage of its own size: DCP's writer would copy a tensor viewing a larger storage before writing it
        assert staged[name].untyped_storage().nbytes() == staged[name].nbytes, name
    # each buffer rounded up to a cache line only: not to a power of two per tensor, as the pinned allocator does
    assert stager.nbytes == 4 * PinnedStager.ALIGN
    stager.close()
    assert stager.nbytes == 0


def test_a_non_tensor_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="optim.lr is a float"):
        PinnedStager().stage({"optim.lr": 0.1})


def test_a_dtensor_stays_a_dtensor_with_its_global_shape(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        staged = PinnedStager().stage({"model.w": value})["model.w"]
        assert isinstance(staged, DTensor) and staged.shape == (4, 2) and staged.placements == (Shard(0),)
        assert staged.to_local().data_ptr() != value.to_local().data_ptr()
        assert torch.equal(staged.full_tensor(), torch.arange(8.0).reshape(4, 2))
    finally:
        dist.destroy_process_group()
