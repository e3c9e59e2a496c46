"""Naming devices: ``cpu``, ``cuda:N``, or a GPU by its UUID (stable across reboots and pods)."""

from __future__ import annotations

import torch


def gpu_uuid(index: int) -> str:
    """``GPU-xxxxxxxx-...``, the form nvidia-smi and NVIDIA_VISIBLE_DEVICES use."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def resolve_device(device: str, uuid: str | None = None) -> tuple[torch.device, str]:
    """(torch device, GPU UUID or ``"cpu"``) for ``--device`` / ``--gpu-uuid``."""
    if uuid is not None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--gpu-uuid {uuid} given but no CUDA device is visible")
        wanted = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        for index in range(torch.cuda.device_count()):
            if gpu_uuid(index) == wanted:
                return torch.device("cuda", index), wanted
        raise RuntimeError(f"no visible GPU has UUID {uuid}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda:N, got {device!r}") from None
    if parsed.type == "cpu":
        return parsed, "cpu"
    if parsed.type != "cuda":
        raise ValueError(f"--device must be cpu or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} given but no CUDA device is visible")
    index = parsed.index if parsed.index is not None else 0
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    return torch.device("cuda", index), gpu_uuid(index)
