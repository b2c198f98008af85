"""Megatron-Core's rerun-from-checkpoint with the DFlash data pipeline (examples/pretrain_dflash.py).

megatron-core 0.19.2 (`megatron/core/rerun_state_machine.py`): `RerunDataIterator` keeps the micro-batches of
the current iteration (a shallow `copy.copy` of each, whenever the rerun mode is not disabled; Megatron's
default `--rerun-mode` is validate_results); when a fault is to be re-run from a checkpoint (state
WILL_RERUN_FROM_CHECKPOINT) `RerunStateMachine.state_dict` puts `[d.state_dict() for d in iterators]`, i.e.
the saved micro-batches, into a ShardedObject, which the torch_dist strategy serialises with `torch.save`
(`dist_checkpointing/strategies/torch.py`, `_mcore_to_torch_sharded_object`) and loads with
`torch.load(weights_only=False)` (torch DCP's `load_bytes`). The job restarted from it rewinds the iterator
and replays those micro-batches through forward_step.

Our micro-batches are `data.prefetch.PreparedItem`s (host batch, device upload, kwargs with the Split-KV
metadata bound to the CP group). Before: the save failed with "cannot pickle 'ProcessGroup' object". Now a
PreparedItem pickles as its host batch (`UnpreparedItem`), forward_step prepares it again in the loading job
(upload + bind to that job's CP group), and the replayed micro-batches give the drafter exactly what the
original ones gave. Bound metadata pickled on its own raises a TypeError that says what to do.

Runs on 2 gloo ranks (CP = 2, a real ProcessGroup in the metadata), CPU."""

import copy
import io
import os
import pickle
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from _dist import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensors_of(call):
    feats, blocks, kv_seq, kv_pos = call
    return [feats, blocks.input_ids, blocks.position_ids, blocks.labels, blocks.loss_weight, kv_seq, kv_pos]


def _worker(rank, world):
    import megatron.core.rerun_state_machine as rsm
    import torch.distributed as dist
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode, RerunState, RerunStateMachine

    from megatron_splitkv.data.prefetch import PreparedItem, UnpreparedItem
    from test_data_pipeline import _Model, pretrain_in_worker
    from test_metadata_from_plan import meta_diff

    mod = pretrain_in_worker("pretrain_dflash_rerun", rank, world)

    sm = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    rsm._GLOBAL_RERUN_STATE_MACHINE = sm
    it, _, _ = mod.train_valid_test_datasets_provider(None)
    wrapped = RerunDataIterator(it)
    model = _Model()
    for _ in range(2):  # one iteration of 2 micro-batches
        mod.forward_step(wrapped, model)
    saved = wrapped.saved_microbatches
    assert len(saved) == 2 and all(isinstance(x, PreparedItem) for x in saved)
    assert all(m is not None and m.group.pg is dist.group.WORLD for m in model.metadata)  # bound to the group
    assert copy.copy(saved[0]) is saved[0]
    with pytest.raises(TypeError, match="SplitKVMetadata bound to a CP process group cannot be pickled"):
        pickle.dumps(model.metadata[0])

    # the fault is to be re-run from a checkpoint: what Megatron saves, as its torch_dist strategy saves it
    sm.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    sd = sm.state_dict(wrapped, "torch_dist")
    buf = io.BytesIO()
    torch.save([sd["sharded"].data], buf)  # raised "cannot pickle 'ProcessGroup' object" before
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)[0]
    ckpt = loaded["data_iterator_checkpoints"][0]
    assert [type(x) for x in ckpt["saved_microbatches"]] == [UnpreparedItem, UnpreparedItem]
    it.close()

    # the restarted job: a fresh pipeline (at the next batch), the checkpointed micro-batches replayed first
    it2, _, _ = mod.train_valid_test_datasets_provider(None)
    again = RerunDataIterator(it2)
    again.load_state_dict(ckpt)
    again.rewind()
    model2 = _Model()
    for _ in range(2):
        mod.forward_step(again, model2)
    for a, b in zip(model.calls, model2.calls):
        for x, y in zip(_tensors_of(a), _tensors_of(b)):
            assert x.dtype == y.dtype and torch.equal(x, y)
    for m, m2 in zip(model.metadata, model2.metadata):
        assert m2.bound and m2.group.pg is dist.group.WORLD and meta_diff(m, m2) == []
    it2.close()
    return len(model.calls)


def test_rerun_from_checkpoint_saves_and_replays_prepared_items():
    assert run_distributed(_worker, 2, timeout=300) == [2, 2]


def test_prepared_item_pickles_as_its_host_item():
    from megatron_splitkv.data.prefetch import PreparedItem, UnpreparedItem

    x = PreparedItem({"host": 1}, torch.zeros(2), {"metadata": object()})  # an unpicklable kwarg
    host, dev, kw = x
    assert host == {"host": 1} and x[1] is dev and copy.copy(x) is x
    back = pickle.loads(pickle.dumps(x))
    assert isinstance(back, UnpreparedItem) and back.host == {"host": 1}
    with pytest.raises(TypeError):
        _a, _b, _c = back  # not a prepared item: unpacking it fails at once
