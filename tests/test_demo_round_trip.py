"""The demo's round trip on a tiny config: the demo target is made with transformers (Qwen3ForCausalLM) and
cached by fingerprint, the drafter trains at CP=2 against it through the Hugging Face import, is exported before
and after training, and both exports are evaluated with dflash (tau.json with both labels)."""

import json
import os

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("dflash.model")
pytest.importorskip("transformers")

from megatron_splitkv import train_demo  # noqa: E402

TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--steps", "2", "--target-train-steps", "3", "--eval-prompts", "1",
        "--eval-new-tokens", "8"]


def test_demo_round_trip_tiny(tmp_path, capsys):
    out = str(tmp_path / "demo")
    assert train_demo.main(TINY + ["--out-dir", out]) in (0, 1)  # 1: two steps need not lower the loss
    text = capsys.readouterr().out
    assert "made in" in text and "held-out tau (B = 16): untrained drafter" in text
    assert "regenerated responses" in text and os.path.isfile(os.path.join(out, "regenerated.npz"))
    for d in ("target-hf", "drafter-hf", "drafter-hf-init"):
        assert os.path.isfile(os.path.join(out, d, "config.json")), d
    assert os.path.isfile(os.path.join(out, "target-hf", "token_map.json"))
    res = json.load(open(os.path.join(out, "tau.json")))["results"]
    assert sorted(res) == ["trained", "untrained"]
    assert all(1 <= r["mean_tau"] <= 16 for r in res.values())
    cfg = json.load(open(os.path.join(out, "drafter-hf", "config.json")))
    assert cfg["dflash_config"]["target_layer_ids"] == [1] and cfg["num_target_layers"] == 2
    # the second run reuses the target (same fingerprint); a changed flag rebuilds it
    args = train_demo.parse_args(TINY + ["--out-dir", out])
    train_demo.prepare_target(args, log=lambda s: print(s))
    text = capsys.readouterr().out
    assert text.count("reused (fingerprint matches)") == 2  # the target and the regenerated responses
    assert args.target_hf_path == os.path.join(out, "target-hf")
    assert args.train_corpus_path == os.path.join(out, "regenerated.npz")
    corpus = train_demo.training_corpus(args)  # prompt + the target's response, loss on the response only
    prompt_len = corpus.lengths[0] - int(corpus.conversation(0)[1].sum())
    assert 1 <= int(corpus.conversation(0)[1].sum()) <= 64 and not corpus.conversation(0)[1][:prompt_len].any()
    args = train_demo.parse_args(TINY + ["--out-dir", out, "--no-regenerate"])
    train_demo.prepare_target(args, log=lambda s: None)
    assert getattr(args, "train_corpus_path", None) is None
    assert train_demo.training_corpus(args).tokens.tolist() != corpus.tokens.tolist()  # ShareGPT's own text


def test_bad_target_flags_fail_before_the_ranks(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_demo.parse_args(["--target-hf-path", str(tmp_path)])
    assert e.value.code == 2 and "--target-hf-path" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        train_demo.parse_args(["--random-target", "--target-hf-path", str(tmp_path)])
    assert "not allowed with" in capsys.readouterr().err
