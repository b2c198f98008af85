"""Local attention kernels for interval masks and their registry (contract: `kernels/base.py`).

Backends:
    "math": `MathAttentionKernel` (pure PyTorch, any device, float32/float64 arithmetic).
    "flex": `FlexAttentionKernel` from `kernels/flex.py` (torch FlexAttention; imported lazily).
    "te":   `TEAttentionKernel` from `kernels/te.py` (Transformer Engine fused attention; imported
            lazily; ImportError with an install hint when Transformer Engine is missing).
    "staircase": `StaircaseAttentionKernel` from `kernels/staircase.py` (dense cuDNN rectangles for most
            of the mask + the "auto" kernel for the remainder, merged by lse; bf16/fp16 on CUDA, any
            float dtype on CPU; options from MEGATRON_SPLITKV_STAIRCASE_* env vars). Never picked by "auto".
    "auto": "flex" on CUDA devices when it imports, the dtype is not float64 and the head dim is at
            least 16 (FlexAttention's minimum in torch 2.11), else "math".

Source: DESIGN.md sections 2 and 5 (arXiv 2611.05926, Split-KV).
"""

import torch

from .base import IntervalMask
from .math import MathAttentionKernel

__all__ = ["IntervalMask", "MathAttentionKernel", "get_kernel", "BACKENDS"]

BACKENDS = ("auto", "math", "flex", "te", "staircase")
_CACHE: dict = {}


def _load(backend: str):
    if backend == "math":
        return MathAttentionKernel
    if backend == "flex":
        from .flex import FlexAttentionKernel

        return FlexAttentionKernel
    if backend == "te":
        try:
            from .te import TEAttentionKernel
        except ImportError as exc:
            raise ImportError(
                "backend='te' needs Transformer Engine 2.x (pip install 'megatron-splitkv[te]', see "
                f"/work/shared/gpu/README.md); import failed: {exc}"
            ) from exc
        return TEAttentionKernel
    if backend == "staircase":
        from .staircase import StaircaseAttentionKernel

        return StaircaseAttentionKernel
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def get_kernel(backend: str = "auto", device=None, dtype=None, head_dim=None):
    """Return a (cached) local kernel instance.

    Args:
        backend: one of "auto", "math", "flex", "te", "staircase".
        device: torch.device (or str) the kernel will run on; decides "auto".
        dtype: input dtype; "auto" uses "math" for float64.
        head_dim: D; "auto" uses "math" when D < 16.

    Raises:
        ValueError: unknown backend. ImportError: "flex"/"te" requested but not importable.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dev_type = torch.device(device).type if device is not None else "cpu"
    if backend == "auto":
        backend = "math"
        if dev_type == "cuda" and dtype != torch.float64 and (head_dim is None or head_dim >= 16):
            try:
                _load("flex")
                backend = "flex"
            except ImportError:
                pass
    key = (backend, dev_type, dtype)  # head_dim only picks the backend
    if key not in _CACHE:
        cls = _load(backend)
        try:
            _CACHE[key] = cls()
        except ImportError as exc:  # e.g. "te": the module imports, Transformer Engine itself is missing
            if backend != "te":
                raise
            raise ImportError(
                "backend='te' needs Transformer Engine 2.x (pip install 'megatron-splitkv[te]', see "
                f"/work/shared/gpu/README.md); import failed: {exc}"
            ) from exc
    return _CACHE[key]
