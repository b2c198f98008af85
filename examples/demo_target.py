"""The demo's tiny Qwen3 target in Hugging Face format: made with `transformers` (`Qwen3Config`,
`Qwen3ForCausalLM`), briefly trained on the demo's ShareGPT conversations, saved with `save_pretrained`.

Why trained: a random target's greedy text is one token repeated, which any drafter predicts; a target that
has learnt a little of ShareGPT continues a prompt with varied text, so the acceptance length measures the
drafter. Vocabulary: compact (`megatron_splitkv.data.vocab.CompactVocab`, saved as ``token_map.json``): the
Qwen ids of the training conversations, of the first `VOCAB_PROMPTS` held-out prompts (their rows exist so
that the evaluation can feed them; they are never trained on) and of the chat-template specials, plus one MASK
row; the embedding is padded to a multiple of 64 rows.

Cache: the directory holds ``demo_target.json`` with the `DemoTargetSpec` fingerprint (sha256 of its fields
and `FORMAT`); `ensure_demo_target` reuses a directory whose fingerprint matches and rebuilds it otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from megatron_splitkv.acceptance import HELDOUT_FIRST_RECORD, heldout_prompts
from megatron_splitkv.data.sharegpt import ENDOFTEXT, IM_END, IM_START, load_sharegpt
from megatron_splitkv.data.vocab import CompactVocab

__all__ = ["FORMAT", "VOCAB_PROMPTS", "DemoTargetSpec", "ensure_demo_target", "make_demo_target"]

FORMAT = 1
META_FILE = "demo_target.json"
#: held-out prompts whose token ids get rows in the demo target's vocabulary (the evaluation's prompts)
VOCAB_PROMPTS = 64


@dataclasses.dataclass(frozen=True)
class DemoTargetSpec:
    """What the demo target is made from (every field enters the fingerprint).

    limit: ShareGPT conversations trained on (the first `limit` records, as the demo's drafter training).
    hidden, num_layers: sizes; heads = max(2, hidden // 16), kv heads = max(1, heads // 2), head dim 16,
    intermediate 2 * hidden (the demo's drafter shape). init_std: `initializer_range`. steps, seq_len,
    batch, lr: causal-LM training (AdamW, linear warm-up over 5% of the steps, cosine to 10%).
    max_positions: `max_position_embeddings`. seed: init and window sampling.
    """

    limit: int = 400
    hidden: int = 128
    num_layers: int = 6
    init_std: float = 0.02
    steps: int = 300
    seq_len: int = 64
    batch: int = 8
    lr: float = 1e-2
    max_positions: int = 4096
    seed: int = 0

    def fingerprint(self) -> str:
        text = json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def hf_config(self, vocab_rows: int) -> Qwen3Config:
        heads = max(2, self.hidden // 16)
        return Qwen3Config(vocab_size=vocab_rows, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                           num_hidden_layers=self.num_layers, num_attention_heads=heads,
                           num_key_value_heads=max(1, heads // 2), head_dim=16, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           max_position_embeddings=self.max_positions, tie_word_embeddings=False,
                           initializer_range=self.init_std, architectures=["Qwen3ForCausalLM"])


def _windows(stream: np.ndarray, n: int, seq_len: int, rng) -> torch.Tensor:
    starts = rng.integers(0, stream.shape[0] - seq_len, size=n)
    return torch.as_tensor(np.stack([stream[s:s + seq_len] for s in starts]))


def make_demo_target(spec: DemoTargetSpec, out_dir: str, *, threads: int = 1, device="cpu", max_seconds=None,
                     log=print) -> dict:
    """Make the demo target (see the module docstring) and save it to `out_dir` (`save_pretrained`,
    ``token_map.json``, ``demo_target.json``), training in float32 on `device` (TF32 matmuls on CUDA);
    `max_seconds` (None: no limit) ends training early after the step that passes it. Returns the metadata
    written to ``demo_target.json``: fingerprint, spec, parameters, steps run, vocabulary size, first/last
    training loss, seconds, and for 3 held-out prompts the number of distinct tokens among 32 greedy new
    tokens."""
    if spec.limit > HELDOUT_FIRST_RECORD:
        raise ValueError(f"--limit {spec.limit}: the demo target would train on the held-out ShareGPT records "
                         f"(from {HELDOUT_FIRST_RECORD} on); use --limit <= {HELDOUT_FIRST_RECORD}")
    t0 = time.time()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        corpus = load_sharegpt(spec.limit)
        prompts = heldout_prompts(VOCAB_PROMPTS, max_prompt_tokens=1 << 30)
        vocab = CompactVocab.from_tokens(corpus.tokens, *[p.tokens for p in prompts], [IM_START, IM_END, ENDOFTEXT])
        rows = -(-vocab.num_rows // 64) * 64
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(spec.hf_config(rows)).to(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        stream = vocab.encode(corpus.tokens, "training conversations")
        rng = np.random.default_rng([spec.seed, 11])
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.95))
        warm = max(1, spec.steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, spec.steps))))))
        model.train()
        losses = []
        for step in range(spec.steps):
            x = _windows(stream, spec.batch, spec.seq_len, rng).to(device)
            loss = model(input_ids=x, labels=x).loss  # shifted inside: position t predicts t + 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log and (step + 1) % max(1, spec.steps // 6) == 0:
                log(f"  demo target step {step + 1}/{spec.steps}  loss {losses[-1]:.3f}")
            if max_seconds is not None and time.time() - t0 > max_seconds:
                if log:
                    log(f"  demo target: time budget {max_seconds} s reached after {step + 1} steps")
                break
        model.eval()
        distinct = []
        with torch.no_grad():
            for p in prompts[:3]:
                x = torch.as_tensor(vocab.encode(p.tokens[-spec.seq_len:]))[None].to(device)
                y = model.generate(x, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, x.shape[1]:]
                distinct.append(int(torch.unique(y).numel()))
    finally:
        torch.set_num_threads(saved_threads)
    tmp = f"{out_dir.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    vocab.save(tmp)
    k = max(1, min(10, len(losses) // 5))
    meta = {"fingerprint": spec.fingerprint(), "spec": dataclasses.asdict(spec), "steps_run": len(losses),
            "parameters": sum(p.numel() for p in model.parameters()), "vocab_ids": len(vocab),
            "vocab_rows": rows, "mask_token_id": vocab.mask_token_id,
            "loss_first": float(np.mean(losses[:k])) if losses else None,
            "loss_last": float(np.mean(losses[-k:])) if losses else None,
            "greedy_distinct_tokens_of_32": distinct, "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(tmp, out_dir)
    return meta


def ensure_demo_target(spec: DemoTargetSpec, out_dir: str, *, threads: int = 1, log=print) -> tuple:
    """`out_dir` holding the demo target of `spec`: reused when its ``demo_target.json`` fingerprint
    matches, else made (`make_demo_target`). Returns (metadata dict, made: bool)."""
    path = os.path.join(out_dir, META_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            meta = {}
        if meta.get("fingerprint") == spec.fingerprint():
            return meta, False
    if log:
        log(f"making the demo target in {out_dir} (transformers Qwen3ForCausalLM, {spec.num_layers} layers, "
            f"hidden {spec.hidden}, {spec.steps} steps on {spec.limit} ShareGPT conversations)")
    return make_demo_target(spec, out_dir, threads=threads, log=log), True
