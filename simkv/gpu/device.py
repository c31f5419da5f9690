"""torch, for the layers above simkv.gpu: whether it is installed and what device it sees.

Only simkv.gpu imports torch; the CLI and the validation ask here (and import nothing heavy
until they do)."""
from __future__ import annotations

from simkv.errors import InputError


def require_torch(what: str):
    """The torch module, or an InputError naming `what` needs it and how to install it."""
    try:
        import torch
    except ImportError:
        raise InputError(f"{what} needs torch: pip install -e '.[gpu]'") from None
    return torch


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def release_cuda_cache() -> None:
    """Give the caching allocator's free blocks back to the device (no-op without CUDA)."""
    if cuda_available():
        import torch
        torch.cuda.empty_cache()
