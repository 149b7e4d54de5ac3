"""Where the policy can run: `check_device` refuses a device this machine's torch cannot use,
at config time, naming the field and the fix, before anything loads or joins.

Shared by the hub's learner config and the peer's config. torch is imported only for a device
other than "cpu", and the GPU count comes from `torch.cuda.device_count`, which asks NVML and so
does not initialise CUDA in this process (a hub forks scoring workers after it).
"""

from __future__ import annotations

import os

from ..errors import ConfigError

FIX = "pass --device cpu, or install a CUDA build of torch (https://pytorch.org/get-started)"


def check_device(device: str, field: str = "device") -> None:
    """ConfigError on `field` unless this machine's torch can put a model on `device` (cpu,
    cuda, cuda:N, or any other torch device: those torch checks itself when the model moves)."""
    if device == "cpu":
        return
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(field, f"cpu, cuda or cuda:N (a torch device), got {device!r}") from None
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(field, "mps (an Apple GPU) is not available here: pass --device cpu")
    if kind != "cuda":
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise ConfigError(field, f"{device}: this torch {torch.__version__} is a CPU-only build "
                                 f"(not compiled with CUDA): {FIX}")
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if count == 0:
        raise ConfigError(field, f"{device}: no CUDA GPU is visible here (no driver, or "
                                 f"CUDA_VISIBLE_DEVICES={visible!r}): pass --device cpu")
    if (torch.device(device).index or 0) >= count:
        raise ConfigError(field, f"{device}: this machine shows {count} CUDA GPU(s): pass "
                                 f"--device cuda:N with N < {count}, or --device cpu")
