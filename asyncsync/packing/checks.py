"""What makes a tensor unsafe to pack, checked in Python before any pack reads its memory.

A compiled pack reads raw memory: handed a tensor subclass whose data lives elsewhere (a DTensor, a
FakeTensor: data pointer 0), a meta tensor, or a view whose storage was freed or shrunk after the view
was made (``untyped_storage().resize_(0)``, which FSDP does to unsharded parameters), it would read
through a null or dangling pointer and kill the trainer. ``memory_problem`` finds each of those; the
weights view (``trainer.source.check_tensors``) and the CUDA launcher (``packing.cuda``) raise
``UnpackableTensor`` on it, and the C++ op checks the same again itself (csrc/pack_cpu.cpp,
``check_tensor``), so no bad tensor reaches native code from any path.
"""

from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class UnpackableTensor(ValueError):
    """A tensor cannot be packed as it is; the message names it, what is wrong and what to do."""


def memory_problem(t: object) -> str | None:
    """Why reading ``t``'s bytes would be unsafe, as a phrase that follows the tensor's name; None
    when it is a dense tensor whose storage holds every byte its view reads.

    About 2.5 us per tensor: run once per version where the weights are read, never per ``publish``."""
    if type(t) not in _PLAIN:
        if not isinstance(t, torch.Tensor):
            return f"is a {type(t).__name__}, not a tensor; pass a module or a mapping of name -> torch.Tensor"
        if torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
            return (f"is a {type(t).__name__}, a tensor subclass whose data is not plain memory; "
                    "pass plain tensors (for a DTensor, its full_tensor(); for a FakeTensor, a real one)")
    if t.is_meta:
        return "is a meta tensor: it has a shape but no data; materialize it (to_empty() and load weights) first"
    if t.layout is not torch.strided:
        return f"has layout {t.layout}; only dense tensors can be sent (call .to_dense() first)"
    if t.numel():
        storage = t.untyped_storage()
        if t.is_contiguous():
            last = t.storage_offset() + t.numel()
        else:
            last = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        needed, have = last * t.element_size(), storage.nbytes()
        if have < needed or storage.data_ptr() == 0:
            return (f"reads {needed} bytes of a storage that holds {have}: its storage was freed or resized after "
                    "the view was made (e.g. by FSDP resharding); publish it while its data is allocated")
    return None


def check_tensor(name: str, t: object) -> None:
    """Raise ``UnpackableTensor`` naming ``name`` when ``memory_problem(t)`` finds something."""
    problem = memory_problem(t)
    if problem is not None:
        raise UnpackableTensor(f"tensor '{name}' {problem}")
