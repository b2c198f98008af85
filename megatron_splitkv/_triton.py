"""Triton kernels defined on first use. Triton is optional (CPU machines, some CUDA builds): a module that has a
Triton kernel and a torch path asks for the kernel when it runs and takes the torch path on None."""

from __future__ import annotations

import functools


def lazy_triton_kernel(define):
    """Decorator: `define(triton, tl)` defines and returns one `triton.jit` kernel (`tl` = triton.language). The
    decorated name becomes a function of no argument that returns that kernel, defined once on the first call
    (Triton reads its own switches, such as its CPU interpreter, when the kernel is defined), or None when
    Triton does not import."""

    @functools.cache
    def kernel():
        try:
            import triton  # noqa: PLC0415 - optional dependency, imported on first use
            import triton.language as tl  # noqa: PLC0415
        except Exception:  # noqa: BLE001 - Triton is optional (CPU, some CUDA builds)
            return None
        return define(triton, tl)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(kernel, attr, getattr(define, attr))
    return kernel
