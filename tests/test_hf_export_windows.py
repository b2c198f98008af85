"""Export of a drafter with sliding-window / causal layers (issue 23 item 3): config.json carries layer_types,
sliding_window, use_sliding_window (dflash_config.use_swa / swa_window_size, is_causal when set), z-lab's
`dflash.model.DFlashDraftModel.from_pretrained` builds the same layer kinds and gives the same hidden states as
our Megatron drafter (float32, atol 2e-5 + rtol 1e-4), for a window smaller than the block and one larger; the
command line exports the same config from a Megatron checkpoint whose args carry the flags."""

import json
import os
from argparse import Namespace

import pytest
import torch

from _dist import run_distributed
from _warning_marks import MEGATRON_ENV

pytest.importorskip("megatron.core")
dflash_model = pytest.importorskip("dflash.model")
pytest.importorskip("transformers")

from test_hf_export import (ANCHORS, B, DRAFT_LAYERS, MASK_ID, SEQ_LENS, TARGET_LAYERS, _data,  # noqa: E402
                            _dflash_hidden, _drafter, _expected_keys)

from megatron_splitkv import export as export_cli  # noqa: E402
from megatron_splitkv.layer_types import hf_layer_fields, layer_attention_kinds  # noqa: E402
from megatron_splitkv.megatron.hf import HFCheckpointError, drafter_hf_config  # noqa: E402

pytestmark = MEGATRON_ENV

TYPES = ["sliding_attention", "full_attention"]  # DRAFT_LAYERS = 2 of test_hf_export

CASES = [  # (sliding window, is_causal): W < B, W > B with dflash's is_causal false, and true
    (3, None), (6, False), (6, True),
]


def _worker(rank, world, tp, cp, kinds, out_dir, ckpt_dir, flags):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.checkpoint import write_manifest
    from megatron_splitkv.data.sharding import shard_batch
    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.megatron.hf import export_drafter
    from megatron_splitkv.megatron.models import DFlashDraftModel
    from megatron_splitkv.planning import plan_context_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 create_gloo_process_groups=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    tp_r, cp_r = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    base = _drafter(pgs, tp)  # test_hf_export's drafter and target pieces, rebuilt with the layer kinds
    torch.manual_seed(1)
    model = DFlashDraftModel(base.config, num_taps=2, word_embeddings=base.word_embeddings,
                             output_layer=base.output_layer, mask_token_id=MASK_ID, block_size=B, pg_collection=pgs,
                             rotary_base=1e4, layer_attention=kinds)
    batch = _data()
    plan = plan_context_parallel(SEQ_LENS, ANCHORS, block_size=B, cp_size=cp, chunk_size=4, strategy="lpt")
    shard = shard_batch({k: batch[k] for k in ("input_ids", "loss_mask")}, plan, cp_r)
    sl = plan.query_slice(cp_r)
    blocks = build_draft_blocks(batch["input_ids"], SEQ_LENS, plan.q_seq[sl], plan.q_anchor[sl], block_size=B,
                                mask_token_id=MASK_ID, loss_mask=batch["loss_mask"])
    starts = torch.tensor([0, SEQ_LENS[0]])
    feats = batch["features"][starts[shard["kv_seq"]] + shard["kv_pos"]]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-2)
    for _ in range(2):  # a few steps through the windowed backward, so that every weight moves
        opt.zero_grad()
        model(feats, blocks, shard["kv_seq"], shard["kv_pos"]).loss.backward()
        for n, p in model.named_parameters():
            if p.requires_grad and cp > 1:
                dist.all_reduce(p.grad, group=pgs.cp)
            if tp > 1 and ("q_layernorm" in n or "k_layernorm" in n):
                dist.all_reduce(p.grad, group=pgs.tp)
        opt.step()
    config = export_drafter(model, out_dir if rank == 0 else None, target_layer_ids=[1, 3],
                            num_target_layers=TARGET_LAYERS, max_position_embeddings=64)
    with torch.no_grad():
        params_ = model.packed_seq_params(blocks, shard["kv_seq"], shard["kv_pos"])
        ctx = model.fuse_context(feats)
        h = model.word_embeddings(blocks.input_ids[None, :].to(torch.int64)).transpose(0, 1).contiguous()
        h = model.decoder(hidden_states=h, attention_mask=None, context=ctx[:, None, :], packed_seq_params=params_)
        emb = model.word_embeddings.weight.detach()
        full_emb = [torch.empty_like(emb) for _ in range(tp)]
        dist.all_gather(full_emb, emb, group=pgs.tp)
    if ckpt_dir is not None and cp_r == 0:  # Megatron --ckpt-format torch, its args carrying the layer flags
        d = os.path.join(ckpt_dir, "iter_0000002", f"mp_rank_{tp_r:02d}")
        os.makedirs(d, exist_ok=True)
        args = Namespace(num_layers=DRAFT_LAYERS, target_num_layers=TARGET_LAYERS, mask_token_id=MASK_ID,
                         dflash_block_size=B, padded_vocab_size=64, rotary_base=1e4, norm_epsilon=1e-6,
                         max_position_embeddings=64, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         qk_layernorm=True, tensor_model_parallel_size=tp, **flags)
        torch.save({"model": model.state_dict(), "args": args, "iteration": 2}, os.path.join(d, "model_optim_rng.pt"))
    dist.barrier()
    if ckpt_dir is not None and rank == 0:
        write_manifest(os.path.join(ckpt_dir, "iter_0000002"))
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    ps.destroy_model_parallel()
    return dict(config=config, q_seq=blocks.q_seq.tolist(), q_anchor=blocks.q_anchor.tolist(),
                block_ids=blocks.input_ids.tolist(), hidden=h[:, 0].clone(), emb=torch.cat(full_emb, 0))


def _check_against_dflash(res, out, window, is_causal, kinds):
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["layer_types"] == TYPES and cfg["sliding_window"] == window and cfg["use_sliding_window"] is True
    assert cfg["dflash_config"]["use_swa"] is True and cfg["dflash_config"]["swa_window_size"] == window
    assert cfg.get("is_causal") == is_causal and cfg["dflash_config"].get("causal") == is_causal
    model, info = dflash_model.DFlashDraftModel.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    # dflash builds exactly our layer kinds
    assert [(a.self_attn.sliding_window, a.self_attn.is_causal) for a in model.layers] == list(kinds)
    batch, emb = _data(), res[0]["emb"]
    checked = 0
    for r in res:
        for b, (seq, anchor) in enumerate(zip(r["q_seq"], r["q_anchor"])):
            if anchor < 0:
                continue
            ours = r["hidden"][b * B:(b + 1) * B]
            theirs = _dflash_hidden(model, emb, batch, seq, anchor, r["block_ids"][b * B:(b + 1) * B])
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4, msg=f"block {seq}@{anchor}")
            checked += 1
    assert checked >= sum(len(a) for a in ANCHORS)
    return cfg


@pytest.mark.parametrize("window,is_causal", CASES)
def test_windowed_export_matches_dflash_cp1(window, is_causal, tmp_path):
    kinds = layer_attention_kinds(TYPES, num_layers=DRAFT_LAYERS, sliding_window=window, is_causal=is_causal)
    flags = dict(dflash_layer_types=tuple(TYPES), dflash_sliding_window=window,
                 dflash_is_causal=None if is_causal is None else str(is_causal).lower())
    out, ckpt = str(tmp_path / "drafter-hf"), str(tmp_path / "ckpt")
    res = run_distributed(_worker, 1, 1, 1, kinds, out, ckpt, flags, timeout=240)
    cfg = _check_against_dflash(res, out, window, is_causal, kinds)
    # the windows matter here: the same weights as full layers give other hidden states
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**cfg, "layer_types": ["full_attention"] * DRAFT_LAYERS, "use_sliding_window": False,
                   "sliding_window": None, "is_causal": False}, f)
    full = dflash_model.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    r = res[0]
    b = max(range(len(r["q_anchor"])), key=lambda i: r["q_anchor"][i])  # the block with the most context
    other = _dflash_hidden(full, r["emb"], _data(), r["q_seq"][b], r["q_anchor"][b], r["block_ids"][b * B:(b + 1) * B])
    assert (other - r["hidden"][b * B:(b + 1) * B]).abs().max() > 1e-3
    # the command line, from the Megatron checkpoint whose args carry --dflash-layer-types etc.
    out2 = str(tmp_path / "cli-hf")
    assert export_cli.main(["--load", ckpt, "--out", out2]) == 0
    assert json.load(open(os.path.join(out2, "config.json"))) == cfg


def test_windowed_export_matches_dflash_tp2_cp2(tmp_path):
    kinds = layer_attention_kinds(TYPES, num_layers=DRAFT_LAYERS, sliding_window=3)
    out = str(tmp_path / "drafter-hf")
    res = run_distributed(_worker, 4, 2, 2, kinds, out, None, {}, timeout=300)
    _check_against_dflash(res, out, 3, None, kinds)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == _expected_keys(DRAFT_LAYERS)


def test_full_layers_keep_the_plain_config():
    fields = hf_layer_fields(None, 3)
    assert fields == {"layer_types": ["full_attention"] * 3, "sliding_window": None, "is_causal": None}


@pytest.mark.parametrize("kinds,match", [
    (((3, True), (5, True)), "one sliding_window"),
    (((3, True), (None, True), (3, False)), "neither dflash's default"),
])
def test_inexpressible_layer_kinds_are_refused(kinds, match):
    with pytest.raises(ValueError, match=match):
        hf_layer_fields(kinds, len(kinds))


@pytest.mark.parametrize("kw,match", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window .*is required"),
    (dict(layer_types=["full_attention"]), "one type per drafter layer"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=0), "sliding_window must be a positive"),
])
def test_drafter_hf_config_refuses_bad_layer_types(kw, match):
    from megatron_splitkv.megatron.hf import Qwen3Shape

    shape = Qwen3Shape(hidden=32, heads=4, groups=2, head_dim=8, ffn=48)
    with pytest.raises(HFCheckpointError, match=match):
        drafter_hf_config(shape, 2, mask_token_id=1, target_layer_ids=[0], num_target_layers=4, block_size=4,
                          vocab_size=8, rope_theta=1e4, **kw)


def test_checkpoint_args_is_causal_garbage_refused():
    """A checkpoint whose args carry a dflash_is_causal other than 'true' / 'false' / unset is refused naming it
    (it was exported as is_causal false, a drafter other than the trained one); the flag's text splits."""
    from megatron_splitkv.megatron.hf import _meta_from_megatron_args

    base = dict(num_layers=2, target_num_layers=4, dflash_layer_types=tuple(TYPES), dflash_sliding_window=3)
    for bad in ("maybe", "True", 1, 0.0):
        with pytest.raises(HFCheckpointError, match="dflash_is_causal .*must be 'true', 'false' or unset"):
            _meta_from_megatron_args(Namespace(**base, dflash_is_causal=bad))
    for causal, want in ((None, None), ("true", True), ("false", False), (True, True), (False, False)):
        assert _meta_from_megatron_args(Namespace(**base, dflash_is_causal=causal)).get("is_causal") is want
    meta = _meta_from_megatron_args(Namespace(**{**base, "dflash_layer_types": "sliding_attention, full_attention"}))
    assert meta["layer_types"] == TYPES
