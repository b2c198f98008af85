"""How Split-KV returns each chunk's partials to the rows' owners: one all-to-all, or two levels (one interface).

- `FlatAllToAll`: one all-to-all over the CP group of P ranks per chunk ("splitkv.fwd.out": [O | lse] in q's
  dtype, lse bit-packed, `common.pack_partial`; "splitkv.bwd.dq": dQ partials in q's dtype). The owner
  merges / sums the P partials in fp32.
- `TwoLevelAllToAll` (`cp_ranks_per_node` = L, 1 < L < P, N = P / L nodes of L consecutive CP ranks): stage 1
  (".intra", over the node's L ranks) sends local peer j the rows of the owners with local index j; the
  receiver lse-merges (forward) or sums (dQ) the L partials per row in fp32; stage 2 (".inter", over the N
  ranks with this local index) sends each owner its rows in fp32, where the N node partials are merged.
  Our extension of DESIGN.md section 2's merge rule for CP groups spanning nodes: inter-node bytes per rank
  drop from ~(P - 1) / P * Lq * Hq * D * 2 (bf16) to ~(N - 1) / N * Lq / L * Hq * D * 4.

Each pass (forward [O | lse], backward dQ) runs through an `exchange()`: `send(packed, rows)` per chunk,
`finish()` after the last; its `pending` (one per chunk, `wait()` / `take()` as `comm.Pending`) deliver the
owner's [partials * rows, Hc, D(+r)] buffer. `collectives()` lists what a chunk issues, with the bytes the
packing functions below send. Built once per metadata (`transport_for`) or from sizes (`make_transport`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..comm import all_to_all
from .common import (
    RelayStream,
    fuse_bwd_gather,
    local_index_major,
    pack_partial,
    pack_partial_local_major,
    packed_width,
)
from .fused_merge import merge_received_partials, sum_partials


@dataclass(frozen=True)
class Collective:
    """One collective of the op on one rank, as `comm.comm_stats` records it.

    name: the record name ("splitkv.fwd.q"); kind: "all_gather" | "all_to_all" | "reduce_scatter";
    message: bytes of one rank's block (the send tensor of an all-gather, 1 / size of an all-to-all's);
    step: the chunk index (-1: not chunked); group_size: ranks of the group it runs over."""

    name: str
    kind: str
    message: int
    step: int
    group_size: int

    @property
    def bytes(self) -> int:
        """The bytes `comm.comm_stats` records for it (comm.py's convention: 2 * (size - 1) * message; 0 on one
        rank)."""
        return 2 * (self.group_size - 1) * self.message


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class FlatAllToAll:
    """One all-to-all per chunk over the CP group (`group`: a `comm.CommGroup`, None for a description
    only; `size`: P)."""

    two_level = False

    def __init__(self, size: int, group=None):
        self.size, self.group = size, group

    @property
    def partials(self) -> int:
        """How many partials of each row the owner receives: P."""
        return self.size

    @property
    def fused_dout_gather(self) -> bool:
        """Whether the backward gathers dO and (delta, lse) in ONE all-gather (`common.fuse_bwd_gather`)."""
        return fuse_bwd_gather(self.size, self.two_level)

    def recv_dtype(self, dtype, acc):
        """The dtype the owner receives [O | lse] in: q's."""
        return dtype

    def pack_out(self, o, lse, dtype):
        """The forward send buffer [P * rows, Hc, D + r] of a chunk's partial (O in `dtype`, lse bit-packed)."""
        return pack_partial(o, lse, dtype)

    def pack_dq(self, dq, dtype):
        """The backward send buffer of a chunk's dQ partial: dq in `dtype`."""
        return dq.to(dtype)

    def gathered_grads(self, pending, chunking, dtype, device, head_dim: int) -> tuple:
        """The gradient placeholders of the gathered query chunks (`query_gather`): the exchanges' receive
        buffers, unwaited ([P * rc, Hc, D]: the gathered chunk's shape)."""
        return tuple(p.result for p in pending)

    def exchange(self, phase: str, acc, head_dim: int, device):
        """One pass's all-to-alls ("fwd": [O | lse], "bwd": dQ)."""
        return _FlatExchange(self.group, _NAMES[phase])

    def collectives(self, phase: str, step: int, rows: int, heads: int, head_dim: int, dtype, acc) -> list:
        """The `Collective`s chunk `step` (segment [rows, heads] per rank) issues in `phase`."""
        width = packed_width(head_dim, acc, dtype) if phase == "fwd" else head_dim
        return [Collective(_NAMES[phase], "all_to_all", rows * heads * width * _nbytes(dtype), step, self.size)]


class TwoLevelAllToAll(FlatAllToAll):
    """Two all-to-alls per chunk: over the node (`intra`, L ranks) then between nodes (`inter`, N ranks with
    this local index); `comm.node_groups`' pair, or None for a description only."""

    two_level = True

    def __init__(self, nodes: int, per_node: int, intra=None, inter=None):
        super().__init__(nodes * per_node)
        self.nodes, self.per_node, self.intra, self.inter = nodes, per_node, intra, inter

    @property
    def partials(self) -> int:
        """N: the owner receives one fp32 node partial per node."""
        return self.nodes

    def recv_dtype(self, dtype, acc):
        return acc

    def pack_out(self, o, lse, dtype):
        """Stage 1's send buffer: `pack_partial` with the rows local-index-major (peer j gets the rows of the
        owners (n, j) of every node n)."""
        return pack_partial_local_major(o, lse, dtype, self.nodes, self.per_node)

    def pack_dq(self, dq, dtype):
        return local_index_major(dq, self.nodes, self.per_node, dtype)

    def gathered_grads(self, pending, chunking, dtype, device, head_dim: int) -> tuple:
        """Zero-stride [P * rc, Hc, D] placeholders: no receive buffer has the gathered chunk's shape."""
        z = torch.zeros((), dtype=dtype, device=device)
        return tuple(z.expand(self.size * rc, hc, head_dim) for rc, hc in map(chunking.segment, range(len(pending))))

    def exchange(self, phase: str, acc, head_dim: int, device):
        return _TwoLevelExchange(self, phase, acc, head_dim, RelayStream.get(device))

    def collectives(self, phase: str, step: int, rows: int, heads: int, head_dim: int, dtype, acc) -> list:
        w1, w2 = (packed_width(head_dim, acc, dtype), packed_width(head_dim, acc, acc)) if phase == "fwd" else \
            (head_dim, head_dim)
        name = _NAMES[phase]
        return [Collective(name + ".intra", "all_to_all", self.nodes * rows * heads * w1 * _nbytes(dtype), step,
                           self.per_node),
                Collective(name + ".inter", "all_to_all", rows * heads * w2 * _nbytes(acc), step, self.nodes)]


_NAMES = {"fwd": "splitkv.fwd.out", "bwd": "splitkv.bwd.dq"}


class _FlatExchange:
    def __init__(self, group, name):
        self.group, self.name, self.pending = group, name, []

    def send(self, packed, rows: int) -> None:
        """Issue one chunk's all-to-all of `packed` (its segment of `rows` rows per owner)."""
        self.pending.append(all_to_all(packed, self.group, self.name, async_op=True))

    def finish(self) -> None:
        """After the last chunk: nothing left to issue."""


class _TwoLevelExchange(_FlatExchange):
    """Each chunk's stage 1 issued at `send`; the chunk before advanced to stage 2 right after (so stage 1
    overlaps the next chunk's kernel, stage 2 the one after); the last at `finish`."""

    def __init__(self, transport, phase, acc, head_dim, relay):
        super().__init__(transport.intra, _NAMES[phase])
        self.transport, self.acc, self.head_dim, self.relay = transport, acc, head_dim, relay
        self.between = _merge_node if phase == "fwd" else _sum_node  # what lies between the stages

    def send(self, packed, rows: int) -> None:
        first = all_to_all(packed, self.transport.intra, self.name + ".intra", async_op=True)
        reduce = self.between(self.transport, self.name + ".inter", rows, self.head_dim, self.acc)
        self.pending.append(_TwoStage(first, reduce, self.relay))
        if len(self.pending) > 1:
            self.pending[-2].advance()

    def finish(self) -> None:
        if self.pending:
            self.pending[-1].advance()


def _merge_node(tr, name, rows, head_dim, acc):
    """Stage 2 of the forward: the L partials [O | lse] received for the rows of the N owners with this local
    index, lse-merged in fp32 (`merge_received_partials`: -inf rows give O = 0, lse = -inf), sent to those
    owners as fp32 [O | lse]."""

    def reduce(first):
        o, lse = merge_received_partials(first, tr.per_node, tr.nodes * rows, head_dim, acc)
        packed = pack_partial(o, lse, acc)
        del o, lse
        return all_to_all(packed, tr.inter, name, async_op=True)

    return reduce


def _sum_node(tr, name, rows, head_dim, acc):
    """Stage 2 of dQ: the L partials received for the rows of the N owners with this local index, summed in
    fp32 (`fused_merge.sum_partials`), sent to those owners in fp32."""

    def reduce(first):
        recv = first.take()
        node_sum = sum_partials(recv.view(tr.per_node, tr.nodes * rows, *recv.shape[1:]), acc)
        del recv
        return all_to_all(node_sum, tr.inter, name, async_op=True)

    return reduce


class _TwoStage:
    """One chunk's two-level collective in flight: `first` (a `comm.Pending`) is stage 1; `advance()` hands
    it to `reduce`, which waits for it, does what lies between the stages and returns the issued stage 2
    (a `comm.Pending`), once. `wait()` / `take()` behave like `comm.Pending`'s for stage 2's result.

    relay (an `ops.common.RelayStream`, CUDA only): the current stream is marked when stage 1 is issued and
    `reduce` runs on the relay stream after that mark, so the caller's stream never waits for stage 1;
    `wait()` / `take()` make the current stream wait for stage 2. Same host order, same arithmetic as relay
    None (every stage on the caller's stream): bit-identical."""

    __slots__ = ("_first", "_reduce", "_second", "_relay", "_mark")

    def __init__(self, first, reduce, relay=None):
        self._first, self._reduce, self._second = first, reduce, None
        self._relay = relay
        self._mark = None if relay is None else relay.mark()

    def advance(self):
        if self._first is not None:
            first, reduce = self._first, self._reduce
            self._first = self._reduce = None
            if self._relay is None:
                self._second = reduce(first)
            else:
                mark, self._mark = self._mark, None
                self._second = self._relay.run(mark, first, lambda: reduce(first))
        return self

    def wait(self):
        res = self.advance()._second.wait()
        return res if self._relay is None else self._relay.taken(res)

    def take(self):
        res = self.advance()._second.take()
        return res if self._relay is None else self._relay.taken(res)


def sum_dq_partials(pending, chunking, transport, rows: int, head_dim: int, dtype, acc):
    """The owner's dQ: waits each chunk's exchange (its [partials * rc, Hc, D] holds every partial of this
    rank's rc rows of the chunk) and sums the partials in `acc` in one reduction (`fused_merge.sum_partials`;
    one partial: cast straight). Returns dq [rows, Hq, D] in `dtype`, chunks written into their rows / heads."""
    k, dq = transport.partials, None
    for c, p in enumerate(pending):
        recv = p.take()
        (r0, r1), (h0, h1) = chunking.rows(c), chunking.heads(c)
        parts = recv.view(k, r1 - r0, *recv.shape[1:])
        if dq is None:
            dq = recv.new_empty((rows, chunking.num_heads_q, head_dim), dtype=dtype)
        r1 = min(r1, rows)
        if r1 <= r0:
            continue
        dst = dq[r0:r1, h0:h1]
        if k == 1:  # one partial: its values cast straight (their fp32 upcast and cast back are exact)
            dst.copy_(parts[0, : r1 - r0])
        else:
            dst.copy_(sum_partials(parts[:, : r1 - r0], acc))
        del recv, parts, dst
    return dq


def make_transport(cp_size: int, ranks_per_node: int, groups=None):
    """`TwoLevelAllToAll` for 1 < ranks_per_node < cp_size (groups: its (intra, inter) or None), else
    `FlatAllToAll` over cp_size ranks."""
    if 1 < ranks_per_node < cp_size:
        intra, inter = groups or (None, None)
        return TwoLevelAllToAll(cp_size // ranks_per_node, ranks_per_node, intra, inter)
    return FlatAllToAll(cp_size)


_TRANSPORTS = weakref.WeakKeyDictionary()


def transport_for(meta):
    """The transport of a splitkv `SplitKVMetadata` (its `node_groups`), built once per metadata."""
    tr = _TRANSPORTS.get(meta)
    if tr is None:
        if meta.node_groups is None:
            tr = FlatAllToAll(meta.group.size, meta.group)
        else:
            intra, inter = meta.node_groups
            tr = TwoLevelAllToAll(inter.size, intra.size, intra, inter)
        _TRANSPORTS[meta] = tr
    return tr
