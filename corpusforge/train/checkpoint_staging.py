"""The host copy an asynchronous checkpoint writes from: one buffer per saved tensor, allocated at the first save
and refilled by every later one, pinned when the tensor lives on a GPU.

DCP's default staging allocates pageable memory at every save; on an H200 the copy of GPT-2 124M's 1.96 GB ran at
~1.4 GB/s and held the loop 1.42 s. Pinned buffers copy at the link's speed, and keeping them avoids paying for
`cudaHostAlloc` each time. DCP's own pinned stager (DefaultStager) deep-copies objects by reduction, which fails on
torch 2.11 for parameters (tensor subclasses reduce to their class); this one handles tensors and DTensors only,
which is all a `ShardedState.flat` holds. The cost: one copy of this rank's shards in host RAM for the whole run.

Example:
    >>> stager = PinnedStager()
    >>> dcp.async_save(state.flat, storage_writer=writer, async_stager=stager)  # returns once the copy is done
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["PinnedStager"]


class PinnedStager(AsyncStager):
    """dcp.async_save's stager: copies a flat {name: tensor} state into buffers it keeps, blocking until the copy is
    done (the next optimizer step may then change the tensors). Not thread-safe; one save in flight at a time, as
    the Checkpointer guarantees (a buffer is the previous write's source until that write has finished)."""

    _synchronize_after_execute = False  # stage() returns a finished copy: nothing to wait for afterwards

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = {name: self._stage(name, value) for name, value in state_dict.items()}
        if any(b.is_pinned() for b in self._buffers.values()):
            torch.accelerator.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()

    def _stage(self, name: str, value: Any) -> Any:
        if not torch.is_tensor(value):
            raise TypeError(f"checkpoint staging: {name} is a {type(value).__name__}, not a tensor")
        local = value.to_local() if _is_dtensor(value) else value
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
            self._buffers[name] = buffer
        buffer.copy_(local.detach(), non_blocking=local.is_cuda)
        if not _is_dtensor(value):
            return buffer
        # the same global tensor and placements around the host copy (DTensor.from_local would move it to the mesh's
        # device); the flatten protocol's context differs between torch versions, so it is passed through untouched
        names, context = value.__tensor_flatten__()
        inner = {n: getattr(value, n) for n in names}
        inner["_local_tensor"] = buffer
        return type(value).__tensor_unflatten__(inner, context, value.shape, value.stride())


def _is_dtensor(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)
