"""Target import (issue 20 item 1): a Hugging Face Qwen3 checkpoint written by transformers' save_pretrained
(random init; one model.safetensors, and a sharded save with model.safetensors.index.json) loaded into our
frozen target GPTModel at TP 1 and TP 2 (gloo): its logits and every tapped feature equal transformers'
`Qwen3ForCausalLM(output_hidden_states=True)` on the same input (feature of tap id i = `hidden_states[i + 1]`,
the DFlash convention; the last layer's is after the final norm, as transformers returns it), float32,
atol 2e-5 + rtol 1e-4; GQA (4 query / 2 kv heads), tied and untied embeddings, rope theta != the default.
Bad input: a clear `HFCheckpointError` naming the file and the field (or tensor).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil

import pytest
import torch

from _dist import run_distributed
from _warning_marks import MEGATRON_ENV

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

pytestmark = MEGATRON_ENV

LAYERS, VOCAB, S = 3, 96, 13
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(path, tied, shard):
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                   rope_theta=5e5, tie_word_embeddings=tied, initializer_range=0.2)
    torch.manual_seed(7 if tied else 8)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a norm mapped to the wrong place shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": "40KB"} if shard else {}))
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return dict(path=path, ids=ids[0], logits=out.logits[0], hidden=[h[0] for h in out.hidden_states])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tied = _save(str(root / "tied"), True, False)
    untied = _save(str(root / "untied"), False, True)
    assert os.path.exists(os.path.join(untied["path"], "model.safetensors.index.json"))  # the sharded path
    assert os.path.exists(os.path.join(tied["path"], "model.safetensors"))
    return {"tied": tied, "untied": untied}


def _worker(rank, world, paths, ids, bad):
    """TP `world` over spawned gloo ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)
    try:
        return _run(ProcessGroupCollection.use_mpu_process_groups(), world, paths, ids, bad)
    finally:
        ps.destroy_model_parallel()


@contextlib.contextmanager
def _in_process():
    """TP 1 in this process (a one-rank gloo group; none of the spawn cost)."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if own:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        ps.initialize_model_parallel()
        try:
            yield ProcessGroupCollection.use_mpu_process_groups()
        finally:
            ps.destroy_model_parallel()
            if own:
                dist.destroy_process_group()


def _run(pgs, world, paths, ids, bad):
    """Our target's features (every layer tapped) and gathered logits per checkpoint; the pretrain script's
    target at TP 1; the bad inputs' error messages."""
    import torch.distributed as dist

    from megatron_splitkv.megatron.hf import HFCheckpointError, load_hf_target, read_qwen3_config
    from megatron_splitkv.megatron.models import TargetFeatureProvider, target_packed_seq_params

    out = {}
    for name, path in paths.items():
        model = load_hf_target(path, pg_collection=pgs, mask_token_id=VOCAB - 1, drafter_hidden_size=32)
        provider = TargetFeatureProvider(model, list(range(LAYERS)))  # every layer tapped
        pos = torch.arange(S)
        with torch.no_grad():
            feats = provider(ids, torch.zeros(S, dtype=torch.long), pos)
            h = model.embedding(input_ids=ids[None], position_ids=None)
            params = target_packed_seq_params(torch.zeros(S, dtype=torch.long), pos)
            for layer in model.decoder.layers:
                h, _ = layer(hidden_states=h, attention_mask=None, packed_seq_params=params)
            logits, _ = model.output_layer(model.decoder.final_layernorm(h))
            parts = [torch.empty_like(logits) for _ in range(world)]
            dist.all_gather(parts, logits.contiguous(), group=pgs.tp)
        out[name] = dict(feats=feats, logits=torch.cat(parts, -1)[:, 0])
    if world == 1:  # examples/pretrain_dflash.py --target-hf-path (the untied, sharded checkpoint)
        args = argparse.Namespace(target_hf_path=paths["untied"], target_load=None, features_path=None,
                                  mask_token_id=VOCAB - 1, hidden_size=32, max_position_embeddings=64)
        provider = _example()._build_target(args, torch.float32, [0, 2], pgs, cpu_init=True)
        with torch.no_grad():
            out["pretrain_feats"] = provider(ids, torch.zeros(S, dtype=torch.long), torch.arange(S))
    errors = {}
    for case, (fn, kw) in bad.items():
        try:
            if fn == "load":
                load_hf_target(pg_collection=pgs, **kw)
            else:
                read_qwen3_config(**kw)
        except HFCheckpointError as exc:
            errors[case] = str(exc)
    out["errors"] = errors
    return out


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_dflash_hf", os.path.join(ROOT, "examples",
                                                                                     "pretrain_dflash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bad_checkpoints(checkpoints, root):
    """Broken copies of the saved checkpoints -> {case: (function, kwargs)}."""
    tied, untied = checkpoints["tied"]["path"], checkpoints["untied"]["path"]
    llama = os.path.join(root, "llama")
    shutil.copytree(tied, llama)
    cfg = json.load(open(os.path.join(llama, "config.json")))
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    json.dump(cfg, open(os.path.join(llama, "config.json"), "w"))
    no_shard = os.path.join(root, "no-shard")
    shutil.copytree(untied, no_shard)
    index = json.load(open(os.path.join(no_shard, "model.safetensors.index.json")))
    lost = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(no_shard, lost))
    no_tensor = os.path.join(root, "no-tensor")
    shutil.copytree(untied, no_tensor)
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    json.dump(index, open(os.path.join(no_tensor, "model.safetensors.index.json"), "w"))
    return {
        "not_qwen3": ("load", dict(path=llama)),
        "missing_shard": ("load", dict(path=no_shard)),
        "missing_tensor": ("load", dict(path=no_tensor)),
        "no_mask_room": ("read", dict(path=tied, mask_token_id=VOCAB)),
        "hidden_mismatch": ("load", dict(path=tied, drafter_hidden_size=64)),
        "tp_heads": ("read", dict(path=tied, tp_size=4)),
    }, lost


@pytest.mark.parametrize("tp", [1, 2])
def test_import_matches_transformers(checkpoints, tp, tmp_path):
    bad, lost = _bad_checkpoints(checkpoints, str(tmp_path)) if tp == 1 else ({}, None)
    paths = {k: v["path"] for k, v in checkpoints.items()}
    ids = checkpoints["tied"]["ids"]
    assert torch.equal(ids, checkpoints["untied"]["ids"])
    if tp == 1:
        with _in_process() as pgs:
            res = [_run(pgs, 1, paths, ids, bad)]
    else:
        res = run_distributed(_worker, tp, paths, ids, bad, timeout=240)
    for name, ref in checkpoints.items():
        for r in range(tp):
            got = res[r][name]
            feats = got["feats"].view(S, LAYERS, 32)
            for i in range(LAYERS):  # tap id i = hidden_states[i + 1]
                torch.testing.assert_close(feats[:, i], ref["hidden"][i + 1], atol=2e-5, rtol=1e-4,
                                           msg=f"{name} TP{tp} rank {r}: tap {i}")
            torch.testing.assert_close(got["logits"], ref["logits"], atol=2e-5, rtol=1e-4,
                                       msg=f"{name} TP{tp} rank {r}: logits")
        # the features differ from a shifted tap (the bug class a wrong +1 causes)
        assert (res[0][name]["feats"].view(S, LAYERS, 32)[:, 0] - ref["hidden"][0]).abs().max() > 1e-2
    if tp == 1:
        ref = checkpoints["untied"]["hidden"]
        for r in range(tp):
            torch.testing.assert_close(res[r]["pretrain_feats"], torch.cat([ref[1], ref[3]], -1), atol=2e-5,
                                       rtol=1e-4, msg=f"pretrain_dflash --target-hf-path, rank {r}")
    if tp == 1:
        err = res[0]["errors"]
        assert set(err) == set(bad), err  # every bad input raised HFCheckpointError
        assert "config.json" in err["not_qwen3"] and "model_type" in err["not_qwen3"] and "'llama'" in err["not_qwen3"]
        assert "model.safetensors.index.json" in err["missing_shard"] and lost in err["missing_shard"]
        assert "model.layers.1.mlp.up_proj.weight" in err["missing_tensor"] and "index.json" in err["missing_tensor"]
        assert "config.json" in err["no_mask_room"] and "vocab_size" in err["no_mask_room"]
        assert f"mask token id {VOCAB}" in err["no_mask_room"]
        assert "config.json" in err["hidden_mismatch"] and "hidden_size = 32" in err["hidden_mismatch"]
        assert "64" in err["hidden_mismatch"]
        assert "num_key_value_heads = 2" in err["tp_heads"] and "4" in err["tp_heads"]


def test_extract_features_flag(checkpoints, tmp_path, capsys):
    """tools/extract_features.py --target-hf-path: the target's sizes come from config.json; a checkpoint that
    is not Qwen3 is one argparse error naming the file and the field (exit status 2)."""
    spec = importlib.util.spec_from_file_location("extract_features_hf", os.path.join(ROOT, "tools",
                                                                                      "extract_features.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = tool.parse_args(["--out", str(tmp_path / "f"), "--target-hf-path", checkpoints["tied"]["path"],
                            "--draft-num-layers", "1"])
    got = (args.target_num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
           args.kv_channels, args.ffn_hidden_size, args.vocab_size, args.rotary_base)
    assert got == (LAYERS, 32, 4, 2, 8, 48, VOCAB, 5e5)
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["tied"]["path"], bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["model_type"] = "mistral"
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(SystemExit) as exc:
        tool.parse_args(["--out", str(tmp_path / "f"), "--target-hf-path", str(bad)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--target-hf-path" in err and "config.json" in err and "'mistral'" in err, err
    with pytest.raises(SystemExit) as exc:
        tool.parse_args(["--out", str(tmp_path / "f"), "--target-hf-path", str(bad), "--target-load", str(bad)])
    assert exc.value.code == 2 and "--target-load" in capsys.readouterr().err


def _variant(src, dst, change=None, files=None):
    """A copy of checkpoint directory `src` with config.json changed by `change(cfg)` (a returned value
    replaces the whole config) and files replaced by `files` {name: bytes}."""
    shutil.copytree(src, dst)
    if change is not None:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        new = change(cfg)
        json.dump(cfg if new is None else new, open(os.path.join(dst, "config.json"), "w"))
    for name, data in (files or {}).items():
        with open(os.path.join(dst, name), "wb") as f:
            f.write(data)
    return dst


CONFIG_REFUSALS = [  # (case, change of config.json, words the message must hold besides config.json)
    ("rope_scaling_linear", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     ["rope_scaling", "linear"]),
    ("rope_parameters_yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                 "rope_theta": 5e5}), ["rope_parameters", "yarn"]),
    ("rope_scaling_type", lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), ["rope_scaling"]),
    ("rope_theta_zero", lambda c: c.update(rope_parameters=None, rope_theta=0), ["rope_theta"]),
    ("rope_theta_nan", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     ["rope_theta"]),
    ("eps_negative", lambda c: c.update(rms_norm_eps=-1e-6), ["rms_norm_eps"]),
    ("eps_inf", lambda c: c.update(rms_norm_eps=float("inf")), ["rms_norm_eps"]),
    ("max_pos_zero", lambda c: c.update(max_position_embeddings=0), ["max_position_embeddings"]),
    ("layers_bool", lambda c: c.update(num_hidden_layers=True), ["num_hidden_layers"]),
    ("layers_float", lambda c: c.update(num_hidden_layers=3.0), ["num_hidden_layers"]),
    ("kv_heads_zero", lambda c: c.update(num_key_value_heads=0), ["num_key_value_heads"]),
    ("head_dim_str", lambda c: c.update(head_dim="8"), ["head_dim"]),
    ("arch_other", lambda c: c.update(architectures=["Qwen3ForSequenceClassification"]), ["architectures"]),
    ("arch_drafter", lambda c: c.update(architectures=["DFlashDraftModel"]), ["architectures", "DFlash drafter"]),
    ("dtype_int8", lambda c: c.update(dtype="int8"), ["dtype", "int8"]),
    ("not_object", lambda c: [c], ["not a JSON object"]),
]


def test_import_config_refusals(checkpoints, tmp_path):
    """Every unsupported or out-of-range config.json value: HFCheckpointError naming config.json and the
    field (transformers would load a scaled RoPE with other logits; a bool / zero size is no model)."""
    from megatron_splitkv.megatron.hf import HFCheckpointError, read_qwen3_config

    tied = checkpoints["tied"]["path"]
    read_qwen3_config(_variant(tied, str(tmp_path / "ok"), lambda c: c.pop("architectures") and None))  # absent: fine
    for case, change, words in CONFIG_REFUSALS:
        d = _variant(tied, str(tmp_path / case), change)
        with pytest.raises(HFCheckpointError) as exc:
            read_qwen3_config(d)
        msg = str(exc.value)
        assert os.path.join(d, "config.json") in msg and all(w in msg for w in words), (case, msg)


def test_import_tensor_refusals(checkpoints, tmp_path):
    """vocab_size that differs from the embedding's / LM head's rows, and damaged safetensors files (empty,
    truncated, bad header): HFCheckpointError naming the file (and the tensor and field), not a raw
    SafetensorError and not a silently padded vocabulary."""
    from megatron_splitkv.megatron.hf import HFCheckpointError, load_hf_target

    tied, untied = checkpoints["tied"]["path"], checkpoints["untied"]["path"]
    data = open(os.path.join(tied, "model.safetensors"), "rb").read()
    index = json.load(open(os.path.join(untied, "model.safetensors.index.json")))
    lm_shard = index["weight_map"]["lm_head.weight"]
    cases = {
        "vocab_more": (_variant(tied, str(tmp_path / "vm"), lambda c: c.update(vocab_size=VOCAB + 4)),
                       "model.safetensors", ["model.embed_tokens.weight", f"{VOCAB} rows", "vocab_size"]),
        "vocab_less": (_variant(untied, str(tmp_path / "vl"), lambda c: c.update(vocab_size=VOCAB - 1)),
                       None, ["embed_tokens.weight", f"{VOCAB} rows", "vocab_size"]),
        "empty": (_variant(tied, str(tmp_path / "e"), files={"model.safetensors": b""}), "model.safetensors",
                  ["safetensors"]),
        "truncated": (_variant(tied, str(tmp_path / "t"), files={"model.safetensors": data[:len(data) // 2]}),
                      "model.safetensors", ["damaged"]),
        "bad_header": (_variant(tied, str(tmp_path / "h"), files={"model.safetensors": data[:8] + b"{x" + data[10:]}),
                       "model.safetensors", ["damaged"]),
        "shard_truncated": (_variant(untied, str(tmp_path / "s"), files={
            lm_shard: open(os.path.join(untied, lm_shard), "rb").read()[:-64]}), lm_shard, ["damaged"]),
    }
    with _in_process() as pgs:
        for case, (path, file, words) in cases.items():
            with pytest.raises(HFCheckpointError) as exc:
                load_hf_target(path, pg_collection=pgs)
            msg = str(exc.value)
            assert (file is None or os.path.join(path, file) in msg) and all(w in msg for w in words), (case, msg)
