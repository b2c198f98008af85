"""Device-side prefetch one step ahead: the next batch uploaded (and its Split-KV metadata bound) while the
current step's forward runs on the GPU.

Why (issue 6, "planner and sharding overhead < 1% of a training step"; docs/lab/perf-notes.md item 16): with the
data pipeline's worker processes (`data.pipeline.PrefetchedBatches`) the step's data part is only
`next()` + the upload's issue + `SplitKVMetadata.bind`, about 2 ms of host time on the H200 at 16K-32K
context (tools/step_overhead.py --profile-data, 2026-11-30). At a step boundary the GPU is idle (the previous
step's optimizer ends with host reads: grad norm, found-inf, loss reporting), so those 2 ms are exposed in full:
3.2% of a 16K CP=2 drafter step. Done while the GPU still has the current step's forward queued (tens of ms),
the same host work costs the step nothing; the step boundary then only takes the ready item.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

__all__ = ["DevicePrefetcher", "PreparedItem", "UnpreparedItem"]


class UnpreparedItem:
    """What a pickled `PreparedItem` loads as: only its host item (`host`), to be prepared again (uploaded,
    metadata bound) by the process that loaded it, e.g. `prepare(x.host)` in forward_step. Not iterable, so
    code that would unpack it as a prepared item fails at once instead of using a stale device copy."""

    __slots__ = ("host",)

    def __init__(self, host):
        self.host = host

    def __repr__(self):
        return f"UnpreparedItem({type(self.host).__name__})"


class PreparedItem(tuple):
    """One prepared item: the tuple (host, device, kwargs), e.g. (a `data.pipeline.PlannedBatch` in pinned
    host memory, its upload to the device, the op's keyword arguments such as `metadata=` bound to the CP
    group). Unpacks and indexes as that 3-tuple.

    Pickling keeps the host item only and loads as `UnpreparedItem(host)`. Why: Megatron-Core's
    `RerunDataIterator` (megatron/core/rerun_state_machine.py, 0.19.2; `rerun_mode` validate_results is
    Megatron's default) keeps the micro-batches of the current iteration, and when a fault is to be re-run
    from a checkpoint (state WILL_RERUN_FROM_CHECKPOINT) its `state_dict()` puts them into the checkpoint,
    where torch_dist pickles them (`torch.save` of the ShardedObject data). The kwargs hold Split-KV
    metadata bound to the CP group, whose ProcessGroup cannot be pickled (the save failed with "cannot pickle
    'ProcessGroup' object"), and a device copy and a group belong to the process that made them anyway: the
    job that loads the checkpoint prepares the host item again with its own device and group.

    `copy.copy` returns the item itself (RerunDataIterator shallow-copies every micro-batch it saves for an
    in-place rerun; a tuple is immutable)."""

    __slots__ = ()

    def __new__(cls, host, device, kwargs):
        return super().__new__(cls, (host, device, kwargs))

    def __copy__(self):
        return self

    def __reduce__(self):
        return (UnpreparedItem, (self[0],))


class DevicePrefetcher:
    """Iterator over prepared items (uploaded to the device, metadata bound), one item ahead on request.

    `next(p)` returns the item prepared by the last `p.prefetch()` if there is one, else takes the next host
    item from `source` and prepares it now. `p.prefetch()` takes and prepares the next item immediately: call
    it when the GPU has queued work to hide the host time behind, e.g. in forward_step right after the model's
    forward is issued (examples/pretrain_dflash.py does). Without `prefetch()` calls it behaves as
    `map(prepare, source)` (except for a StopIteration raised by `prepare`, see Errors).

    The order of items is the source's; no item is duplicated, and none is dropped except one whose `prepare`
    raised (taken from the source; its error is raised in its place, see Errors). An item prepared ahead but never
    taken (end of training) is simply discarded: a resumed run skips the consumed items only
    (`args.iteration * micro-batches`), so that item is produced again after a restart.

    Args:
        source: iterator of host items (e.g. `PrefetchedBatches`: `data.pipeline.PlannedBatch` in pinned
            memory). Its `close()` is called by `close()` when it has one.
        prepare: item -> prepared item, e.g. `lambda it: it.to(device, non_blocking=True)` plus binding
            `it.metadata` to the CP group. It runs on the calling thread, on the current CUDA stream: a
            non_blocking upload issued during the forward is ordered after the forward's queued kernels, so
            the buffer is ready before the next step's first kernel (no extra stream, no record_stream).

    Errors: an exception raised by `source` or `prepare` during `prefetch()` is held and raised by the `next()`
    that would have returned that item (the step that needs it), with its traceback; StopIteration of the
    source likewise ends the iteration at that `next()`, not at `prefetch()`. A StopIteration raised by
    `prepare` does not end the iteration (unlike `map`): it is that item's error, a RuntimeError (cause: the
    StopIteration), and the next `next()` continues with the source's following item.
    """

    def __init__(self, source: Iterator, prepare: Callable):
        if not callable(prepare):
            raise ValueError(f"DevicePrefetcher: prepare must be callable, got {type(prepare).__name__}")
        self.source = iter(source)
        self.prepare = prepare
        self._ready: Optional[tuple] = None  # ("item", x) | ("error", exc) | ("stop", None)

    @property
    def ready(self) -> bool:
        """Whether `next()` will return (or raise) without touching the source."""
        return self._ready is not None

    def _take(self) -> tuple:
        try:
            x = next(self.source)
        except StopIteration:
            return ("stop", None)
        except Exception as exc:  # noqa: BLE001 - handed to the next() that needs the item, unchanged
            return ("error", exc)
        try:
            return ("item", self.prepare(x))
        except StopIteration as exc:  # not the source's end (PEP 479's rule): an error of this item
            err = RuntimeError("DevicePrefetcher: prepare raised StopIteration (an error of this item, not the "
                               "end of the source)")
            err.__cause__ = exc
            return ("error", err)
        except Exception as exc:  # noqa: BLE001 - handed to the next() that needs the item, unchanged
            return ("error", exc)

    def prefetch(self) -> None:
        """Take and prepare the next item now (no-op when one is already prepared or the source ended)."""
        if self._ready is None:
            self._ready = self._take()

    def __iter__(self):
        return self

    def __next__(self):
        kind, value = self._ready if self._ready is not None else self._take()
        if kind == "stop":
            self._ready = ("stop", None)  # stays ended
            raise StopIteration
        self._ready = None
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        """Drop the prepared item and close the source (its worker processes) when it can be closed."""
        self._ready = None
        close = getattr(self.source, "close", None)
        if callable(close):
            close()

    def __getattr__(self, name):
        # the source's descriptive attributes (num_workers, prefetch, pin_memory, ...) stay visible
        if name in ("source", "prepare", "_ready"):
            raise AttributeError(name)
        return getattr(self.source, name)
