"""Drafter export (issue 20 item 2): our Megatron DFlash drafter, trained a few steps at TP 2 x CP 2 (gloo,
4 ranks), exported in the DFlash Hugging Face layout, loaded by z-lab's official inference code
(`dflash.model.DFlashDraftModel.from_pretrained`, dflash 0.1.0, which no one here wrote) with no missing /
unexpected key, gives the same drafter hidden states (after the final norm) as our model on the same context
features and block tokens: float32, atol 2e-5 + rtol 1e-4. Also the command line from a Megatron
`--ckpt-format torch` checkpoint (TP shards gathered from files) and from the demo's common.pt (equal to
dflash's own save_pretrained of the same weights), and its refusals.
"""

import json
import os
import shutil
from argparse import Namespace

import pytest
import torch

from _dist import run_distributed
from _warning_marks import MEGATRON_ENV

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
dflash_model = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

from megatron_splitkv import export as export_cli  # noqa: E402
from megatron_splitkv.checkpoint import write_manifest  # noqa: E402
from megatron_splitkv.megatron.hf import HFCheckpointError, export_checkpoint  # noqa: E402

pytestmark = MEGATRON_ENV

B = 4
VOCAB, MASK_ID = 64, 63
HIDDEN, TARGET_LAYERS, DRAFT_LAYERS = 32, 6, 2
SEQ_LENS = [23, 18]
ANCHORS = [[0, 9], [3, 11]]  # anchor 0: a block without context


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
        write_manifest(os.path.join(ckpt_dir, "iter_0000003"))  # as the manifest hook of Megatron's save does
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
    assert export_cli.main(["--load", ckpt, "--out", out2]) == 0
    assert json.load(open(os.path.join(out2, "config.json"))) == cfg
    _assert_same_tensors(out, out2)


def _assert_same_tensors(a_dir, b_dir):
    from safetensors import safe_open

    with safe_open(os.path.join(a_dir, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(b_dir, "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A drafter exported at TP 1 by `export_checkpoint` from a demo-format common.pt
    (examples/train_demo.py --save) whose parameters are built from a tiny random DFlash checkpoint
    written by dflash itself (so this fixture does not go through our key table)."""
    root = tmp_path_factory.mktemp("demo")
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "intermediate_size": 48, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "num_target_layers": TARGET_LAYERS, "block_size": B,
           "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [3]}}
    torch.manual_seed(0)
    ref = dflash_model.DFlashDraftModel(transformers.Qwen3Config(**cfg))
    with torch.no_grad():  # every tensor distinct (norms too), so that a key mapped to the wrong place shows
        for prm in ref.parameters():
            prm.normal_()
    sd = ref.state_dict()
    h, d, g = HIDDEN, 8, 2
    lay = "decoder.layers.0."
    kv = torch.cat([sd["layers.0.self_attn.k_proj.weight"].view(g, d, h),
                    sd["layers.0.self_attn.v_proj.weight"].view(g, d, h)], 1).reshape(-1, h)
    model = {"fc.weight": sd["fc.weight"], "hidden_norm.weight": sd["hidden_norm.weight"],
             "decoder.final_layernorm.weight": sd["norm.weight"],
             lay + "input_layernorm.weight": sd["layers.0.input_layernorm.weight"],
             lay + "self_attention.linear_q.weight": sd["layers.0.self_attn.q_proj.weight"],
             lay + "self_attention.linear_kv.weight": kv,
             lay + "self_attention.q_layernorm.weight": sd["layers.0.self_attn.q_norm.weight"],
             lay + "self_attention.k_layernorm.weight": sd["layers.0.self_attn.k_norm.weight"],
             lay + "self_attention.linear_proj.weight": sd["layers.0.self_attn.o_proj.weight"],
             lay + "pre_mlp_layernorm.weight": sd["layers.0.post_attention_layernorm.weight"],
             lay + "mlp.linear_fc1.weight": torch.cat([sd["layers.0.mlp.gate_proj.weight"],
                                                       sd["layers.0.mlp.up_proj.weight"]], 0),
             lay + "mlp.linear_fc2.weight": sd["layers.0.mlp.down_proj.weight"]}
    ref_dir = str(root / "ref")
    ref.save_pretrained(ref_dir)
    it = root / "ckpt" / "iter_0000005"
    it.mkdir(parents=True)
    meta = dict(mask_token_id=MASK_ID, target_layer_ids=[3], num_target_layers=TARGET_LAYERS, block_size=B,
                vocab_size=VOCAB, rope_theta=1e6)
    torch.save({"format": 1, "step": 5, "model": model, "dflash_export": meta,
                "args": {"target_layers": TARGET_LAYERS, "draft_layers": 1, "block_size": B}},
               str(it / "common.pt"))
    write_manifest(str(it))
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5\n")
    return dict(root=root, ckpt=str(root / "ckpt"), ref=ref_dir, common=str(it / "common.pt"))


def test_export_demo_checkpoint(exported, tmp_path):
    """The demo's common.pt -> the same tensors as dflash's own save_pretrained of the same weights."""
    out = str(tmp_path / "out")
    assert export_cli.main(["--load", exported["ckpt"], "--out", out]) == 0
    _assert_same_tensors(out, exported["ref"])
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [3]}
    model, info = dflash_model.DFlashDraftModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _refusal(argv, capsys):
    code = export_cli.main(argv)
    return code, capsys.readouterr().err


def test_export_refusals(exported, tmp_path, capsys):
    """Bad checkpoints and flags: one error line naming the file and the field, exit status 2."""
    out = str(tmp_path / "out")
    code, err = _refusal(["--load", str(tmp_path / "none"), "--out", out], capsys)
    assert code == 2 and "no such directory" in err
    code, err = _refusal(["--load", exported["ckpt"], "--out", out, "--mask-token-id", str(VOCAB)], capsys)
    assert code == 2 and f"mask_token_id {VOCAB}" in err and f"vocab_size {VOCAB}" in err, err
    code, err = _refusal(["--load", exported["ckpt"], "--out", out, "--target-layer-ids", "1,3"], capsys)
    assert code == 2 and "fc.weight" in err and "[1, 3]" in err, err  # 2 taps, but fc reads 1 x hidden
    common = torch.load(exported["common"], weights_only=False)

    def variant(name, change):
        d = tmp_path / name
        d.mkdir()
        c = dict(common, model=dict(common["model"]))
        change(c)
        torch.save(c, str(d / "common.pt"))
        write_manifest(str(d))
        return _refusal(["--load", str(d), "--out", out], capsys)

    code, err = variant("bias", lambda c: c["model"].update({"decoder.layers.0.mlp.linear_fc2.bias": torch.zeros(4)}))
    assert code == 2 and "bias" in err and "common.pt" in err, err
    code, err = variant("no-qk-norm", lambda c: c["model"].pop("decoder.layers.0.self_attention.q_layernorm.weight"))
    assert code == 2 and "q_layernorm" in err, err
    code, err = variant("no-meta", lambda c: c.pop("dflash_export"))  # the demo's args lack the mask token
    assert code == 2 and "common.pt" in err and "mask_token_id" in err and "vocab_size" in err, err
    assert "target_layer_ids" not in err.split("missing")[0]  # taps and depth came from the args
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / ".metadata").write_text("")
    code, err = _refusal(["--load", str(tmp_path / "dist"), "--out", out], capsys)
    assert code == 2 and "torch_dist" in err and "--ckpt-format torch" in err, err
    for bad, why in [("1,x", "plain decimal"), ("1,1,3", "distinct"), ("1,,3", "plain decimal"), ("+1,3", "plain decimal"),
                     ("1_0", "plain decimal"), ("-1,2", "[0, "), ("2000", "[0, ")]:
        with pytest.raises(SystemExit) as exc:
            export_cli.parse_args(["--load", exported["ckpt"], "--out", out, f"--target-layer-ids={bad}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--target-layer-ids" in err and why in err, (bad, err)
    assert export_cli._ids(" 1, 9,17") == [1, 9, 17]


def _copy_ckpt(exported, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported["ckpt"], ckpt)
    return ckpt


def test_export_verifies_the_checkpoint(exported, tmp_path, capsys):
    """A flipped byte inside common.pt's tensors, a garbage tracker, a missing manifest: one line naming the
    file, exit status 2, nothing written."""
    ckpt = _copy_ckpt(exported, tmp_path)
    common = ckpt / "iter_0000005" / "common.pt"
    data = bytearray(common.read_bytes())
    fc = torch.load(exported["common"], weights_only=False)["model"]["fc.weight"]
    at = bytes(data).find(fc.numpy().tobytes()[:16])  # the first bytes of fc.weight's storage
    assert at > 0
    data[at + 3] ^= 0x40
    common.write_bytes(bytes(data))
    out = tmp_path / "out"
    code, err = _refusal(["--load", str(ckpt), "--out", str(out)], capsys)
    assert code == 2 and "common.pt" in err and "damaged" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("five\n")
    code, err = _refusal(["--load", str(ckpt), "--out", str(out)], capsys)
    assert code == 2 and "latest_checkpointed_iteration.txt" in err and "not an iteration number" in err, err
    (ckpt / "iter_0000005" / "manifest.json").unlink()
    code, err = _refusal(["--load", str(ckpt / "iter_0000005"), "--out", str(out)], capsys)
    assert code == 2 and "manifest.json" in err and "missing" in err, err


def _flag_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        export_cli.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_export_flag_limits(exported, tmp_path, capsys):
    """Out-of-range metadata flags and an --out that is a file or a foreign non-empty directory: argparse's
    error naming the flag, exit status 2; a previous export is overwritten."""
    base = ["--load", exported["ckpt"], "--out", str(tmp_path / "out")]
    for flag, value in (("--block-size", "1025"), ("--block-size", "1"), ("--num-target-layers", "1025"),
                        ("--num-target-layers", "0"), ("--vocab-size", "0"), ("--vocab-size", str(1 << 30)),
                        ("--mask-token-id", "-1"), ("--rope-theta", "0"), ("--rope-theta", "nan"),
                        ("--rope-theta", "1e300")):
        err = _flag_error(base + [flag, value], capsys)
        assert f"argument {flag}" in err, (flag, value, err)
    err = _flag_error(base + ["--vocab-size", "10", "--mask-token-id", "10"], capsys)
    assert "--mask-token-id" in err and "--vocab-size 10" in err, err
    err = _flag_error(base + ["--num-target-layers", "4", "--target-layer-ids", "1,4"], capsys)
    assert "--target-layer-ids" in err and "--num-target-layers 4" in err, err
    (tmp_path / "file").write_text("x")
    err = _flag_error(["--load", exported["ckpt"], "--out", str(tmp_path / "file")], capsys)
    assert "argument --out" in err and "existing file" in err, err
    with pytest.raises(HFCheckpointError, match="file") as exc:  # the Python API too
        export_checkpoint(exported["ckpt"], str(tmp_path / "file"))
    assert str(tmp_path / "file") in str(exc.value)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep me")
    err = _flag_error(["--load", exported["ckpt"], "--out", str(tmp_path / "foreign")], capsys)
    assert "argument --out" in err and "not empty" in err, err
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "keep me"
    out = str(tmp_path / "again")
    assert export_cli.main(["--load", exported["ckpt"], "--out", out]) == 0
    assert export_cli.main(["--load", exported["ckpt"], "--out", out, "--block-size", "8"]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["block_size"] == 8
