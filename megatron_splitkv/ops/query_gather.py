"""Split-KV's query all-gather, issued by the op or started early by the layer (`splitkv_start_query_gather`).

Forward step 1 of DESIGN.md section 2: per chunk, one asynchronous all-gather "splitkv.fwd.q" of this rank's
padded query rows (invalid blocks' rows zeroed), a chunk's share of them (`ops.chunking`). The op issues
them itself (`QueryChunks`, one chunk ahead of its kernel), or a layer that has q before k/v starts every
chunk's gather right after q (`splitkv_start_query_gather` -> `SplitKVQueryGather`, an autograd Function of
its own: `_QueryGather`) and computes k/v while it is in flight. In backward the op then returns the dQ
all-to-alls unwaited as the gradient of the gathered chunks; `_QueryGather.backward` waits and sums them
after the autograd nodes created in between (the k/v projections) ran their backward. Same collectives and
bytes, bit-identical results.
"""

from __future__ import annotations

import collections
import warnings

import torch

from ..comm import all_gather
from .chunking import chunking_for
from .agreement import check_query_gather_start
from .transport import sum_dq_partials, transport_for

__all__ = ["splitkv_start_query_gather", "SplitKVQueryGather", "UnconsumedQueryGatherWarning", "QueryChunks"]


class QueryChunks:
    """The op's own query all-gathers: `sends` (per chunk this rank's padded rows of it, from the chunking's `sends`)
    issued over `group` in chunk order, each send tensor dropped once issued (its Pending keeps it)."""

    def __init__(self, sends, group):
        self.sends, self.group, self.pending, self.issued = sends, group, {}, 0

    def prefetch(self, upto: int) -> None:
        """Issue the all-gathers of chunks < upto not issued yet."""
        while self.issued < min(upto, len(self.sends)):
            c, self.issued = self.issued, self.issued + 1
            x, self.sends[c] = self.sends[c], None
            self.pending[c] = all_gather(x, self.group, "splitkv.fwd.q", async_op=True)

    def wait(self, c: int):
        """The gathered chunk c [P * rc, Hc, D] (the next chunk's gather issued first)."""
        self.prefetch(c + 2)
        return self.pending.pop(c).wait()


class UnconsumedQueryGatherWarning(RuntimeWarning):
    """A `SplitKVQueryGather` was garbage-collected without being consumed by `splitkv_attention` or
    released with `discard()` (its collectives were issued for nothing)."""


class _GatherShared:
    """What the gather's and the op's autograd nodes share (no reference to the handle, so that a handle
    dropped unconsumed is freed at once instead of sitting in a reference cycle through the graph)."""

    __slots__ = ("metadata", "pending", "dq", "__weakref__")

    def __init__(self, metadata):
        self.metadata = metadata
        self.pending = None  # forward all-gathers, one Pending per chunk (waited by _SplitKV.forward)
        self.dq = collections.deque()  # per backward of _SplitKV: its dQ all-to-alls, for _QueryGather

    def wait_forward(self, c):
        self.pending[c].wait()
        if c == len(self.pending) - 1:
            self.pending = None

    def queries(self, gathered):
        """The gathered chunks (outputs of `_QueryGather`) with `QueryChunks`' interface for the op."""
        return _StartedChunks(self, gathered)


class _StartedChunks:
    def __init__(self, shared, gathered):
        self.shared, self.gathered = shared, gathered

    def prefetch(self, upto: int) -> None:
        """Nothing to issue: every chunk's gather was issued by `splitkv_start_query_gather`."""

    def wait(self, c: int):
        self.shared.wait_forward(c)
        return self.gathered[c]


class SplitKVQueryGather:
    """Handle of the in-flight query all-gather of one Split-KV call (`splitkv_start_query_gather`).

    Created by `splitkv_start_query_gather(q, metadata=meta)`, right after the layer computed q; pass it
    as `splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, metadata=meta, query_gather=handle)` once k/v
    exist. Consumed exactly once: a second use raises ValueError. If the layer fails between the two calls,
    call `discard()` (or let it be garbage-collected: an `UnconsumedQueryGatherWarning` is issued then);
    neither waits for the collectives (they complete on their own on every rank that issued them).

    Attributes: metadata (the `SplitKVMetadata`), state ("pending", "consumed" or "discarded").
    """

    def __init__(self, metadata, q):
        self.metadata = metadata
        self.state = "pending"
        self._q = q
        self._q_version = q._version
        self._shared = _GatherShared(metadata)
        self._gathered = None  # the gathered chunks: outputs of _QueryGather, inputs of _SplitKV

    def __repr__(self):
        return f"SplitKVQueryGather(state={self.state!r}, chunks={len(self.metadata.chunks)})"

    @property
    def pending(self) -> bool:
        """True until consumed by `splitkv_attention` or discarded."""
        return self.state == "pending"

    def discard(self) -> None:
        """Release an unconsumed gather (e.g. when the layer raised before its attention call): drops the
        references to q and the gathered buffers without waiting; later use raises ValueError. No-op on a
        consumed or discarded handle."""
        if self.state == "pending":
            self.state = "discarded"
            self._q = self._gathered = None
            self._shared.pending = None

    def _check_consume(self, meta, q):
        """ValueError unless this handle may be consumed by a call with metadata `meta` and query q."""
        if self.state != "pending":
            raise ValueError(f"query_gather was already {self.state}; a SplitKVQueryGather serves exactly one "
                             "splitkv_attention call: call splitkv_start_query_gather again for the next one")
        if meta is not self.metadata:
            raise ValueError("query_gather was started with another metadata: pass the same metadata= to "
                             "splitkv_start_query_gather and splitkv_attention")
        if q is not self._q:
            raise ValueError("q must be the very tensor given to splitkv_start_query_gather (its rows are "
                             "already being gathered)")
        if q._version != self._q_version:
            raise ValueError("q was modified in place after splitkv_start_query_gather (its rows are already "
                             "being gathered): compute q completely before starting the gather")

    def _consume(self):
        """Mark consumed; return (the state shared with the autograd nodes, the gathered chunk tensors:
        the op's inputs in place of q)."""
        gathered = self._gathered
        self.state = "consumed"
        self._q = self._gathered = None
        return self._shared, gathered

    def __del__(self):
        try:
            if self.state == "pending":
                self._shared.pending = None
                warnings.warn("a SplitKVQueryGather was never consumed by splitkv_attention(..., "
                              "query_gather=) nor discarded (its all-gathers were issued for nothing)",
                              UnconsumedQueryGatherWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _QueryGather(torch.autograd.Function):
    """q -> the gathered padded query chunks (`SplitKVMetadata.chunks`), issued asynchronously.

    Created before the layer's k/v projections, so in backward the autograd engine (highest sequence
    number first among ready nodes) runs the k/v projections' backward between `_SplitKV.backward`, which
    issues the dQ all-to-alls without waiting, and this backward, which waits them and sums the P
    partials of this rank's rows in fp32 (two-level all-to-all: the N fp32 node sums, `transport.sum_dq_partials`).
    """

    @staticmethod
    def forward(ctx, shared, q):
        meta = shared.metadata
        rows_max = max(meta.n_blocks) * meta.block_size
        gathers = QueryChunks(chunking_for(meta).sends(q, rows_max, valid_rows=meta.valid_rows), meta.group)
        gathers.prefetch(len(meta.chunks))
        shared.pending = [gathers.pending[c] for c in range(len(meta.chunks))]
        ctx.shared, ctx.rows, ctx.dtype = shared, q.shape[0], q.dtype
        return tuple(p.result for p in shared.pending)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        shared = ctx.shared
        if not shared.dq:
            raise RuntimeError("splitkv query gather: no dQ all-to-all to wait for (the gathered queries "
                               "must reach no other op than splitkv_attention)")
        pending = shared.dq.popleft()
        meta = shared.metadata
        dq = sum_dq_partials(pending, chunking_for(meta), transport_for(meta), ctx.rows, meta.head_dim, ctx.dtype,
                             torch.float64 if ctx.dtype == torch.float64 else torch.float32)
        return None, dq


def splitkv_start_query_gather(q, *, metadata) -> SplitKVQueryGather:
    """Start Split-KV's query all-gather of one layer early, before k/v exist.

    Issues exactly the collectives `splitkv_attention` would issue first in its forward: per query chunk
    of the metadata (`num_chunks`), one asynchronous all-gather "splitkv.fwd.q" of this rank's padded q
    rows (invalid blocks' rows zeroed), same bytes in `comm_stats`. Call it right after q is computed
    (projection, q-norm, RoPE), then compute k/v (their projections overlap the gather on the GPU: NCCL
    runs it on its own stream) and pass the handle to

        out = splitkv_attention(q, k_ctx, v_ctx, k_blk, v_blk, metadata=metadata, query_gather=handle)

    with the very same q tensor, unmodified. Results are bit-identical to the call without
    `query_gather=`. In backward the dQ all-to-alls are waited for only after the autograd nodes created
    between the two calls (the k/v projections) have run their backward, so these overlap the dQ
    all-to-all too.

    Every rank of the CP group must do the same: all start a gather for the layer's call and pass it,
    or none (with `group_check` metadata a mismatch raises the same ValueError on every rank; without it
    the collectives do not match and the call fails or hangs, as documented for `metadata=`). A handle
    serves one call; see `SplitKVQueryGather` for the error path (`discard()`).

    Args:
        q: [Tq_local, Hq, D] this rank's query rows (the shape, dtype and device the metadata implies).
        metadata: a `SplitKVMetadata` from `prepare_splitkv_metadata(..., impl="splitkv")` (required: the
            chunking and the gathered block layout are fixed there).

    Returns:
        `SplitKVQueryGather`. Differentiable: the gradient of q flows through it (the gathered rows'
        gradients are summed over ranks in fp32, as in `splitkv_attention`).

    Raises:
        ValueError: metadata not a splitkv `SplitKVMetadata`; q's shape / dtype / device not the
            metadata's (on this rank; on every rank with `group_check`).
    """
    check_query_gather_start(metadata, q)
    handle = SplitKVQueryGather(metadata, q)
    handle._gathered = _QueryGather.apply(handle._shared, q)
    for p in handle._shared.pending:  # the handle holds the gathered tensors; a Pending holding these
        p.result = None  # outputs of _QueryGather too would close a cycle through its node's ctx
    return handle


