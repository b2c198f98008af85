"""Offline features (`examples/pretrain_dflash.py --features-path`): only the target's embedding and LM head
are built (`build_target_model(decoder_layers=False)`), no decoder layer is kept, and the drafter's loss
on a fixed batch equals the one with the whole target (the online path's model) on the same weights:
loaded from a file (no decoder layer is even constructed) or the same random init (same seed).

CPU, one gloo process; reference: the whole target built by `build_target_model` (the pre-fix path).
"""

import argparse
import importlib.util
import os

import pytest
import torch
from _warning_marks import MEGATRON_ENV  # marks of the warnings these tests trigger

pytestmark = MEGATRON_ENV

pytest.importorskip("megatron.core")

B, VOCAB, MASK_ID, HIDDEN, N_TARGET = 4, 64, 63, 32, 4
SEQ_LENS, ANCHORS = [20, 13], [[0, 6, 11], [2, 7]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pgs(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = not dist.is_initialized()
    if own:
        init = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0) if torch.cuda.is_available() else None
    yield ProcessGroupCollection.use_mpu_process_groups()
    ps.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _args(**kw):
    a = dict(target_num_layers=N_TARGET, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
             kv_channels=8, ffn_hidden_size=64, target_num_attention_heads=None, target_num_query_groups=None,
             target_kv_channels=None, target_ffn_hidden_size=None, tensor_model_parallel_size=1,
             context_parallel_size=1, padded_vocab_size=VOCAB, max_position_embeddings=128, rotary_base=1e6,
             target_seed=7, target_load=None, features_path=None)
    a.update(kw)
    return argparse.Namespace(**a)


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_dflash_t", os.path.join(ROOT, "examples", "pretrain_dflash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _LayerCount:
    """Counts TransformerLayer constructions (restored on exit)."""

    def __enter__(self):
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.cls, self.inner, self.n = TransformerLayer, TransformerLayer.__init__, 0

        def counted(obj, *a, **k):
            self.n += 1
            return self.inner(obj, *a, **k)

        TransformerLayer.__init__ = counted
        return self

    def __exit__(self, *exc):
        self.cls.__init__ = self.inner


def _loss(provider_for_features, provider_for_head, pgs):
    """The drafter's loss on a fixed batch: features from the whole target, the head borrowed from
    `provider_for_head` (drafter weights from a fixed seed)."""
    from megatron_splitkv.data.sharding import shard_batch
    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.megatron.models import DFlashDraftModel, qwen3_config
    from megatron_splitkv.planning import plan_context_parallel

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (sum(SEQ_LENS),), generator=g)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    plan = plan_context_parallel(SEQ_LENS, ANCHORS, block_size=B, cp_size=1, chunk_size=8)
    shard = shard_batch(batch, plan, 0)
    blocks = build_draft_blocks(ids, SEQ_LENS, plan.q_seq, plan.q_anchor, block_size=B, mask_token_id=MASK_ID)
    feats = provider_for_features(shard["input_ids"], shard["kv_seq"], shard["kv_pos"])
    dcfg = qwen3_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                        ffn_hidden_size=64)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(dcfg, num_taps=len(provider_for_head.tap_layers),
                               word_embeddings=provider_for_head.word_embeddings,
                               output_layer=provider_for_head.output_layer, mask_token_id=MASK_ID, block_size=B,
                               cp_impl="splitkv", pg_collection=pgs, use_te=False)
    return drafter(feats, blocks, shard["kv_seq"], shard["kv_pos"]).loss.detach()


def _head_params(model):
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("load", [False, True], ids=["random-init", "target-load"])
def test_offline_path_builds_only_the_borrowed_head(pgs, tmp_path, load):
    from megatron_splitkv.dflash import target_layer_ids

    pre = _example()
    taps = target_layer_ids(N_TARGET, 1)
    args = _args()
    with _LayerCount() as full_count:
        online = pre._build_target(args, torch.float32, taps, pgs, cpu_init=True)
    assert full_count.n == N_TARGET  # the online path: the whole target, as before
    if load:  # the weights of the offline run come from a file: a target saved with another seed
        path = str(tmp_path / "target.pt")
        torch.save({"model": online.model.state_dict()}, path)
        args = _args(target_load=path, target_seed=99)
    with _LayerCount() as head_count:
        offline = pre._build_target(_args(**{**vars(args), "features_path": "/features"}), torch.float32, taps,
                                    pgs, cpu_init=True)
    # with weights loaded no decoder layer is even constructed; for a random target each is built and
    # freed once (same random streams as the full model), none is kept
    assert head_count.n == (0 if load else N_TARGET)
    kept = [m for m in offline.modules() if type(m).__name__ == "TransformerLayer"]
    assert kept == [] and len(offline.model.decoder.layers) == N_TARGET
    names = set(_head_params(offline.model))
    assert names == {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    full = _head_params(online.model)
    for k, v in _head_params(offline.model).items():
        assert torch.equal(v, full[k]), k
    n_head = sum(p.numel() for p in offline.parameters())
    assert n_head == 2 * VOCAB * HIDDEN + HIDDEN < sum(p.numel() for p in online.parameters())
    assert offline.feature_dim == online.feature_dim
    # the loss on a fixed batch: the head of the offline path == the head of the whole target (reference)
    ref = _loss(online, online, pgs)
    got = _loss(online, offline, pgs)
    assert torch.isfinite(ref) and torch.equal(got, ref)
    with pytest.raises(RuntimeError, match="decoder_layers=False"):
        offline(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.arange(3))
