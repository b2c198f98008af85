"""The Megatron DFlash drafter + online target features under CP (CPU, gloo): loss and every gradient at
CP = 2 and 4 equal CP = 1, on a permuted (LPT, small chunks) context layout, including case C4 (Lq = 64,
the last 16 queries unsupervised, P = 4: one rank holds no supervised token).

One spawn of 4 gloo ranks runs all three CP sizes (CP=1 on each rank alone, CP=2 on {0,1} and {2,3},
CP=4 on all), to keep the suite fast on 2 cores.
"""

import math
import os

import pytest
import torch

from _dist import run_distributed
from megatron_splitkv import SplitKVConfig
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

pytest.importorskip("megatron.core")

B = 16
VOCAB, MASK_ID = 128, 127
SEQ_LENS = [41, 30]
ANCHORS = [[0, 17], [5, 20]]  # anchor 0 sees no context; sequence 1 is unsupervised after 20


def _batch():
    g = torch.Generator().manual_seed(3)
    T = sum(SEQ_LENS)
    ids = torch.randint(0, VOCAB - 1, (T,), generator=g)
    loss_mask = torch.ones(T, dtype=torch.bool)
    loss_mask[SEQ_LENS[0] + 21 :] = False  # block 4 = the last 16 queries predicts nothing
    return {"input_ids": ids, "loss_mask": loss_mask}


def _models(pgs, cp_impl, config=None):
    from megatron_splitkv.dflash import target_layer_ids
    from megatron_splitkv.megatron.models import (
        DFlashDraftModel,
        TargetFeatureProvider,
        build_target_model,
        qwen3_config,
    )

    tcfg = qwen3_config(num_layers=6, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        kv_channels=16, ffn_hidden_size=128)
    target = build_target_model(tcfg, vocab_size=VOCAB, max_sequence_length=128, pg_collection=pgs, seed=0)
    taps = target_layer_ids(6, 2)
    provider = TargetFeatureProvider(target, taps)
    dcfg = qwen3_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        kv_channels=16, ffn_hidden_size=128)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(dcfg, num_taps=len(taps), word_embeddings=provider.word_embeddings,
                               output_layer=provider.output_layer, mask_token_id=MASK_ID, block_size=B,
                               cp_impl=cp_impl, pg_collection=pgs, splitkv_config=config)
    return provider, drafter


def _step(pgs, cp_rank, cp_size, cp_impl, config=None):
    from megatron_splitkv.data.sharding import shard_batch
    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.planning import plan_context_parallel

    batch = _batch()
    plan = plan_context_parallel(SEQ_LENS, ANCHORS, block_size=B, cp_size=cp_size, chunk_size=8,
                                 strategy="lpt")
    shard = shard_batch(batch, plan, cp_rank)
    sl = plan.query_slice(cp_rank)
    blocks = build_draft_blocks(batch["input_ids"], SEQ_LENS, plan.q_seq[sl], plan.q_anchor[sl],
                                block_size=B, mask_token_id=MASK_ID, loss_mask=batch["loss_mask"])
    provider, drafter = _models(pgs, cp_impl, config)
    feats = provider(shard["input_ids"], shard["kv_seq"], shard["kv_pos"])
    out = drafter(feats, blocks, shard["kv_seq"], shard["kv_pos"])
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    frozen = [n for n, p in drafter.named_parameters() if not p.requires_grad]
    return out, grads, frozen, float(blocks.loss_weight.sum()), provider, shard, feats


def _target_checks(provider, shard, feats):
    """Causal target on the packed batch (CP=1, all tokens in order): each sequence's features equal
    the sequence run alone (no attention across sequences) and do not depend on later tokens."""
    s0 = SEQ_LENS[0]
    ids = shard["input_ids"]
    alone = provider(ids[s0:], torch.zeros(SEQ_LENS[1], dtype=torch.long), torch.arange(SEQ_LENS[1]))
    changed = ids.clone()
    changed[20:s0] = (changed[20:s0] + 1) % (VOCAB - 1)  # alter sequence 0 from position 20 on
    f2 = provider(changed, shard["kv_seq"], shard["kv_pos"])
    return dict(isolation=float((alone - feats[s0:]).abs().max()),
                prefix=float((f2[:20] - feats[:20]).abs().max()),
                after=float((f2[20:s0] - feats[20:s0]).abs().max()),
                shape=list(feats.shape))


def _offline(rank, P, g, provider, shard, feats, tmp):
    """Offline features: written at CP=1 (rank 0) and CP=2 (the gather path), read back per shard."""
    import torch.distributed as dist

    from megatron_splitkv.megatron.models import FeatureStore, write_features

    batch, s0 = _batch(), SEQ_LENS[0]
    convs = [(10, batch["input_ids"][:s0], batch["loss_mask"][:s0]),
             (11, batch["input_ids"][s0:], batch["loss_mask"][s0:])]
    if P in (1, 2):
        path = os.path.join(tmp, f"cp{P}_g{rank // P}")
        write_features(provider, convs, path, cp_group=g if P > 1 else None, dtype=torch.float32,
                       meta={"test": True})
    dist.barrier()
    store = FeatureStore(os.path.join(tmp, "cp1_g0"))
    rows = store.rows([0, 1], shard["kv_seq"], shard["kv_pos"])
    err = float((rows - feats).abs().max()) if rows.numel() else 0.0
    same_file = None
    if P == 2 and rank == 0:
        other = FeatureStore(os.path.join(tmp, "cp2_g0"))
        same_file = float(abs(torch.from_numpy(other._mm[:]) - torch.from_numpy(store._mm[:])).max())
        same_file = (same_file, other.conv_ids.tolist(), bool((other.tokens == store.tokens).all()))
    return dict(err=err, same_file=same_file)


def _weights_roundtrip(pgs, provider, shard, feats, tmp):
    """load_target_weights: a state dict with Transformer Engine key names loads into a fresh target."""
    from megatron_splitkv.megatron.models import TargetFeatureProvider, build_target_model, load_target_weights

    sd = {}
    for k, v in provider.model.state_dict().items():
        k = k.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        k = k.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        sd[k] = v
    sd["decoder.layers.0.self_attention.core_attention._extra_state"] = None
    path = os.path.join(tmp, "target.pt")
    torch.save({"model": sd}, path)
    fresh = build_target_model(provider.model.config, vocab_size=VOCAB, max_sequence_length=128,
                               pg_collection=pgs, seed=99)
    before = TargetFeatureProvider(fresh, provider.tap_layers)(shard["input_ids"], shard["kv_seq"], shard["kv_pos"])
    load_target_weights(fresh, path)
    after = TargetFeatureProvider(fresh, provider.tap_layers)(shard["input_ids"], shard["kv_seq"], shard["kv_pos"])
    return float((before - feats).abs().max()), float((after - feats).abs().max())


def _worker(rank, world, cp_impl, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = None
    if cp_impl == "splitkv-heads":  # Split-KV's head chunks from the config (2 kv heads: k = 2 splits them)
        config = SplitKVConfig(chunk_axis="heads", num_chunks=2)
        cp_impl = "splitkv"
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    base = ProcessGroupCollection.use_mpu_process_groups()
    groups = {1: [dist.new_group([r]) for r in range(world)],
              2: [dist.new_group([0, 1]), dist.new_group([2, 3])],
              4: [dist.group.WORLD]}
    res = {}
    for P in (1, 2, 4):
        g = groups[P][rank // P]
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        pgs.cp = g
        out, grads, frozen, wsum, provider, shard, feats = _step(pgs, rank % P, P, cp_impl, config)
        if P == 1 and rank == 0:
            res["target"] = _target_checks(provider, shard, feats)
        if P == 1 and rank == 1:
            res["weights"] = _weights_roundtrip(pgs, provider, shard, feats, tmp)
        for v in grads.values():  # replicated parameters: the exact gradient is the sum over ranks
            dist.all_reduce(v, group=g)
        parts = out.loss.detach().clone()
        dist.all_reduce(parts, group=g)
        res[P] = dict(total=float(out.total), sum=float(parts), wsum_local=wsum,
                      grads={n: v.tolist() for n, v in grads.items()}, frozen=frozen,
                      offline=_offline(rank, P, g, provider, shard, feats, tmp))
    del base
    return res


@pytest.mark.parametrize("cp_impl", ["splitkv", "splitkv-heads"])
def test_drafter_loss_and_grads_cp_equal_single(cp_impl, tmp_path):
    res = run_distributed(_worker, 4, cp_impl, str(tmp_path), timeout=240)
    ref = res[0][1]
    tgt = res[0]["target"]
    assert tgt["shape"] == [sum(SEQ_LENS), 2 * 64]  # two taps of hidden 64
    assert tgt["isolation"] < 1e-5 and tgt["prefix"] < 1e-5 and tgt["after"] > 1e-3, tgt
    assert math.isfinite(ref["total"]) and ref["total"] > 0
    assert abs(ref["sum"] - ref["total"]) < 1e-5 * ref["total"]
    # the shared embedding and LM head are frozen, everything else trains
    assert any("word_embeddings" in n for n in ref["frozen"]) and any("output_layer" in n for n in ref["frozen"])
    assert any(n.startswith("fc.") for n in ref["grads"]) and any("decoder" in n for n in ref["grads"])
    before, after = res[1]["weights"]
    assert before > 1e-3 and after < 1e-6, (before, after)  # a different seed differs; loaded weights match
    # offline features (tools/extract_features.py's store): every rank's shard rows equal the online
    # features at every CP size, and the file written under CP=2 equals the CP=1 one
    for r in range(4):
        for P in (1, 2, 4):
            assert res[r][P]["offline"]["err"] < 1e-5, (r, P, res[r][P]["offline"])
    diff, conv_ids, same_tokens = res[0][2]["offline"]["same_file"]
    assert diff < 1e-5 and conv_ids == [10, 11] and same_tokens
    # C4: at P = 4 rank 3 holds the last block, whose 16 queries are all unsupervised
    assert res[3][4]["wsum_local"] == 0.0 and res[0][4]["wsum_local"] > 0
    for r in range(4):
        for P in (2, 4):
            got = res[r][P]
            assert math.isclose(got["total"], ref["total"], rel_tol=1e-5), (r, P)
            assert math.isclose(got["sum"], ref["total"], rel_tol=1e-5), (r, P)
            for n, gref in ref["grads"].items():
                a, b = torch.tensor(got["grads"][n]), torch.tensor(gref)
                assert torch.isfinite(a).all(), n
                assert b.abs().max() > 0, f"{n}: zero gradient at CP=1"
                torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-6, msg=f"{n} at CP={P}, rank {r}")


def test_pretrain_script_and_tool_parse_on_cpu(tmp_path):
    """examples/pretrain_dflash.py needs CUDA to train; on CPU it must import and parse its flags
    (--features-path must name an existing directory: tests/test_faults_flags.py)."""
    import importlib.util
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")

    def load(rel, name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, rel))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    pre = load("examples/pretrain_dflash.py", "pretrain_dflash")
    argv = sys.argv
    try:
        args = pre.main(["--parse-only", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
                         "--context-parallel-impl", "allgather-kv", "--num-anchors", "8", "--block-size", "4",
                         "--loss-decay-gamma", "1.75", "--target-num-layers", "6", "--features-path", str(tmp_path),
                         "--attention-dropout", "0", "--transformer-impl", "local"])
    finally:
        sys.argv = argv
    assert (args.dflash_num_anchors, args.dflash_block_size, args.loss_decay_gamma) == (8, 4, 1.75)
    assert args.context_parallel_impl == "allgather-kv" and args.features_path == str(tmp_path)
    assert args.target_num_layers == 6 and args.mask_token_id == pre.QWEN3_FIRST_UNUSED_ID
    tool = load("tools/extract_features.py", "extract_features")
    targs = tool.parse_args(["--out", "/tmp/f", "--tap-layers", "1", "3", "--dtype", "float16"])
    assert targs.tap_layers == [1, 3] and targs.dtype == "float16"
