"""The demo's round trip on a tiny config: the demo target is made with transformers (Qwen3ForCausalLM) and
cached by fingerprint, the drafter trains at CP=2 against it through the Hugging Face import, is exported before
and after training, and both exports are evaluated with dflash (tau.json with both labels)."""

import json
import os

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("dflash.model")
pytest.importorskip("transformers")

from _dist import forked_ranks  # noqa: E402
from examples import train_demo  # noqa: E402

TINY = ["--limit", "4", "--max-tokens", "640", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1",
        "--num-anchors", "4", "--steps", "2", "--target-train-steps", "3", "--eval-prompts", "1",
        "--eval-new-tokens", "8"]


def test_demo_round_trip_tiny(tmp_path, capsys):
    out = str(tmp_path / "demo")
    assert train_demo.main(TINY + ["--out-dir", out]) == 0  # two steps: the loss trend is printed, not judged
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


def test_demo_checkpoint_exports_without_flags(tmp_path, monkeypatch):
    """A demo --save checkpoint carries its export metadata: `python -m megatron_splitkv.export --load D --out E`
    with no metadata flags writes the config.json and tensors of the demo's own in-memory export."""
    forked_ranks(monkeypatch)  # test_demo_round_trip_tiny runs the ranks as the demo does (spawned)
    import subprocess
    import sys

    from safetensors.torch import load_file

    out, ckpt, exp = (str(tmp_path / n) for n in ("demo", "ckpt", "exported"))
    flags = TINY[: TINY.index("--steps")] + ["--steps", "1", "--target-train-steps", "3", "--eval-prompts", "0",
                                             "--no-regenerate", "--out-dir", out, "--save", ckpt]
    assert train_demo.main(flags) in (0, 1)
    r = subprocess.run([sys.executable, "-m", "megatron_splitkv.export", "--load", ckpt, "--out", exp],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    own = os.path.join(out, "drafter-hf")
    assert json.load(open(os.path.join(exp, "config.json"))) == json.load(open(os.path.join(own, "config.json")))
    a, b = load_file(os.path.join(exp, "model.safetensors")), load_file(os.path.join(own, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k


def test_target_vocab_smaller_than_the_corpus_ids_fails_before_the_ranks(tmp_path):
    """A --target-hf-path without token_map.json (Qwen's ids) whose vocab_size is below the corpus's largest id:
    exit 2 up front, naming config.json's vocab_size and the largest id (no rank starts)."""
    import subprocess
    import sys

    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, architectures=["Qwen3ForCausalLM"])
    cfg.to_json_file(str(tmp_path / "config.json"))
    r = subprocess.run([sys.executable, train_demo.__file__, "--target-hf-path", str(tmp_path),
                        "--mask-token-id", "999", "--no-regenerate", "--limit", "4", "--hidden", "32",
                        "--target-layers", "2", "--draft-layers", "1", "--steps", "1", "--eval-prompts", "0",
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "config.json: field vocab_size = 1000" in r.stderr and "largest id" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stderr.lower(), r.stderr


def test_cp_above_the_cpu_limit_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        train_demo.parse_args(["--cp", str(train_demo.MAX_CP + 1)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--cp" in err and str(train_demo.MAX_CP) in err, err
    assert train_demo.parse_args(["--cp", str(train_demo.MAX_CP), "--random-target"]).cp == train_demo.MAX_CP


def test_demo_with_a_cp_rank_of_zero_query_blocks_runs(tmp_path, monkeypatch):
    """--max-tokens 256 --num-anchors 2 --block-size 4 at CP=2: a CP rank gets zero query blocks in some step, and
    the drafter's layers (core attention and the layer's output reshape) return empty tensors for it."""
    forked_ranks(monkeypatch)
    flags = ["--steps", "2", "--hidden", "32", "--target-layers", "2", "--draft-layers", "1", "--limit", "20",
             "--max-tokens", "256", "--num-anchors", "2", "--block-size", "4", "--target-train-steps", "3",
             "--eval-prompts", "0", "--out-dir", str(tmp_path)]
    assert train_demo.main(flags) in (0, 1)  # 1: two steps need not lower the loss; 2: a rank failed


def test_demo_run_leaks_no_semaphore(tmp_path):
    """`make demo` ended with the resource tracker's "There appear to be 1 leaked semaphore objects": rank 0's
    progress bar took tqdm's default multiprocessing lock (a named semaphore), which the rank's os._exit never
    released. A short run as a command (random target, CP 1, one step) ends without that warning."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONWARNINGS="always::UserWarning", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "examples/train_demo.py", "--random-target", "--cp", "1", "--steps", "1",
                        "--out-dir", str(tmp_path), *TINY[:TINY.index("--steps")]],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "summary" in p.stdout
    assert "leaked semaphore" not in p.stderr, p.stderr[-3000:]
