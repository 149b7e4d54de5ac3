"""The torch side of a snapshot: a state dict to (name, dtype, shape, raw bytes) and back.

Used by the hub to build a version (`state_to_tensors` then `echo2p2p.snapshot.build_snapshot`)
and by peers to load one (`ChunkAssembler.tensors` then `tensors_to_state`). Raw bytes are the
tensor's memory as it lies on a little-endian CPU; bfloat16 has no numpy dtype, so bytes always
go through a torch.uint8 view. Knows nothing of chunks, hashes or the wire.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from echo2p2p.errors import LocalProtocolError, SnapshotError
from echo2p2p.snapshot import DTYPE_BYTES

if sys.byteorder != "little":  # the wire format is little-endian; we never byte-swap
    raise ImportError("echo2p2p.policy.weights needs a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the name a manifest uses."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16; SnapshotError for a name a manifest may not carry."""
    dtype = getattr(torch, name, None) if name in DTYPE_BYTES else None
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"unsupported dtype {str(name)[:40]!r}")
    return dtype


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the view keeps `t` alive)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def state_to_tensors(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> list[tuple[str, str, list[int], memoryview]]:
    """(name, dtype name, shape, raw bytes) per tensor of `state`, in its order.

    Floating-point tensors are cast to `dtype`; integer and bool buffers keep their dtype (a
    cast would corrupt them). A tensor that is the very same view of the same memory as an
    earlier one (tied embeddings) is sent once, under the first name. Views that merely share a
    storage at different offsets or shapes (slices of a fused weight) are kept: dropping them
    would lose data. When no cast or move is needed the bytes alias the input's memory, so the
    caller must not modify `state` until the snapshot is built.
    """
    out: list[tuple[str, str, list[int], memoryview]] = []
    seen: set[tuple] = set()
    for name, t in state.items():
        t = t.detach()
        if t.numel() > 0:  # empty tensors may all report data_ptr 0: never "tied"
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                   tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
        out.append(tensor_entry(name, t, dtype))
    return out


def tensor_entry(name: str, t: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[str, str, list[int], memoryview]:
    """(name, dtype name, shape, raw bytes) of one tensor, floating point cast to `dtype`: what
    `state_to_tensors` gives per tensor, for a caller that streams them one by one (and has
    removed tied names itself: a freed tensor's address is reused, so pointers prove nothing)."""
    target = dtype if t.is_floating_point() else t.dtype
    if dtype_name(target) not in DTYPE_BYTES:
        raise LocalProtocolError(f"tensor {name!r}: dtype {target} cannot go in a snapshot")
    t = t.detach().to(device="cpu", dtype=target).contiguous()
    return name, dtype_name(target), list(t.shape), _byte_view(t)


def tensors_to_state(
    tensors: Iterable[tuple[str, str, Sequence[int], bytes | memoryview]],
) -> dict[str, torch.Tensor]:
    """The inverse of `state_to_tensors`: fresh CPU tensors that own writable memory.

    Each tensor's bytes are copied exactly once, so the result outlives the assembler's buffer.
    Raises SnapshotError if a byte count does not match its dtype and shape.
    """
    state: dict[str, torch.Tensor] = {}
    for name, dtype, shape, data in tensors:
        out = torch.empty(list(shape), dtype=torch_dtype(dtype))
        src = np.frombuffer(data, dtype=np.uint8)  # a read-only view, no copy yet
        nbytes = out.numel() * out.element_size()
        if src.size != nbytes:
            raise SnapshotError(f"tensor {name[:80]!r}: byte count does not match {dtype}{list(shape)}")
        if nbytes:
            out.reshape(-1).view(torch.uint8).numpy()[:] = src
        state[name] = out
    return state
