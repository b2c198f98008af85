"""Split-KV's collectives as data: what one call issues on one rank, chunk by chunk, with each message's bytes.

The single description of the op's schedule (the comm tests, the benchmark's `predicted_records` and the
simulator read it): per chunk the query all-gather "splitkv.fwd.q" and the transport's forward exchange, then
(backward) the [dO | stats] all-gather(s) and the transport's dQ exchange. The segment of each chunk comes
from its `ops.chunking` object and the exchanges from its `ops.transport` object, the same objects the op
runs with. Not included: the size / block metadata all-gathers of a call without `metadata=`
("splitkv.meta", "splitkv.fwd.block_meta"; `ops.metadata`).
"""

from __future__ import annotations

import torch

from .chunking import chunking_for, make_chunking
from .common import acc_dtype, packed_width
from .metadata import resolve_num_chunks, resolve_ranks_per_node
from .transport import Collective, make_transport, transport_for

__all__ = ["Collective", "splitkv_collectives", "describe_splitkv", "collectives_of"]


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def splitkv_collectives(chunking, transport, head_dim: int, dtype: torch.dtype, backward: bool = True) -> list:
    """The `Collective`s of one call in issue order per pass (every chunk's forward, then every chunk's
    backward), for inputs of `dtype` (accumulation dtype: `common.acc_dtype`).

    Per chunk c with segment (rows, heads) per rank: "splitkv.fwd.q" all-gather of rows * heads * D elements
    of `dtype`; the transport's "fwd" exchange; backward: "splitkv.bwd.dout" (fused: dO with (delta, lse)
    bit-packed, `common.pack_dout_stats`; else dO, plus "splitkv.bwd.stats" of rows * heads * 2 accumulation
    values); the transport's "bwd" exchange. Group size: the CP group's P for the gathers."""
    acc, el, P = acc_dtype(dtype), _nbytes(dtype), transport.size
    segments = [chunking.segment(c) for c in range(len(chunking))]
    out = []
    for c, (rows, heads) in enumerate(segments):
        out.append(Collective("splitkv.fwd.q", "all_gather", rows * heads * head_dim * el, c, P))
        out += transport.collectives("fwd", c, rows, heads, head_dim, dtype, acc)
    if not backward:
        return out
    for c, (rows, heads) in enumerate(segments):
        if transport.fused_dout_gather:  # delta and lse: two accumulation values bit-packed per head
            width = packed_width(head_dim, acc, dtype, stats=2)
            out.append(Collective("splitkv.bwd.dout", "all_gather", rows * heads * width * el, c, P))
        else:
            out.append(Collective("splitkv.bwd.dout", "all_gather", rows * heads * head_dim * el, c, P))
            out.append(Collective("splitkv.bwd.stats", "all_gather", rows * heads * 2 * _nbytes(acc), c, P))
        out += transport.collectives("bwd", c, rows, heads, head_dim, dtype, acc)
    return out


def describe_splitkv(*, cp_size: int, max_blocks: int, block_size: int, num_heads_q: int, num_heads_kv: int,
                     head_dim: int, dtype: torch.dtype, num_chunks=None, chunk_axis: str = "rows",
                     cp_ranks_per_node=None, config=None, backward: bool = True) -> list:
    """`splitkv_collectives` of a call from sizes alone (no process group): P = cp_size, max_blocks =
    max(n_blocks) over the CP ranks, the options resolved as the op resolves them (`num_chunks`:
    `ops.metadata.resolve_num_chunks`, clamped to Hkv for chunk_axis "heads"; `cp_ranks_per_node`:
    `ops.metadata.resolve_ranks_per_node`; None: `config`'s, else the defaults). Raises ValueError as those
    resolutions do (a chunk count that is not a positive int, L not dividing P, an unknown chunk_axis)."""
    heads = chunk_axis == "heads"
    k = resolve_num_chunks(num_chunks, cp_size, num_heads_kv if heads else max_blocks, config)
    L = resolve_ranks_per_node(cp_ranks_per_node, cp_size, config)
    chunking = make_chunking(chunk_axis, k, max_blocks, block_size, num_heads_q, num_heads_kv)
    return splitkv_collectives(chunking, make_transport(cp_size, L), head_dim, dtype, backward)


def collectives_of(meta, backward: bool = True) -> list:
    """`splitkv_collectives` of a call with `metadata=meta` (a splitkv `SplitKVMetadata`): its chunking and
    transport (`chunking_for`, `transport_for`)."""
    return splitkv_collectives(chunking_for(meta), transport_for(meta), meta.head_dim, meta.dtype, backward)
