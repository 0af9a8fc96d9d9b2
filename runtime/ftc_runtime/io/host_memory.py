"""Page-locking host memory in place, so that host→GPU copies from it run as DMA at full PCIe speed.

`cudaHostRegister` pins an existing buffer without copying it (`Tensor.pin_memory()` would copy the
whole expert pool). A failed call leaves CUDA's per-thread "last error" set, and torch would raise
it at its next kernel launch, so a failure is read back and cleared here.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

_REGISTERED: set[int] = set()  # data pointers pinned by this process


@lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library that torch loaded (found in this process's memory map)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "libcudart" in Path(path).name:
                return ctypes.CDLL(path)
    except OSError:
        pass
    return None


def pin_in_place(buffer: torch.Tensor) -> bool:
    """Pins `buffer` (contiguous, on the host) once per process, until the tensor is freed; True
    when it is pinned. Unpinned at free: a later buffer at the same addresses must not find a
    stale registration of pages that are gone."""
    ptr = buffer.data_ptr()
    if ptr in _REGISTERED:
        return True
    if torch.cuda.cudart().cudaHostRegister(ptr, buffer.numel() * buffer.element_size(), 0) == 0:
        _REGISTERED.add(ptr)
        weakref.finalize(buffer, _unpin, ptr)
        return True
    lib = _cudart()
    if lib is not None:
        lib.cudaGetLastError()
    return False


def _unpin(ptr: int) -> None:
    _REGISTERED.discard(ptr)
    torch.cuda.cudart().cudaHostUnregister(ptr)


def mapped_address(buffer: torch.Tensor, address: int) -> int | None:
    """The device's address of host `address`, inside the pinned `buffer` (pinned here or by
    torch; kernels reach it over PCIe through the mapping), or None where there is no mapping."""
    lib = _cudart()
    if lib is None:
        return None
    base = ctypes.c_void_p()
    if lib.cudaHostGetDevicePointer(ctypes.byref(base), ctypes.c_void_p(buffer.data_ptr()), 0) != 0:
        lib.cudaGetLastError()
        return None
    return base.value + (address - buffer.data_ptr())


@dataclass(frozen=True)
class MappedHost:
    """Pinned host memory as the device sees it (`mapped_address`): Triton takes any object with
    `data_ptr()` and `dtype` as a pointer argument, and its kernels read it over PCIe."""

    address: int
    dtype: torch.dtype = torch.int32

    @classmethod
    def of(cls, tensor: torch.Tensor, offset_elements: int = 0) -> MappedHost:
        """The pinned `tensor` (from its element `offset_elements` on) as the device maps it."""
        address = mapped_address(tensor, tensor.data_ptr() + offset_elements * tensor.element_size())
        if address is None:
            raise RuntimeError("host memory is not mapped into the device (pinned memory needed)")
        return cls(address, tensor.dtype)

    def data_ptr(self) -> int:
        return self.address
