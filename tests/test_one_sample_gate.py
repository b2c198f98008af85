"""One-sample gate of the round trip (issue 20; SpecForge has one): a drafter overfitted on ONE prompt's target
continuation, exported, must be accepted by the official DFlash inference code on that prompt, and the same test
with the exported tap ids shifted by one must fail, so the gate is shown to catch that bug class.

Chain: a tiny random Qwen3 target made with transformers (`Qwen3ForCausalLM`, save_pretrained); its greedy
continuation of a random prompt (transformers' `generate`); our Megatron `DFlashDraftModel` trained on
prompt + continuation (anchors at every position of the continuation) against the target's features, the target
imported through `megatron_splitkv.megatron.hf.load_hf_target` and tapped by `TargetFeatureProvider`; the drafter
exported through `megatron_splitkv.megatron.hf.export_drafter`; z-lab's `dflash.model.dflash_generate` (dflash
0.1.0) decodes the prompt greedily with the exported drafter: mean acceptance length >= 0.8 x B, and the tokens are
the target's own greedy continuation (speculative decoding is lossless). Then `dflash_config.target_layer_ids` is
shifted by -1 (reading Hugging Face's `hidden_states[i]` instead of `hidden_states[i + 1]`, the off-by-one of
sglang 37475): the gate must fail.

The continuation is checked to need the context (one of its tokens is followed by different tokens at two places),
so a drafter that ignored the target's features could not pass the gate.
"""

import json
import os
import shutil

import pytest
import torch

from _dist import run_distributed
from _warning_marks import MEGATRON_ENV

pytest.importorskip("megatron.core")
pytest.importorskip("safetensors")
pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

pytestmark = MEGATRON_ENV

B = 4
VOCAB = 48
MASK_ID = VOCAB - 1  # never in the prompt; a random target may still emit it, which changes nothing here
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 32, 4, 2, 8, 64
TARGET_LAYERS, TAPS = 4, [2]  # one drafter layer taps the middle layer (DFlash's rule for 1 draft layer)
PROMPT_LEN, NEW = 8, 40
STEPS, LR = 250, 1e-2
GATE = 0.8 * B


def _make_target(path):
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=GROUPS, head_dim=HEAD_DIM, max_position_embeddings=128,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(cfg).eval()
    target.save_pretrained(path)
    prompt = torch.randint(0, VOCAB - 1, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        seq = target.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return target, prompt, seq[0]


def _train_and_export(rank, world, target_dir, seq, out_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_splitkv.dflash import build_draft_blocks
    from megatron_splitkv.megatron.hf import export_drafter, load_hf_target
    from megatron_splitkv.megatron.models import DFlashDraftModel, TargetFeatureProvider, qwen3_config

    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1,
                                 create_gloo_process_groups=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    target = load_hf_target(target_dir, pg_collection=pgs, mask_token_id=MASK_ID, drafter_hidden_size=HIDDEN)
    provider = TargetFeatureProvider(target, TAPS)
    S = seq.shape[0]
    kv_seq, kv_pos = torch.zeros(S, dtype=torch.int64), torch.arange(S)
    feats = provider(seq, kv_seq, kv_pos)
    anchors = torch.arange(PROMPT_LEN, S - 1)  # every block the decoding can start: at the continuation
    blocks = build_draft_blocks(seq, [S], torch.zeros_like(anchors), anchors, block_size=B, mask_token_id=MASK_ID)
    torch.manual_seed(1)
    dcfg = qwen3_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                        kv_channels=HEAD_DIM, ffn_hidden_size=FFN)
    drafter = DFlashDraftModel(dcfg, num_taps=len(TAPS), word_embeddings=provider.word_embeddings,
                               output_layer=provider.output_layer, mask_token_id=MASK_ID, block_size=B,
                               pg_collection=pgs)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = drafter(feats, blocks, kv_seq, kv_pos)
        out.loss.backward()
        opt.step()
        losses.append(float(out.total))
    export_drafter(drafter, out_dir, target_layer_ids=TAPS, num_target_layers=TARGET_LAYERS,
                   max_position_embeddings=128)
    ps.destroy_model_parallel()
    return losses


def _mean_acceptance(drafter_dir, target, prompt):
    from dflash.model import DFlashDraftModel

    from megatron_splitkv.acceptance import acceptance_lengths

    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    acc, new = acceptance_lengths(drafter, target, prompt, NEW, None)
    return sum(acc) / len(acc), new


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    target, prompt, seq = _make_target(str(root / "target"))
    out = str(root / "drafter")
    losses = run_distributed(_train_and_export, 1, str(root / "target"), seq, out, timeout=240)[0]
    return root, target, prompt, seq, out, losses


def test_continuation_needs_the_context(gate):
    seq = gate[3][PROMPT_LEN:].tolist()
    follow = {}
    for a, b in zip(seq, seq[1:]):
        follow.setdefault(a, set()).add(b)
    assert len(set(seq)) > 2, seq  # not one repeated token
    assert any(len(s) > 1 for s in follow.values()), seq  # the last token alone does not say what comes next


def test_overfitted_drafter_passes_the_gate(gate):
    root, target, prompt, seq, out, losses = gate
    assert losses[-1] < 0.05 * losses[0], losses[::25]
    tau, new = _mean_acceptance(out, target, prompt)
    assert new.tolist() == seq[PROMPT_LEN:].tolist()  # lossless: the target's own greedy continuation
    print(f"one-sample gate: mean acceptance {tau:.2f} (B = {B}, gate {GATE})")
    assert tau >= GATE, f"mean acceptance {tau:.2f} < {GATE} (B = {B})"


def test_shifted_tap_ids_fail_the_gate(gate):
    root, target, prompt, seq, out, _ = gate
    shifted = str(root / "drafter-shifted")
    shutil.copytree(out, shifted)
    path = os.path.join(shifted, "config.json")
    cfg = json.load(open(path))
    assert cfg["dflash_config"]["target_layer_ids"] == TAPS
    cfg["dflash_config"]["target_layer_ids"] = [i - 1 for i in TAPS]
    json.dump(cfg, open(path, "w"))
    tau, new = _mean_acceptance(shifted, target, prompt)
    assert new.tolist() == seq[PROMPT_LEN:].tolist()  # still lossless: only the drafts get worse
    print(f"one-sample gate, tap ids shifted by -1: mean acceptance {tau:.2f} (B = {B}, gate {GATE})")
    assert tau < GATE, f"the gate missed shifted tap ids: mean acceptance {tau:.2f} >= {GATE}"
