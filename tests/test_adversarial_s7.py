"""Adversarial tests of the s7 data-pipeline changes (the flat shared item buffer, the lazy metadata, the
DevicePrefetcher). Expected values come from independent references: the raw token arrays and DESIGN.md's
loss-weight formula in float64, never from the code under test. CPU only, small inputs."""

import functools
import math

import numpy as np
import pytest
import torch

from megatron_splitkv.data import PrefetchedBatches
from megatron_splitkv.data.prefetch import DevicePrefetcher
from megatron_splitkv.data.sharegpt import make_packed_batch
from _warning_marks import FORK  # marks of the warnings these tests trigger

pytestmark = FORK

B, MASK_ID = 4, 999


# ---------------------------------------------------------------------------------------------------------
# DevicePrefetcher
# ---------------------------------------------------------------------------------------------------------


def _stop_on(bad):
    def prepare(x):
        if x == bad:
            raise StopIteration("from prepare")
        return x
    return prepare


@pytest.mark.parametrize("ahead", [False, True])
def test_prepare_raising_stop_iteration_is_an_error_not_the_end(ahead):
    """A StopIteration raised by `prepare` (e.g. a `next()` on an exhausted iterator inside it) is an error of
    that item, not the end of the source: the iteration must not end silently after 2 of 5 items."""
    p = DevicePrefetcher(iter(range(5)), _stop_on(2))
    got = []
    with pytest.raises(RuntimeError, match="prepare raised StopIteration"):
        for _ in range(5):
            got.append(next(p))
            if ahead:
                p.prefetch()
    assert got == [0, 1]
    assert next(p) == 3  # the source was not ended: the next item comes


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
    return 7.0 * B / 16  # DESIGN.md: gamma = 7 for B = 16, scaled with B (dflash.default_gamma)


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
            w = b.loss_weight[j * B:(j + 1) * B].double()
            total += float(w.sum())
            if not keep:
                assert torch.all(w == 0), name
                continue
            seen.append((s, a))
            S, x, m = int(batch.seq_lens[s]), batch.input_ids[offs[s]:offs[s + 1]], batch.loss_mask[offs[s]:offs[s + 1]]
            assert b.input_ids[j * B] == x[a] and torch.all(b.input_ids[j * B + 1:(j + 1) * B] == MASK_ID), name
            assert b.position_ids[j * B:(j + 1) * B].tolist() == [a + k for k in range(B)], name
            ref = [0.0] + [float(a + k < S and m[a + k]) * math.exp(-(k - 1) / _gamma()) for k in range(1, B)]
            ref_total += sum(ref)
            assert np.allclose(w.numpy(), ref, rtol=1e-6, atol=0), (name, s, a)
            for k in range(1, B):
                if a + k < S and ref[k] > 0:
                    assert int(b.labels[j * B + k]) == int(x[a + k]), name
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
                                       prefetch=1, pin_memory=False, cp_size=P, cp_rank=r, block_size=B,
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
    import os

    names = os.listdir("/dev/shm")
    return sorted(n for n in names for pid in pids if n.startswith(f"torch_{pid}_"))


@pytest.mark.skipif(not __import__("os").path.isdir("/dev/shm"), reason="Linux /dev/shm")
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
                          cp_rank=0, block_size=B, mask_token_id=MASK_ID, chunk_size=16)
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
