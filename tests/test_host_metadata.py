"""Split-KV metadata built in the data pipeline and bound in the step (`MetadataSpec`, `PlannedBatch.metadata`,
`DFlashPackedSeqParams.metadata`, `DFlashDraftModel.forward(..., metadata=)`), CPU, gloo, no timing:

* the drafter with the worker-built metadata bound to the CP group gives bit-identical loss and gradients
  to the drafter preparing its own (`prepare_splitkv_metadata` on the first layer), at CP = 1 and CP = 2,
  with the early query all-gather on and off; with the metadata given nothing is prepared, and the early
  query gather (CP = 2, on) runs on it;
* metadata built for other shapes (Hkv, head dim, dtype, block size, CP group), unbound metadata, or passed
  together with packed_seq_params raises ValueError naming what differs, on every rank, before a collective;
* `splitkv_metadata_spec` derives the per-TP-rank heads from the config.
The pipeline side (items equal to `prepare_splitkv_metadata_from_plan`) is in tests/test_data_pipeline.py.
"""

import dataclasses

import numpy as np
import pytest
import torch

from _dist import run_distributed
from megatron_splitkv import SplitKVConfig
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

pytest.importorskip("megatron.core")

B, VOCAB, MASK_ID, HIDDEN = 4, 96, 95, 32
SEQ_LENS = [37, 22, 15]
ANCHORS = [[0, 9, 20, 30], [3, 12], [1, 7]]


def _batch():
    from megatron_splitkv.data.sharegpt import make_packed_batch

    rng = np.random.default_rng(5)
    convs = [(rng.integers(0, MASK_ID, size=n, dtype=np.int64), np.ones(n, dtype=bool)) for n in SEQ_LENS]
    batch = make_packed_batch(convs, num_anchors=4, rng=rng)
    # fixed anchors (a multiple of CP = 2 blocks in all)
    return dataclasses.replace(batch, anchors=[np.array(a, dtype=np.int64) for a in ANCHORS])


def _config(num_layers=2, **kw):
    from megatron_splitkv.megatron.models import qwen3_config

    cfg = dict(hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64)
    cfg.update(kw)
    return qwen3_config(num_layers=num_layers, **cfg)


def _model(pgs, overlap):
    from megatron_splitkv.megatron.models import DFlashDraftModel, build_target_model

    target = build_target_model(_config(1), vocab_size=VOCAB, max_sequence_length=128, pg_collection=pgs, seed=0)
    torch.manual_seed(1)
    return DFlashDraftModel(_config(), num_taps=2, word_embeddings=target.embedding.word_embeddings,
                            output_layer=target.output_layer, mask_token_id=MASK_ID, block_size=B, pg_collection=pgs,
                            use_te=False, overlap_query_gather=overlap)


class _Counter:
    """Counts calls of a module attribute (restored by `close`)."""

    def __init__(self, mod, name):
        self.mod, self.name, self.inner, self.calls = mod, name, getattr(mod, name), 0

        def counted(*a, **k):
            self.calls += 1
            return self.inner(*a, **k)

        setattr(mod, name, counted)

    def close(self):
        setattr(self.mod, self.name, self.inner)


def _run(model, item, feats, **kw):
    model.zero_grad(set_to_none=True)
    out = model(feats, item.blocks, item.kv_seq, item.kv_pos, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.total.detach().clone(), out.loss.detach().clone(), grads


def _errors(model, item, feats, spec, cp_group):
    """The ValueError message (or None) of the model called with metadata that does not fit."""
    from megatron_splitkv.data.pipeline import MetadataSpec

    msgs = {}

    def attempt(name, **kw):
        try:
            model(feats, item.blocks, item.kv_seq, item.kv_pos, **kw)
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)

    def bound(s=spec, group=cp_group, plan=item.plan, block_size=B):
        return s.build(plan, item.cp_rank, block_size).bind(group, "cpu")

    assert isinstance(spec, MetadataSpec)
    attempt("num_heads_kv", metadata=bound(dataclasses.replace(spec, num_heads_kv=1)))
    attempt("head_dim", metadata=bound(dataclasses.replace(spec, head_dim=16)))
    attempt("dtype", metadata=bound(dataclasses.replace(spec, dtype=torch.bfloat16)))
    attempt("num_heads_q", metadata=bound(dataclasses.replace(spec, num_heads_q=2)))
    attempt("unbound", metadata=spec.build(item.plan, item.cp_rank, B))
    attempt("with_params", metadata=bound(),
            packed_seq_params=model.packed_seq_params(item.blocks, item.kv_seq, item.kv_pos))
    import torch.distributed as dist

    if dist.get_world_size(cp_group) == 1:  # bound to the default (world) group instead of the CP group
        try:
            other = spec.build(item.plan, item.cp_rank, B).bind(None, "cpu")
            attempt("group", metadata=other)
        except ValueError as e:  # bind itself refuses a group of another size
            msgs["group"] = "bind: " + str(e)
    return msgs


def _worker(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    import megatron_splitkv.megatron.attention as att
    from megatron_splitkv.data import plan_batch
    from megatron_splitkv.megatron import splitkv_metadata_spec

    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    groups = {1: [dist.new_group([r]) for r in range(world)], 2: [dist.group.WORLD]}
    res = {}
    try:
        for P in (1, 2):
            g = groups[P][rank // P]
            pgs = ProcessGroupCollection.use_mpu_process_groups()
            pgs.cp = g
            spec = splitkv_metadata_spec(_config(), tp_size=1, kernel_backend="auto", cuda=False)
            item = plan_batch(_batch(), cp_size=P, cp_rank=rank % P, block_size=B, mask_token_id=MASK_ID,
                              chunk_size=8, metadata=spec)
            gen = torch.Generator().manual_seed(10 + rank)
            feats = torch.randn(item.kv_seq.shape[0], 2 * HIDDEN, generator=gen)
            for overlap in (True, False):
                model = _model(pgs, overlap)
                prep = _Counter(att, "prepare_splitkv_metadata")
                gath = _Counter(att, "splitkv_start_query_gather")
                try:
                    own = _run(model, item, feats)
                    own_counts = (prep.calls, gath.calls)
                    prep.calls = gath.calls = 0
                    bound = item.metadata.bind(g, "cpu")
                    host = _run(model, item, feats, metadata=bound)
                    host_counts = (prep.calls, gath.calls)
                finally:
                    prep.close()
                    gath.close()
                same = {"total": torch.equal(own[0], host[0]), "loss": torch.equal(own[1], host[1]),
                        "grads": sorted(n for n in own[2] if not torch.equal(own[2][n], host[2][n])),
                        "n_grads": len(own[2]), "nonzero": sum(int(v.abs().sum() > 0) for v in own[2].values())}
                res[(P, overlap)] = dict(same=same, own_counts=own_counts, host_counts=host_counts,
                                         loss=float(own[0]))
            res[(P, "errors")] = _errors(model, item, feats, spec, g)
    finally:
        ps.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=600)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_bound_worker_metadata_bit_identical_loss_and_grads(results, P, overlap):
    for rank, res in enumerate(results):
        r = res[(P, overlap)]
        s = r["same"]
        assert s["total"] and s["loss"] and s["grads"] == [], (rank, s)
        assert s["n_grads"] > 0 and s["nonzero"] > 0 and np.isfinite(r["loss"]), (rank, s)
        # prepared once by its own first layer; never with the metadata given
        assert r["own_counts"][0] == 1 and r["host_counts"][0] == 0, (rank, r)
        # the early query gather runs (CP = 2, overlap on) on the given metadata, as often as without it
        gathers = 2 if (P == 2 and overlap) else 0  # two layers
        assert r["own_counts"][1] == r["host_counts"][1] == gathers, (rank, r)
    assert results[0][(P, overlap)]["loss"] == results[1][(P, overlap)]["loss"] or P == 1


@pytest.mark.parametrize("P", [1, 2])
def test_mismatched_metadata_raises_naming_the_field(results, P):
    for rank, res in enumerate(results):
        e = res[(P, "errors")]
        assert "num_heads_kv (Hkv per TP rank) 1 (layer: 2)" in e["num_heads_kv"], e
        assert "head_dim 16 (layer: 8)" in e["head_dim"], e
        assert "dtype torch.bfloat16 (layer: torch.float32)" in e["dtype"], e
        assert "num_heads_q (Hq per TP rank) 2 (layer: 4)" in e["num_heads_q"], e
        assert "not bound to a CP group" in e["unbound"], e
        assert "packed_seq_params" in e["with_params"], e
        if P == 1:
            assert e["group"] is not None and ("CP group" in e["group"] or "bind:" in e["group"]), e


def test_block_size_mismatch_and_spec_from_config():
    """A block size other than the layers' raises (single process, no group); the spec splits heads by TP."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.data import plan_batch
    from megatron_splitkv.megatron import SplitKVArgumentError, splitkv_metadata_spec
    from megatron_splitkv.megatron.attention import DFlashPackedSeqParams

    spec = splitkv_metadata_spec(_config(num_attention_heads=8, num_query_groups=4, kv_channels=16), tp_size=2,
                                 kernel_backend="flex", cuda=True)
    assert (spec.num_heads_q, spec.num_heads_kv, spec.head_dim, spec.dtype, spec.flex_block_masks) == (
        4, 2, 16, torch.float32, True)
    assert not splitkv_metadata_spec(_config(), kernel_backend="math", cuda=True).flex_block_masks
    with pytest.raises(SplitKVArgumentError, match="--num-query-groups"):
        splitkv_metadata_spec(_config(num_attention_heads=8, num_query_groups=2), tp_size=4)
    del ps, ProcessGroupCollection
    checked = SplitKVConfig(debug_checks=True)  # the metadata's config: the layer compares the index values
    spec = splitkv_metadata_spec(_config(), tp_size=1, cuda=False, splitkv_config=checked)
    item = plan_batch(_batch(), cp_size=1, cp_rank=0, block_size=B, mask_token_id=MASK_ID, chunk_size=8,
                      metadata=spec)
    bound = item.metadata.bind(None, "cpu")
    params = DFlashPackedSeqParams(q_seq=item.blocks.q_seq, q_anchor=item.blocks.q_anchor, kv_seq=item.kv_seq,
                                   kv_pos=item.kv_pos, block_size=B + 1, metadata=bound)
    kw = dict(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32, device="cpu", config=checked)
    with pytest.raises(ValueError, match=r"block_size 4 \(layer: 5\)"):
        params.op_metadata("splitkv", **kw)
    params.block_size = B
    assert params.op_metadata("splitkv", **kw) is bound
    with pytest.raises(ValueError, match="--context-parallel-impl ring-kv"):
        params.op_metadata("ring-kv", **kw)
    # another micro-batch's metadata with the same counts: caught with SplitKVConfig.debug_checks
    params2 = DFlashPackedSeqParams(q_seq=item.blocks.q_seq, q_anchor=item.blocks.q_anchor, kv_seq=item.kv_seq,
                                    kv_pos=item.kv_pos.flip(0), block_size=B, metadata=bound)
    with pytest.raises(ValueError, match="describes another micro-batch"):
        params2.op_metadata("splitkv", **kw)
