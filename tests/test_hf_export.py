"""Drafter export (issue 20 item 2): our Megatron DFlash drafter, trained a few steps at TP 2 x CP 2 (gloo,
4 ranks), exported in the DFlash Hugging Face layout, loaded by z-lab's official inference code
(`dflash.model.DFlashDraftModel.from_pretrained`, dflash 0.1.0, which no one here wrote) with no missing /
unexpected key, gives the same drafter hidden states (after the final norm) as our model on the same context
features and block tokens: float32, atol 2e-5 + rtol 1e-4. Also the command line from a Megatron
`--ckpt-format torch` checkpoint (TP shards gathered from files) and its refusals.
"""

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from _dist import run_distributed
from _warning_marks import MEGATRON_ENV

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
dflash_model = pytest.importorskip("dflash.model")

pytestmark = MEGATRON_ENV

B = 4
VOCAB, MASK_ID = 64, 63
HIDDEN, TARGET_LAYERS, DRAFT_LAYERS = 32, 6, 2
SEQ_LENS = [23, 18]
ANCHORS = [[0, 9], [3, 11]]  # anchor 0: a block without context
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data():
    """Token ids and (stand-in) tapped target features [T, n_taps * hidden] of the packed batch."""
    g = torch.Generator().manual_seed(5)
    T = sum(SEQ_LENS)
    return {"input_ids": torch.randint(0, VOCAB - 1, (T,), generator=g),
            "loss_mask": torch.ones(T, dtype=torch.bool),
            "features": torch.randn(T, 2 * HIDDEN, generator=g)}


def _drafter(pgs, tp):
    from megatron_splitkv.megatron.models import DFlashDraftModel, build_target_model, qwen3_config

    tcfg = qwen3_config(num_layers=TARGET_LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                        kv_channels=8, ffn_hidden_size=48, tensor_model_parallel_size=tp)
    target = build_target_model(tcfg, vocab_size=VOCAB, max_sequence_length=64, pg_collection=pgs, seed=0,
                                decoder_layers=False, match_random_init=False)
    dcfg = qwen3_config(num_layers=DRAFT_LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                        kv_channels=8, ffn_hidden_size=48, tensor_model_parallel_size=tp)
    torch.manual_seed(1)
    return DFlashDraftModel(dcfg, num_taps=2, word_embeddings=target.embedding.word_embeddings,
                            output_layer=target.output_layer, mask_token_id=MASK_ID, block_size=B,
                            pg_collection=pgs, rotary_base=1e4)


def _worker(rank, world, out_dir, ckpt_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.data.sharding import shard_batch
    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.megatron.hf import export_drafter
    from megatron_splitkv.planning import plan_context_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                 create_gloo_process_groups=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    tp_r, cp_r = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    model = _drafter(pgs, 2)
    batch = _data()
    plan = plan_context_parallel(SEQ_LENS, ANCHORS, block_size=B, cp_size=2, chunk_size=4, strategy="lpt")
    shard = shard_batch({k: batch[k] for k in ("input_ids", "loss_mask")}, plan, cp_r)
    sl = plan.query_slice(cp_r)
    blocks = build_draft_blocks(batch["input_ids"], SEQ_LENS, plan.q_seq[sl], plan.q_anchor[sl], block_size=B,
                                mask_token_id=MASK_ID, loss_mask=batch["loss_mask"])
    starts = torch.tensor([0, SEQ_LENS[0]])  # the packed row of each of this rank's context tokens
    feats = batch["features"][starts[shard["kv_seq"]] + shard["kv_pos"]]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-2)
    losses = []
    for _ in range(3):  # a few steps, so that norms and projections move away from their init
        opt.zero_grad()
        out = model(feats, blocks, shard["kv_seq"], shard["kv_pos"])
        out.loss.backward()
        for n, p in model.named_parameters():  # as Megatron's finalize_model_grads:
            if p.requires_grad:  # the CP group holds parts of the batch: sum
                dist.all_reduce(p.grad, group=pgs.cp)
            if "q_layernorm" in n or "k_layernorm" in n:  # per-head norms see only this TP rank's heads: sum
                dist.all_reduce(p.grad, group=pgs.tp)
        opt.step()
        losses.append(float(out.total))
    config = export_drafter(model, out_dir if rank == 0 else None, target_layer_ids=[1, 3],
                            num_target_layers=TARGET_LAYERS, max_position_embeddings=64)
    with torch.no_grad():  # our drafter's hidden states (final norm applied) for this rank's blocks
        params_ = model.packed_seq_params(blocks, shard["kv_seq"], shard["kv_pos"])
        ctx = model.fuse_context(feats)
        h = model.word_embeddings(blocks.input_ids[None, :].to(torch.int64)).transpose(0, 1).contiguous()
        h = model.decoder(hidden_states=h, attention_mask=None, context=ctx[:, None, :], packed_seq_params=params_)
        emb = model.word_embeddings.weight.detach()
        full_emb = [torch.empty_like(emb) for _ in range(2)]
        dist.all_gather(full_emb, emb, group=pgs.tp)
    if cp_r == 0:  # Megatron --ckpt-format torch layout: one mp_rank_XX/model_optim_rng.pt per TP rank
        d = os.path.join(ckpt_dir, "iter_0000003", f"mp_rank_{tp_r:02d}")
        os.makedirs(d, exist_ok=True)
        args = Namespace(num_layers=DRAFT_LAYERS, target_num_layers=TARGET_LAYERS, mask_token_id=MASK_ID,
                         dflash_block_size=B, padded_vocab_size=VOCAB, rotary_base=1e4, norm_epsilon=1e-6,
                         max_position_embeddings=64, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         qk_layernorm=True, tensor_model_parallel_size=2)
        torch.save({"model": model.state_dict(), "args": args, "iteration": 3}, os.path.join(d, "model_optim_rng.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    ps.destroy_model_parallel()
    return dict(config=config, losses=losses, q_seq=blocks.q_seq.tolist(), q_anchor=blocks.q_anchor.tolist(),
                block_ids=blocks.input_ids.tolist(), hidden=h[:, 0].clone(), emb=torch.cat(full_emb, 0))


def _dflash_hidden(model, emb, batch, seq, anchor, block_ids):
    """dflash's drafter output for one block: context = the sequence's features at positions < anchor."""
    start = sum(SEQ_LENS[:seq])
    target_hidden = batch["features"][start:start + anchor][None]
    noise = torch.nn.functional.embedding(torch.tensor(block_ids)[None], emb)
    position_ids = torch.arange(anchor + B)[None]
    with torch.no_grad():
        return model(target_hidden=target_hidden, noise_embedding=noise, position_ids=position_ids)[0]


def _expected_keys(layers):
    per = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
           "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
           "post_attention_layernorm"]
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{k}.weight" for i in range(layers)
                                                                  for k in per}


def test_export_tp2_cp2_matches_dflash(tmp_path):
    from safetensors import safe_open

    out, ckpt = str(tmp_path / "drafter-hf"), str(tmp_path / "ckpt")
    res = run_distributed(_worker, 4, out, ckpt, timeout=240)
    assert res[0]["losses"][-1] < res[0]["losses"][0], res[0]["losses"]  # it trained
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    assert (cfg["num_target_layers"], cfg["block_size"], cfg["num_hidden_layers"]) == (TARGET_LAYERS, B, DRAFT_LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 8)
    assert (cfg["intermediate_size"], cfg["vocab_size"], cfg["rope_theta"]) == (48, VOCAB, 1e4)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == _expected_keys(DRAFT_LAYERS)

    model, info = dflash_model.DFlashDraftModel.from_pretrained(out, output_loading_info=True,
                                                                 dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    assert model.target_layer_ids == [1, 3] and model.mask_token_id == MASK_ID and model.block_size == B
    batch = _data()
    emb = res[0]["emb"]
    assert all(torch.equal(r["emb"], emb) for r in res)
    checked = 0
    for r in res:
        for b, (seq, anchor) in enumerate(zip(r["q_seq"], r["q_anchor"])):
            if anchor < 0:  # a padding block
                continue
            ours = r["hidden"][b * B:(b + 1) * B]
            theirs = _dflash_hidden(model, emb, batch, seq, anchor, r["block_ids"][b * B:(b + 1) * B])
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4, msg=f"block {seq}@{anchor}")
            checked += 1
    assert checked >= sum(len(a) for a in ANCHORS)  # every real block, on both TP ranks of each CP rank

    # the command line, from the Megatron --ckpt-format torch checkpoint (TP shards read from files)
    out2 = str(tmp_path / "cli-hf")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "megatron_splitkv.export", "--load", ckpt, "--out", out2],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert json.load(open(os.path.join(out2, "config.json"))) == cfg
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(out2, "model.safetensors"), "pt") as b:
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k

    # refusals: one line naming the file and the field, exit status 2, no traceback
    bad = subprocess.run([sys.executable, "-m", "megatron_splitkv.export", "--load", str(tmp_path / "none"),
                          "--out", out2], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "no such directory" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "megatron_splitkv.export", "--load", ckpt, "--out", out2,
                          "--mask-token-id", str(VOCAB)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "mask_token_id 64" in bad.stderr and "vocab_size 64" in bad.stderr, bad.stderr
