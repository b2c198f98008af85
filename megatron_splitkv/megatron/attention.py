"""Split-KV core attention for Megatron-Core 0.19 and the DFlash metadata object it reads.

Two public pieces:

* `DFlashPackedSeqParams`: a subclass of Megatron-Core's `PackedSeqParams` that carries the DFlash mask
  metadata (query blocks' sequence ids and anchors; local context tokens' sequence ids and global
  positions). `packed_seq_params` is the one per-batch object that Megatron-Core 0.19 already threads
  from `TransformerBlock.forward` -> `TransformerLayer.forward` -> `Attention.forward` ->
  `core_attention(...)`, so the metadata travels through the block without globals.
* `SplitKVCoreAttention`: a core-attention module honouring Megatron-Core 0.19's contract
  (`megatron/core/transformer/attention.py`, `CoreAttentionBuilder` / `CoreAttentionInterface`): built
  with `config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
  pg_collection`, called with `(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
  packed_seq_params)`; sbhd and thd layouts. Its context-parallel implementation is chosen at build
  time: `splitkv` (query-sized communication), `allgather-kv` or `ring-kv` (baselines).

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1, 2 and 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .._ints import as_int
from ..comm import resolve_group
from ..config import SplitKVConfig, resolve_config
from ..ops import (
    SplitKVQueryGather,
    allgather_kv_attention,
    prepare_splitkv_metadata,
    ring_kv_attention,
    splitkv_attention,
    splitkv_start_query_gather,
)
from ..ops.agreement import raise_on_every_rank
from ..ops.metadata import SplitKVMetadata
from ..ops.validation import check_prepared_config
from .arguments import CP_IMPLS
from .check_groups import cp_check_group

__all__ = [
    "CP_IMPLS",
    "DFlashPackedSeqParams",
    "DFlashQueryGather",
    "SplitKVCoreAttention",
    "resolve_cp_attention_fn",
]

_OPS = {
    "splitkv": splitkv_attention,
    "allgather-kv": allgather_kv_attention,
    "ring-kv": ring_kv_attention,
}


def kind_kwargs(window: Optional[int], causal: bool) -> dict:
    """The ops' `window=` / `causal=` keywords of a layer kind; {} for the default kind (no window, not
    causal), so that a call of a full-attention layer is the plain one."""
    return {} if window is None and not causal else {"window": window, "causal": bool(causal)}


#: plain cross-attention as DFlash metadata: the anchor of a query row that sees every context key of
#: its sample (positions are < 2**31 - 1), and the sequence id of masked-out keys (no query has it).
CROSS_SEE_ALL_ANCHOR = 2**31 - 1
CROSS_MASKED_SEQ = -1


# --------------------------------------------------------------------------------------------------
# Metadata object
# --------------------------------------------------------------------------------------------------


@dataclass
class DFlashPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` carrying the DFlash drafter mask metadata of one CP rank's micro-batch.

    Pass it as `packed_seq_params=` to `TransformerBlock.forward` (or to `DFlashAttention` /
    `SplitKVCoreAttention` directly); every DFlash layer reads the same object.

    Token order ("flattened order"): tokens are numbered sample-major, i.e. an sbhd tensor
    `[s, b, ...]` is read as `x.transpose(0, 1).reshape(b * s, ...)` (b = 1 is the usual drafter case,
    where this is simply the sequence order); a thd tensor `[t, ...]` is read as is.

    Fields (all int64 tensors on the activations' device; the inherited `PackedSeqParams` fields stay
    unused except `qkv_format`):
        q_seq: [n_blocks_local] sequence id of each local query block.
        q_anchor: [n_blocks_local] anchor position a_b of each block; `< 0` marks an invalid (padding)
            block, which sees nothing (its rows output 0).
        kv_seq: [Tk_local] sequence id of each local context token (flattened order).
        kv_pos: [Tk_local] GLOBAL position of each local context token (also its RoPE position).
        block_size: B, query tokens per block; the local query length must be n_blocks_local * B.
        qkv_format: "sbhd" (default) or "thd".

    Every CP rank holds the same number of query blocks (pad with invalid blocks); context shards may
    have any length, including 0. Query block b's tokens have positions `a_b + 0 .. B-1`.

    With sbhd and b > 1 the blocks and context tokens are numbered in that flattened order: sample i's
    query tokens are rows `i * sq .. (i + 1) * sq - 1` (blocks `i * sq / B ..`, so sq should be a
    multiple of B) and its context tokens rows `i * sk_ctx ..` of kv_seq / kv_pos; the metadata itself
    says which sequence each block and context token belongs to.

    Per-step op metadata (`op_metadata`): every drafter layer of a step calls the CP op with this same
    object, so the op's mask metadata (`megatron_splitkv.ops.prepare_splitkv_metadata`: validation,
    size/metadata all-gathers, context sort, key intervals, the cached FlexAttention BlockMask) is built
    ONCE, by the first layer's call, cached on this instance (keyed by cp_impl, Hq, Hkv, D, dtype,
    device and the CP group) and passed as `metadata=` by every later layer (no host sync, no metadata
    collective per layer). Consequently q_seq, q_anchor, kv_seq, kv_pos and block_size must not be
    modified (in place or by reassignment) after the first layer's call: build a new
    `DFlashPackedSeqParams` per micro-batch instead. Activation recompute reuses the cached metadata.

    Metadata built ahead (`metadata`): a BOUND Split-KV `SplitKVMetadata` of this micro-batch, e.g. built
    in a data-loader worker with `ops.prepare_splitkv_metadata_from_plan` and bound in the step with
    `meta.bind(cp_group, device)` (examples/pretrain_dflash.py, docs/megatron.md "Data pipeline"). Every
    layer (and the early query gather) then uses it instead of preparing (no collective, no host sync);
    `op_metadata` checks that it matches the layer (impl, CP group, block size, Hq / Hkv per TP rank, head
    dim, dtype, device, local block and context counts; ValueError naming what differs). The caller
    guarantees that it describes THIS micro-batch (with the metadata's config.debug_checks its q_anchor /
    kv_seq / kv_pos and q_seq on valid blocks are compared with this object's, one host sync per layer).

    Errors: `validate()` raises ValueError on shape/dtype mismatches.
    Source: DESIGN.md section 1 (DFlash mask), arXiv 2611.05926.
    """

    q_seq: Tensor = None
    q_anchor: Tensor = None
    kv_seq: Tensor = None
    kv_pos: Tensor = None
    block_size: int = None
    metadata: SplitKVMetadata = None
    # per-step cache of the ops' SplitKVMetadata (see `op_metadata`); not part of the constructor
    _op_metadata: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        super().__post_init__()

    @property
    def num_blocks(self) -> int:
        """Local number of query blocks."""
        return int(self.q_seq.numel())

    @property
    def num_query_tokens(self) -> int:
        """Local number of query tokens, n_blocks_local * block_size."""
        return self.num_blocks * int(self.block_size)

    @property
    def num_ctx_tokens(self) -> int:
        """Local number of context tokens."""
        return int(self.kv_seq.numel())

    def query_positions(self) -> Tensor:
        """[n_blocks_local * B] int64 global positions of the query tokens, `a_b + i`
        (invalid blocks get positions 0 .. B-1; they see nothing anyway)."""
        B = int(self.block_size)
        anchor = self.q_anchor.clamp(min=0)
        offs = torch.arange(B, device=anchor.device, dtype=torch.int64)
        return (anchor[:, None] + offs[None, :]).reshape(-1)

    def op_metadata(self, cp_impl: str, *, num_heads_q: int, num_heads_kv: int, head_dim: int,
                    dtype: torch.dtype, device, cp_group=None, backend: str = "auto",
                    config: Optional[SplitKVConfig] = None, window: Optional[int] = None,
                    causal: bool = False, check_group=None) -> SplitKVMetadata:
        """The CP op's `SplitKVMetadata` for this micro-batch, prepared on the first call (collective:
        every rank of `cp_group` calls it, as every rank runs the same layers) with
        `prepare_splitkv_metadata(q_seq, q_anchor, kv_seq, kv_pos, block_size=..., impl=cp_impl, ...)`
        and returned from the cache on this instance by later calls with the same key (cp_impl,
        num_heads_q, num_heads_kv, head_dim, dtype, device, id(cp_group)). Pass it to the op as
        `metadata=` (with q_seq, q_anchor, kv_seq, kv_pos, block_size, cp_group left None). `backend`: the
        kernel the calls pass (prepare's `backend`: only "auto" takes part in the group-wide check of what
        "auto" resolves to). `config`: the layer's `SplitKVConfig` (prepare's `config`; None: the defaults).
        `check_group`: the gloo mirror of cp_group (prepare's `check_group`, `check_groups.cp_check_group`; part
        of the key) or None.
        `window`, `causal`: the layer's attention kind (prepare's; `layer_types`): part of the key, so a model
        that mixes layer kinds holds one metadata per distinct (window, causal) and step, each layer taking its
        own; only the first kind is prepared (collective), the others are derived from it without a collective
        (`SplitKVMetadata.with_attention_type`; ring-kv, whose masks need the other ranks' keys, prepares each).

        The cached metadata holds validated copies/views of the four index tensors: they must not be
        modified in place after the first call. Errors: those of `prepare_splitkv_metadata` (ValueError
        on every rank of the group).

        With `self.metadata` (bound metadata built ahead): returns it, after `check_metadata` against this
        call (ValueError "DFlashPackedSeqParams.metadata ... : <field> ..." naming what differs; the same
        on every rank, before any collective); nothing is prepared: a layer of another kind gets
        `self.metadata.with_attention_type(window, causal)` (no collective)."""
        device = torch.device(device)
        config = resolve_config(config)
        base = (cp_impl, int(num_heads_q), int(num_heads_kv), int(head_dim), dtype, device, id(cp_group),
                config.digest(), id(check_group))
        key = base + ((window, bool(causal)),)
        meta = self._op_metadata.get(key)
        if meta is None and self.metadata is not None:  # built ahead for one kind: the others derived from it
            self.check_metadata(cp_impl, num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, head_dim=head_dim,
                                dtype=dtype, device=device, cp_group=cp_group, config=config,
                                window=self.metadata.window, causal=self.metadata.causal,
                                check_group=check_group)
            meta = self._op_metadata[key] = self.metadata.with_attention_type(window, causal)
        if meta is None:  # the metadata references cp_group, so id(cp_group) cannot be reused meanwhile
            sibling = next((m for k, m in self._op_metadata.items() if k[:-1] == base), None)
            if sibling is not None and cp_impl != "ring-kv":  # another layer kind of this step: no collective
                meta = sibling.with_attention_type(window, causal)
            else:
                meta = prepare_splitkv_metadata(
                    self.q_seq, self.q_anchor, self.kv_seq, self.kv_pos, block_size=int(self.block_size),
                    num_heads_q=int(num_heads_q), num_heads_kv=int(num_heads_kv), head_dim=int(head_dim),
                    dtype=dtype, cp_group=cp_group, impl=cp_impl, device=device, backend=backend, config=config,
                    check_group=check_group, **kind_kwargs(window, causal),
                )
            self._op_metadata[key] = meta
        return meta

    def check_metadata(self, cp_impl: str, *, num_heads_q: int, num_heads_kv: int, head_dim: int,
                       dtype: torch.dtype, device, cp_group=None, config: Optional[SplitKVConfig] = None,
                       window: Optional[int] = None, causal: bool = False, check_group=None) -> None:
        """Raise ValueError unless `self.metadata` (bound metadata built ahead) fits a layer call with
        these arguments: a bound `SplitKVMetadata` of impl `cp_impl` (splitkv), bound to `cp_group` (the
        same process group object; None: the default group / one process), with this block size, Hq, Hkv
        (per TP rank), head dim, dtype, device, this rank's query block / context token counts, its check
        group (`bind(..., check_group=)`: the layer's `check_group`, None or the same group object), the
        layer's `config` (None: the defaults; fields set by the build's keyword arguments excepted), and the
        layer's attention kind (`window`, `causal`; metadata built ahead holds one kind). Local
        checks only (no collective, no host sync; with the metadata's `config.debug_checks` also the index
        values, one host sync)."""
        meta, where = self.metadata, "DFlashPackedSeqParams.metadata"
        if not isinstance(meta, SplitKVMetadata):
            raise ValueError(f"{where} must be a bound SplitKVMetadata (prepare_splitkv_metadata_from_plan(...)"
                             f".bind(cp_group, device)), got {type(meta).__name__}")
        if not meta.bound:
            raise ValueError(f"{where} is not bound to a CP group yet: pass meta.bind(cp_group, device) "
                             "(the unbound metadata of prepare_splitkv_metadata_from_plan)")
        if cp_impl != "splitkv":
            raise ValueError(f"{where}: metadata built ahead is Split-KV's, but this layer runs "
                             f"--context-parallel-impl {cp_impl}")
        group = resolve_group(cp_group)
        got_g, want_g = meta.group, group
        diffs = []
        if meta.impl != "splitkv":
            diffs.append(f"impl {meta.impl!r} (layer: 'splitkv')")
        if (got_g.pg is not want_g.pg) or (got_g.size, got_g.rank) != (want_g.size, want_g.rank):
            other = ", another group object" if got_g.pg is not want_g.pg else ""
            diffs.append(f"CP group (size {got_g.size}, rank {got_g.rank}{other}; layer: size {want_g.size}, "
                         f"rank {want_g.rank})")
        if getattr(meta.check_group, "pg", None) is not check_group:
            diffs.append(f"check_group ({'none' if meta.check_group is None else 'a gloo group'}; layer: "
                         f"{'none' if check_group is None else 'its CP group mirror'}: bind with "
                         "check_group=megatron_splitkv.megatron.cp_check_group(cp_group))")
        for name, got, want in (("block_size", meta.block_size, int(self.block_size)),
                                ("num_heads_q (Hq per TP rank)", meta.num_heads_q, int(num_heads_q)),
                                ("num_heads_kv (Hkv per TP rank)", meta.num_heads_kv, int(num_heads_kv)),
                                ("head_dim", meta.head_dim, int(head_dim)),
                                ("dtype", meta.dtype, dtype),
                                ("device", torch.device(meta.device), torch.device(device)),
                                ("window", meta.window, window),
                                ("causal", bool(meta.causal), bool(causal))):
            if got != want:
                diffs.append(f"{name} {got} (layer: {want})")
        try:
            check_prepared_config(resolve_config(config), meta.config)
        except ValueError as exc:
            diffs.append(str(exc))
        if not diffs:
            r = meta.group.rank
            for name, got, want in (("query blocks of this rank", meta.n_blocks[r], self.num_blocks),
                                    ("context tokens of this rank", meta.n_ctx[r], self.num_ctx_tokens)):
                if got != want:
                    diffs.append(f"{name} {got} (this micro-batch: {want})")
        if diffs:
            raise ValueError(f"{where} does not match this layer / micro-batch: " + "; ".join(diffs)
                             + " (build it with the layer's shapes: MetadataSpec / splitkv_metadata_spec)")
        if meta.config.debug_checks:
            valid = self.q_anchor >= 0
            same = (torch.equal(meta.q_anchor, self.q_anchor) and torch.equal(meta.kv_seq, self.kv_seq)
                    and torch.equal(meta.kv_pos, self.kv_pos)
                    and torch.equal(meta.q_seq[valid], self.q_seq[valid]))
            if not same:
                raise ValueError(f"{where} describes another micro-batch: its q_seq / q_anchor / kv_seq / kv_pos "
                                 "differ from this DFlashPackedSeqParams' (SplitKVConfig.debug_checks)")

    def validate(self) -> None:
        """Raise ValueError when the metadata is inconsistent."""
        for name in ("q_seq", "q_anchor", "kv_seq", "kv_pos"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise ValueError(f"DFlashPackedSeqParams.{name} must be a 1-D int64 tensor, got {t!r}")
            if t.dtype != torch.int64:
                raise ValueError(f"DFlashPackedSeqParams.{name} must be int64, got {t.dtype}")
        if self.q_seq.numel() != self.q_anchor.numel():
            raise ValueError("DFlashPackedSeqParams: q_seq and q_anchor must have the same length")
        if self.kv_seq.numel() != self.kv_pos.numel():
            raise ValueError("DFlashPackedSeqParams: kv_seq and kv_pos must have the same length")
        self.block_size = as_int(self.block_size, "DFlashPackedSeqParams.block_size", minimum=1)
        if self.qkv_format not in ("sbhd", "thd"):
            raise ValueError(f"DFlashPackedSeqParams.qkv_format must be 'sbhd' or 'thd', got {self.qkv_format!r}")


# --------------------------------------------------------------------------------------------------
# Op resolution
# --------------------------------------------------------------------------------------------------


def resolve_cp_attention_fn(cp_impl: str) -> Callable:
    """The DFlash attention op for `cp_impl` in CP_IMPLS: `megatron_splitkv.splitkv_attention`,
    `allgather_kv_attention` or `ring_kv_attention` (signature documented in DESIGN.md section 2).

    Raises ValueError naming `--context-parallel-impl` for an unknown implementation."""
    if cp_impl not in CP_IMPLS:
        raise ValueError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
    return _OPS[cp_impl]


def _layer_kind(layer_attention, layer_number: int, num_layers: int) -> tuple:
    """(window, causal) of Megatron layer `layer_number` (1-based, global) from a per-layer table (None: the
    default kind). ValueError naming --dflash-layer-types when the table does not have num_layers entries."""
    if layer_attention is None:
        return None, False
    table = tuple(layer_attention)
    if len(table) != num_layers:
        raise ValueError(f"--dflash-layer-types has {len(table)} layer kinds (layer_attention), the model has "
                         f"{num_layers} layers (--num-layers): give one per layer")
    window, causal = table[layer_number - 1]
    return window, bool(causal)


@dataclass(eq=False)
class DFlashQueryGather:
    """The query all-gather of one DFlash layer started early by `SplitKVCoreAttention.start_query_gather`
    (Split-KV only): `query` is the tensor given to it (the layer passes the very same tensor to the core
    attention call), `q` its flattened [Tq_local, Hq, D] view that the op gathers, `gather` the op's
    `SplitKVQueryGather`. `discard()` releases it unconsumed (the layer calls it when computing k/v
    raises)."""

    query: Tensor
    q: Tensor
    gather: SplitKVQueryGather
    params: "DFlashPackedSeqParams"

    def discard(self) -> None:
        self.gather.discard()


# --------------------------------------------------------------------------------------------------
# Core attention module
# --------------------------------------------------------------------------------------------------


class SplitKVCoreAttention(MegatronModule):
    """Context-parallel core attention for cross-attention-shaped workloads (Lq << Lk).

    Construction (Megatron-Core 0.19 `CoreAttentionBuilder`): `config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection`, plus `cp_impl` (bind it with
    `functools.partial` in a spec; see `megatron_splitkv.megatron.specs.splitkv_core_attention`).
    The CP group is `pg_collection.cp`, else `parallel_state.get_context_parallel_group()`.
    `cp_comm_type` is ignored (the implementation is chosen by `cp_impl`). `splitkv_config`: the op's
    `SplitKVConfig` (None: the defaults), given to every op call and metadata prepare of the layer.
    `layer_attention`: None (every layer full attention, non-causal), or one (window, causal) per layer of the
    model (`megatron_splitkv.layer_types`, `arguments.layer_attention_from_args`); this layer runs entry
    `layer_number - 1` (Megatron's global 1-based layer number, so pipeline stages pick their own), stored as
    `self.window` / `self.causal` and given to the op's metadata (DFlash mode only). ValueError naming
    `--dflash-layer-types` when its length is not config.num_layers.

    Call: `forward(query, key, value, attention_mask, *, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None, query_gather=None)` with heads already split by TP:

    * DFlash mode (`packed_seq_params` is a `DFlashPackedSeqParams`): sbhd query `[sq, b, Hq_tp, D]`,
      key/value `[sk_ctx + sq, b, Hkv_tp, D]` = `[context keys | block keys]` concatenated along the
      sequence (sk_ctx = Tk_local / b), or thd query `[t, Hq_tp, D]`, key/value `[Tk_local + t, Hkv_tp, D]`.
      The mask is the DFlash mask (DESIGN.md section 1) built from the metadata; the CP algorithm is
      `cp_impl` (Split-KV exact merge, all-gather-KV or ring-KV). The op's metadata is prepared once
      per `packed_seq_params` object and reused by every layer (`DFlashPackedSeqParams.op_metadata`).
    * Plain cross-attention (Megatron's `CrossAttention`, `packed_seq_params=None`): sbhd query
      `[sq_local, b, Hq, D]`, key/value `[sk_local, b, Hkv, D]`, both sequence-sharded over CP; every
      query sees every key of its sample (optionally minus `attention_mask` [b, 1, 1|sq, sk_local],
      True = masked, Megatron's convention). Computed by the `cp_impl` op without own-block part
      (`k_blk = v_blk = None`; see `_cross`); rows whose sample has no visible key output 0.

    Returns sbhd `[sq, b, Hq_tp * D]` or thd `[t, Hq_tp * D]`, dtype of `query`.

    Early query all-gather (Split-KV, DFlash mode; docs/lab/perf-notes.md item 3): a layer that computes its
    queries before its keys/values calls `handle = core_attention.start_query_gather(query,
    packed_seq_params)` right after q (projection, q-norm, RoPE) and passes `query_gather=handle` (a
    keyword argument beyond Megatron's core-attention contract; None or absent = the plain call) with the
    SAME query tensor to the call above, after computing k/v. The Q all-gather then overlaps the k/v
    projections in forward, and the dQ all-to-all their backward. `start_query_gather` returns None
    when there is nothing to overlap (impl other than splitkv, no DFlash metadata, CP size 1); passing
    None is the plain call. `DFlashAttention` does this unless built with `overlap_query_gather=False`.

    Errors: NotImplementedError for `attention_bias`, causal masks in plain mode; ValueError for
    inconsistent shapes/metadata, or a `query_gather` started for another query / params / impl.
    Source: Megatron-Core 0.19 `attention.py` contract; arXiv 2611.05926.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: Optional[str] = None,
        softmax_scale: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_impl: str = "splitkv",
        kernel_backend: str = "auto",
        splitkv_config: Optional[SplitKVConfig] = None,
        layer_attention=None,
        **unused,
    ):
        super().__init__(config=config)
        if cp_impl not in CP_IMPLS:
            raise ValueError(f"--context-parallel-impl must be one of {CP_IMPLS}, got {cp_impl!r}")
        if config.attention_dropout:
            raise ValueError(
                "SplitKVCoreAttention does not implement attention dropout: set --attention-dropout 0 "
                f"(config.attention_dropout={config.attention_dropout})"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale
        self.cp_impl = cp_impl
        self.kernel_backend = kernel_backend
        self.splitkv_config = resolve_config(splitkv_config)
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp is None and parallel_state.model_parallel_is_initialized():
            cp = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp
        self.window, self.causal = _layer_kind(layer_attention, layer_number, config.num_layers)

    def _check_group(self):
        """The gloo mirror of the CP group (`check_groups.create_cp_check_groups`) over which the ops exchange
        their verdict rows on the host, or None (then over the CP group itself)."""
        return cp_check_group(self.cp_group) if self._cp_size() > 1 else None

    def _scale(self, d: int) -> float:
        return 1.0 / math.sqrt(d) if self.softmax_scale is None else self.softmax_scale

    def _cp_size(self) -> int:
        if self.cp_group is None:
            return 1
        return dist.get_world_size(self.cp_group) if dist.is_initialized() else 1

    def start_query_gather(self, query: Tensor, packed_seq_params, *, num_heads_kv: int) -> Optional[DFlashQueryGather]:
        """Start this call's Split-KV query all-gather before the k/v projections (see the class
        docstring). `query`: exactly what will be passed as `query` to `forward` (sbhd [sq, b, Hq_tp, D]
        or thd [t, Hq_tp, D]); `num_heads_kv`: Hkv per TP rank of the key/value that will follow (it
        keys the per-step metadata, `DFlashPackedSeqParams.op_metadata`, which this call prepares when
        it is the step's first: collective over the CP group, as the first layer's call is anyway).

        Returns a `DFlashQueryGather` to pass as `forward(..., query_gather=)`, or None when there is
        nothing to overlap: cp_impl is not splitkv, `packed_seq_params` is not DFlash metadata, or the
        CP group has one rank. Errors: those of `forward` for the query's shape, and of
        `splitkv_start_query_gather`."""
        if self.cp_impl != "splitkv" or not isinstance(packed_seq_params, DFlashPackedSeqParams):
            return None
        if self._cp_size() == 1:
            return None
        params = packed_seq_params
        params.validate()
        q = self._flat_query(query, params)
        meta = params.op_metadata(
            self.cp_impl, num_heads_q=q.shape[1], num_heads_kv=num_heads_kv, head_dim=q.shape[2],
            dtype=q.dtype, device=q.device, cp_group=self.cp_group, backend=self.kernel_backend,
            config=self.splitkv_config, window=self.window, causal=self.causal, check_group=self._check_group(),
        )
        return DFlashQueryGather(query=query, q=q, gather=splitkv_start_query_gather(q, metadata=meta),
                                 params=params)

    @staticmethod
    def _flat_query(query: Tensor, params: "DFlashPackedSeqParams") -> Tensor:
        """DFlash mode: the op's q [Tq_local, Hq, D] from sbhd [sq, b, H, D] (sample-major flattening)
        or thd [t, H, D] ([t, 1, H, D] tolerated). ValueError on a wrong rank or query token count."""
        if params.qkv_format == "sbhd":
            if query.dim() != 4:
                raise ValueError(f"sbhd query must be [s, b, h, d], got {tuple(query.shape)}")
            q = query.transpose(0, 1).reshape(-1, query.shape[2], query.shape[3])
        else:
            q = query.squeeze(1) if query.dim() == 4 else query
        if q.shape[0] != params.num_query_tokens:
            raise ValueError(
                f"query tokens {q.shape[0]} != n_blocks {params.num_blocks} x block_size {params.block_size}"
            )
        return q

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        query_gather: Optional[DFlashQueryGather] = None,
        **unused,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SplitKVCoreAttention does not support attention_bias")
        if isinstance(packed_seq_params, DFlashPackedSeqParams):
            return self._dflash(query, key, value, packed_seq_params, query_gather)
        if query_gather is not None:
            raise ValueError("query_gather= needs DFlash packed_seq_params (it was started for them)")
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SplitKVCoreAttention: packed_seq_params must be DFlashPackedSeqParams or None "
                f"(got {type(packed_seq_params).__name__})"
            )
        return self._cross(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type)

    def _dflash(self, query, key, value, params: DFlashPackedSeqParams, query_gather=None) -> Tensor:
        try:
            q, k_ctx, v_ctx, k_blk, v_blk, sbhd = self._dflash_inputs(query, key, value, params, query_gather)
        except ValueError as exc:  # the other ranks are in the op's first collective: join it with the error
            raise_on_every_rank("SplitKVCoreAttention", self.cp_group, exc,
                                query.device if isinstance(query, Tensor) else None, self._check_group())
        fn = resolve_cp_attention_fn(self.cp_impl)
        # built by the first layer of the step, reused by the others (see DFlashPackedSeqParams)
        meta = params.op_metadata(
            self.cp_impl, num_heads_q=q.shape[1], num_heads_kv=k_ctx.shape[1], head_dim=q.shape[2],
            dtype=q.dtype, device=q.device, cp_group=self.cp_group, backend=self.kernel_backend,
            config=self.splitkv_config, window=self.window, causal=self.causal, check_group=self._check_group(),
        )
        extra = kind_kwargs(self.window, self.causal)  # the layer kind: the metadata's, checked by the op
        if query_gather is not None:
            extra["query_gather"] = query_gather.gather
        out = fn(q, k_ctx, v_ctx, k_blk, v_blk, softmax_scale=self._scale(q.shape[-1]),
                 backend=self.kernel_backend, metadata=meta, **extra)
        width = q.shape[1] * q.shape[2]  # explicit: a CP rank may hold zero query blocks (0 rows)
        if sbhd is not None:
            out = out.reshape(*sbhd, width).transpose(0, 1).contiguous()
        else:
            out = out.reshape(out.shape[0], width)
        return out

    def _dflash_inputs(self, query, key, value, params: DFlashPackedSeqParams, query_gather=None) -> tuple:
        """(q, k_ctx, v_ctx, k_blk, v_blk, sbhd) of a DFlash call: the op's tensors and (b, sq) for sbhd (None:
        thd), after this rank's checks of the layouts against `params` (ValueError naming the mismatch)."""
        params.validate()
        fmt = params.qkv_format
        if query_gather is not None:
            if not isinstance(query_gather, DFlashQueryGather):
                raise ValueError("query_gather must be the DFlashQueryGather returned by start_query_gather, "
                                 f"got {type(query_gather).__name__}")
            if query_gather.query is not query or query_gather.params is not params:
                raise ValueError("query_gather was started for another query tensor or packed_seq_params: pass "
                                 "the very query given to start_query_gather (and the same params)")
            if self.cp_impl != "splitkv":
                raise ValueError(f"query_gather= is Split-KV's; this core attention runs {self.cp_impl}")
        if fmt == "sbhd":
            if query.dim() != 4:
                raise ValueError(f"sbhd query must be [s, b, h, d], got {tuple(query.shape)}")
            sq, b = query.shape[0], query.shape[1]
            n_ctx_total = params.num_ctx_tokens
            if n_ctx_total % b:
                raise ValueError(f"kv_seq length {n_ctx_total} not divisible by batch {b}")
            sk_ctx = n_ctx_total // b
            if key.shape[0] != sk_ctx + sq:
                raise ValueError(
                    f"key length {key.shape[0]} != context {sk_ctx} + block tokens {sq} (per sample)"
                )

            def flat(x):  # [s, b, h, d] -> [b*s, h, d] (sample-major)
                return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])

            q = flat(query) if query_gather is None else query_gather.q  # the tensor being gathered
            k_ctx, k_blk = flat(key[:sk_ctx]), flat(key[sk_ctx:])
            v_ctx, v_blk = flat(value[:sk_ctx]), flat(value[sk_ctx:])
        else:
            if query.dim() == 4:  # [t, 1, h, d] tolerated
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            if query_gather is not None:
                query = query_gather.q  # the tensor being gathered (same values)
            t = query.shape[0]
            n_ctx = params.num_ctx_tokens
            if key.shape[0] != n_ctx + t:
                raise ValueError(f"key length {key.shape[0]} != context {n_ctx} + block tokens {t}")
            q, k_ctx, k_blk = query, key[:n_ctx], key[n_ctx:]
            v_ctx, v_blk = value[:n_ctx], value[n_ctx:]
        if q.shape[0] != params.num_query_tokens:
            raise ValueError(
                f"query tokens {q.shape[0]} != n_blocks {params.num_blocks} x block_size {params.block_size}"
            )
        if q.shape[1] % k_ctx.shape[1]:
            raise ValueError(
                f"query heads per TP rank ({q.shape[1]}) must be a multiple of kv heads per TP rank "
                f"({k_ctx.shape[1]}): check --num-query-groups vs --tensor-model-parallel-size"
            )
        return q, k_ctx, v_ctx, k_blk, v_blk, (b, sq) if fmt == "sbhd" else None

    def _cross(self, query, key, value, attention_mask, mask_type) -> Tensor:
        """Plain cross-attention through the CP op without own-block part (k_blk = v_blk = None), as
        DFlash metadata on the sample-major flattening: every query row is its own block
        (block_size=1) with q_seq = its sample index and q_anchor = CROSS_SEE_ALL_ANCHOR, so it sees
        every context key of its sample on every CP rank; context keys get kv_seq = their sample index
        (CROSS_MASKED_SEQ where the key-padding mask is True) and kv_pos = their local index."""
        if mask_type == AttnMaskType.causal:
            raise NotImplementedError(
                "SplitKVCoreAttention: causal masks need DFlash metadata (pass DFlashPackedSeqParams)"
            )
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                "plain cross-attention expects sbhd [s, b, h, d] query/key/value, got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        if key.shape[1] != b or tuple(value.shape) != tuple(key.shape):
            raise ValueError(
                f"plain cross-attention: key {tuple(key.shape)} / value {tuple(value.shape)} must be "
                f"[sk, b={b}, h, d] with equal shapes"
            )
        dev = query.device
        kv_seq = torch.arange(b, dtype=torch.int64, device=dev).repeat_interleave(sk)
        if attention_mask is not None:
            # Megatron convention: True = masked out; key padding [b, 1, 1, sk] (b may broadcast).
            am = attention_mask
            if am.dim() != 4 or am.shape[1] != 1 or am.shape[2] != 1 or am.shape[0] not in (1, b) \
                    or am.shape[3] != sk:
                raise NotImplementedError(
                    "SplitKVCoreAttention: only key-padding masks [b, 1, 1, sk] are supported, got "
                    f"attention_mask of shape {tuple(am.shape)} (b={b}, sk={sk})"
                )
            masked = am[:, 0, 0, :].to(device=dev, dtype=torch.bool).expand(b, sk).reshape(-1)
            kv_seq = kv_seq.masked_fill(masked, CROSS_MASKED_SEQ)
        kv_pos = torch.arange(sk, dtype=torch.int64, device=dev).repeat(b)
        q_seq = torch.arange(b, dtype=torch.int64, device=dev).repeat_interleave(sq)
        q_anchor = torch.full_like(q_seq, CROSS_SEE_ALL_ANCHOR)

        def flat(x):  # [s, b, h, d] -> [b*s, h, d] (sample-major)
            return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])

        fn = resolve_cp_attention_fn(self.cp_impl)
        out = fn(flat(query), flat(key), flat(value), None, None, q_seq, q_anchor, kv_seq, kv_pos,
                 block_size=1, cp_group=self.cp_group, softmax_scale=self._scale(query.shape[-1]),
                 backend=self.kernel_backend, config=self.splitkv_config,
                 check_group=self._check_group())  # [b*sq, H, D]
        return out.reshape(b, sq, -1).transpose(0, 1).contiguous()
