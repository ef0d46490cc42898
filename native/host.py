"""numpy views of CPU tensors for the kernels (the CPU kernels, and the CUDA kernels under numba's
simulator), made once per tensor object."""
from __future__ import annotations

import ctypes

import numpy as np
import torch


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()`` of a CPU tensor that needs no gradient, prepared once per tensor object:
    the buckets' buffers and scratch live for the whole run, and torch's conversion dispatches
    an op at each call. The array kept on the tensor (for contiguous ones) is a view of its
    memory (an empty array of its own for an empty tensor) that holds no reference back to it
    (no cycle to keep a temporary alive), so it lives and dies with the tensor; it is made
    again when the tensor's memory or shape changed."""
    cached = t.__dict__.get("_hvd_zoadam_numpy")
    if cached is not None and cached[0] == t.data_ptr() and cached[1].shape == t.shape and t.is_contiguous():
        return cached[1]
    a = t.numpy()
    if not t.is_contiguous():
        return a
    if a.size:
        memory = (ctypes.c_byte * a.nbytes).from_address(t.data_ptr())
        view = np.frombuffer(memory, dtype=a.dtype).reshape(a.shape)
    else:  # no memory to view: an empty array of its own (the kernels' "none" arguments)
        view = np.empty(a.shape, dtype=a.dtype)
    t.__dict__["_hvd_zoadam_numpy"] = (t.data_ptr(), view)
    return view
