"""tools/eval_acceptance.py end to end on CPU: a tiny random Hugging Face Qwen3 target (transformers) with a compact
vocabulary and a tiny random DFlash drafter (z-lab dflash's own `DFlashDraftModel`, save_pretrained). The JSON's
numbers are recomputed from its per-step acceptance lengths, and the tokens dflash_generate produced are checked
against transformers' own greedy `generate` of the target (greedy speculative decoding is lossless); bad input
exits 2 naming the flag or the file and field."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("dflash")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from megatron_splitkv.acceptance import heldout_prompts  # noqa: E402
from megatron_splitkv.data.sharegpt import ENDOFTEXT, IM_END  # noqa: E402
from megatron_splitkv.data.vocab import CompactVocab  # noqa: E402
from tools import eval_acceptance  # noqa: E402

B = 4
N_PROMPTS = 3
MAX_PROMPT = 48
MAX_NEW = 20


def _qwen3_config(vocab_size, num_layers, **extra):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                       tie_word_embeddings=False, **extra)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("pair")
    prompts = heldout_prompts(N_PROMPTS, max_prompt_tokens=MAX_PROMPT)
    vocab = CompactVocab.from_tokens(*[p.tokens for p in prompts], [IM_END, ENDOFTEXT])
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(_qwen3_config(vocab.num_rows, 4))
    target.save_pretrained(root / "target")
    vocab.save(str(root / "target"))
    dcfg = _qwen3_config(vocab.num_rows, 1, num_target_layers=4, block_size=B, architectures=["DFlashDraftModel"],
                         dflash_config={"mask_token_id": vocab.mask_token_id, "target_layer_ids": [1]})
    DFlashDraftModel(dcfg).save_pretrained(root / "drafter")
    return root, target.eval(), vocab, prompts


def test_end_to_end_json_png_and_lossless_tokens(pair, capsys):
    root, target, vocab, prompts = pair
    out = root / "tau"
    rc = eval_acceptance.main(["--target-hf-path", str(root / "target"), "--drafter", str(root / "drafter"),
                               "--num-prompts", str(N_PROMPTS), "--max-new-tokens", str(MAX_NEW),
                               "--max-prompt-tokens", str(MAX_PROMPT), "--ignore-eos", "--no-progress",
                               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "mean tau" in text and "per-prompt tau" in text and "histogram" in text
    assert os.path.getsize(f"{out}.png") > 1000
    res = json.load(open(f"{out}.json"))["results"]["drafter"]
    assert res["block_size"] == B and res["target_layer_ids"] == [1]
    assert res["mask_token_id"] == vocab.mask_token_id
    assert res["num_prompts"] == N_PROMPTS and not res["skipped"]
    assert [r["record"] for r in res["per_prompt"]] == [p.record for p in prompts]
    for r, p in zip(res["per_prompt"], prompts):
        acc = r["acceptance_lengths"]
        assert r["steps"] == len(acc) > 0
        assert all(1 <= a <= B for a in acc)
        assert r["tau"] == pytest.approx(np.mean(acc))
        assert r["prompt_tokens"] == len(p.tokens) <= MAX_PROMPT
        # without stop tokens: MAX_NEW tokens, the first from the prefill, the others from the steps
        assert r["new_tokens"] == MAX_NEW == len(r["new_token_ids"]) == 1 + sum(acc)
        x = torch.as_tensor(vocab.encode(p.tokens))[None]
        want = target.generate(x, max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW)[0, x.shape[1]:]
        assert r["new_token_ids"] == want.tolist()
    allacc = [a for r in res["per_prompt"] for a in r["acceptance_lengths"]]
    assert 1 <= res["mean_tau"] <= B
    assert res["mean_tau"] == pytest.approx(np.mean([r["tau"] for r in res["per_prompt"]]))
    assert res["pooled_tau"] == pytest.approx(np.mean(allacc))
    assert res["histogram"] == {str(k): allacc.count(k) for k in range(1, B + 1)}


def test_prompts_are_held_out_and_deterministic():
    from megatron_splitkv.acceptance import HELDOUT_FIRST_RECORD

    a, b = heldout_prompts(3, max_prompt_tokens=32), heldout_prompts(3, max_prompt_tokens=32)
    assert [p.record for p in a] == [p.record for p in b]
    assert all(p.record >= HELDOUT_FIRST_RECORD for p in a)
    assert all(np.array_equal(p.tokens, q.tokens) and len(p.tokens) <= 32 for p, q in zip(a, b))


def _exit_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        eval_acceptance.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_flags_exit_2_naming_the_flag(pair, tmp_path, capsys):
    root = pair[0]
    base = ["--target-hf-path", str(root / "target"), "--drafter", str(root / "drafter"), "--out", str(tmp_path / "x")]
    err = _exit_message(["--target-hf-path", str(tmp_path), "--drafter", str(root / "drafter"), "--out", "x"], capsys)
    assert "--target-hf-path" in err and "config.json" in err
    for flag, value in (("--num-prompts", "0"), ("--max-new-tokens", "-1"), ("--num-prompts", "1.5"),
                        ("--device", "tpu"), ("--dtype", "int8")):
        assert flag in _exit_message(base + [flag, value], capsys)


def test_mismatched_drafter_exits_2_naming_file_and_field(pair, tmp_path, capsys):
    root = pair[0]
    bad = tmp_path / "drafter"
    bad.mkdir()
    for f in os.listdir(root / "drafter"):
        (bad / f).write_bytes((root / "drafter" / f).read_bytes())
    cfg = json.load(open(bad / "config.json"))
    cfg["dflash_config"]["target_layer_ids"] = [4]
    json.dump(cfg, open(bad / "config.json", "w"))
    rc = eval_acceptance.main(["--target-hf-path", str(root / "target"), "--drafter", str(bad), "--out",
                               str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert str(bad / "config.json") in err and "target_layer_ids" in err and "num_hidden_layers 4" in err


def test_swapped_dirs_and_huge_block_size_exit_2_before_loading(pair, tmp_path, capsys):
    """A drafter passed as the target (and the reverse), and a drafter block_size beyond MAX_BLOCK_SIZE (it hung
    in dflash_generate), are refused from the config files alone, naming the file and the field."""
    from megatron_splitkv.acceptance import MAX_BLOCK_SIZE

    root = pair[0]
    out = ["--out", str(tmp_path / "x"), "--no-progress"]
    rc = eval_acceptance.main(["--target-hf-path", str(root / "drafter"), "--drafter", str(root / "target")] + out)
    err = capsys.readouterr().err
    assert rc == 2 and str(root / "drafter" / "config.json") in err and "not a Qwen3ForCausalLM target" in err
    for value in (10 ** 12, 1, "16", MAX_BLOCK_SIZE + 1):
        bad = tmp_path / f"drafter_{value}"
        bad.mkdir()
        for f in os.listdir(root / "drafter"):
            (bad / f).write_bytes((root / "drafter" / f).read_bytes())
        cfg = json.load(open(bad / "config.json"))
        cfg["block_size"] = value
        json.dump(cfg, open(bad / "config.json", "w"))
        rc = eval_acceptance.main(["--target-hf-path", str(root / "target"), "--drafter", str(bad),
                                   "--threads", "1"] + out)
        err = capsys.readouterr().err
        assert rc == 2 and str(bad / "config.json") in err and "block_size" in err, (value, err)


def test_compact_vocab_round_trip_and_errors(tmp_path):
    v = CompactVocab.from_tokens([7, 3, 151645], [3, 9])
    assert v.token_ids.tolist() == [3, 7, 9, 151645] and v.mask_token_id == 4 and v.num_rows == 5
    assert v.encode([9, 3, 151645]).tolist() == [2, 0, 3]
    assert v.decode([2, 0, 3, 4]).tolist() == [9, 3, 151645, -1]  # MASK has no tokenizer id
    with pytest.raises(ValueError, match=r"prompt: 1 token id\(s\) outside .* \(first: 8\)"):
        v.encode([3, 8], "prompt")
    v.save(str(tmp_path))
    assert CompactVocab.load(str(tmp_path)).token_ids.tolist() == v.token_ids.tolist()
    assert CompactVocab.load(str(tmp_path / "none")) is None
    (tmp_path / "token_map.json").write_text(json.dumps({"format": 1, "token_ids": [5, 2]}))
    with pytest.raises(ValueError, match="token_map.json: field 'token_ids' must be sorted"):
        CompactVocab.load(str(tmp_path))
