"""What a result was measured on: GPU, driver, torch, CPU, disk."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def describe(data_dir: str | None = None) -> dict:
    info = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    if torch.cuda.is_available():
        smi = _run(
            "nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"
        )
        info["gpu"] = torch.cuda.get_device_name(0)
        info["nvidia_smi"] = smi
    if data_dir:
        info["disk"] = _run("df", "-h", "--output=source,fstype,size,avail", data_dir)
    return info
