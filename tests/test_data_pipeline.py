"""The prefetching data pipeline (`megatron_splitkv.data.pipeline`, `--dflash-data-workers`): DataLoader worker
processes yield exactly what the synchronous path computes in forward_step (plans, shards, draft blocks,
kv_seq / kv_pos, feature rows), in stream order, at CP=1 and on both ranks of CP=2, also after a resume
(`skip`); with a `MetadataSpec` the items' Split-KV metadata equals `prepare_splitkv_metadata_from_plan`
field by field (0 and 1 workers, through pickle / pin / upload); a worker's error reaches the training
process with its message; bad values are errors naming the flag; examples/pretrain_dflash.py's provider and
forward_step with 0 and 1 workers, with and without the worker-built metadata (--dflash-host-metadata).
CPU only, no timing."""

import functools
import itertools
import math
import os
import sys
import threading

import numpy as np
import pytest
import torch

from megatron_splitkv.data import PrefetchedBatches, ShareGPTLoader, data_parallel_batches, plan_batch
from megatron_splitkv.data.sharegpt import TokenizedCorpus, make_packed_batch
from megatron_splitkv.ops.packing import split_views, unique_tensors
from _warning_marks import FORK, MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV + FORK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK, MASK_ID, ANCHORS, MAX_TOKENS = 4, 999, 6, 512


def _corpus(n=14, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(20, 300, size=n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = rng.integers(0, MASK_ID, size=int(offsets[-1])).astype(np.int32)
    mask = rng.random(int(offsets[-1])) < 0.7
    return TokenizedCorpus(tokens, mask, offsets)


def _source(skip=0, dp=1, dpr=0, corpus=None):
    loader = ShareGPTLoader(max_tokens=MAX_TOKENS, num_anchors=ANCHORS, seed=3,
                            corpus=corpus if corpus is not None else _corpus())
    return functools.partial(data_parallel_batches, loader, dp, dpr, skip)


def _kw(cp, rank, store=None):
    return dict(cp_size=cp, cp_rank=rank, block_size=BLOCK, mask_token_id=MASK_ID, chunk_size=64, strategy="lpt",
                gamma=None, feature_store=store)


def _naive_batches(loader, dp, dpr, skip):
    """examples/pretrain_dflash.py's `_batches` before the pipeline: build every batch, drop the skipped."""
    n, epoch = 0, 0
    while True:
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i % dp != dpr:
                continue
            if n >= skip:
                yield batch
            n += 1
        epoch += 1


def _old_forward_step_items(batches, cp, rank, store=None):
    """What forward_step computed synchronously before the pipeline (its code, device moves left out)."""
    from megatron_splitkv.data import shard_batch
    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.planning import plan_context_parallel

    for batch in batches:
        plan = plan_context_parallel(batch.seq_lens, batch.anchors, block_size=BLOCK, cp_size=cp, chunk_size=64,
                                     strategy="lpt")
        shard = shard_batch(batch.to_dict(), plan, rank)
        sl = plan.query_slice(rank)
        blocks = build_draft_blocks(batch.input_ids, batch.seq_lens, plan.q_seq[sl], plan.q_anchor[sl],
                                    block_size=BLOCK, mask_token_id=MASK_ID, loss_mask=batch.loss_mask, gamma=None)
        feats = store.rows(batch.source, shard["kv_seq"], shard["kv_pos"]) if store is not None else None
        yield plan, shard, blocks, feats, batch


def _same_tensor(a, b, what):
    # compared on the host: with CUDA present forward_step uploads its inputs, the references stay on the CPU
    a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


def _same_plan(p, q):
    import dataclasses

    for f in dataclasses.fields(p):
        if f.name == "_cache":
            continue
        a, b = getattr(p, f.name), getattr(q, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def _same_item(x, y):
    """Two PlannedBatch items are identical (every tensor: dtype, shape, values)."""
    import dataclasses

    assert (x.index, x.cp_rank, x.num_tokens) == (y.index, y.cp_rank, y.num_tokens)
    _same_plan(x.plan, y.plan)
    assert sorted(x.shard) == sorted(y.shard)
    for k in x.shard:
        _same_tensor(x.shard[k], y.shard[k], k)
    for f in dataclasses.fields(x.blocks):
        a, b = getattr(x.blocks, f.name), getattr(y.blocks, f.name)
        if f.name == "block_size":
            assert a == b
        else:
            _same_tensor(a, b, f"blocks.{f.name}")
    for k in ("kv_seq", "kv_pos", "input_ids", "source"):
        _same_tensor(getattr(x, k), getattr(y, k), k)
    assert (x.features is None) == (y.features is None)
    if x.features is not None:
        _same_tensor(x.features, y.features, "features")


def _take(it, n):
    with it:
        return list(itertools.islice(it, n))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny offline feature store (bf16 rows, as tools/extract_features.py writes them)."""
    pytest.importorskip("megatron.core")
    from megatron_splitkv.megatron.models import FeatureStore, FeatureWriter

    corpus = _corpus(seed=1)
    path = str(tmp_path_factory.mktemp("feat") / "f")
    w = FeatureWriter(path, 8, torch.bfloat16, {"tap_layers": [1]})
    g = torch.Generator().manual_seed(0)
    for i in range(len(corpus)):
        ids, m = corpus.conversation(i)
        w.append(100 + i, ids, m, torch.randn(ids.shape[0], 8, generator=g))
    w.close()
    return FeatureStore(path)


# ---------------------------------------------------------------------------------------------------------
# identity with the synchronous path
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2])
def test_sync_path_equals_the_old_forward_step(cp):
    """0 workers = what forward_step computed before (plan, shard, blocks), item by item."""
    n = 5
    for rank in range(cp):
        items = _take(PrefetchedBatches(_source(), num_workers=0, **_kw(cp, rank)), n)
        ref = list(itertools.islice(_old_forward_step_items(_source()(), cp, rank), n))
        assert [it.index for it in items] == list(range(n))
        for it, (plan, shard, blocks, feats, batch) in zip(items, ref):
            _same_plan(it.plan, plan)
            assert sorted(it.shard) == sorted(shard)
            for k in shard:
                _same_tensor(it.shard[k], torch.as_tensor(shard[k]), k)
            for k in ("input_ids", "q_seq", "q_anchor", "block_keep", "labels", "loss_weight", "position_ids"):
                _same_tensor(getattr(it.blocks, k), getattr(blocks, k), k)
            _same_tensor(it.kv_seq, torch.as_tensor(shard["kv_seq"]), "kv_seq")
            _same_tensor(it.kv_pos, torch.as_tensor(shard["kv_pos"]), "kv_pos")
            assert it.features is None and it.num_tokens == batch.num_tokens
            assert it.imbalance == float(plan.imbalance)


@pytest.mark.parametrize("cp, workers", [(1, 1), (2, 1), (2, 2)])
def test_workers_yield_exactly_the_synchronous_items(cp, workers):
    """Worker processes (1 and 2, prefetch 2 and 1) give the synchronous items, in order, on every CP rank;
    several batches cross an epoch boundary (the test corpus packs into a few batches per epoch)."""
    n = 9
    for rank in range(cp):
        sync = _take(PrefetchedBatches(_source(), num_workers=0, **_kw(cp, rank)), n)
        loader = PrefetchedBatches(_source(), num_workers=workers, prefetch=3 - workers, **_kw(cp, rank))
        pre = _take(loader, n)
        assert len(sync) == len(pre) == n
        for x, y in zip(sync, pre):
            _same_item(x, y)
            # one shared-memory segment for the upload set, one for the rest (a cheap hand-over)
            up, host = y.buffers[0].untyped_storage(), y.buffers[2].untyped_storage()
            # with CUDA the DataLoader's pin thread copies the upload set into pinned memory (one copy)
            assert (y.buffers[0].is_pinned() if loader.pin_memory else y.buffers[0].is_shared())
            assert y.buffers[2].is_shared()
            for t in (y.kv_seq, y.kv_pos, y.input_ids, y.blocks.labels, y.blocks.block_keep, y.blocks.loss_weight):
                assert t.untyped_storage().data_ptr() == up.data_ptr()
            for t in (y.source, *y.shard.values()):
                assert t.untyped_storage().data_ptr() == host.data_ptr()
    epoch_len = len(ShareGPTLoader(max_tokens=MAX_TOKENS, num_anchors=ANCHORS, seed=3, corpus=_corpus()))
    assert epoch_len < n  # the stream crossed an epoch boundary


@pytest.mark.parametrize("cp", [1, 2])
def test_resume_skip_gives_the_later_items(cp):
    """A run resumed after `skip` batches (worker processes) yields the items a straight run yields from
    position `skip` on (the index counts from the resume point)."""
    skip, n = 4, 5
    for rank in range(cp):
        straight = _take(PrefetchedBatches(_source(), num_workers=0, **_kw(cp, rank)), skip + n)
        resumed = _take(PrefetchedBatches(_source(skip), num_workers=1, **_kw(cp, rank)), n)
        for x, y in zip(straight[skip:], resumed):
            y.index += skip
            _same_item(x, y)


@pytest.mark.parametrize("dp, skip", [(1, 0), (1, 3), (1, 11), (2, 0), (2, 5), (3, 7)])
def test_data_parallel_batches_equals_the_old_generator(dp, skip):
    """The fast resume (whole epochs counted, the resumed epoch started at its batch) gives the batches of
    pretrain_dflash.py's old `_batches` generator, which built and dropped every skipped batch."""
    corpus = _corpus()
    for dpr in range(dp):
        fast = _source(skip, dp, dpr, corpus)()
        old = _naive_batches(ShareGPTLoader(max_tokens=MAX_TOKENS, num_anchors=ANCHORS, seed=3, corpus=corpus),
                             dp, dpr, skip)
        for a, b in zip(itertools.islice(fast, 8), itertools.islice(old, 8)):
            np.testing.assert_array_equal(a.input_ids, b.input_ids)
            np.testing.assert_array_equal(a.source, b.source)
            assert all(np.array_equal(x, y) for x, y in zip(a.anchors, b.anchors))


def test_feature_rows_in_workers(store):
    """With a feature store the workers read this rank's rows: equal to the synchronous path and to the
    old forward_step's `store.rows(...)`, at CP=1 and CP=2."""
    n = 4
    for cp in (1, 2):
        for rank in range(cp):
            src = _source(corpus=store.corpus())
            sync = _take(PrefetchedBatches(src, num_workers=0, **_kw(cp, rank, store)), n)
            pre = _take(PrefetchedBatches(src, num_workers=1, **_kw(cp, rank, store)), n)
            ref = list(itertools.islice(_old_forward_step_items(src(), cp, rank, store), n))
            for x, y, r in zip(sync, pre, ref):
                _same_item(x, y)
                assert x.features.dtype == torch.bfloat16 and x.features.shape == (x.kv_seq.shape[0], 8)
                _same_tensor(x.features, r[3], "features")


def test_feature_store_rows_into_a_buffer(store):
    """FeatureStore.rows(..., out=) reads the same rows into the given tensor; a wrong `out` is an error."""
    src, seq, pos = np.array([3, 0]), torch.tensor([0, 0, 1, 1]), torch.tensor([5, 0, 7, 2])
    ref = store.rows(src, seq, pos)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    assert store.rows(src, seq, pos, out=out) is out and torch.equal(out.view(torch.int16), ref.view(torch.int16))
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor"):
        store.rows(src, seq, pos, out=torch.empty(4, 8))
    with pytest.raises(IndexError, match="beyond its stored conversation"):
        store.rows(src, seq, torch.tensor([5, 0, 7, -1]), out=out)


def test_spawned_workers_reopen_the_feature_store_by_path(store):
    """A worker started by spawn gets the dataset pickled: the FeatureStore travels by path (not its rows)."""
    import pickle

    assert len(pickle.dumps(store)) < 1000
    src = _source(corpus=store.corpus())
    sync = _take(PrefetchedBatches(src, num_workers=0, **_kw(2, 1, store)), 2)
    pre = _take(PrefetchedBatches(src, num_workers=1, multiprocessing_context="spawn", **_kw(2, 1, store)), 2)
    for x, y in zip(sync, pre):
        _same_item(x, y)


def test_pin_memory_and_upload():
    """`pin_memory` pins the upload set (blocks, kv_seq, kv_pos, input_ids, features) and `to` moves only it;
    the plan, shard and source stay on the host."""
    item = next(PrefetchedBatches(_source(), num_workers=0, **_kw(2, 0)))
    moved = item.to("cpu")
    _same_item(item, moved)
    import pickle

    _same_item(item, pickle.loads(pickle.dumps(item)))  # by value, as the flat buffers
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    pinned = item.pin_memory()
    assert pinned.kv_seq.is_pinned() and pinned.blocks.input_ids.is_pinned() and pinned.input_ids.is_pinned()
    dev = pinned.to("cuda")
    assert dev.kv_pos.is_cuda and dev.blocks.loss_weight.is_cuda and not dev.shard["kv_seq"].is_cuda


# ---------------------------------------------------------------------------------------------------------
# Split-KV metadata built in the workers (MetadataSpec)
# ---------------------------------------------------------------------------------------------------------

HQ, HKV, HD = 4, 2, 8


def _spec(flex=True):
    from megatron_splitkv.data import MetadataSpec

    return MetadataSpec(num_heads_q=HQ, num_heads_kv=HKV, head_dim=HD, dtype=torch.float32, flex_block_masks=flex)


def _meta_problems(m, ref):
    """What differs between the item's unbound metadata `m` and `ref` (prepare_splitkv_metadata_from_plan run
    here): every dataclass field (test_metadata_from_plan.meta_diff; the packed buffer record aside) and the
    host-built FlexAttention tables of every mask."""
    import dataclasses

    from test_metadata_from_plan import meta_diff

    def norm(x):
        hb = x.host_build
        return dataclasses.replace(x, host_build=None if hb is None else dataclasses.replace(hb, buffer=None,
                                                                                              layout=None))

    bad = meta_diff(norm(m), norm(ref))
    if (m.host_build.cp_size, m.host_build.cp_rank) != (ref.host_build.cp_size, ref.host_build.cp_rank):
        bad.append("host_build")
    for i, (a, b) in enumerate(zip(m.chunk_masks_own, ref.chunk_masks_own)):
        ta, tb = a.__dict__.get("_flex_host_tables", {}), b.__dict__.get("_flex_host_tables", {})
        if sorted(ta) != sorted(tb) or any(
                not all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip((ta[k][0],) + ta[k][1],
                                                                                  (tb[k][0],) + tb[k][1]))
                for k in ta):
            bad.append(f"flex tables of chunk {i}")
    return bad


def _meta_ref(item, spec):
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan

    return prepare_splitkv_metadata_from_plan(item.plan, item.cp_rank, block_size=BLOCK, num_heads_q=spec.num_heads_q,
                                              num_heads_kv=spec.num_heads_kv, head_dim=spec.head_dim, dtype=spec.dtype,
                                              flex_block_masks=spec.flex_block_masks)


def test_meta_problems_detects_differences():
    """The comparison below is not vacuous: another rank's, another head count's or flex-less metadata differ."""
    import dataclasses

    item = plan_batch(next(_source()()), metadata=_spec(), **_kw(2, 0))
    ref = _meta_ref(item, _spec())
    assert _meta_problems(item.metadata, ref) == []
    other = plan_batch(next(_source()()), metadata=_spec(), **_kw(2, 1)).metadata
    assert "keys" in _meta_problems(other, ref) and "host_build" in _meta_problems(other, ref)
    assert _meta_problems(_meta_ref(item, dataclasses.replace(_spec(), num_heads_kv=1)), ref) == ["num_heads_kv"]
    assert "flex tables of chunk 0" in _meta_problems(_meta_ref(item, _spec(flex=False)), ref)


@pytest.mark.parametrize("cp, workers", [(1, 0), (2, 0), (2, 1)])
def test_worker_metadata_equals_prepare_from_plan(cp, workers):
    """Each item's metadata (unbound, this rank's) equals `prepare_splitkv_metadata_from_plan(item.plan,
    rank, ...)` run here, field by field, flex tables included; its tensors are views of the item's ONE upload
    buffer (no extra shared segment); the rest of the item equals the items built without metadata."""
    n = 4
    for rank in range(cp):
        plain = _take(PrefetchedBatches(_source(), num_workers=0, **_kw(cp, rank)), n)
        it = PrefetchedBatches(_source(), num_workers=workers, metadata=_spec(), **_kw(cp, rank))
        items = _take(it, n)
        for x, y in zip(plain, items):
            _same_item(x, y)
            m = y.metadata
            assert x.metadata is None and m is not None and not m.bound
            assert _meta_problems(m, _meta_ref(y, _spec())) == [], (rank, y.index)
            up = y.buffers[0].untyped_storage().data_ptr()
            assert all(t.untyped_storage().data_ptr() == up for t in unique_tensors(m))
            assert m.host_build.buffer.untyped_storage().data_ptr() == up
            if workers:
                assert y.buffers[0].is_pinned() if it.pin_memory else y.buffers[0].is_shared()


def test_worker_metadata_pickle_pin_upload_bind():
    """The item's metadata survives pickling (as from a worker: its tensors travel in the upload buffer, the
    pickle holds no copy of them), `to` moves it with the batch (still unbound) and `bind` (P = 1) gives the
    metadata `prepare_splitkv_metadata_from_plan(...).bind` gives; on CUDA the pin thread's `pin_memory`
    pins it with the batch and `bind` after `to(cuda)` copies nothing."""
    import pickle

    from test_metadata_from_plan import meta_diff

    item = next(PrefetchedBatches(_source(), num_workers=0, metadata=_spec(), **_kw(1, 0)))
    ref = _meta_ref(item, _spec())
    plain = next(PrefetchedBatches(_source(), num_workers=0, **_kw(1, 0)))
    extra = len(pickle.dumps(item)) - len(pickle.dumps(plain))
    assert extra < item.buffers[0].numel() - plain.buffers[0].numel() + 20000  # the skeleton, not the data twice
    back = pickle.loads(pickle.dumps(item))
    assert _meta_problems(back.metadata, ref) == []
    moved = item.to("cpu")
    assert _meta_problems(moved.metadata, ref) == []
    assert meta_diff(moved.metadata.bind(None, "cpu"), ref.bind(None, "cpu")) == []
    if not torch.cuda.is_available():
        pytest.skip("pinned memory / upload need CUDA")
    pinned = item.pin_memory()
    assert pinned.metadata.host_build.buffer.is_pinned() and pinned.metadata.pin_memory() is pinned.metadata
    assert pinned.metadata.keys.is_pinned()
    dev = pinned.to("cuda")
    assert dev.metadata.keys.is_cuda and not dev.metadata.bound
    bound = dev.metadata.bind(None, torch.device("cuda", torch.cuda.current_device()))
    assert bound.keys.untyped_storage().data_ptr() == dev.buffers[0].untyped_storage().data_ptr()  # no copy
    for name in ("q_seq", "q_anchor", "kv_seq", "kv_pos", "keys", "block_meta", "valid_rows"):
        assert torch.equal(getattr(bound, name).cpu(), getattr(ref, name)), name


def test_metadata_spec_errors():
    batch = next(_source()())
    with pytest.raises(TypeError, match="metadata must be a MetadataSpec"):
        plan_batch(batch, metadata={"num_heads_q": 4}, **_kw(1, 0))
    import dataclasses

    with pytest.raises(ValueError, match="prepare_splitkv_metadata_from_plan: Hq % Hkv"):
        plan_batch(batch, metadata=dataclasses.replace(_spec(), num_heads_kv=3), **_kw(1, 0))


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


def _failing_batches(fail_at):
    for k, batch in enumerate(_source()()):
        if k == fail_at:
            raise ValueError(f"corrupt packed batch {k} in the test stream")
        yield batch


class _BadStore:
    def rows(self, source, kv_seq, kv_pos):
        raise IndexError("a context position lies beyond its stored conversation (test)")


@pytest.mark.parametrize("workers", [0, 1])
def test_worker_error_surfaces_with_its_message(workers):
    """An error in the batch stream (after two good batches) and one in the preparation (the feature read)
    are raised by `next` in the training process, with their message and type; no hang."""
    it = PrefetchedBatches(functools.partial(_failing_batches, 2), num_workers=workers, **_kw(2, 0))
    assert [next(it).index, next(it).index] == [0, 1]
    with pytest.raises(ValueError, match="corrupt packed batch 2 in the test stream"):
        next(it)
    it.close()
    it = PrefetchedBatches(_source(), num_workers=workers, **_kw(1, 0, _BadStore()))
    with pytest.raises(IndexError, match="beyond its stored conversation"):
        next(it)
    it.close()


def _dying_batches():
    os._exit(7)  # a worker killed (e.g. by the OOM killer) before it delivers anything
    yield


def test_dead_worker_is_an_error_not_a_hang():
    it = PrefetchedBatches(_dying_batches, num_workers=1, **_kw(1, 0))
    with pytest.raises(RuntimeError, match="DataLoader worker .* exited unexpectedly"):
        next(it)
    it.close()


@pytest.mark.parametrize("kw, msg", [({"num_workers": -1}, "num_workers must be an integer >= 0"),
                                     ({"num_workers": 1.5}, "num_workers must be an integer >= 0"),
                                     ({"num_workers": True}, "num_workers must be an integer >= 0"),
                                     ({"prefetch": 0}, "prefetch must be an integer >= 1")])
def test_bad_pipeline_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PrefetchedBatches(_source(), **kw, **_kw(1, 0))
    with pytest.raises(TypeError, match="zero-argument callable"):
        PrefetchedBatches(iter([]), num_workers=0, **_kw(1, 0))


def test_plan_batch_rank_out_of_range():
    batch = next(_source()())
    with pytest.raises(ValueError, match="cp_rank"):
        plan_batch(batch, **_kw(2, 2))


# ---------------------------------------------------------------------------------------------------------
# flags (Megatron)
# ---------------------------------------------------------------------------------------------------------


def test_data_flags_parse_default_and_errors(capsys):
    pytest.importorskip("megatron.core")
    import argparse

    from megatron_splitkv.megatron import SplitKVArgumentError, add_splitkv_args, validate_splitkv_args
    from megatron_splitkv.megatron.arguments import data_prefetch_from_args, data_workers_from_args

    p = add_splitkv_args(argparse.ArgumentParser())
    a = p.parse_args([])
    assert a.dflash_data_workers is None and a.dflash_data_prefetch is None
    assert data_workers_from_args(a) == (1 if torch.cuda.is_available() else 0) and data_prefetch_from_args(a) == 2
    a = p.parse_args(["--dflash-data-workers", "0", "--dflash-data-prefetch", "1"])
    assert data_workers_from_args(a) == 0 and data_prefetch_from_args(a) == 1
    assert data_workers_from_args(p.parse_args(["--dflash-data-workers", "3"])) == 3
    for argv, flag, msg in ((["--dflash-data-workers", "-1"], "--dflash-data-workers", "must be >= 0"),
                            (["--dflash-data-prefetch", "0"], "--dflash-data-prefetch", "must be >= 1")):
        a = p.parse_args(argv + ["--context-parallel-impl", "splitkv"])
        with pytest.raises(SplitKVArgumentError, match=f"{flag} {msg}"):
            (data_workers_from_args if "workers" in flag else data_prefetch_from_args)(a)
        with pytest.raises(SplitKVArgumentError, match=flag):
            validate_splitkv_args(a, have_te=True)
    with pytest.raises(SplitKVArgumentError, match="--dflash-data-workers must be an integer"):
        data_workers_from_args(argparse.Namespace(dflash_data_workers="2"))
    with pytest.raises(SystemExit):
        p.parse_args(["--dflash-data-workers", "two"])
    assert "--dflash-data-workers" in capsys.readouterr().err


def _load_pretrain(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "pretrain_dflash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PARSE = ["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
         "256", "--max-position-embeddings", "256", "--micro-batch-size", "1", "--attention-dropout", "0",
         "--transformer-impl", "local", "--num-anchors", "8"]


def test_data_workers_upper_bound():
    """--dflash-data-workers has a documented cap (MAX_DATA_WORKERS = 32 worker processes per rank): the cap is
    accepted, one more is a SplitKVArgumentError naming the flag and the limit (was accepted: 10**6 workers
    would have started a million processes), from the flag readers and from --parse-only."""
    pytest.importorskip("megatron.core")
    import argparse

    from megatron_splitkv.megatron import SplitKVArgumentError, add_splitkv_args, validate_splitkv_args
    from megatron_splitkv.megatron.arguments import MAX_DATA_WORKERS, data_workers_from_args

    assert MAX_DATA_WORKERS == 32
    p = add_splitkv_args(argparse.ArgumentParser())
    assert "At most 32 per rank" in " ".join(p.format_help().split())
    assert data_workers_from_args(p.parse_args(["--dflash-data-workers", "32"])) == 32
    for bad in ("33", str(10 ** 6)):
        a = p.parse_args(["--dflash-data-workers", bad, "--context-parallel-impl", "splitkv"])
        for check in (data_workers_from_args, lambda a: validate_splitkv_args(a, have_te=True)):
            with pytest.raises(SplitKVArgumentError, match=f"--dflash-data-workers must be at most 32 .*got {bad}"):
                check(a)
    mod = _load_pretrain("pretrain_dflash_dw")
    argv = sys.argv
    try:
        assert mod.main(PARSE + ["--dflash-data-workers", "32"]).dflash_data_workers == 32
        with pytest.raises(SplitKVArgumentError, match="--dflash-data-workers must be at most 32"):
            mod.main(PARSE + ["--dflash-data-workers", "33"])
    finally:
        sys.argv = argv


def test_pretrain_parse_only_data_flags():
    pytest.importorskip("megatron.core")
    from megatron_splitkv.megatron import SplitKVArgumentError

    mod = _load_pretrain("pretrain_dflash_dp")
    argv = sys.argv
    try:
        args = mod.main(PARSE + ["--dflash-data-workers", "2", "--dflash-data-prefetch", "3"])
        assert (args.dflash_data_workers, args.dflash_data_prefetch) == (2, 3)
        for bad, msg in ((["--dflash-data-workers", "-2"], "--dflash-data-workers must be >= 0"),
                         (["--dflash-data-prefetch", "0"], "--dflash-data-prefetch must be >= 1")):
            with pytest.raises(SplitKVArgumentError, match=msg):
                mod.main(PARSE + bad)
    finally:
        sys.argv = argv


# ---------------------------------------------------------------------------------------------------------
# examples/pretrain_dflash.py: the provider and forward_step (CPU, parallel state and args stubbed)
# ---------------------------------------------------------------------------------------------------------


class _Timer:
    def start(self):
        pass

    def stop(self):
        pass


class _Model:
    """Records what forward_step hands the drafter; returns a loss object."""

    def __init__(self):
        self.calls, self.metadata = [], []

    def __call__(self, feats, blocks, kv_seq, kv_pos, **kw):
        self.calls.append((feats, blocks, kv_seq, kv_pos))
        self.metadata.append(kw.pop("metadata", None))
        assert not kw, kw

        class Out:
            loss = torch.zeros(())
            total = torch.zeros(())

        return Out()


def _patched_pretrain(monkeypatch, name, store, cp, **extra_args):
    """examples/pretrain_dflash.py loaded as `name` with Megatron's args (the data flags, resumed at iteration
    2, plus `extra_args`), timers, printing, 2 micro-batches, DP=2 rank 1 and CP (size, rank) = `cp`
    patched, and the feature store `store`."""
    import argparse

    import megatron.core.num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps

    mod = _load_pretrain(name)
    args = argparse.Namespace(seq_length=MAX_TOKENS, dflash_num_anchors=ANCHORS, data_seed=3, sharegpt_limit=None,
                              sharegpt_cache_dir=None,
                              iteration=2, cp_balance="lpt", cp_chunk_size=64, dflash_block_size=BLOCK,
                              mask_token_id=MASK_ID, loss_decay_gamma=None, dflash_data_prefetch=2, **extra_args)
    monkeypatch.setattr(mod, "get_args", lambda: args)
    monkeypatch.setattr(mod, "get_timers", lambda: (lambda *a, **k: _Timer()))
    monkeypatch.setattr(mod, "print_rank_0", lambda *a, **k: None)
    monkeypatch.setattr(nmc, "get_num_microbatches", lambda: 2)
    for fn, v in (("get_data_parallel_world_size", 2), ("get_data_parallel_rank", 1),
                  ("get_context_parallel_world_size", cp[0]), ("get_context_parallel_rank", cp[1])):
        monkeypatch.setattr(ps, fn, lambda v=v, **k: v)
    monkeypatch.setitem(mod._STATE, "store", store)
    return mod


def pretrain_in_worker(name, rank, world):
    """examples/pretrain_dflash.py loaded as `name` inside a tests/_dist.py worker (no monkeypatch there: the
    process ends with the test): Megatron's args (CP = `world`, rank `rank`, DP 1, iteration 0, host-built
    Split-KV metadata, device prefetch on, the math kernel), timers, printing and 2 micro-batches stubbed, the
    test corpus instead of ShareGPT, a tiny Qwen3 config and the default process group as the CP group;
    forward_step runs on the CPU. Returns the module (tests/test_rerun_checkpoint.py,
    tests/test_exchange_env_agreement.py)."""
    import argparse
    import types

    import megatron.core.num_microbatches_calculator as nmc
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import megatron_splitkv.data as msd
    from megatron_splitkv.megatron.models import qwen3_config

    mod = _load_pretrain(name)
    args = argparse.Namespace(seq_length=MAX_TOKENS, dflash_num_anchors=ANCHORS, data_seed=3, sharegpt_limit=None,
                              sharegpt_cache_dir=None,
                              iteration=0, cp_balance="lpt", cp_chunk_size=64, dflash_block_size=BLOCK,
                              mask_token_id=MASK_ID, loss_decay_gamma=None, dflash_data_prefetch=2,
                              dflash_data_workers=0, context_parallel_impl="splitkv", dflash_host_metadata="on",
                              dflash_device_prefetch="on", tensor_model_parallel_size=1, splitkv_kernel="math")
    mod.get_args = lambda: args
    mod.get_timers = lambda: (lambda *a, **k: _Timer())
    mod.print_rank_0 = lambda *a, **k: None
    mod._device = lambda: torch.device("cpu")
    nmc.get_num_microbatches = lambda: 2
    for fn, v in (("get_data_parallel_world_size", 1), ("get_data_parallel_rank", 0),
                  ("get_context_parallel_world_size", world), ("get_context_parallel_rank", rank)):
        setattr(ps, fn, lambda v=v, **k: v)
    corpus, loader_cls = _corpus(), msd.ShareGPTLoader
    msd.ShareGPTLoader = lambda **kw: loader_cls(**dict(kw, corpus=corpus))  # the test corpus, no ShareGPT
    mod._STATE.update(store=None, config=qwen3_config(num_layers=1, hidden_size=64, num_attention_heads=4,
                                                      num_query_groups=2, kv_channels=16, ffn_hidden_size=64),
                      pgs=types.SimpleNamespace(cp=dist.group.WORLD),
                      provider=lambda ids, kv_seq, kv_pos: ids.to(torch.float32)[:, None].repeat(1, 8))
    return mod


@pytest.mark.parametrize("workers, ahead", [(0, None), (1, None), (1, "off"), (0, "on")])
def test_pretrain_provider_and_forward_step(store, monkeypatch, workers, ahead):
    """train_valid_test_datasets_provider (DP=2 rank 1, CP=2 rank 1, resumed at iteration 2 with 2
    micro-batches per iteration) and forward_step with a stand-in drafter: the drafter gets this rank's
    features, blocks, kv_seq and kv_pos of the batches the old synchronous code would have built (checked
    against it), the logged stats are the batch's tokens and the plan's imbalance. With
    --dflash-device-prefetch (default on) the next batch is prepared when forward_step returns (none
    skipped, none repeated: the same sequence); off: nothing is taken ahead."""
    mod = _patched_pretrain(monkeypatch, f"pretrain_dflash_fs{workers}{ahead}", store, cp=(2, 1),
                            dflash_data_workers=workers, dflash_device_prefetch=ahead)
    if not torch.cuda.is_available():  # forward_step uploads to the current CUDA device; here: the CPU
        monkeypatch.setattr(mod, "_device", lambda: torch.device("cpu"))
    it, valid, test = mod.train_valid_test_datasets_provider(None)
    assert valid is None and test is None and it.num_workers == workers
    model = _Model()
    loader = ShareGPTLoader(max_tokens=MAX_TOKENS, num_anchors=ANCHORS, seed=3, corpus=store.corpus())
    ref = _old_forward_step_items(_naive_batches(loader, 2, 1, 4), 2, 1, store)
    from megatron.core.rerun_state_machine import RerunDataIterator

    wrapped = RerunDataIterator(it)  # what megatron.training hands forward_step
    for _ in range(3):
        loss, _fn = mod.forward_step(wrapped, model)
        feats, blocks, kv_seq, kv_pos = model.calls[-1]
        plan, shard, rblocks, rfeats, batch = next(ref)
        _same_tensor(feats, rfeats, "features")
        _same_tensor(kv_seq, torch.as_tensor(shard["kv_seq"]), "kv_seq")
        _same_tensor(kv_pos, torch.as_tensor(shard["kv_pos"]), "kv_pos")
        _same_tensor(blocks.labels, rblocks.labels, "labels")
        _same_tensor(blocks.loss_weight, rblocks.loss_weight, "loss_weight")
        assert mod._STATE["stats"] == {"tokens": batch.num_tokens, "imbalance": float(plan.imbalance)}
        assert it.ready is (ahead != "off"), (ahead, it.ready)  # the next batch prepared during the forward
    assert model.metadata == [None] * 3  # no --context-parallel-impl: no metadata built
    it.close()


@pytest.mark.parametrize("workers, flag, built", [(1, None, True), (0, "on", True), (1, "off", False),
                                                  (0, None, False)])
def test_pretrain_forward_step_binds_worker_metadata(store, monkeypatch, workers, flag, built):
    """--context-parallel-impl splitkv with --dflash-host-metadata (default on with workers): the provider builds
    the metadata in the pipeline with the drafter config's per-TP-rank shapes, forward_step binds it to the
    drafter's CP group and passes it as `metadata=`; it equals prepare_splitkv_metadata_from_plan(...).bind
    of the batch the old synchronous code built. Off (or 0 workers by default): nothing is passed. DP=2 rank 1,
    CP=1 (binding needs no process group), resumed at iteration 2."""
    import types

    from megatron_splitkv.megatron.models import qwen3_config
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from test_metadata_from_plan import meta_diff

    mod = _patched_pretrain(monkeypatch, f"pretrain_dflash_meta{workers}{flag}", store, cp=(1, 0),
                            dflash_data_workers=workers, context_parallel_impl="splitkv",
                            dflash_host_metadata=flag, tensor_model_parallel_size=2, splitkv_kernel="auto")
    # the drafter's config: 8 heads / 4 query groups x 16 over TP = 2 -> 4 / 2 heads per TP rank
    cfg = qwen3_config(num_layers=1, hidden_size=128, num_attention_heads=8, num_query_groups=4, kv_channels=16,
                       ffn_hidden_size=64)
    monkeypatch.setitem(mod._STATE, "config", cfg)
    monkeypatch.setitem(mod._STATE, "pgs", types.SimpleNamespace(cp=None))
    if not torch.cuda.is_available():
        monkeypatch.setattr(mod, "_device", lambda: torch.device("cpu"))
    it, _, _ = mod.train_valid_test_datasets_provider(None)
    model = _Model()
    loader = ShareGPTLoader(max_tokens=MAX_TOKENS, num_anchors=ANCHORS, seed=3, corpus=store.corpus())
    ref = _old_forward_step_items(_naive_batches(loader, 2, 1, 4), 1, 0, store)
    try:
        for _ in range(3):
            mod.forward_step(it, model)
            meta = model.metadata[-1]
            plan, shard, rblocks, rfeats, batch = next(ref)
            _same_tensor(model.calls[-1][2], torch.as_tensor(shard["kv_seq"]), "kv_seq")
            if not built:
                assert meta is None
                continue
            assert meta is not None and meta.bound and (meta.group.size, meta.group.rank) == (1, 0)
            want = prepare_splitkv_metadata_from_plan(
                plan, 0, block_size=BLOCK, num_heads_q=4, num_heads_kv=2, head_dim=16, dtype=torch.float32,
                flex_block_masks=torch.cuda.is_available()).bind(None, mod._device())
            assert meta_diff(meta, want) == []
    finally:
        it.close()


def test_host_metadata_flag():
    pytest.importorskip("megatron.core")
    import argparse

    from megatron_splitkv.megatron import SplitKVArgumentError, add_splitkv_args, validate_splitkv_args
    from megatron_splitkv.megatron.arguments import host_metadata_from_args

    p = add_splitkv_args(argparse.ArgumentParser())
    for argv, workers, want in (([], 1, False), (["--context-parallel-impl", "splitkv"], 1, True),
                                (["--context-parallel-impl", "splitkv"], 0, False),
                                (["--context-parallel-impl", "splitkv", "--dflash-host-metadata", "on"], 0, True),
                                (["--context-parallel-impl", "splitkv", "--dflash-host-metadata", "off"], 2, False),
                                (["--context-parallel-impl", "ring-kv"], 2, False)):
        a = p.parse_args(argv)
        assert host_metadata_from_args(a, workers) is want, argv
    a = p.parse_args(["--context-parallel-impl", "allgather-kv", "--dflash-host-metadata", "on"])
    with pytest.raises(SplitKVArgumentError, match="--dflash-host-metadata on needs --context-parallel-impl splitkv"):
        validate_splitkv_args(a, have_te=True)
    with pytest.raises(SplitKVArgumentError, match="--dflash-host-metadata must be one of"):
        host_metadata_from_args(argparse.Namespace(dflash_host_metadata="yes", context_parallel_impl="splitkv"))
    with pytest.raises(SystemExit):
        p.parse_args(["--dflash-host-metadata", "maybe"])


def test_pretrain_prefetcher_unwraps_megatron_iterators():
    """forward_step finds the DevicePrefetcher under Megatron's RerunDataIterator (nested too); an iterator
    that does not wrap one is a clear TypeError naming the flag, not an AttributeError deep in the step."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_splitkv.data.prefetch import DevicePrefetcher

    mod = _load_pretrain("pretrain_dflash_unwrap")
    p = DevicePrefetcher(iter(range(3)), lambda x: x)
    assert mod._prefetcher(p) is p
    assert mod._prefetcher(RerunDataIterator(p)) is p
    assert mod._prefetcher(RerunDataIterator(RerunDataIterator(p))) is p
    with pytest.raises(TypeError, match="--dflash-device-prefetch"):
        mod._prefetcher(RerunDataIterator(iter(range(3))))


# ---------------------------------------------------------------------------------------------------------
# The packed hand-over (one flat buffer + a header of Python values per item)
# ---------------------------------------------------------------------------------------------------------


def _random_batch(rng, tiny=False):
    """A random packed batch: 1-4 sequences of 1-160 tokens, some without any anchor candidate (loss mask
    off), up to 6 anchors each; `tiny`: one sequence of one token (fewer context tokens than ranks: whatever
    the planner chooses, the other ranks get no context at all)."""
    from megatron_splitkv.data.sharegpt import make_packed_batch

    pieces = []
    for _ in range(1 if tiny else int(rng.integers(1, 5))):
        n = 1 if tiny else int(rng.integers(1, 160))
        mask = rng.random(n) < 0.8 if rng.random() < 0.8 else np.zeros(n, dtype=bool)
        pieces.append((rng.integers(0, MASK_ID, size=n), mask))
    return make_packed_batch(pieces, num_anchors=int(rng.integers(1, 7)), rng=rng,
                             source=rng.integers(0, 1000, size=len(pieces)))


class _CountingPickler:
    """torch's ForkingPickler (the DataLoader's queues) counting what crosses: tensors and storages reduced by
    torch's reducers (each storage one shared-memory segment), item buffers (`_ItemBuffer`, one segment)."""

    def __init__(self):
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing import reductions

        from megatron_splitkv.data import pipeline

        self.counts = {"tensor": 0, "storage": 0, "item_buffer": 0}
        originals = {reductions.reduce_tensor: "tensor", reductions.reduce_storage: "storage",
                     pipeline._reduce_item_buffer: "item_buffer"}

        def counted(key, fn):
            def f(x):
                self.counts[key] += 1
                return fn(x)
            return f

        class P(ForkingPickler):
            _extra_reducers = {t: (counted(originals[fn], fn) if fn in originals else fn)
                               for t, fn in ForkingPickler._extra_reducers.items()}

        self.cls = P

    def dumps(self, obj) -> bytes:
        import io
        import pickle

        buf = io.BytesIO()
        self.cls(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue()


def _as_worker(monkeypatch):
    """plan_batch as in a DataLoader worker (its buffer allocated in shared memory)."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("k, axis", [(1, None), (2, None), (2, "heads")])
def test_packed_round_trip_equals_direct_build(P, k, axis, monkeypatch):
    """Fresh random batches and plans (P = 1-4, uneven and empty shards, k = 1 and 2 chunks): an item packed as
    a worker packs it, through torch's ForkingPickler (the DataLoader's path: ONE item buffer, nothing else
    shared) and through a plain pickle (by value), then `to`, equals the item built directly on every field,
    and its metadata equals `prepare_splitkv_metadata_from_plan` run here field by field (flex tables
    included); at P = 1 `bind` equals the reference's bind."""
    import pickle

    from megatron_splitkv.data import MetadataSpec
    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from test_metadata_from_plan import meta_diff

    spec = MetadataSpec(num_heads_q=HQ, num_heads_kv=HKV, head_dim=HD, dtype=torch.float32, num_chunks=k,
                        flex_block_masks=True, chunk_axis=axis)
    rng = np.random.default_rng(100 * P + k)
    empty_seen = False
    for trial in range(4):
        batch = _random_batch(rng, tiny=trial == 0)
        chunk = 64 if trial == 0 else int(rng.integers(4, 64))
        for rank in range(P):
            kw = dict(_kw(P, rank), chunk_size=chunk, metadata=spec, index=trial)
            direct = plan_batch(batch, **kw)
            with monkeypatch.context() as m:
                _as_worker(m)
                packed = plan_batch(batch, **kw)
            ref = prepare_splitkv_metadata_from_plan(direct.plan, rank, block_size=BLOCK, num_heads_q=HQ,
                                                     num_heads_kv=HKV, head_dim=HD, dtype=torch.float32,
                                                     num_chunks=k, flex_block_masks=True, chunk_axis=axis)
            assert ref.chunk_axis == (axis or "rows") and (axis is None or ref.num_chunks == k)
            empty_seen |= direct.kv_seq.numel() == 0
            counter = _CountingPickler()
            from multiprocessing.reduction import ForkingPickler

            via_queue = ForkingPickler.loads(counter.dumps(packed))
            assert counter.counts == {"tensor": 0, "storage": 0, "item_buffer": 1}, counter.counts
            by_value = pickle.loads(pickle.dumps(packed))
            for y in (packed, via_queue, by_value, via_queue.to("cpu"), by_value.to("cpu")):
                _same_item(direct, y)
                assert _meta_problems(y.metadata, ref) == [], (P, k, trial, rank)
                assert _meta_problems(direct.metadata, ref) == []
                up = y.buffers[0].untyped_storage().data_ptr()
                assert up == y.buffers[2].untyped_storage().data_ptr()  # one buffer
                assert all(t.untyped_storage().data_ptr() == up for t in unique_tensors(y.metadata))
            if P == 1:
                assert meta_diff(via_queue.to("cpu").metadata.bind(None, "cpu"), ref.bind(None, "cpu")) == []
    if P >= 2:
        assert empty_seen  # the random batches did give a rank without context


def test_one_buffer_crosses_the_worker_boundary_per_item(store):
    """Per item, exactly ONE shared-memory buffer crosses from a DataLoader worker to the training process (no
    other tensor, storage or file descriptor), with and without the metadata and with offline features: the
    received item, handed on again, pickles as one item buffer and nothing else; every tensor of it is a view
    of that one buffer."""
    for kwargs in ({}, {"metadata": _spec()}, {"metadata": _spec(flex=False)}):
        items = _take(PrefetchedBatches(_source(corpus=_corpus(seed=1)), num_workers=1, pin_memory=False, **kwargs,
                                        **_kw(2, 1, store)),
                      3)
        for y in items:
            counter = _CountingPickler()
            counter.dumps(y)
            assert counter.counts == {"tensor": 0, "storage": 0, "item_buffer": 1}, (kwargs, counter.counts)
            whole = y.packing[0].tensor
            assert whole.is_shared() and y.packing[0].by_name
            ptr = whole.untyped_storage().data_ptr()
            tensors = [y.kv_seq, y.kv_pos, y.input_ids, y.features, y.source, *y.shard.values(),
                       *(getattr(y.blocks, f) for f in ("input_ids", "labels", "loss_weight", "block_keep"))]
            if y.metadata is not None:
                tensors += unique_tensors(y.metadata)
            assert all(t.untyped_storage().data_ptr() == ptr for t in tensors)


def test_lazy_metadata_field():
    """`PlannedBatch.metadata` defaults to None, is built once on first access (the same object after), and a
    hand-built item keeps what it was given."""
    item = plan_batch(next(_source()()), metadata=_spec(), **_kw(2, 0))
    back = __import__("pickle").loads(__import__("pickle").dumps(item))
    from megatron_splitkv.data.pipeline import _PendingMetadata, _raw_metadata

    assert type(_raw_metadata(back)) is _PendingMetadata
    assert back.metadata is back.metadata and not back.metadata.bound
    plain = plan_batch(next(_source()()), **_kw(2, 0))
    assert plain.metadata is None
    import dataclasses

    assert dataclasses.replace(plain).metadata is None
    assert dataclasses.replace(plain, metadata=item.metadata).metadata is item.metadata


def test_split_views_errors():
    """The packed views refuse a misaligned, overlapping or out-of-range entry with a ValueError."""
    buf = torch.zeros(64, dtype=torch.uint8)
    a, b = split_views(buf, [(torch.int64, (2,), 0), (torch.int32, (2, 2), 16)])
    assert a.shape == (2,) and b.shape == (2, 2) and a.untyped_storage().data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="not aligned"):
        split_views(buf, [(torch.int64, (1,), 4)])
    with pytest.raises(ValueError, match="overlap"):
        split_views(buf, [(torch.int64, (2,), 0), (torch.int64, (1,), 8)])
    with pytest.raises(ValueError, match="past the 64-byte buffer"):
        split_views(buf, [(torch.int64, (9,), 0)])


def test_worker_init_ends_the_process_like_a_forked_worker(tmp_path):
    """`_worker_init` (the pipeline's DataLoader worker_init_fn): the worker process ends with os._exit(0)
    after its own exit work, like a forked worker, so a spawn / forkserver worker skips the interpreter
    finalisation in which it aborted now and then (SIGABRT at C++ static destruction). Checked in a child
    process: output printed before is flushed, handlers registered later still run (atexit is LIFO), the
    finalisation-time ones registered before do not, exit code 0; and the DataLoader is built with it."""
    import subprocess
    import sys

    code = f"""
import atexit, sys
sys.path.insert(0, {ROOT!r})
atexit.register(lambda: open({str(tmp_path / 'before')!r}, 'w').write('ran'))
from megatron_splitkv.data.pipeline import _worker_init
_worker_init(0)
atexit.register(lambda: open({str(tmp_path / 'after')!r}, 'w').write('ran'))
sys.stdout.write('unflushed output')
sys.exit(0)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "unflushed output", (p.returncode, p.stdout, p.stderr[-2000:])
    assert (tmp_path / "after").exists() and not (tmp_path / "before").exists()
    from megatron_splitkv.data.pipeline import _worker_init

    pipe = PrefetchedBatches(_source(), num_workers=1, **_kw(2, 0))
    try:
        assert pipe.loader.worker_init_fn is _worker_init
    finally:
        pipe.close()


# ---------------------------------------------------------------------------------------------------------
# data_parallel_batches with fewer batches an epoch than DP ranks
# ---------------------------------------------------------------------------------------------------------


class _FakeLoader:
    """`ShareGPTLoader`'s interface (set_epoch(epoch, start=), len, iteration from start): n batches an epoch."""

    def __init__(self, n):
        self.n, self.epoch, self.start = n, 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter([(self.epoch, b) for b in range(self.start, self.n)])


def _next_or_hang(gen, timeout=5.0):
    box = {}

    def run():
        try:
            box["value"] = next(gen)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "data_parallel_batches hung (looked for a batch forever)"
    return box


@pytest.mark.parametrize("n, dp, skip", [(1, 2, 0), (1, 2, 3), (2, 3, 0), (3, 4, 1)])
def test_data_parallel_batches_fewer_batches_than_dp_ranks_raises_on_every_rank(n, dp, skip):
    """A loader with fewer batches an epoch than DP ranks: the last DP ranks never got a batch and
    `data_parallel_batches` looped over epochs forever (a hang while the other DP ranks wait for it in the
    all-reduce). Now every DP rank raises the same ValueError naming dp_size."""
    for dpr in range(dp):
        box = _next_or_hang(data_parallel_batches(_FakeLoader(n), dp, dpr, skip))
        assert isinstance(box.get("error"), ValueError), box
        assert "dp_size" in str(box["error"])


def test_data_parallel_batches_enough_batches_still_works():
    for dpr in range(2):
        got = [_next_or_hang(g)["value"] for g in [data_parallel_batches(_FakeLoader(3), 2, dpr)] for _ in range(3)]
        want = [(0, 0), (0, 2), (1, 0)] if dpr == 0 else [(0, 1), (1, 1), (2, 1)]
        assert got == want


# ---------------------------------------------------------------------------------------------------------
# Shared cases through the pipeline (DataLoader workers, the packed item buffer)
# ---------------------------------------------------------------------------------------------------------


def _batch(lens, masks=None, num_anchors=4, seed=0):
    rng = np.random.default_rng(seed)
    pieces = []
    for j, n in enumerate(lens):
        m = np.ones(n, bool) if masks is None or masks[j] is None else np.asarray(masks[j], bool)
        pieces.append((rng.integers(0, MASK_ID, size=n), m))
    return make_packed_batch(pieces, num_anchors=num_anchors, rng=rng, source=np.arange(len(lens)))


def _cases():
    """{P: [(name, batch, chunk_size)]}: C4, C5, C6, C8 of /work/shared/cases (block size 4)."""
    c4_masks = [None, None, None, np.zeros(40, bool)]  # the last 16 queries (4 blocks) unsupervised
    return {
        2: [("C5 Lk=7", _batch([7], num_anchors=2), 2),
            ("C8 two sequences, permuted chunks", _batch([37, 23], num_anchors=3, seed=1), 5)],
        3: [("C6 Lk=10", _batch([10], num_anchors=2), 1)],
        4: [("C4 one rank unsupervised", _batch([40, 40, 40, 40], c4_masks, num_anchors=4, seed=2), 16),
            ("C4 three ranks unsupervised", _batch([40, 40, 40, 40], [None] + [np.zeros(40, bool)] * 3,
                                                   num_anchors=1, seed=5), 16),
            ("C5 Lk=2999 odd blocks", _batch([2999], num_anchors=9, seed=3), 64),
            ("C6 Lk=2", _batch([2], num_anchors=1), 1)],
        8: [("C5 Lk=4097", _batch([4097], num_anchors=8, seed=4), 64)],
    }


def _gamma():
    return 7.0 * BLOCK / 16  # DESIGN.md: gamma = 7 for a block size of 16, scaled with it (dflash.default_gamma)


def _check_case(name, batch, items):
    """The items of all P ranks against the raw batch (float64 reference)."""
    offs = np.concatenate([[0], np.cumsum(batch.seq_lens)])
    # context: every (sequence, GLOBAL position) exactly once over the ranks, with its token id
    kv = sorted((int(s), int(p)) for it in items for s, p in zip(it.kv_seq.tolist(), it.kv_pos.tolist()))
    assert kv == [(s, p) for s, n in enumerate(batch.seq_lens) for p in range(int(n))], name
    for it in items:
        want = [int(batch.input_ids[offs[s] + p]) for s, p in zip(it.kv_seq.tolist(), it.kv_pos.tolist())]
        assert it.input_ids.tolist() == want, name
    # query blocks: every anchor exactly once; ids, positions, labels, loss weights (DESIGN.md section 1)
    seen, total, ref_total = [], 0.0, 0.0
    for it in items:
        b = it.blocks
        for j in range(b.q_seq.numel()):
            s, a, keep = int(b.q_seq[j]), int(b.q_anchor[j]), bool(b.block_keep[j])
            w = b.loss_weight[j * BLOCK:(j + 1) * BLOCK].double()
            total += float(w.sum())
            if not keep:
                assert torch.all(w == 0), name
                continue
            seen.append((s, a))
            S, x, m = int(batch.seq_lens[s]), batch.input_ids[offs[s]:offs[s + 1]], batch.loss_mask[offs[s]:offs[s + 1]]
            assert b.input_ids[j * BLOCK] == x[a] and torch.all(b.input_ids[j * BLOCK + 1:(j + 1) * BLOCK] == MASK_ID), name
            assert b.position_ids[j * BLOCK:(j + 1) * BLOCK].tolist() == [a + k for k in range(BLOCK)], name
            ref = [0.0] + [float(a + k < S and m[a + k]) * math.exp(-(k - 1) / _gamma()) for k in range(1, BLOCK)]
            ref_total += sum(ref)
            assert np.allclose(w.numpy(), ref, rtol=1e-6, atol=0), (name, s, a)
            for k in range(1, BLOCK):
                if a + k < S and ref[k] > 0:
                    assert int(b.labels[j * BLOCK + k]) == int(x[a + k]), name
    assert sorted(seen) == sorted((s, int(a)) for s, anc in enumerate(batch.anchors) for a in anc), name
    assert math.isclose(total, ref_total, rel_tol=1e-6), name  # the global denominator (C4: no 0/0)
    return [float(it.blocks.loss_weight.double().sum()) for it in items]


def test_shared_cases_through_worker_pipeline():
    """C4, C5, C6, C8 through DataLoader workers (the packed item buffer, 2 workers at P = 2): on every rank
    the context tokens are exactly the batch's, each once with its global position and id; every anchor's
    block is on exactly one rank with the right ids, positions, labels and loss weights; C4 has a rank with
    no supervised token and the global weight sum equals the reference."""
    for P, cases in _cases().items():
        per_rank = []
        for r in range(P):
            # one pipeline per rank over the cases of this P (chunk size per case: one stream per case)
            got = []
            for name, batch, chunk in cases:
                with PrefetchedBatches(functools.partial(iter, [batch]), num_workers=2 if P == 2 else 1,
                                       prefetch=1, pin_memory=False, cp_size=P, cp_rank=r, block_size=BLOCK,
                                       mask_token_id=MASK_ID, chunk_size=chunk) as p:
                    (item,) = list(p)
                got.append(item)
            per_rank.append(got)
        for i, (name, batch, _) in enumerate(cases):
            sums = _check_case(name, batch, [per_rank[r][i] for r in range(P)])
            if name.startswith("C4 three"):
                assert sorted(sums)[:3] == [0.0] * 3 and sum(sums) > 0, sums


# ---------------------------------------------------------------------------------------------------------
# Shared-memory segments of items that never reached the training process
# ---------------------------------------------------------------------------------------------------------


def _segments_of(pids):
    names = os.listdir("/dev/shm")
    return sorted(n for n in names for pid in pids if n.startswith(f"torch_{pid}_"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
@pytest.mark.parametrize("pin", [False, True])
def test_close_frees_the_segments_of_unconsumed_items(pin):
    """Items the workers prepared ahead but the training process never took (2 workers x prefetch 3) must not
    keep their shared-memory segments after `close()` and the dropped items: with the by-name hand-over each
    sent item holds a reference for its receiver, so the unreceived ones stayed in /dev/shm until the process
    exited (every close leaked up to workers x prefetch item buffers, feature rows included)."""
    import gc
    import time

    if pin and not torch.cuda.is_available():
        pytest.skip("pin_memory needs CUDA")
    batches = [_batch([int(n)], seed=i) for i, n in enumerate(np.random.default_rng(0).integers(30, 200, 12))]
    p = PrefetchedBatches(functools.partial(iter, batches), num_workers=2, prefetch=3, pin_memory=pin, cp_size=2,
                          cp_rank=0, block_size=BLOCK, mask_token_id=MASK_ID, chunk_size=16)
    pids = [w.pid for w in p._it._workers]
    first = [next(p), next(p)]
    deadline = time.time() + 20
    while len(_segments_of(pids)) < 6 and time.time() < deadline:  # the workers fill their prefetch slots
        time.sleep(0.05)
    assert len(_segments_of(pids)) >= 6
    held = _segments_of(pids)
    p.close()
    left = _segments_of(pids)
    assert len(left) == 2 and set(left) <= set(held), left  # only the two items still held here
    assert first[0].kv_seq.numel() > 0 and int(first[1].index) == 1  # still readable
    del first
    gc.collect()
    assert _segments_of(pids) == []
