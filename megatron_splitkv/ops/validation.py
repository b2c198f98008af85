"""Argument checks of the CP attention ops and their metadata builders, local to one rank (no collective).

- scalars: `check_block_size` (B >= 1), `check_heads_dtype` (Hq, Hkv, D >= 1, Hq % Hkv == 0; dtype bf16 / fp16
  / fp32 / fp64), `check_scale_backend` (softmax_scale None or positive finite; a known kernel name),
  `check_prepared_config` (a call's config against its metadata's);
- tensors: `check_tensors` (q [Tq, Hq, D]; k_ctx, v_ctx [Tk, Hkv, D]; k_blk, v_blk [Tq, Hkv, D] or both None;
  one dtype and device; B divides Tq), `check_tensor_against` (one tensor against a metadata's shape, dtype
  and device), `metadata_ints` / `check_metadata_tensors` (q_seq, q_anchor [nb] and kv_seq, kv_pos [Tk]: 1-D
  signed integer, to int64, values in [-2**31, 2**31) checked on the device and read on the host),
  `host_ints` (a numpy array or CPU tensor of the host-side build);
- devices and groups: `check_device` (a device this rank can allocate on), `comm_device` (the device of a
  group's collectives: the current CUDA device with NCCL), `resolve_check_group` (a gloo group holding the
  CP group's ranks in its order);
- `HostReads`: device values the host needs at the end of a prepare, read with ONE `.tolist()`.

Every check raises ValueError naming the argument (or field) and its limit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.distributed as dist

from .._ints import as_int
from ..comm import CommGroup
from ..config import SplitKVConfig
from ..kernels import BACKENDS
from .common import SUPPORTED_DTYPES

__all__ = ["INT32", "comm_device", "check_device", "usable_device", "resolve_check_group", "HostReads",
           "check_block_size", "check_heads_dtype", "check_scale_backend", "check_metadata_tensors", "metadata_ints",
           "check_own_block", "check_tensors", "check_prepared_config", "check_tensor_against", "host_ints"]


INT32 = 1 << 31


_UINT64 = getattr(torch, "uint64", None)


def comm_device(group: CommGroup, device) -> torch.device:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if group.size > 1 and dist.get_backend(group.pg) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(device, what: str = "device") -> torch.device:
    """`device` as a torch.device this rank can allocate on, a CUDA device without an index ("cuda") made the
    current one ("cuda:<torch.cuda.current_device()>", the device tensors created with "cuda" land on, so that
    the per-call device check compares equal); ValueError naming `what` otherwise (not a device, the meta
    device, CUDA missing or an index beyond this rank's GPUs). Host-side only."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} must be a torch.device or a device string, got {device!r}") from exc
    if not usable_device(dev):
        raise ValueError(f"{what}={dev} cannot hold the metadata on this rank (" + (
            "the meta device has no data" if dev.type == "meta" else
            f"{torch.cuda.device_count()} CUDA device(s) available") + ")")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def usable_device(dev: torch.device) -> bool:
    if dev.type == "meta":
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index is None or 0 <= dev.index < torch.cuda.device_count())
    return True


def resolve_check_group(check_group, group: CommGroup) -> CommGroup | None:
    """The group of the verdict rows besides the CP group `group`: None for None (the rows go over `group`),
    else `check_group` as a `comm.CommGroup` after checking that it is a torch.distributed ProcessGroup with a
    gloo (CPU) backend whose global ranks are the CP group's, in the CP group's rank order (so that row r of
    an all-gather over it is CP rank r's). Local check (no collective): a bad check_group raises on every
    rank where it is bad, so pass it on every rank of the CP group or on none (like cp_group).

    Raises:
        ValueError naming check_group and what differs (not a ProcessGroup; backend without gloo; its ranks)."""
    if check_group is None:
        return None
    if not isinstance(check_group, dist.ProcessGroup) and check_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"check_group must hold the CP group's global ranks; this rank ({dist.get_rank()}) is not "
                         "in it (torch.distributed.new_group's non-member placeholder)")
    if not isinstance(check_group, dist.ProcessGroup):
        raise ValueError(f"check_group must be None or a torch.distributed ProcessGroup (gloo), got "
                         f"{type(check_group).__name__}")
    backend = str(dist.get_backend(check_group))
    if "gloo" not in backend.lower():
        raise ValueError(f"check_group must be a gloo process group (its rows are CPU tensors), got backend "
                         f"{backend!r}: create it with torch.distributed.new_group(ranks, backend='gloo')")
    ranks = dist.get_process_group_ranks(check_group)
    want = [group.global_rank(r) for r in range(group.size)]
    if list(ranks) != want:
        raise ValueError(f"check_group must hold the CP group's global ranks in its rank order, {want}; got "
                         f"{list(ranks)}")
    return CommGroup(check_group, len(want), group.rank)


class HostReads:
    """Device values the host needs at the end of a prepare (the deferred range check, the "already
    sorted" test, the mask contract), read with ONE `.tolist()`, i.e. one host sync instead of one each.

    `add(tensors, use)`: 0-dim or 1-D tensors (bool or integer) and a callable that gets their values
    (a flat list of ints) and raises when they say so; `read()` runs the callables in the order added."""

    def __init__(self):
        self._parts, self._uses = [], []

    def add(self, tensors, use):
        tensors = [t.reshape(-1) for t in tensors]
        self._parts += tensors
        self._uses.append((sum(int(t.numel()) for t in tensors), use))

    def read(self):
        if not self._parts:
            return
        values = torch.cat(self._parts).tolist()  # bools promote to int64: one tensor, one sync
        self._parts = []
        at = 0
        for n, use in self._uses:
            use(values[at:at + n])
            at += n
        self._uses = []


class _RangeCheck:
    """The int32 range check of the metadata tensors (sequence ids and positions in [-2**31, 2**31)):
    min and max of each non-empty tensor computed on its device, checked on the host by `check` (one
    host sync) or later with other values through `HostReads` (`defer`)."""

    def __init__(self, named):
        self.names = [n for n, _ in named]
        self.parts = [b for _, t in named for b in torch.aminmax(t)]  # min, max per tensor (0-dim)

    def check(self):
        if self.parts:
            self.raise_if_bad(torch.stack(self.parts).tolist())

    def raise_if_bad(self, values, prefix=""):
        for i, n in enumerate(self.names):
            lo, hi = values[2 * i], values[2 * i + 1]
            if lo < -INT32 or hi >= INT32:
                raise ValueError(f"{prefix}{n} values must lie in [-2**31, 2**31), got range [{lo}, {hi}]")

    def defer(self, reads: HostReads, name: str):
        """Read the bounds with the other host values of the prepare (`reads`); a violation then raises
        ValueError("<name>: ..."), as the immediate check does in a size-1 group."""
        if self.parts:
            reads.add(self.parts, lambda v: self.raise_if_bad(v, f"{name}: "))

    def raise_first(self, name: str):
        """On another local error of a size-1 group: the range check comes first (as when it was not
        deferred), so raise its ValueError("<name>: ...") if it fails."""
        try:
            self.check()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc


def check_block_size(block_size) -> int:
    """block_size (B, tokens per draft block) as an int >= 1: any `__index__` integer (np.int64(16) too).

    Raises:
        ValueError: a bool, float, string or other non-integer, or a value < 1 ("block_size must be a
            positive int, got ...")."""
    return as_int(block_size, "block_size", minimum=1)


def check_heads_dtype(num_heads_q, num_heads_kv, head_dim, dtype):
    """The metadata's head counts Hq, Hkv and head_dim D (each an `__index__` integer >= 1, bool and
    float rejected; Hq % Hkv == 0) and dtype (bf16/fp16/fp32/fp64).

    Returns:
        (num_heads_q, num_heads_kv, head_dim) as Python ints.

    Raises:
        ValueError: naming the argument and its limit."""
    num_heads_q, num_heads_kv, head_dim = (as_int(v, n, minimum=1) for n, v in (
        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)))
    if num_heads_q % num_heads_kv:
        raise ValueError(f"Hq % Hkv != 0: num_heads_q={num_heads_q}, num_heads_kv={num_heads_kv}; "
                         "Hq must be a multiple of Hkv")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of bf16/fp16/fp32/fp64, got {dtype!r}")
    return num_heads_q, num_heads_kv, head_dim


def check_scale_backend(softmax_scale, backend):
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_metadata_tensors(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device):
    """Metadata tensors: 1-D integer of lengths nb, nb, tk, tk (nb/tk None: taken from q_seq/kv_seq);
    returns them as int64 on `device` (q_seq zeroed on invalid blocks). Includes the int32 range check
    (one host sync)."""
    q_seq, q_anchor, kv_seq, kv_pos, _, rng = metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device)
    rng.check()
    return q_seq, q_anchor, kv_seq, kv_pos


def metadata_ints(q_seq, q_anchor, kv_seq, kv_pos, nb, tk, device):
    """`check_metadata_tensors` without the host sync: (q_seq, q_anchor, kv_seq, kv_pos, valid, range
    check), valid = q_anchor >= 0, the `_RangeCheck` not yet read (its `check` or `defer`)."""
    def length_of(t):
        return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() == 1 else -1

    nb = length_of(q_seq) if nb is None else nb
    tk = length_of(kv_seq) if tk is None else tk
    meta = []
    for n, t, length in (("q_seq", q_seq, nb), ("q_anchor", q_anchor, nb), ("kv_seq", kv_seq, tk),
                         ("kv_pos", kv_pos, tk)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            need = f" of length {length}" if length >= 0 else ""
            raise ValueError(f"{n} must be a 1-D integer tensor{need}, got {shape}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{n} must have an integer dtype (int64), got {t.dtype}")
        if t.dtype == _UINT64:  # values >= 2**63 would wrap to negative int64 and pass the range check
            raise ValueError(f"{n} must have a signed integer dtype (int64), got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{n} must hold data, got a tensor on the meta device")
        meta.append(t.to(device=device, dtype=torch.int64))
    q_seq, q_anchor, kv_seq, kv_pos = meta
    valid = q_anchor >= 0
    q_seq = torch.where(valid, q_seq, 0)
    rng = _RangeCheck([(n, t) for n, t in (("q_seq", q_seq), ("kv_seq", kv_seq), ("kv_pos", kv_pos)) if t.numel()])
    return q_seq, q_anchor, kv_seq, kv_pos, valid, rng


def check_own_block(k_blk, v_blk):
    """k_blk and v_blk are both given or both None (no own-block part). Returns True when given."""
    if (k_blk is None) != (v_blk is None):
        raise ValueError("k_blk and v_blk must both be tensors or both be None (no own-block part), got "
                         f"k_blk {type(k_blk).__name__}, v_blk {type(v_blk).__name__}")
    return k_blk is not None


def check_tensors(q, k_ctx, v_ctx, k_blk, v_blk, block_size):
    """Shapes/dtypes/devices of the five activations (no metadata given; k_blk = v_blk = None allowed).
    Returns (nb, tk, hq, hkv, d, block_size), block_size as a Python int (`check_block_size`)."""
    names = ("q", "k_ctx", "v_ctx") + (("k_blk", "v_blk") if check_own_block(k_blk, v_blk) else ())
    tensors = (q, k_ctx, v_ctx, k_blk, v_blk)[: len(names)]
    for n, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{n} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of bf16/fp16/fp32/fp64, got {q.dtype}")
    if q.device.type == "meta":
        raise ValueError("q.device must hold data, got the meta device")
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise ValueError(f"{n}.dtype ({t.dtype}) must equal q.dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{n}.device ({t.device}) must equal q.device ({q.device})")
    tq, hq, d = q.shape
    tk, hkv, dk = k_ctx.shape
    if hkv < 1 or dk != d:
        raise ValueError(f"k_ctx.shape {tuple(k_ctx.shape)} must be [Tk_local, Hkv >= 1, D={d}]")
    if tuple(v_ctx.shape) != tuple(k_ctx.shape):
        raise ValueError(f"v_ctx.shape {tuple(v_ctx.shape)} must equal k_ctx.shape {tuple(k_ctx.shape)}")
    for n, t in zip(names[3:], tensors[3:]):
        if tuple(t.shape) != (tq, hkv, d):
            raise ValueError(f"{n}.shape {tuple(t.shape)} must be [Tq_local={tq}, Hkv={hkv}, D={d}]")
    if hq % hkv:
        raise ValueError(
            f"Hq % Hkv != 0: q has Hq={hq} heads and k_ctx Hkv={hkv}; Hq must be a multiple of Hkv"
        )
    block_size = check_block_size(block_size)
    if tq % block_size:
        raise ValueError(f"block_size={block_size} must divide q.shape[0] (Tq_local={tq})")
    return tq // block_size, tk, hq, hkv, d, block_size


#: the config fields a prepare's keyword arguments may have set: None in a call's config matches any value
_REQUEST_FIELDS = ("num_chunks", "chunk_axis", "cp_ranks_per_node")


def check_prepared_config(config, prepared: SplitKVConfig) -> None:
    """ValueError unless a call's `config` (with metadata=) is None or equals the metadata's `prepared` config
    (fields the prepare's keyword arguments set may be None in `config`), naming the first field that differs."""
    if config is None:
        return
    if not isinstance(config, SplitKVConfig):
        raise ValueError(f"config must be None or a SplitKVConfig, got {type(config).__name__}")
    for f in dataclasses.fields(SplitKVConfig):
        given, have = getattr(config, f.name), getattr(prepared, f.name)
        if given != have and not (f.name in _REQUEST_FIELDS and given is None):
            raise ValueError(f"config.{f.name}={given!r} differs from the metadata's {have!r} (the config is "
                             "fixed at prepare time: pass config=None or the config given to the prepare)")


def check_tensor_against(meta, n, t, shape):
    """ValueError unless `t` (named `n`) is a tensor of `shape` with the metadata's dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{n} must be a tensor of shape {list(shape)}, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{n}.shape {tuple(t.shape)} does not match the metadata: expected {list(shape)} on CP rank "
            f"{meta.rank} (Tq_local = n_blocks {meta.n_blocks[meta.rank]} x B {meta.block_size}, "
            f"Tk_local = {meta.tk_local}, Hq = {meta.num_heads_q}, Hkv = {meta.num_heads_kv}, D = {meta.head_dim})")
    if t.dtype != meta.dtype:
        raise ValueError(f"{n}.dtype {t.dtype} does not match the metadata's dtype {meta.dtype}")
    if t.device != meta.device:
        raise ValueError(f"{n}.device {t.device} does not match the metadata's device {meta.device}")


def host_ints(x, name: str, length: int) -> torch.Tensor:
    """A 1-D integer numpy array / tensor of `length` as an int64 CPU tensor; ValueError naming `name`."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or not np.issubdtype(x.dtype, np.integer) or x.dtype == np.uint64:
            raise ValueError(f"{name} must be a 1-D signed integer array of length {length}, got shape "
                             f"{x.shape} dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor of length {length}, got {shape}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool or x.dtype == _UINT64:
        raise ValueError(f"{name} must have a signed integer dtype (int64), got {x.dtype}")
    if x.device.type == "meta":
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    if x.shape[0] != length:
        raise ValueError(f"{name} must have length {length} (this rank's context tokens under the plan), got "
                         f"{x.shape[0]}")
    return x.to(device="cpu", dtype=torch.int64)
