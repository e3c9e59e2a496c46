"""``vmm_fd``: CUDA virtual-memory allocations shared as POSIX file descriptors.

The daemon creates physical allocations with ``cuMemCreate`` (POSIX-fd
handle type, recommended granularity), maps them, loads the weights straight
into them and exports one fd per allocation. An engine imports each fd,
reserves its own address range and maps it read-only (unless it asks for
read-write). Physical memory is reference-counted by the driver per mapping,
so an engine keeps its weights when the daemon dies, and no shared PID
namespace is needed (unlike legacy CUDA IPC).
"""

from __future__ import annotations

import functools
import os

import torch

from weightcache.transport.base import (
    AllocationEntry,
    DaemonMemory,
    Export,
    WeightCacheTransportBackend,
)


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise RuntimeError(
            "the vmm_fd transport needs cuda-python's bindings: pip install 'weightcache[cuda]'"
        ) from None
    return driver


def _check(result: tuple, what: str):
    """Unpack a cuda-python call's (CUresult, *values), raising on failure."""
    err, *values = result
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def _context(ordinal: int):
    """Make the device's primary context (the one PyTorch uses) current on this thread."""
    drv = _driver()
    torch.cuda.init()
    _check(drv.cuInit(0), "cuInit")
    device = _check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    return _check(drv.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")


def _use_device(ordinal: int) -> None:
    _check(_driver().cuCtxSetCurrent(_context(ordinal)), "cuCtxSetCurrent")


def _allocation_prop(ordinal: int):
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = (
        drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


@functools.cache
def granularity(ordinal: int) -> int:
    drv = _driver()
    _use_device(ordinal)
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(
        _check(drv.cuMemGetAllocationGranularity(_allocation_prop(ordinal), flag), "granularity")
    )


def vmm_fd_supported(device: torch.device) -> bool:
    """Whether the GPU supports VMM with POSIX-fd handles (and the bindings are installed)."""
    try:
        drv = _driver()
        ordinal = device.index or 0
        _use_device(ordinal)
        dev = _check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        attr = drv.CUdevice_attribute
        vmm = _check(
            drv.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev
            ),
            "cuDeviceGetAttribute",
        )
        fds = _check(
            drv.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
            ),
            "cuDeviceGetAttribute",
        )
    except RuntimeError:
        return False
    return bool(vmm) and bool(fds)


class DeviceMapping:
    """A mapped VA range over one physical allocation; unmapped when the last view dies.

    PyTorch tensors built from ``__cuda_array_interface__`` keep this object
    alive, so unmapping can never pull memory out from under a live tensor.
    """

    def __init__(self, handle, size: int, ordinal: int, writable: bool) -> None:
        """Takes ownership of ``handle``: it is released with the mapping, or on failure."""
        drv = _driver()
        self.size = size
        self.ordinal = ordinal
        self._handle = handle
        self._reserved = 0
        self.ptr = 0
        try:
            _use_device(ordinal)
            reserved = drv.cuMemAddressReserve(size, granularity(ordinal), 0, 0)
            self._reserved = int(_check(reserved, "cuMemAddressReserve"))
            _check(drv.cuMemMap(self._reserved, size, 0, handle, 0), "cuMemMap")
            self.ptr = self._reserved
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = ordinal
            flags = drv.CUmemAccess_flags
            access.flags = (
                flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                if writable
                else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            )
            _check(drv.cuMemSetAccess(self.ptr, size, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.release()
            raise

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def tensor(self) -> torch.Tensor:
        if self.size == 0:
            return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", self.ordinal))
        return torch.as_tensor(self, device=torch.device("cuda", self.ordinal))

    def release(self) -> None:
        drv = _driver()
        _use_device(self.ordinal)
        if self.ptr:
            drv.cuMemUnmap(self.ptr, self.size)
            self.ptr = 0
        if self._reserved:
            drv.cuMemAddressFree(self._reserved, self.size)
            self._reserved = 0
        if self._handle is not None:
            drv.cuMemRelease(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


class VmmMemory(DaemonMemory):
    backend_name = "vmm_fd"

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        super().__init__(sizes, device)
        drv = _driver()
        ordinal = device.index or 0
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.fds: list[int] = []
        # The daemon's own read-write mappings, which the loader fills.
        self._mappings: list[DeviceMapping] = []
        try:
            _use_device(ordinal)
            prop = _allocation_prop(ordinal)
            for size in sizes:
                handle = _check(drv.cuMemCreate(size, prop, 0), f"cuMemCreate({size})")
                mapping = DeviceMapping(handle, size, ordinal, writable=True)
                self._mappings.append(mapping)
                self.fds.append(
                    int(_check(drv.cuMemExportToShareableHandle(handle, kind, 0), "export"))
                )
            self.buffers = [m.tensor() for m in self._mappings]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.buffers = []
        self._mappings = []  # each unmaps and releases once no view uses it
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class VmmFdBackend(WeightCacheTransportBackend):
    name = "vmm_fd"
    uses_fds = True
    keeps_fds = True

    def __init__(self, writable: bool = False) -> None:
        self.writable = writable

    def allocation_alignment(self, device: torch.device) -> int:
        return granularity(device.index or 0)

    def allocate(self, sizes: list[int], device: torch.device) -> DaemonMemory:
        if device.type != "cuda":
            raise RuntimeError(
                f"vmm_fd holds weights in GPU memory; the daemon's device is {device}"
            )
        return VmmMemory(sizes, device)

    def prepare_export(self, memory: DaemonMemory) -> Export:
        assert isinstance(memory, VmmMemory)
        return Export(handles=None, fds=list(memory.fds))

    def import_tensor(self, entry: AllocationEntry) -> torch.Tensor:
        assert entry.fd is not None
        drv = _driver()
        ordinal = torch.cuda.current_device()
        _use_device(ordinal)
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        imported = drv.cuMemImportFromShareableHandle(entry.fd, kind)
        handle = _check(imported, "cuMemImportFromShareableHandle")
        return DeviceMapping(handle, entry.size, ordinal, self.writable).tensor()
