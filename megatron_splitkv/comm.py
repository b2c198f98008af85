"""Communication wrappers with byte accounting for the Split-KV op and its baselines.

Every collective of `splitkv_attention`, `allgather_kv_attention` and `ring_kv_attention` goes through
the thin wrappers below, which call `torch.distributed` (gloo on CPU, NCCL on GPU) and, only while a
`comm_stats()` context is active, append a `CommRecord` (op name, collective kind, bytes). When nothing
is recording, the only overhead is one truthiness check of a module-level list.

Byte convention (per rank, padding included): the payload bytes this rank SENDS plus the bytes it
RECEIVES under the bandwidth-optimal ring implementation of each collective (what NCCL uses for large
messages), with P the group size and n the message bytes:

    all_gather      (each rank contributes n bytes):            2 * (P - 1) * n
    reduce_scatter  (each rank ends with n bytes):              2 * (P - 1) * n
    all_reduce      (n bytes on every rank):                    4 * (P - 1) * n / P
    all_to_all      (P blocks of n bytes, one per rank):         2 * (P - 1) * n
    send / recv     (point-to-point, batch_isend_irecv):        n per message sent or received

reduce_scatter uses `reduce_scatter_tensor`, which gloo implements in the pinned torch 2.11, so no
all_reduce fallback is needed on CPU (and the recorded bytes are those of a real reduce-scatter).
A group of size 1 moves nothing: its calls are skipped and recorded with 0 bytes.

Asynchronous collectives (`async_op=True` on `all_gather`, `reduce_scatter`, `all_to_all`): the call
issues the collective (torch.distributed `async_op=True`; on NCCL it runs on NCCL's own stream) and
returns a `Pending`; `Pending.wait()` returns the result (on CUDA it makes the current stream wait for
the collective; gloo blocks the host). The record is made at issue time with the same bytes as the
synchronous call, so splitting a message into chunks changes the number of records but not the total
bytes per op name. The caller must `wait()` every Pending before it uses the result, and must not
modify the input meanwhile (the Pending keeps both alive). Used by Split-KV's chunked merge pipeline.
`node_groups` builds (once, cached) the two sub-groups of Split-KV's two-level all-to-all (the L ranks of
a node, the N ranks with one local index); their collectives are recorded like any other, with the
sub-group's size as `group_size` and P replaced by it in the byte formulas. The validation
all-gather of each op (a few int64 per rank) is recorded too, as kind "all_gather" with op name
"<op>.meta". Source: arXiv 2611.05926 (Split-KV), DESIGN.md section 2 ("every collective moves
O(Lq * H * D) elements").

Example:
    with comm_stats() as stats:
        out = splitkv_attention(...)
        out.sum().backward()
    stats.bytes_by_collective  # {"all_gather": ..., "all_to_all": ...}
    stats.total_bytes
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._ints import as_int

__all__ = [
    "CommGroup",
    "CommRecord",
    "CommStats",
    "comm_stats",
    "resolve_group",
    "node_groups",
    "shutdown_distributed",
    "gloo_worker_threads",
    "exit_process",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "RingExchange",
    "Pending",
]


@dataclass(frozen=True)
class CommRecord:
    """One recorded collective: `op` (e.g. "splitkv.fwd.q"), `kind` (all_gather, reduce_scatter,
    all_to_all, all_reduce, send, recv), `bytes` (see the module docstring), `group_size`, `numel`, `dtype`."""

    op: str
    kind: str
    bytes: int
    group_size: int
    numel: int
    dtype: str


@dataclass
class CommStats:
    """Records collected inside one `comm_stats()` context (all ops, forward and backward)."""

    records: list = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def _bytes_by(self, field_name: str) -> dict:
        """dict record.<field_name> -> total bytes of the records with it."""
        out = defaultdict(int)
        for r in self.records:
            out[getattr(r, field_name)] += r.bytes
        return dict(out)

    @property
    def bytes_by_collective(self) -> dict:
        """dict kind -> bytes (kinds: all_gather, reduce_scatter, all_to_all, all_reduce, send, recv)."""
        return self._bytes_by("kind")

    @property
    def bytes_by_op(self) -> dict:
        """dict op name -> bytes."""
        return self._bytes_by("op")

    def bytes_matching(self, prefix: str) -> int:
        """Total bytes of records whose op name starts with `prefix` (e.g. "splitkv")."""
        return sum(r.bytes for r in self.records if r.op.startswith(prefix))


_ACTIVE: list = []


@contextlib.contextmanager
def comm_stats():
    """Record every collective issued by this process's Split-KV ops inside the block.

    Yields a `CommStats`; nested contexts each receive every record.
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def _record(op: str, kind: str, nbytes: int, group_size: int, t: torch.Tensor) -> None:
    rec = CommRecord(op, kind, int(nbytes), group_size, t.numel(), str(t.dtype).replace("torch.", ""))
    for s in _ACTIVE:
        s.records.append(rec)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class CommGroup:
    """A resolved CP group: `pg` (the ProcessGroup, None = default group), `size`, `rank` (in group)."""

    pg: object
    size: int
    rank: int

    def global_rank(self, group_rank: int) -> int:
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)


def resolve_group(cp_group=None) -> CommGroup:
    """`cp_group` None -> the default group when torch.distributed is initialised, else a single
    process (size 1, no communication)."""
    if cp_group is None:
        if dist.is_available() and dist.is_initialized():
            return CommGroup(None, dist.get_world_size(), dist.get_rank())
        return CommGroup(None, 1, 0)
    return CommGroup(cp_group, dist.get_world_size(cp_group), dist.get_rank(cp_group))


#: (default group object, the CP group's global ranks, ranks per node) -> (intra, inter) `CommGroup`s
_NODE_GROUPS: dict = {}


def node_groups(group: CommGroup, ranks_per_node: int, device=None):
    """The two sub-groups of Split-KV's two-level all-to-all, built once per (CP group, L) and cached.

    The CP group's P ranks form N = P / L "nodes" of L consecutive CP ranks (node n = CP ranks
    [n * L, (n + 1) * L), local index j = rank % L). Returns (intra, inter): `CommGroup`s of this rank's
    node (size L, rank j) and of the N ranks with its local index j (size N, rank n), with the CP group's
    backend. Collective over the CP group: every rank of it must call it with the same L, in the same
    order relative to its other process-group creations (Split-KV calls it while building the metadata,
    right after the group-wide agreement on L). Later calls with the same (CP ranks, L) return the cached
    pair without communicating; a re-initialised default group starts a new cache.

    Creation: when the CP group is the whole default group, every rank calls `torch.distributed.new_group`
    for every node and every local index (the standard contract: all ranks, same order). Otherwise only
    the CP group's ranks are in the call, so the sub-groups are created with
    `use_local_synchronization=True` (only members call). torch names such groups by a hash of the member
    ranks AND of the caller's count of process groups it belongs to, so members with different group
    histories would wait for each other forever; that count is therefore all-gathered over the CP group
    first (an unrecorded setup collective, like the group creation itself) and a mismatch raises on
    every rank instead.

    Args:
        group: the resolved CP group (`resolve_group`), size P > 1.
        ranks_per_node: L, 1 < L < P, dividing P (callers use the single all-to-all for L = 1 or P).
        device: device of the setup all-gather (CUDA with an NCCL group); default CPU.

    Raises:
        ValueError: L does not satisfy 1 < L < P with P % L == 0; the CP ranks' process-group counts
            differ (use_local_synchronization path; the same message on every rank).
        RuntimeError: the created sub-groups do not rank their members in CP-rank order.

    Source: our extension of DESIGN.md section 2's merge for CP groups spanning several nodes.
    """
    P = group.size
    what = f"an int with 1 < L < P = {P} that divides P"
    L = as_int(ranks_per_node, "node_groups: ranks_per_node", minimum=2, maximum=P - 1, what=what)
    if P % L:
        raise ValueError(f"node_groups: ranks_per_node must be {what}, got {ranks_per_node!r}")
    N = P // L
    ranks = tuple(group.global_rank(r) for r in range(P))
    key = (dist.group.WORLD, ranks, L)
    hit = _NODE_GROUPS.get(key)
    if hit is not None:
        return hit
    n_me, j_me = divmod(group.rank, L)
    nodes = [list(ranks[n * L:(n + 1) * L]) for n in range(N)]
    locals_ = [list(ranks[j::L]) for j in range(L)]
    backend = dist.get_backend(group.pg)
    if dist.get_world_size() == P:  # the CP group is the default group: all ranks create every sub-group
        intra = [dist.new_group(r, backend=backend) for r in nodes][n_me]
        inter = [dist.new_group(r, backend=backend) for r in locals_][j_me]
    else:
        from torch.distributed import distributed_c10d as c10d

        mine = len(getattr(getattr(c10d, "_world", None), "pg_names", ()))
        counts = torch.empty(P, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(counts, torch.tensor([mine], dtype=torch.int64, device=device), group=group.pg)
        counts = counts.tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                "cp_ranks_per_node: cannot create the node sub-groups of this CP group: its ranks belong to "
                f"different numbers of process groups ({counts} by CP rank), which makes torch's locally "
                "synchronised group names differ across them; create the CP group's process groups "
                "symmetrically, or use cp_ranks_per_node=1")
        intra = dist.new_group(nodes[n_me], backend=backend, use_local_synchronization=True)
        inter = dist.new_group(locals_[j_me], backend=backend, use_local_synchronization=True)
    pair = (CommGroup(intra, L, dist.get_rank(intra)), CommGroup(inter, N, dist.get_rank(inter)))
    if (pair[0].rank, pair[1].rank) != (j_me, n_me):  # new_group ranks members by global rank
        raise RuntimeError(f"node_groups: sub-group ranks {(pair[0].rank, pair[1].rank)} != {(j_me, n_me)}")
    _NODE_GROUPS[key] = pair
    return pair


class Pending:
    """An issued asynchronous collective: `wait()` returns its result tensor (idempotent); `take()` waits
    and returns it while dropping the Pending's own reference (so that the caller's last use frees it).

    Holds the torch.distributed work handle (None when nothing was sent: group of size 1, empty
    message) and the input and output tensors, which must stay alive and unmodified until `wait()`.
    """

    __slots__ = ("result", "_work", "_keep")

    def __init__(self, result: torch.Tensor, work=None, keep=None):
        self.result, self._work, self._keep = result, work, keep

    def wait(self) -> torch.Tensor:
        """Make the CURRENT stream wait for the collective (NCCL: a stream wait; gloo: blocks) and return
        the result. The input kept alive until now is marked used by the current stream before it is
        released, so that the caching allocator does not hand its memory out on the stream it was
        allocated on before the waiting stream (which now follows the collective) got there: waiting on
        another stream than the issuing one (Split-KV's relay stream, `ops.common.RelayStream`) stays safe."""
        if self._work is not None:
            self._work.wait()
            keep = self._keep
            if isinstance(keep, torch.Tensor) and keep.is_cuda:
                keep.record_stream(torch.cuda.current_stream(keep.device))
            self._work = self._keep = None
        return self.result

    def take(self) -> torch.Tensor:
        """`wait()`, then forget the result (a later wait / take returns None)."""
        result = self.wait()
        self.result = None
        return result


def _finish(result, work, keep, async_op):
    if async_op:
        return Pending(result, work, keep)
    if work is not None:
        work.wait()
    return result


def all_gather(x: torch.Tensor, group: CommGroup, op: str, async_op: bool = False):
    """All-gather equal-sized `x` [n, ...] along dim 0 -> [P * n, ...] (rank order). Callers pad
    uneven shards to the maximum first. async_op=True: returns a `Pending` (see the module docstring)."""
    x = x.contiguous()
    if group.size == 1:
        if _ACTIVE:
            _record(op, "all_gather", 0, 1, x)
        return _finish(x, None, None, async_op)
    out = x.new_empty((group.size * x.shape[0],) + tuple(x.shape[1:]))
    work = None
    if x.numel():
        work = dist.all_gather_into_tensor(out, x, group=group.pg, async_op=async_op)
    if _ACTIVE:
        _record(op, "all_gather", 2 * (group.size - 1) * _nbytes(x), group.size, x)
    return _finish(out, work, x, async_op)


def reduce_scatter(x: torch.Tensor, group: CommGroup, op: str, async_op: bool = False):
    """Sum `x` [P * n, ...] over ranks and return this rank's slice [n, ...] (rank order).
    async_op=True: returns a `Pending` (see the module docstring)."""
    x = x.contiguous()
    if group.size == 1:
        if _ACTIVE:
            _record(op, "reduce_scatter", 0, 1, x)
        return _finish(x, None, None, async_op)
    n = x.shape[0] // group.size
    out = x.new_empty((n,) + tuple(x.shape[1:]))
    work = None
    if x.numel():
        work = dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op)
    if _ACTIVE:
        _record(op, "reduce_scatter", 2 * (group.size - 1) * _nbytes(out), group.size, out)
    return _finish(out, work, x, async_op)


def all_to_all(x: torch.Tensor, group: CommGroup, op: str, async_op: bool = False):
    """Personalised exchange: `x` [P * n, ...] is P equal blocks along dim 0, block r going to rank r;
    returns [P * n, ...] whose block s came from rank s (rank order; block `rank` is this rank's own).
    No arithmetic: the payload arrives bit-exact (Split-KV packs its fp32 lse inside a bf16 tensor).
    Bytes (module convention): this rank sends P - 1 blocks and receives P - 1 blocks, 2 * (P - 1) * n
    element bytes with n = the block, the same count as a reduce-scatter whose result is one block.
    async_op=True: returns a `Pending`."""
    x = x.contiguous()
    if group.size == 1:
        if _ACTIVE:
            _record(op, "all_to_all", 0, 1, x)
        return _finish(x, None, None, async_op)
    out = torch.empty_like(x)
    work = None
    if x.numel():
        work = dist.all_to_all_single(out, x, group=group.pg, async_op=async_op)
    if _ACTIVE:
        _record(op, "all_to_all", 2 * (group.size - 1) * _nbytes(x) // group.size, group.size, x)
    return _finish(out, work, x, async_op)


class RingExchange:
    """Non-blocking point-to-point exchange with the ring neighbours (batch_isend_irecv).

    `RingExchange(group, op, sends, recv_shapes_like)` posts one send of each tensor in `sends` to
    rank + 1 and one receive per (shape, dtype, device) spec from rank - 1 (group ranks, modulo P);
    `wait()` returns the received tensors. Empty tensors are neither sent nor received (both sides know
    every shard's size from the op's metadata gather, so they agree). Used by `ring_kv_attention`.
    """

    def __init__(self, group: CommGroup, op: str, sends, recv_specs):
        self._works = []
        self.received = [torch.empty(shape, dtype=dt, device=dev) for shape, dt, dev in recv_specs]
        nxt = group.global_rank((group.rank + 1) % group.size)
        prv = group.global_rank((group.rank - 1) % group.size)
        ops = []
        for t in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt, group.pg))
                if _ACTIVE:
                    _record(op, "send", _nbytes(t), group.size, t)
        for t in self.received:
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, prv, group.pg))
                if _ACTIVE:
                    _record(op, "recv", _nbytes(t), group.size, t)
        self._ops = ops  # keep the (possibly copied) send buffers alive until wait()
        if ops:
            self._works = dist.batch_isend_irecv(ops)

    def wait(self):
        for w in self._works:
            w.wait()
        self._works, self._ops = [], []
        return self.received


# ----------------------------------------------------------------------------- process teardown

#: name of the worker threads of torch's ProcessGroupGloo (Linux /proc/self/task/*/comm)
GLOO_THREAD_NAME = "pt_gloo_runloop"


def gloo_worker_threads() -> int:
    """Number of live gloo worker threads of this process (0 where /proc is unavailable). Each gloo
    process group owns a few; they are joined only when the C++ ProcessGroup is destroyed, i.e. when the last
    Python reference to it goes away (`destroy_process_group` shuts the groups down but does not join
    them while a reference remains)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == GLOO_THREAD_NAME
        except OSError:  # the thread ended meanwhile
            pass
    return n


def shutdown_distributed(*, barrier: bool = True) -> None:
    """Tear torch.distributed down at the end of a process (tools, test workers) so that no gloo worker
    thread outlives it into interpreter finalisation.

    Why: a gloo worker thread drops its reference to a finished collective (the work and its tensors) after
    marking it complete; when that is the last reference to a tensor whose Python object died first, the
    thread takes the GIL to free it. If the interpreter is already finalising then (the worker threads
    of a process group that is still referenced are alive until the group is garbage collected, which for
    a group in a module global or a reference cycle happens during finalisation), the thread is
    terminated inside a C++ destructor and the process aborts (std::terminate, SIGABRT: torchrun reports
    exit code -6 / 1; seen ~1 run in 8 on 2 busy cores with torch 2.11, c10d AsyncAllgatherWork).
    Megatron-Core 0.19's `destroy_model_parallel` leaves `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` set,
    which keeps the groups' threads alive to the end.

    What it does, in order: `barrier()` on the default group (when `barrier` and initialised: no rank
    tears down while another still communicates); Megatron's `destroy_model_parallel()` when
    megatron.core.parallel_state is imported, then every process group (or list / tuple of them) still
    held by that module's globals is set to None; this module's node sub-group cache is cleared;
    `destroy_process_group()`; `gc.collect()` (groups only reachable from reference cycles, e.g. models
    and closures, are destroyed now, which joins their worker threads while the interpreter is alive).
    Safe to call when torch.distributed is not initialised (then only the caches and gc). Groups the
    CALLER still references stay alive: call it after the work function returned, then `exit_process`.
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None:
            ps.destroy_model_parallel()
            for name, value in list(vars(ps).items()):
                if isinstance(value, dist.ProcessGroup) or (
                        isinstance(value, (list, tuple)) and value and all(isinstance(v, dist.ProcessGroup)
                                                                           for v in value)):
                    setattr(ps, name, None)
        _NODE_GROUPS.clear()
        dist.destroy_process_group()
    _NODE_GROUPS.clear()
    gc.collect()


def exit_process(code=0):
    """End a tool / test-worker process with exit status `code` (an int, or None for 0) after
    `shutdown_distributed`, without the gloo teardown abort.

    `gc.collect()`, then: no gloo worker thread alive (every process group destroyed and unreferenced) ->
    `sys.exit(code)` (normal interpreter finalisation, atexit handlers run). Otherwise a process group is
    still held where Python cannot drop it (Megatron-Core 0.19's `initialize_model_parallel` leaves one
    group referenced from C++ after `destroy_model_parallel` + `destroy_process_group`; measured with
    `gloo_worker_threads`): its threads would live into interpreter finalisation, where one that releases
    a finished collective's tensors aborts the process (see `shutdown_distributed`), so stdout / stderr and
    logging are flushed and the process ends with `os._exit(code)` without finalising (atexit handlers do
    not run then). Only called after the work ended normally: an exception before it still exits non-zero
    with its traceback. Never returns."""
    gc.collect()
    code = 0 if code is None else int(code)
    if gloo_worker_threads() == 0:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
