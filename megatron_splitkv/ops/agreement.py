"""Rank agreement of the CP attention ops: one small int64 all-gather, and the same error on every rank.

A prepare or an op call all-gathers one [1, 12] int64 verdict row per rank (`raise_if_any`): column 0 the
byte length of this rank's local error (-1: none), columns 1-11 the row of the caller: n_blocks, n_ctx, B, Hq,
Hkv, D, the dtype code, then what the calling mode must agree on (the impl and group_check of a prepare, the resolved
softmax_scale bits (`scale_bits`) and call mode (`MODE_*`) of an op call), the chunking requests with the
layer type in one int (`request_code`), and the "auto" kernel's code (`auto_entry`) or, for a `metadata=` call,
`metadata_digest`. If any rank failed locally every rank raises ValueError (ImportError when every failure is
an ImportError) naming the ranks and their messages; if a column differs (`check_agree` on the `decoded`
table, `check_auto_agree`) every rank raises ValueError naming the field and the values by rank.

- `check_call`: a call with `metadata=` checked against it (tensor shapes, dtype, device, requests, layer type)
  and, with `group_check`, its verdict row exchanged; `check_query_gather_start` the same for
  `splitkv_start_query_gather`;
- `raise_on_every_rank`: an error found on one rank before an op call, raised on every rank of the CP group;
- `check_environment_agreement`: the `SplitKVConfig` fields that shape the collectives, compared once per
  process in a [1, 5] row (error, num_chunks, cp_ranks_per_node, chunk_axis, the "auto" kernel's code).

The rows go over the CP group on its device, or over a gloo `check_group` as CPU tensors.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from ..comm import CommGroup, all_gather, resolve_group
from ..config import CHUNK_AXES, SplitKVConfig, resolve_config
from ..kernels import BACKENDS, auto_backend_code, auto_backend_text
from ..reference import check_attention_type
from .common import SUPPORTED_DTYPES
from .metadata import (
    MAX_REQUESTED_CHUNKS,
    Plan,
    SplitKVMetadata,
    UNBOUND_MSG,
    call_plan,
    requested_axis,
    requested_chunks,
    resolve_chunk_axis,
    resolve_ranks_per_node,
    resolved_scale,
)
from .validation import (
    check_block_size,
    check_own_block,
    check_prepared_config,
    check_scale_backend,
    check_tensor_against,
    comm_device,
    resolve_check_group,
    usable_device,
)

__all__ = ["IMPL_CODE", "DTYPE_CODE", "MODE_PLAIN", "MODE_METADATA", "MODE_QUERY_GATHER", "MODE_GATHER_START",
           "scale_bits", "request_code", "decoded", "auto_entry", "check_auto_agree", "verdict_device",
           "verdict_route", "raise_if_any", "local_error", "check_agree", "CALL_AGREE", "metadata_digest",
           "check_call", "check_query_gather_start", "raise_on_every_rank", "env_request_row",
           "check_environment_agreement"]


IMPL_CODE = {"splitkv": 0, "allgather_kv": 1, "ring_kv": 2}


DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


_MAX_MSG = 1000


#: how an op call was made, exchanged in the op's agreement row (no `metadata=` / `metadata=` with
#: group_check / `metadata=` and `query_gather=` / `splitkv_start_query_gather` with group_check): a group
#: mixing them raises the same ValueError on every rank instead of hanging.
MODE_PLAIN, MODE_METADATA, MODE_QUERY_GATHER, MODE_GATHER_START = 0, 1, 2, 3


_MODE_NAMES = {MODE_PLAIN: "without metadata=", MODE_METADATA: "with metadata=",
               MODE_QUERY_GATHER: "with metadata= and query_gather=",
               MODE_GATHER_START: "splitkv_start_query_gather"}


def scale_bits(scale: float) -> int:
    """The float64 bit pattern of a (resolved) softmax scale as an int64, for the agreement rows."""
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


#: the layer type's code (`_kind_code`): the window field holds W exactly below this, a hash of W from it on
_EXACT_WINDOWS = 1 << 20


def _kind_code(window=None, causal=False) -> int:
    """The layer type (window, causal; checked, `reference.check_attention_type`) as a 22-bit code for the agreement
    rows (`request_code`): bit 0 = causal, bits 1-21 the window field: 0 = None, W itself for 1 <= W < 2**20
    (exact), 2**20 + a 20-bit blake2b hash of W for W >= 2**20 (two ranks passing different windows of >= 2**20
    tokens each agree by chance with probability 2**-20, about 1e-6; windows longer than every sequence give the
    same mask anyway)."""
    if window is None:
        field_ = 0
    elif window < _EXACT_WINDOWS:
        field_ = window
    else:
        digest = hashlib.blake2b(str(window).encode(), digest_size=4).digest()
        field_ = _EXACT_WINDOWS + int.from_bytes(digest, "little") % _EXACT_WINDOWS
    return int(causal) + (field_ << 1)


def _kind_text(code: int) -> str:
    """A `_kind_code` as the error shows it: "window=W, causal=C" (a hashed window: "window>=2**20 (hash h)")."""
    field_, causal = code >> 1, bool(code & 1)
    if field_ >= _EXACT_WINDOWS:
        return f"window>=2**20 (hash {field_ - _EXACT_WINDOWS:#x}), causal={causal}"
    return f"window={field_ or None}, causal={causal}"


def request_code(chunks_req: int, ranks_per_node: int, axis: int = 0, window=None, causal=False) -> int:
    """Column 10 of the agreement rows (a non-negative int64): the requested chunk count in the low 23 bits, the
    chunk axis code (`requested_axis`: 0 = rows, 1 = heads) in bit 23, L - 1 in bits 32-47, and the layer type's
    22-bit `_kind_code(window, causal)` with its low 15 bits in bits 48-62 and its high 7 bits in bits 24-30
    (0 for window None, causal False). Rows (axis 0) leaves the code as before."""
    kind = _kind_code(window, causal)
    return (chunks_req + (axis << 23) + ((ranks_per_node - 1) << 32) + ((kind & 0x7FFF) << 48)
            + ((kind >> 15) << 24))


def decoded(table):
    """The agreement table with four derived columns inserted after column 10 of every row: 11 = requested
    num_chunks, 12 = cp_ranks_per_node, 13 = the layer type's `_kind_code` (window / causal), 14 = the chunk
    axis code (decoded from column 10; not sent); the sent columns after 10 follow from 15 (15: `_AUTO_COL`)."""
    return [list(row[:11]) + [row[10] & MAX_REQUESTED_CHUNKS,
                         ((row[10] >> 32) & 0xFFFF) + 1, ((row[10] >> 48) & 0x7FFF) + (((row[10] >> 24) & 0x7F) << 15),
                         (row[10] >> 23) & 1] + list(row[11:])
            for row in table]


#: the decoded agreement rows' column of `kernels.auto_backend_code` (what backend "auto" resolves to on the
#: rank), sent by `prepare_splitkv_metadata` and the call without `metadata=`
_AUTO_COL = 15


#: that column's entry of a rank whose call passes an explicit backend (the call without `metadata=`): not in
#: "auto"'s agreement
_NO_AUTO = -1


def auto_entry(backend, device, dtype, head_dim, config: SplitKVConfig | None = None) -> int:
    """This rank's entry of the agreement rows' "auto" column (`check_auto_agree`): `kernels.auto_backend_code`
    for (device, dtype, head_dim) when its calls pass backend "auto" (and dtype is known), else `_NO_AUTO` (an
    explicit kernel takes no part in the check). ValueError naming backend unless it is "auto" or a name of
    `kernels.BACKENDS`."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return auto_backend_code(device, dtype, head_dim, config) if backend == "auto" and dtype is not None else _NO_AUTO


def check_auto_agree(name, table, col=_AUTO_COL):
    """Raise the same ValueError on every rank when backend "auto" resolves to different kernels across the
    group (table column `col`: `kernels.auto_backend_code` of each rank; a negative entry, `_NO_AUTO`: that
    rank does not call with "auto" and is left out), naming the kernels and the ranks: each rank would
    otherwise run its own kernel (FA4 where installed on a Hopper GPU, flex elsewhere) or raise alone. Decided
    from the gathered table only, so every rank decides the same whatever its own backend."""
    by_kernel: dict = {}
    for r, row in enumerate(table):
        if row[col] >= 0:
            by_kernel.setdefault(auto_backend_text(row[col]), []).append(r)
    if len(by_kernel) > 1:
        got = "; ".join(f"{k!r} on CP rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
                        for k, rs in by_kernel.items())
        raise ValueError(
            f"{name}: kernel backend 'auto' must resolve to the same kernel on every CP rank (same dtype and head dim); "
            f"it resolves to {got}. Make the same kernels available on every rank (FlashAttention-4 on a Hopper "
            "GPU, cuDNN), or pass SplitKVConfig(auto_fa4=False) (no fa4) and staircase_auto_min_keys=0 "
            "(no staircase) on every rank")


def verdict_device(group: CommGroup, device, err: str) -> torch.device:
    """The device of a group verdict's all-gather (`raise_if_any`): `comm_device(group, device)`, except
    on a rank that failed locally with a device it cannot use for the exchange (not a device, meta, CUDA
    missing): there the group's default (CPU with gloo, the current CUDA device with NCCL), so that its
    error reaches every rank instead of failing in the exchange on that rank alone (the others would hang)."""
    try:
        dev = comm_device(group, device)
    except (RuntimeError, TypeError, ValueError):
        return comm_device(group, None)
    return comm_device(group, None) if err and not usable_device(dev) else dev


def verdict_route(group: CommGroup, check: CommGroup | None, device) -> tuple:
    """(group, device) of a verdict row's exchange (`raise_if_any`): the check group on the CPU when there is
    one (no device tensor, no stream, no device sync), else the CP group on `device`."""
    return (group, device) if check is None else (check, torch.device("cpu"))


def raise_if_any(name: str, group: CommGroup, err: str, row: list, dev, tag: str):
    """All-gather [len(err) or -1] + row (int64) over the group; if any rank reported an error, gather
    the messages and raise the same ValueError on every rank (ImportError when every reported error is
    an ImportError: a kernel backend missing there). Returns the table (list of P rows)."""
    msg = err.encode()[:_MAX_MSG]
    head = [len(msg) if err else -1] + list(row)
    if group.size == 1:
        # a single rank's table is its own row: no device tensor, no host sync (comm_stats still records
        # the collective, of nothing: a meta tensor has no data)
        all_gather(torch.empty(1, len(head), dtype=torch.int64, device="meta"), group, tag)
        table = [head]
    else:
        table = all_gather(_device_row(head, dev)[None], group, tag).tolist()
    bad = [r for r in range(group.size) if table[r][0] >= 0]
    if bad:
        width = max(max(table[r][0] for r in bad), 1)
        buf = torch.zeros(1, width, dtype=torch.uint8, device=dev)
        if msg:
            buf[0, : len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
        texts = all_gather(buf, group, tag).cpu().tolist()
        by_msg: dict = {}
        for r in bad:
            by_msg.setdefault(bytes(texts[r][: table[r][0]]).decode(errors="replace"), []).append(r)
        parts = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items()]
        # a backend missing on some rank(s) stays an ImportError (on every rank), anything else ValueError
        cls = ImportError if all(m.startswith("ImportError: ") for m in by_msg) else ValueError
        raise cls(f"{name}: invalid input on CP rank(s) {bad}: " + "; ".join(parts))
    return table


def _device_row(values: list, dev) -> torch.Tensor:
    """An int64 row of host ints on `dev`. On CUDA through pinned memory with a non-blocking copy: a copy
    from pageable memory would synchronise the host with the GPU (PyTorch waits for the stream)."""
    dev = torch.device(dev)
    if dev.type == "cuda":
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=dev)


def local_error(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def check_agree(name, table, cols):
    """cols: (column index, description); raise when a column differs across ranks."""
    for col, what in cols:
        vals = [row[col] for row in table]
        if len(set(vals)) > 1:
            odd = [r for r, v in enumerate(vals) if v != vals[0]]
            ranks = (f"; CP rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} "
                     f"differ{'s' * (len(odd) == 1)} from rank 0")
            if what == "dtype":
                vals = [str(SUPPORTED_DTYPES[v]) for v in vals]
            if what == "impl":
                inv = {v: k for k, v in IMPL_CODE.items()}
                vals = [inv.get(v, v) for v in vals]
            if what.startswith("softmax_scale"):
                vals = [struct.unpack("<d", struct.pack("<q", v))[0] for v in vals]
            if what == "group_check":
                vals = [bool(v) for v in vals]
            if what == "window / causal":
                vals = [_kind_text(v) for v in vals]
            if what.startswith(("chunk_axis", "SplitKVConfig.chunk_axis")):
                vals = [CHUNK_AXES[v] if 0 <= v < len(CHUNK_AXES) else v for v in vals]
            if what.startswith("metadata="):
                modes = set(vals)
                vals = [_MODE_NAMES.get(v, str(v)) for v in vals]
                if modes <= {MODE_PLAIN, MODE_METADATA}:
                    raise ValueError(
                        f"{name}: every rank of the CP group must call the op the same way, all with "
                        f"metadata= or all without; got {vals} (by rank){ranks}")
                raise ValueError(
                    f"{name}: every rank of the CP group must call the op the same way: all with "
                    "splitkv_start_query_gather + splitkv_attention(..., query_gather=) or all without "
                    f"(and all with metadata= or all without); got {vals} (by rank){ranks}")
            raise ValueError(f"{name}: {what} must be the same on every CP rank; got {vals} (by rank){ranks}"
                             + (_AUTO_PIPELINE_HINT if any(w in what for w in _PIPELINE_WORDS) else ""))


#: the agreement names the Megatron integration may have set automatically (megatron.arguments.auto_pipeline /
#: auto_cp_ranks_per_node), and what to check then
_PIPELINE_WORDS = ("num_chunks", "chunk_axis", "cp_ranks_per_node")


_AUTO_PIPELINE_HINT = (" (under Megatron, unset ones are chosen from the launcher's processes per node: check that "
                       "LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE are the same on every node, or set "
                       "--splitkv-num-chunks / --splitkv-chunk-axis / --splitkv-cp-ranks-per-node)")


#: columns of the per-call agreement row (no `metadata=`, or `metadata=` with group_check): both paths
#: all-gather the same [1, 12] int64 row (as their first collective), so a group mixing them is detected.
#: 11-14 are decoded from column 10 (`decoded`; 13: the layer type, `_kind_code`).
CALL_AGREE = ((9, "metadata= use"), (3, "block_size"), (4, "Hq (q.shape[1])"), (5, "Hkv (k_ctx.shape[1])"),
               (6, "head dim D (q.shape[2])"), (7, "dtype"), (8, "softmax_scale (resolved)"),
               (11, "num_chunks (requested)"), (14, "chunk_axis"), (12, "cp_ranks_per_node"),
               (13, "window / causal"))


#: what the digest column of a `metadata=` call's verdict row covers (named when it differs across ranks)
_DIGEST_FIELD = ("metadata (its impl, per-rank size table n_blocks / n_ctx, config digest and layer type window / "
                 "causal: metadata of another step, micro-batch, layer type or CP group?)")


def metadata_digest(meta: SplitKVMetadata) -> int:
    """A 56-bit digest (a non-negative int) of what a `metadata=` call's collectives depend on beyond the
    verdict row's own columns: the impl and the per-rank size table (n_blocks, n_ctx). Equal on every rank
    of a group whose ranks hold metadata of the same prepare; compared by `check_call` so that metadata of
    a different step on one rank raises on every rank instead of mismatching the collectives' sizes. Metadata
    that carries a configuration object (a `config` attribute with `digest()`, e.g. `SplitKVConfig`) adds its
    digest: the one place where the call's agreement takes in the configuration as data. A windowed or causal
    layer type (`SplitKVMetadata.window` / `causal`) is part of it too."""
    config = getattr(meta, "config", None)
    kind = (getattr(meta, "window", None), getattr(meta, "causal", False))
    text = repr((meta.impl, tuple(int(n) for n in meta.n_blocks), tuple(int(n) for n in meta.n_ctx),
                 None if config is None else config.digest()) + ((kind,) if kind != (None, False) else ()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _metadata_row(meta: SplitKVMetadata, scale_bits: int, mode: int) -> list:
    """The verdict row of a `metadata=` call (or `splitkv_start_query_gather`) on a rank without a local error:
    this rank's sizes, B, Hq, Hkv, D, dtype, `scale_bits`, `mode`, the chunking requests with the layer type
    (`request_code`) and `metadata_digest`
    (in the column where the other rows hold the "auto" kernel: "auto" was agreed at prepare). Everything but
    `scale_bits` and `mode` depends on the metadata alone (fixed once prepared): computed on its first call and
    kept on it (the digest alone took ~0.5 ms per call on a loaded 2-core CPU; docs/lab/agreement_cost.md)."""
    fixed = meta.__dict__.get("_verdict_fixed")
    if fixed is None:
        fixed = meta.__dict__["_verdict_fixed"] = (
            [meta.tq_local // meta.block_size, meta.tk_local, meta.block_size, meta.num_heads_q, meta.num_heads_kv,
             meta.head_dim, DTYPE_CODE[meta.dtype]],
            [request_code(meta.num_chunks_requested, meta.cp_ranks_per_node, CHUNK_AXES.index(meta.chunk_axis),
                           getattr(meta, "window", None),
                           getattr(meta, "causal", False)),
             metadata_digest(meta)])
    return fixed[0] + [scale_bits, mode] + fixed[1]


def _check_call_local(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                      block_size, cp_group, softmax_scale, backend, num_chunks=None, query_gather=None,
                      cp_ranks_per_node=None, chunk_axis=None, config=None, check_group=None, window=None,
                      causal=False):
    if query_gather is not None:  # splitkv only; the handle checks q, the metadata and its own state
        check = getattr(query_gather, "_check_consume", None)
        if check is None:
            raise ValueError("query_gather must be the SplitKVQueryGather returned by "
                             f"splitkv_start_query_gather, got {type(query_gather).__name__}")
        check(meta, q)
    if not isinstance(meta, SplitKVMetadata):
        raise ValueError(f"metadata must be a SplitKVMetadata from prepare_splitkv_metadata, got "
                         f"{type(meta).__name__}")
    if not meta.bound:
        raise ValueError(UNBOUND_MSG)
    if meta.impl != name:
        raise ValueError(f"metadata was prepared for impl={meta.impl!r} but passed to {name}_attention; "
                         f"prepare it with impl={name!r}")
    for n, t, src in zip(("q_seq", "q_anchor", "kv_seq", "kv_pos"), (q_seq, q_anchor, kv_seq, kv_pos),
                         meta.sources or (None,) * 4):
        if t is not None and t is not src:
            raise ValueError(f"with metadata=, {n} must be None or the very tensor given to "
                             "prepare_splitkv_metadata (values are not re-checked per call)")
    if block_size is not None and check_block_size(block_size) != meta.block_size:
        raise ValueError(f"block_size={block_size!r} differs from the metadata's block_size={meta.block_size}")
    if cp_group is not None and cp_group is not meta.group.pg:
        raise ValueError("cp_group differs from the group the metadata was prepared with (pass None)")
    if check_group is not None and check_group is not getattr(meta.check_group, "pg", None):
        raise ValueError("check_group differs from the metadata's (given to prepare_splitkv_metadata / bind; "
                         "pass None)")
    kind = check_attention_type(window, causal)
    if kind != (getattr(meta, "window", None), getattr(meta, "causal", False)):
        raise ValueError(f"window={kind[0]!r}, causal={kind[1]!r} differ from the metadata's window="
                         f"{getattr(meta, 'window', None)!r}, causal={getattr(meta, 'causal', False)!r} (the mask "
                         "is fixed at prepare time: prepare one metadata per layer type)")
    # num_chunks: a positive int (bool, float, 0, ... raise) that resolves, i.e. clamps, to the metadata's
    # chunk count: the metadata's num_chunks or the value given to prepare_splitkv_metadata
    # (the limit: the largest block count, or Hkv for head chunks)
    limit = meta.num_heads_kv if meta.chunk_axis == "heads" else max(meta.n_blocks)
    if num_chunks is not None and max(1, min(requested_chunks(num_chunks), limit)) != meta.num_chunks:
        raise ValueError(f"num_chunks={num_chunks!r} differs from the metadata's num_chunks={meta.num_chunks} "
                         "(the chunking is fixed at prepare time: pass num_chunks to prepare_splitkv_metadata)")
    if chunk_axis is not None and resolve_chunk_axis(chunk_axis) != meta.chunk_axis:
        raise ValueError(f"chunk_axis={chunk_axis!r} differs from the metadata's chunk_axis={meta.chunk_axis!r} "
                         "(fixed at prepare time: pass chunk_axis to prepare_splitkv_metadata)")
    # cp_ranks_per_node: None, or a valid value (raises otherwise) equal to the metadata's
    if cp_ranks_per_node is not None and \
            resolve_ranks_per_node(cp_ranks_per_node, meta.group.size) != meta.cp_ranks_per_node:
        raise ValueError(f"cp_ranks_per_node={cp_ranks_per_node!r} differs from the metadata's cp_ranks_per_node="
                         f"{meta.cp_ranks_per_node} (fixed at prepare time: pass cp_ranks_per_node to "
                         "prepare_splitkv_metadata)")
    check_prepared_config(config, meta.config)
    check_scale_backend(softmax_scale, backend)
    tq, tk, hq, hkv, d = meta.tq_local, meta.tk_local, meta.num_heads_q, meta.num_heads_kv, meta.head_dim
    expect = (("q", q, (tq, hq, d)), ("k_ctx", k_ctx, (tk, hkv, d)), ("v_ctx", v_ctx, (tk, hkv, d)))
    if check_own_block(k_blk, v_blk):
        expect += (("k_blk", k_blk, (tq, hkv, d)), ("v_blk", v_blk, (tq, hkv, d)))
    for n, t, shape in expect:
        check_tensor_against(meta, n, t, shape)


def check_call(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size,
               cp_group, softmax_scale, backend, num_chunks=None, query_gather=None,
               cp_ranks_per_node=None, chunk_axis=None, config: SplitKVConfig | None = None,
               check_group=None, window=None, causal=False) -> Plan:
    """Per-call validation with `metadata=`: Python comparisons of the tensors' shapes, dtypes and
    devices against the metadata, then (group_check, the default, at P > 1) the verdict row's all-gather,
    before any data collective of the call.

    Expected on CP rank r: q [n_blocks[r] * B, Hq, D]; k_ctx, v_ctx [n_ctx[r], Hkv, D]; k_blk, v_blk
    [n_blocks[r] * B, Hkv, D] or both None (no own-block part; the metadata does not depend on it);
    dtype and device as prepared; num_chunks None or a positive int that clamps to the metadata's
    (e.g. the value given to prepare); cp_ranks_per_node None or the metadata's; config None or the
    metadata's (`check_prepared_config`: the metadata's config applies). Every rank checks against the same agreed
    size table. With `group_check=True` (the default) the verdict row (this rank's error, sizes, B, Hq, Hkv,
    D, dtype, resolved softmax_scale, call mode, the chunking requests, the layer type window / causal
    (`request_code`) and `metadata_digest`; the same
    [1, 12] int64 shape as the first collective of a call without `metadata=`, of `prepare_splitkv_metadata`
    and of `raise_on_every_rank`) is all-gathered and every rank raises the same ValueError naming the rank
    and the field (ImportError when a kernel backend is missing there); over the metadata's `check_group`
    on the CPU when it has one, else over the CP group on its device. Without it the ValueError is raised
    on that rank only, and the other ranks block in the call's first data collective (until the process
    group's timeout).

    `query_gather` (splitkv only): the `SplitKVQueryGather` of `splitkv_start_query_gather`; q must be
    the very tensor given to it, unmodified, with the same metadata, and the gather not consumed yet
    (see `SplitKVQueryGather._check_consume`). With group_check its use is part of the exchanged row
    (call mode), so a group where only some ranks pass it raises on every rank.
    """
    err, plan = "", None
    grouped = isinstance(meta, SplitKVMetadata) and meta.bound and meta.group_check and meta.group.size > 1
    try:
        _check_call_local(meta, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                          block_size, cp_group, softmax_scale, backend, num_chunks, query_gather,
                          cp_ranks_per_node, chunk_axis, config, check_group, window, causal)
        if grouped:  # the call's kernel: a backend missing on some ranks raises (ImportError) on every rank too
            plan = call_plan(meta, name, softmax_scale, backend)
    except ImportError as exc:
        err = local_error(exc)
    except ValueError as exc:
        if not grouped:
            raise ValueError(f"{name}: {exc}") from exc
        err = str(exc)
    if meta.group_check and meta.group.size > 1:
        # the same [1, 12] row layout as a call without metadata= ("<op>.meta"), so that a group
        # where some ranks pass metadata= (with group_check) and others do not raises everywhere
        mode = MODE_METADATA if query_gather is None else MODE_QUERY_GATHER
        row = [-1] * 8 + [mode, -1, -1] if err else \
            _metadata_row(meta, scale_bits(resolved_scale(softmax_scale, meta.head_dim)), mode)
        table = _metadata_verdict(name, meta, err, row, f"{name}.check")
        _check_rows_agree(name, table)
        return plan
    return call_plan(meta, name, softmax_scale, backend)


def _metadata_verdict(name, meta, err, row, tag):
    """`raise_if_any` of a call with `metadata=`: over its check group on the CPU when it has one, else over
    its CP group on the metadata's device."""
    if meta.check_group is not None:
        return raise_if_any(name, meta.check_group, err, row, torch.device("cpu"), tag)
    return raise_if_any(name, meta.group, err, row, comm_device(meta.group, meta.device), tag)


def _check_rows_agree(name, table):
    """`check_agree` of a `metadata=` call's verdict table (`CALL_AGREE` and the metadata digest). Its
    columns from 3 on hold only what must agree (0: error, 1 and 2: the rank's sizes): equal ones agree."""
    if any(row[3:] != table[0][3:] for row in table[1:]):
        check_agree(name, decoded(table), CALL_AGREE + ((_AUTO_COL, _DIGEST_FIELD),))


def check_query_gather_start(meta, q, name="splitkv_start_query_gather"):
    """Validation of `splitkv_start_query_gather(q, metadata=meta)` before its collectives: meta is a
    splitkv `SplitKVMetadata`, q a tensor of shape [Tq_local, Hq, D] with the metadata's dtype and device.
    Local ValueError (this rank only) unless the metadata has group_check, in which case the verdict
    and the call mode are all-gathered ("splitkv.check", the [1, 12] row of the op's checks) and every
    rank raises the same ValueError: also when other ranks make a different call at that point (e.g.
    the op without query_gather=)."""
    err = ""
    grouped = isinstance(meta, SplitKVMetadata) and meta.bound and meta.group_check and meta.group.size > 1
    try:
        if not isinstance(meta, SplitKVMetadata):
            raise ValueError(f"metadata must be a SplitKVMetadata from prepare_splitkv_metadata(..., "
                             f"impl='splitkv'), got {type(meta).__name__}")
        if not meta.bound:
            raise ValueError(UNBOUND_MSG)
        if meta.impl != "splitkv":
            raise ValueError(f"metadata was prepared for impl={meta.impl!r}; the query gather is Split-KV's "
                             "(prepare it with impl='splitkv')")
        check_tensor_against(meta, "q", q, (meta.tq_local, meta.num_heads_q, meta.head_dim))
    except ValueError as exc:
        if not grouped:
            raise ValueError(f"{name}: {exc}") from exc
        err = str(exc)
    if grouped:
        # softmax_scale is not known yet: 0 on every starting rank
        row = [-1] * 8 + [MODE_GATHER_START, -1, -1] if err else _metadata_row(meta, 0, MODE_GATHER_START)
        table = _metadata_verdict(name, meta, err, row, "splitkv.check")
        _check_rows_agree(name, table)


def raise_on_every_rank(name: str, cp_group, exc: Exception, device=None, check_group=None):
    """Raise `exc`, found on this rank before an op call, on EVERY rank of the CP group instead of this rank
    alone: join the other ranks' first collective of the call (every calling mode's first collective is the
    same [1, 12] int64 verdict row: "<op>.meta" of a call without `metadata=` or of `prepare_splitkv_metadata`,
    "<op>.check" of a `metadata=` call or of `splitkv_start_query_gather`) with this error, so every rank raises
    ValueError("<name>: invalid input on CP rank(s) [r]: rank r: <message>") (ImportError for an ImportError).
    `check_group`: the other ranks' verdict group (`prepare_splitkv_metadata`'s; the row goes over it on the
    CPU). One process: `exc` itself. Never returns."""
    group = resolve_group(cp_group)
    if group.size == 1:
        raise exc
    err = local_error(exc)
    via, dev = verdict_route(group, resolve_check_group(check_group, group), verdict_device(group, device, err))
    raise_if_any(name, via, err, [-1] * 11, dev, f"{name}.check")
    raise AssertionError("unreachable: the verdict row carried an error")


def env_request_row(cp_size: int, config: SplitKVConfig | None = None) -> list:
    """The op's requests of `config` (None: the defaults) as THIS process resolves them, one int each (what
    `check_environment_agreement` compares across ranks): num_chunks (0 = None), cp_ranks_per_node (resolved
    for `cp_size`) and chunk_axis (code: 0 rows, 1 heads). Raises ValueError naming a field that does not fit
    `cp_size`."""
    config = resolve_config(config)
    return [requested_chunks(None, config), resolve_ranks_per_node(None, cp_size, config),
            requested_axis(None, config)]


def check_environment_agreement(cp_group=None, device=None, *, dtype=None, head_dim=None, backend="auto",
                                config: SplitKVConfig | None = None) -> None:
    """Collective over the CP group: check that the `SplitKVConfig` fields which shape Split-KV's collectives
    resolve to the same values on every rank, and raise the same ValueError on every rank when they do not
    (or when one does not fit the group on some rank). It compares config only (the library reads no
    environment variable; the name is kept for its callers).

    `prepare_splitkv_metadata` and the call without `metadata=` agree on these values in their agreement
    row. Host-built metadata (`prepare_splitkv_metadata_from_plan` in a data worker, `bind` in the step)
    resolves them in each process without a collective (`bind` only checks that the training process resolves
    them as the building process did): ranks started with different values would issue different numbers
    or sizes of collectives in the op (gloo aborts, NCCL hangs or mixes data). Call this once per process
    after the CP group exists and before the first op call with host-built metadata (examples/pretrain_dflash.py
    does, at its first micro-batch), on every rank of the group; or build the metadata with
    `group_check=True` (a verdict exchange per call).

    Checked (`config`, None: the defaults): num_chunks, cp_ranks_per_node (as resolved for this group's
    size), chunk_axis and, with `dtype`,
    what kernel backend "auto" resolves to for calls of that dtype and head dim on `device`
    (`kernels.auto_backend_code`: FlashAttention-4, flex, staircase, math; as `prepare_splitkv_metadata` agrees
    it).

    Args:
        cp_group: the CP ProcessGroup (None: the default group when initialised, else one process).
        device: the device of the tiny all-gather (default: CPU, or the current CUDA device with NCCL), and
            the device of the op calls for the "auto" check.
        dtype, head_dim: the op calls' q/k/v dtype and head dim (dtype None: "auto" not checked on this rank).
            The "auto" resolution is computed for `device` (the op's device, also with a gloo group), else for
            the group's communication device.
        backend: the kernel the op calls pass (as `prepare_splitkv_metadata`'s): only "auto" takes part in the
            check of its resolution.

    Raises:
        ValueError("check_environment_agreement: ..."), the same on every rank: a field that does not fit the
            group on some rank (naming the rank(s) and the field), or resolving differently across ranks
            (naming the field and the values by rank).
    """
    name = "check_environment_agreement"
    group = resolve_group(cp_group)
    err, row = "", [-1] * 4
    try:
        requests = env_request_row(group.size, config)
        op_device = comm_device(group, None) if device is None else torch.device(device)
        row = requests + [auto_entry(backend, op_device, dtype, head_dim, config)]
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        err = local_error(exc)
    table = raise_if_any(name, group, err, row, comm_device(group, device), "splitkv.check")
    # columns: 0 = the error length, then the row
    check_agree(name, table, ((1, "SplitKVConfig.num_chunks (requested num_chunks, 0 = None)"),
                               (2, "SplitKVConfig.cp_ranks_per_node (cp_ranks_per_node)"),
                               (3, "SplitKVConfig.chunk_axis (chunk_axis)")))
    check_auto_agree(name, table, col=4)
