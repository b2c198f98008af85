"""Local attention kernels for interval masks and their registry (contract: `kernels/base.py`).

Backends:
    "math": `MathAttentionKernel` (pure PyTorch, any device, float32/float64 arithmetic).
    "flex": `FlexAttentionKernel` from `kernels/flex.py` (torch FlexAttention).
    "te":   `TEAttentionKernel` from `kernels/te.py` (Transformer Engine fused attention; imported
            on first use; ImportError with an install hint when Transformer Engine is missing).
    "staircase": `StaircaseAttentionKernel` from `kernels/staircase.py` (dense cuDNN rectangles for most
            of the mask + the "auto" kernel for the remainder, merged by lse; bf16/fp16 on CUDA, any
            float dtype on CPU; options: `config.StaircaseOptions`, `SplitKVConfig.staircase`).
    "fa4":  `FA4AttentionKernel` from `kernels/fa4.py` (FlashAttention-4 CuTe DSL kernels with block
            sparsity and an interval mask_mod; optional extra `fa4`; Hopper (sm90), bf16 / fp16;
            ImportError with an install hint when flash_attn.cute is missing).
    "auto": `resolve_auto_backend`: "fa4" when FlashAttention-4 is installed, imports and runs there (CUDA
            sm90 (Hopper: the verified architecture), bf16 / fp16, dtype known; an install that fails to import is skipped with a warning;
            `SplitKVConfig.auto_fa4=False` turns this off); otherwise "flex" on
            CUDA devices when it imports, the dtype is not float64 and the head dim is at least 16
            (FlexAttention's minimum in torch 2.11), else "math"; and
            "staircase" instead of "flex" when the caller passes the keys per kernel call
            (`get_kernel(..., keys_per_call=)`) and they reach `SplitKVConfig.staircase_auto_min_keys` (default
            32768) on a CUDA device where cuDNN SDPA can
            run the call (bf16/fp16, head dim a multiple of 8 and <= 256). Without keys_per_call "auto"
            never picks staircase.

Source: DESIGN.md sections 2 and 5 (arXiv 2611.05926, Split-KV); the staircase threshold: docs/kernels.md
("Staircase kernel", "auto"), measured on the H200 (staircase wins from ~32K context keys per rank).
"""

import dataclasses
import warnings

import torch

from ..config import FlexOptions, SplitKVConfig, StaircaseOptions, resolve_config
from .base import IntervalMask, half_precision_cuda_index
from . import fa4  # module reference: `fa4.fa4_runs_on` is looked up per call
from .flex import FlexAttentionKernel
from .math import MathAttentionKernel
from . import staircase
from .staircase import StaircaseAttentionKernel
from .te import TEAttentionKernel

__all__ = ["IntervalMask", "MathAttentionKernel", "get_kernel", "BACKENDS", "resolve_auto_backend",
           "staircase_runs_on", "auto_keys_per_call", "auto_backend_code", "auto_backend_text",
           "warn_ignored_options"]

BACKENDS = ("auto", "math", "flex", "te", "staircase", "fa4")
_CACHE: dict = {}


def _load(backend: str):
    if backend == "math":
        return MathAttentionKernel
    if backend == "flex":
        return FlexAttentionKernel
    if backend == "te":
        return TEAttentionKernel
    if backend == "staircase":
        return StaircaseAttentionKernel
    if backend == "fa4":
        return fa4.FA4AttentionKernel
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


_CUDNN_OK: dict = {}  # device index -> bool (capability and cuDNN version checked once per device)


def staircase_runs_on(device, dtype, head_dim=None) -> bool:
    """True when the staircase kernel's dense part (cuDNN SDPA, `aten._scaled_dot_product_cudnn_attention`)
    can run q/k/v of `dtype` with head dim `head_dim` on `device`: a CUDA device of compute capability >=
    8.0, cuDNN >= 8.9 available, cuDNN SDPA not disabled (`torch.backends.cuda.cudnn_sdp_enabled()`),
    dtype bf16 or fp16 (None: unknown -> False), head dim None or a multiple of 8 <= 256 (the kernel's own
    check). Never raises; no CUDA work beyond reading the device's properties."""
    idx = half_precision_cuda_index(device, dtype, head_dim)
    if idx is None:
        return False
    try:
        if not torch.backends.cuda.cudnn_sdp_enabled():
            return False
        if idx not in _CUDNN_OK:
            ver = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
            _CUDNN_OK[idx] = bool(ver and ver >= 8900 and torch.cuda.get_device_capability(idx) >= (8, 0))
        return _CUDNN_OK[idx]
    except (RuntimeError, AssertionError, AttributeError):  # no driver, torch without CUDA, ...
        return False


def auto_keys_per_call(impl: str, n_ctx) -> int:
    """The group-wide context-key count that decides "auto" for one op call, from the all-gathered size
    table (identical on every rank, so every rank of the CP group picks the same backend):
    "splitkv" / "ring_kv" ("ring-kv"): max(n_ctx) (each call sees one rank's context: the largest one,
    the rank that bounds the step); "allgather_kv" ("allgather-kv"): sum(n_ctx) (every call sees all).

    Args: impl: op name; n_ctx: per-rank context token counts (list of P ints). Returns: int (keys).
    Raises: ValueError for an unknown impl."""
    n = [int(x) for x in n_ctx]
    if impl in ("splitkv", "ring_kv", "ring-kv", "ring"):
        return max(n, default=0)
    if impl in ("allgather_kv", "allgather-kv"):
        return sum(n)
    raise ValueError(f"impl must be splitkv, allgather_kv or ring_kv, got {impl!r}")


def _flex_importable() -> bool:
    try:
        _load("flex")
    except ImportError:
        return False
    return True


def resolve_auto_backend(keys_per_call, device, dtype=None, head_dim=None, config: SplitKVConfig | None = None,
                         row_intervals: bool = False) -> str:
    """What backend="auto" means for one call: "math", "fa4", "flex" or "staircase".

    Rule (docs/kernels.md, "FA4 kernel", "Staircase kernel", "auto"): "math" unless the device is CUDA,
    the dtype is not float64, the head dim is None or >= 16 and flex imports; then "fa4" when
    `config.auto_fa4`, torch's deterministic algorithms are off (`fa4.deterministic_requested`: FA4's
    block-sparse backward is not deterministic) and `fa4.fa4_runs_on(device, dtype, head_dim)`
    (flash_attn.cute installed, sm90 (`fa4.VERIFIED_MAJORS`),
    bf16 / fp16: 90-97% of dense attention per useful FLOP on the H200 at 16K-64K keys, flex 66%,
    staircase 80% at 64K); else "staircase" when keys_per_call is not None,
    `config.staircase_auto_min_keys` > 0, keys_per_call >= it and `staircase_runs_on(device, dtype,
    head_dim)`; else "flex".

    Args:
        keys_per_call: context keys the kernel sees per call (int), or None (unknown: never staircase).
            Pass a GROUP-WIDE quantity (`auto_keys_per_call(impl, n_ctx)` of the all-gathered size
            table), not this rank's count: the choice is then the same on every rank of the CP group
            and for every layer of a step (same metadata).
        device: torch.device or str; dtype: q/k/v dtype (None: unknown); head_dim: D (None: unknown).
        config: the rule's inputs (`SplitKVConfig.auto_fa4`, `.staircase_auto_min_keys`); None: the defaults.
        row_intervals: the call's masks have per-row bounds (a sliding-window or causal layer,
            `IntervalMask.has_rows`): "flex" on CUDA, never "staircase" (its dense rectangles have no per-row
            bounds) and not "fa4" (its per-row mask_mod is exact in the CPU emulation but not verified on a GPU
            yet; backend="fa4" takes such masks explicitly).
    Returns: backend name.
    """
    config = resolve_config(config)
    dev_type = torch.device(device).type if device is not None else "cpu"
    if dev_type != "cuda" or dtype == torch.float64 or (head_dim is not None and head_dim < 16):
        return "math"
    if not _flex_importable():
        return "math"
    if dtype is not None and config.auto_fa4 and not row_intervals:
        # CuTe DSL is imported only on a GPU FA4 runs on (`fa4.fa4_importable`)
        if fa4.fa4_runs_on(device, dtype, head_dim) and not fa4.deterministic_requested():
            return "fa4"
    if keys_per_call is None or row_intervals:
        return "flex"
    threshold = config.staircase_auto_min_keys
    if threshold > 0 and int(keys_per_call) >= threshold and staircase_runs_on(device, dtype, head_dim):
        return "staircase"
    return "flex"


_AUTO_BASES = ("math", "flex", "fa4")  # what "auto" picks without keys_per_call: the low 2 bits of the code
_MAX_CODE_KEYS = 1 << 55  # a staircase threshold saturates here (beyond any key count; fits an int64 row)


def auto_backend_code(device, dtype, head_dim=None, config: SplitKVConfig | None = None) -> int:
    """What backend "auto" means on THIS process for calls of (device, dtype, head_dim), as one int for the ops'
    group-wide agreement rows: the index in ("math", "flex", "fa4") of `resolve_auto_backend(None, ...)`, plus 4
    x the staircase threshold (`SplitKVConfig.staircase_auto_min_keys`, saturated at 2**55) when that is "flex" and the
    staircase kernel runs here (`staircase_runs_on`), else plus 0. Equal codes resolve "auto" to the same kernel
    for every group-wide keys_per_call; codes differ where the facts differ (e.g. FlashAttention-4 installed or
    a Hopper GPU on some ranks only, `SplitKVConfig.auto_fa4`, the deterministic mode). `auto_backend_text`
    decodes it. config: None = `SplitKVConfig()`."""
    config = resolve_config(config)
    base = resolve_auto_backend(None, device, dtype, head_dim, config)
    threshold = config.staircase_auto_min_keys if base == "flex" else 0
    if threshold and not staircase_runs_on(device, dtype, head_dim):
        threshold = 0
    return _AUTO_BASES.index(base) + 4 * min(threshold, _MAX_CODE_KEYS)


def auto_backend_text(code: int) -> str:
    """`auto_backend_code` as text: "fa4", "math", "flex" or "flex, staircase from N keys per call"."""
    base, threshold = _AUTO_BASES[code & 3], code >> 2
    return f"{base}, staircase from {threshold} keys per call" if threshold else base


def get_kernel(backend: str = "auto", device=None, dtype=None, head_dim=None, keys_per_call=None,
               config: SplitKVConfig | None = None, row_intervals: bool = False):
    """Return a (cached) local kernel instance: one per (backend, device type, dtype, kernel options).

    Args:
        backend: one of "auto", "math", "flex", "te", "staircase", "fa4".
        device: torch.device (or str) the kernel will run on; decides "auto".
        dtype: input dtype; "auto" uses "math" for float64.
        head_dim: D; "auto" uses "math" when D < 16.
        keys_per_call: "auto" only: the group-wide context keys per call (`auto_keys_per_call`); with it
            "auto" may pick "staircase" (`resolve_auto_backend`); None: flex / math only.
        row_intervals: "auto" only: the masks have per-row bounds (windowed / causal layers): a kernel
            that reads them (class attribute `row_intervals`: math, flex, fa4), never staircase.
        config: `SplitKVConfig` (None: the defaults): the "auto" rule's inputs and the kernels' options
            (`config.flex` for "flex", `config.staircase` (and the config, for its remainder kernel) for
            "staircase").

    Raises:
        ValueError: unknown backend. ImportError: "flex" / "te" / "fa4" requested but not importable.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    config = resolve_config(config)
    dev_type = torch.device(device).type if device is not None else "cpu"
    if backend == "auto":
        backend = resolve_auto_backend(keys_per_call, device, dtype, head_dim, config, row_intervals)
    kwargs = {"flex": dict(options=config.flex), "staircase": dict(options=config.staircase, config=config)}
    kwargs = kwargs.get(backend, {})
    key = (backend, dev_type, dtype)  # head_dim only picks the backend; non-default options are part of the key
    if any(v != type(v)() for v in kwargs.values()):
        key += (tuple(kwargs.values()),)
    if key not in _CACHE:
        cls = _load(backend)
        try:
            _CACHE[key] = cls(**kwargs)
        except ImportError as exc:  # e.g. "te": the module imports, Transformer Engine itself is missing
            if backend != "te":
                raise
            raise ImportError(
                "backend='te' needs Transformer Engine 2.x (pip install 'megatron-splitkv[te]'; docs/kernels.md "
                f"\"Transformer Engine\"); import failed: {exc}"
            ) from exc
    return _CACHE[key]


_DEFAULT_OPTIONS = {"flex": FlexOptions(), "staircase": StaircaseOptions()}
_WARNED: set = set()  # (options field, kernel in use, the values set): each warned once per process


def _set_fields(options) -> list:
    default = _DEFAULT_OPTIONS["flex" if isinstance(options, FlexOptions) else "staircase"]
    return [f.name for f in dataclasses.fields(options) if getattr(options, f.name) != getattr(default, f.name)]


def warn_ignored_options(kernel, backend: str, device, dtype, head_dim, config: SplitKVConfig | None = None) -> None:
    """Warn (`UserWarning`, once per process for each option field, kernel and values set) when `config` sets
    kernel options that the local kernel of the call, `kernel` (what `get_kernel(backend, ...)` returned), never
    reads: `SplitKVConfig.flex` (`FlexOptions`, read by the flex kernel and by the staircase kernel's flex
    remainder) or `SplitKVConfig.staircase` (`StaircaseOptions`, read by the staircase kernel only). Options
    that "auto" may still use on this device, at another step, are not reported: FlexOptions while "auto" may
    pick flex, StaircaseOptions while it may pick staircase (`staircase_auto_min_keys` > 0 and
    `staircase_runs_on`). The message names the options set, their values, the kernel in use and what applies
    instead. No return value; nothing is raised (an option that is not used is no contradiction)."""
    config = resolve_config(config)
    fields_set = [f for f in ("flex", "staircase") if getattr(config, f) != _DEFAULT_OPTIONS[f]]
    if not fields_set:  # the common case: nothing to report
        return
    name = getattr(kernel, "name", type(kernel).__name__)
    uses = {name}
    if name == "staircase":
        uses.add(getattr(kernel.inner_kernel(device, dtype, head_dim), "name", None))
    if backend == "auto":
        base = resolve_auto_backend(None, device, dtype, head_dim, config)
        uses.add(base)
        if base == "flex" and config.staircase_auto_min_keys > 0 and staircase_runs_on(device, dtype, head_dim):
            uses.add("staircase")
    for field in fields_set:
        options = getattr(config, field)
        if field in uses:
            continue
        what = ", ".join(f"{n}={getattr(options, n)!r}" for n in _set_fields(options))
        if (field, name, what) in _WARNED:
            continue
        _WARNED.add((field, name, what))
        readers = ("the flex kernel and the staircase kernel's flex remainder" if field == "flex" else
                   "the staircase kernel")
        warnings.warn(
            f"SplitKVConfig.{field} sets {what}, but the local kernel in use is {name!r} (backend={backend!r} on "
            f"{torch.device(device).type if device is not None else 'cpu'}), which does not read "
            f"{type(options).__name__}: ignored ({type(options).__name__} applies to {readers} only); "
            f"the {name} kernel runs with its own settings", UserWarning, stacklevel=3)


# the staircase kernel's remainder kernels come from this registry (`get_kernel` looked up per call)
staircase.resolve_inner = lambda *args, **kwargs: get_kernel(*args, **kwargs)
