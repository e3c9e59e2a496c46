"""The ``m31-linear-x2`` chunk sums in one CUDA kernel, compiled at run time with NVRTC.

The digest is defined by its arithmetic (see :mod:`.manifest`): for each chunk
and lane, ``sum_i k[i] * h[i] mod (2^31 - 1)``. Computed with torch ops it
costs about 40 bytes of memory traffic per halfword and lane (int64
temporaries) and several launches per 8 MiB chunk: ~0.5 s for 16 GB on an
H200, against ~40 ms to copy the same bytes between two GPUs. This kernel
reads each halfword once for every lane, accumulates exactly in 64-bit
integers and writes one partial sum (already reduced mod the prime) per block;
torch adds the partials. The host then finishes exactly as the torch
formulation does, so both give the same digest (the GPU tests compare them).

It is compiled by NVRTC through cuda-python (the ``vmm_fd`` transport's
dependency): no C compiler is needed in the image. Any failure (no NVRTC, a
GPU it does not know, a self-check that disagrees with the torch formulation)
makes :func:`chunk_sums` return None, once logged, and callers use torch.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger(__name__)

M31 = (1 << 31) - 1
THREADS = 256
PER_BLOCK = 4096  # halfwords per block: 16 per thread, each product < 2^47, sums < 2^51
MAX_LANES = 4
# Partial sums per launch are lanes x chunks x blocks int64s: at most 8 MiB.
CHUNKS_PER_LAUNCH = 256

SOURCE = r"""
#define M31 2147483647ULL
extern "C" __global__ void m31_chunk_sums(
    const unsigned short* __restrict__ words,  // the allocation, as halfwords
    const unsigned int* __restrict__ keys,     // lanes x key_len inner keys, each < M31
    unsigned long long* __restrict__ out,      // lanes x chunks x gridDim.y partials, < M31
    unsigned long long total,                  // halfwords in the allocation
    unsigned long long chunk,                  // halfwords per chunk
    unsigned long long first_chunk,            // this launch's first chunk
    unsigned int key_len, unsigned int lanes, unsigned int chunks)
{
    // blockIdx.x (fastest): the chunk, so that blocks running together read the same keys.
    const unsigned long long c = first_chunk + blockIdx.x;
    const unsigned long long begin = (unsigned long long)blockIdx.y * PER_BLOCK;
    unsigned long long acc[4] = {0ULL, 0ULL, 0ULL, 0ULL};
    for (unsigned int i = threadIdx.x; i < PER_BLOCK; i += blockDim.x) {
        const unsigned long long j = begin + i;
        const unsigned long long g = c * chunk + j;
        if (j < chunk && g < total) {
            const unsigned long long h = words[g];
#pragma unroll
            for (unsigned int l = 0; l < 4; ++l) {
                if (l < lanes) acc[l] += h * keys[(unsigned long long)l * key_len + j];
            }
        }
    }
    __shared__ unsigned long long part[4][THREADS];
#pragma unroll
    for (unsigned int l = 0; l < 4; ++l) part[l][threadIdx.x] = acc[l] % M31;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
#pragma unroll
            for (unsigned int l = 0; l < 4; ++l) part[l][threadIdx.x] += part[l][threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        for (unsigned int l = 0; l < lanes; ++l) {
            out[((unsigned long long)l * chunks + blockIdx.x) * gridDim.y + blockIdx.y] =
                part[l][0] % M31;
        }
    }
}
"""

_lock = threading.Lock()
_functions: dict[int, object] = {}
_broken: str | None = None


def _check(result: tuple, what: str):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _compile(major: int, minor: int) -> bytes:
    from cuda.bindings import nvrtc

    program = _check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"m31.cu", 0, [], []), "nvrtc")
    try:
        options = [
            f"--gpu-architecture=sm_{major}{minor}".encode(),
            f"-DPER_BLOCK={PER_BLOCK}".encode(),
            f"-DTHREADS={THREADS}".encode(),
        ]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(program, text)
            raise RuntimeError(f"NVRTC: {text.decode(errors='replace').strip()}")
        size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _function(device: torch.device):
    """The kernel, loaded into the device's primary context (torch's)."""
    from cuda.bindings import driver

    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    if ordinal not in _functions:
        torch.cuda.init()
        with torch.cuda.device(ordinal):
            torch.cuda.current_stream()  # makes the primary context current on this thread
            cubin = _compile(*torch.cuda.get_device_capability(ordinal))
            module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            _functions[ordinal] = _check(
                driver.cuModuleGetFunction(module, b"m31_chunk_sums"), "cuModuleGetFunction"
            )
    return _functions[ordinal]


def _launch_sums(words: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """(lanes, chunks) int64 sums of per-block partials, each block's already mod M31."""
    from cuda.bindings import driver

    device = words.device
    total = words.numel()
    lanes, key_len = keys.shape
    chunks = -(-total // chunk)
    blocks = -(-min(chunk, total) // PER_BLOCK)
    function = _function(device)
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    sums = []
    for first in range(0, chunks, CHUNKS_PER_LAUNCH):
        n = min(CHUNKS_PER_LAUNCH, chunks - first)
        out = torch.empty((lanes, n, blocks), dtype=torch.int64, device=device)
        args = [
            ctypes.c_void_p(words.data_ptr()),
            ctypes.c_void_p(keys.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_uint64(total),
            ctypes.c_uint64(chunk),
            ctypes.c_uint64(first),
            ctypes.c_uint32(key_len),
            ctypes.c_uint32(lanes),
            ctypes.c_uint32(n),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        _check(
            driver.cuLaunchKernel(
                function, n, blocks, 1, THREADS, 1, 1, 0, stream, ctypes.addressof(params), 0
            ),
            "cuLaunchKernel",
        )
        sums.append(out.sum(2))
    return torch.cat(sums, dim=1)


def chunk_sums(halfwords: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """Per lane and chunk, a value congruent mod M31 to
    ``sum_i keys[lane, i] * (halfwords[chunk, i] & 0xFFFF)`` (a (lanes, chunks) int64
    tensor), or None where the kernel is unavailable. ``halfwords``: int16 on a GPU;
    ``keys``: (lanes, n) int32 with n = min(chunk, halfwords.numel()), each below M31."""
    if keys.shape[0] > MAX_LANES or not warm_up(halfwords.device):
        return None
    try:
        return _launch_sums(halfwords, keys.contiguous(), chunk)
    except Exception as exc:  # a driver error: torch still can
        _give_up(exc)
        return None


def warm_up(device: torch.device) -> bool:
    """Compile, load and self-check the kernel for ``device`` once; whether it is usable."""
    if _broken is None:
        try:
            with _lock:
                _self_check(device)
        except Exception as exc:  # no NVRTC, a GPU it does not know, a wrong sum
            _give_up(exc)
    return _broken is None


def warm_up_async(device: torch.device) -> None:
    """Start :func:`warm_up` on a thread (NVRTC takes ~0.1-0.2 s): a daemon calls this at
    start, so that its first digest (re-adoption, a seeded copy) finds the kernel ready."""
    if device.type == "cuda":
        threading.Thread(target=warm_up, args=(device,), name="digest-warm-up", daemon=True).start()


def _give_up(exc: Exception) -> None:
    global _broken
    _broken = f"{type(exc).__name__}: {exc}"
    log.warning("digest kernel unavailable, digesting with torch ops: %s", _broken)


_checked: set[int] = set()


def _self_check(device: torch.device) -> None:
    """Once per device: the kernel must agree with the torch formulation, partial chunks
    and large halfwords included."""
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    if ordinal in _checked:
        return
    generator = torch.Generator().manual_seed(20)
    chunk = 3 * PER_BLOCK + 128  # several blocks, the last one partial
    total = 2 * chunk + PER_BLOCK + 256  # a partial last chunk
    words = torch.randint(-(1 << 15), 1 << 15, (total,), generator=generator, dtype=torch.int16)
    words[:8] = -1  # 0xFFFF
    keys = torch.randint(0, M31, (MAX_LANES, chunk), generator=generator, dtype=torch.int32)
    keys[:, :8] = M31 - 1
    expected = torch.stack([
        torch.stack([
            (words[s : s + chunk].to(torch.int64) & 0xFFFF).mul(keys[lane, : min(chunk, total - s)])
            .sum() for s in range(0, total, chunk)
        ]) for lane in range(MAX_LANES)
    ])  # fmt: skip
    got = _launch_sums(words.to(device), keys.to(device), chunk).cpu()
    if not torch.equal(got.remainder(M31), expected.remainder(M31)):
        raise RuntimeError("self-check: the kernel's sums differ from the torch formulation")
    _checked.add(ordinal)
