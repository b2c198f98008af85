"""Acceptance length (tau) of an exported DFlash drafter, measured with the official inference code.

Greedy speculative decoding with z-lab's `dflash` 0.1.0 (`dflash.model.DFlashDraftModel.from_pretrained`,
`dflash.model.dflash_generate(..., return_stats=True)`) against a Hugging Face Qwen3 target
(`transformers.Qwen3ForCausalLM`). dflash's `acceptance_lengths` are the tokens produced per target
verification step (the accepted draft tokens plus the target's bonus token, 1..B); a prompt's tau is their
mean, and the mean tau is the mean over prompts (as dflash's own benchmark prints it).

Held-out prompts: ShareGPT V3 records ``[HELDOUT_FIRST_RECORD, end)`` of the file (671 records), never the
records a run with ``--limit <= HELDOUT_FIRST_RECORD`` trains on (the demo trains on the first 400). A
prompt is the conversation's system turn (if any) and first user turn in the Qwen chat template, followed
by the assistant header ``<|im_start|>assistant\\n``; longer prompts keep their last `max_prompt_tokens`.

Targets with a compact vocabulary (`megatron_splitkv.data.vocab`, ``token_map.json`` in the target
directory) see the prompts through that map; a prompt with an id outside it is skipped and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np
import torch
from dflash import model as dflash_model
from transformers import Qwen3ForCausalLM

from .data.regenerate import ChatPrompt, chat_prompts
from .data.sharegpt import ENDOFTEXT, IM_END
from .data.vocab import CompactVocab

__all__ = ["HELDOUT_FIRST_RECORD", "HeldOutPrompt", "heldout_prompts", "load_pair", "acceptance_lengths",
           "evaluate_acceptance", "write_report"]

#: ShareGPT V3 records from this index on (file order) are held out from training.
HELDOUT_FIRST_RECORD = 17000


#: one held-out prompt (record index, id, tokenizer ids [S] int64)
HeldOutPrompt = ChatPrompt


def heldout_prompts(num_prompts: int, *, max_prompt_tokens: int = 256,
                    first_record: int = HELDOUT_FIRST_RECORD) -> list:
    """The first `num_prompts` usable prompts of ShareGPT records ``[first_record, end)`` (see the module
    docstring; `megatron_splitkv.data.regenerate.chat_prompts`), as `HeldOutPrompt`s. Deterministic. Raises
    ValueError when fewer exist."""
    out = chat_prompts(num_prompts, first_record=first_record, max_prompt_tokens=max_prompt_tokens)
    if len(out) < num_prompts:
        raise ValueError(f"only {len(out)} held-out ShareGPT prompts from record {first_record} on, "
                         f"{num_prompts} asked for")
    return out


def load_pair(target_dir: str, drafter_dir: str, *, device="cpu", dtype=torch.float32):
    """Load the target (`Qwen3ForCausalLM.from_pretrained`), its `CompactVocab` (None without
    ``token_map.json``) and the drafter (`dflash.model.DFlashDraftModel.from_pretrained`), both in eval
    mode on `device`. Returns (target, vocab, drafter).

    Raises ValueError naming the file and field when the two do not fit together: hidden sizes, a
    `target_layer_ids` entry outside the target's layers, a mask token outside the target's vocabulary,
    a drafter `fc` input that is not len(target_layer_ids) x hidden.
    """
    tcfg, dcfg = os.path.join(target_dir, "config.json"), os.path.join(drafter_dir, "config.json")
    _check_pair_configs(tcfg, dcfg)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    drafter = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype).to(device).eval()
    vocab = CompactVocab.load(target_dir)
    th, dh = target.config.hidden_size, drafter.config.hidden_size
    if th != dh:
        raise ValueError(f"{dcfg}: hidden_size {dh} differs from the target's ({tcfg}: hidden_size {th})")
    n = target.config.num_hidden_layers
    taps = [int(i) for i in drafter.target_layer_ids]
    if not taps or min(taps) < 0 or max(taps) >= n:
        raise ValueError(f"{dcfg}: dflash_config.target_layer_ids {taps} must lie in [0, {n}) "
                         f"({tcfg}: num_hidden_layers {n})")
    mask, v = drafter.mask_token_id, target.config.vocab_size
    if mask is None or not 0 <= int(mask) < v:
        raise ValueError(f"{dcfg}: dflash_config.mask_token_id {mask} must lie in [0, {v}) ({tcfg}: vocab_size)")
    if vocab is not None and int(mask) < len(vocab):
        raise ValueError(f"{dcfg}: dflash_config.mask_token_id {mask} is a text token of the target's "
                         f"token_map.json (its MASK row is {vocab.mask_token_id})")
    return target, vocab, drafter


#: the largest drafter block size evaluated (DFlash drafters use 8-16; the verification step is B tokens)
MAX_BLOCK_SIZE = 1024


def _read_config(path: str) -> dict:
    """config.json as a dict; ValueError naming the file when it is unreadable or not a JSON object."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def _check_pair_configs(target_config: str, drafter_config: str) -> None:
    """Before loading any weights: the target's config.json is not a DFlash drafter's, the drafter's names
    DFlashDraftModel and a block_size in [2, MAX_BLOCK_SIZE]. Raises ValueError naming the file and field."""
    t, d = _read_config(target_config), _read_config(drafter_config)
    if "DFlashDraftModel" in (t.get("architectures") or []):
        raise ValueError(f"{target_config}: architectures {t['architectures']} is a DFlash drafter, not a "
                         "Qwen3ForCausalLM target (are --target-hf-path and --drafter swapped?)")
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        raise ValueError(f"{drafter_config}: architectures {d.get('architectures')} does not name "
                         "DFlashDraftModel (an exported drafter: python -m megatron_splitkv.export)")
    b = d.get("block_size")
    if type(b) is not int or not 2 <= b <= MAX_BLOCK_SIZE:
        raise ValueError(f"{drafter_config}: block_size {b!r} must be an int in [2, {MAX_BLOCK_SIZE}]")


@contextlib.contextmanager
def _dflash_clock(device: torch.device):
    """dflash 0.1.0 times its stats with `torch.cuda.synchronize()` (`dflash.model._cuda_time`), which
    raises without a GPU; off CUDA the host clock stands in (timing only: no token depends on it)."""
    if device.type == "cuda":
        yield
        return
    saved = dflash_model._cuda_time
    dflash_model._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dflash_model._cuda_time = saved


def acceptance_lengths(drafter, target, input_ids, max_new_tokens: int, stop_token_ids=None):
    """Greedy `dflash_generate(drafter, target, input_ids [1, S], max_new_tokens, stop_token_ids,
    temperature=0, return_stats=True)`. Returns (acceptance lengths per verification step (list of int),
    new token ids [n] int64 on the CPU)."""
    with _dflash_clock(input_ids.device):
        st = dflash_model.dflash_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids,
                                          temperature=0.0, return_stats=True)
    return [int(a) for a in st.acceptance_lengths], st.output_ids[0, st.num_input_tokens:].cpu()


def evaluate_acceptance(target, vocab, drafter, prompts, *, max_new_tokens: int, stop_at_eos: bool = True,
                        progress: bool = True, desc: str = "tau") -> dict:
    """tau of `drafter` on `prompts` (`HeldOutPrompt`s; tokenizer ids, mapped through `vocab` when given).

    Stop tokens: <|im_end|> and <|endoftext|> (those the vocabulary holds) with `stop_at_eos`, else none
    (every prompt generates `max_new_tokens`). Returns a dict: block_size, target_layer_ids,
    mask_token_id, mean_tau (mean of the per-prompt tau), pooled_tau (all produced tokens / all
    verification steps), histogram {acceptance length: steps}, per_prompt [{record, id, prompt_tokens,
    new_tokens, new_token_ids (model ids), steps, tau, acceptance_lengths}], skipped [{record, id, reason}].
    """
    from tqdm import tqdm

    dev = next(target.parameters()).device
    stops = None
    if stop_at_eos:
        eos = np.asarray([IM_END, ENDOFTEXT], dtype=np.int64)
        stops = [int(i) for i in (vocab.encode(eos[vocab.known(eos)]) if vocab is not None else eos)]
    B = int(drafter.block_size)
    rows, skipped = [], []
    for p in tqdm(prompts, desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True):
        ids = p.tokens
        if vocab is not None:
            if not vocab.known(ids).all():
                skipped.append({"record": p.record, "id": p.id, "reason": "token ids outside token_map.json"})
                continue
            ids = vocab.encode(ids)
        x = torch.as_tensor(ids, dtype=torch.long, device=dev)[None]
        acc, new = acceptance_lengths(drafter, target, x, max_new_tokens, stops)
        rows.append({"record": p.record, "id": p.id, "prompt_tokens": int(ids.shape[0]),
                     "new_tokens": int(new.shape[0]), "new_token_ids": [int(t) for t in new],
                     "steps": len(acc), "tau": float(np.mean(acc)) if acc else None, "acceptance_lengths": acc})
    scored = [r for r in rows if r["steps"]]
    allacc = [a for r in scored for a in r["acceptance_lengths"]]
    return {
        "block_size": B, "target_layer_ids": [int(i) for i in drafter.target_layer_ids],
        "mask_token_id": int(drafter.mask_token_id), "max_new_tokens": int(max_new_tokens),
        "stop_at_eos": bool(stop_at_eos), "num_prompts": len(rows),
        "mean_tau": float(np.mean([r["tau"] for r in scored])) if scored else None,
        "pooled_tau": float(np.sum(allacc) / len(allacc)) if allacc else None,
        "histogram": {str(k): int(allacc.count(k)) for k in range(1, B + 1)},
        "per_prompt": rows, "skipped": skipped,
    }


def format_report(result: dict, label: str = "") -> str:
    """Text lines: mean tau, pooled tau, per-prompt tau, histogram."""
    head = f"{label}: " if label else ""
    tau = result["mean_tau"]
    lines = [f"{head}mean tau {tau:.3f}" if tau is not None else f"{head}mean tau n/a (no verification steps)"]
    if result["pooled_tau"] is not None:
        lines[0] += (f" (pooled {result['pooled_tau']:.3f}) over {result['num_prompts']} prompts, "
                     f"B = {result['block_size']}")
    per = " ".join(f"{r['tau']:.2f}" if r["tau"] is not None else "-" for r in result["per_prompt"])
    lines.append(f"  per-prompt tau: {per}")
    total = max(1, sum(result["histogram"].values()))
    lines.append("  acceptance length histogram (share of verification steps): "
                 + " ".join(f"{k}:{v / total:.0%}" for k, v in result["histogram"].items() if v))
    if result["skipped"]:
        lines.append(f"  skipped {len(result['skipped'])} prompts: "
                     + "; ".join(f"record {s['record']} ({s['reason']})" for s in result["skipped"][:5]))
    return "\n".join(lines)


def write_report(results: dict, prefix: str, meta: dict | None = None) -> tuple:
    """Write ``prefix.json`` ({"meta": meta, "results": {label: result}}) and ``prefix.png`` (per label: the
    histogram of acceptance lengths over verification steps, and the per-prompt tau). Returns the two
    paths."""
    import matplotlib  # noqa: PLC0415 - optional: matplotlib, only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    d = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(d, exist_ok=True)
    jpath, ppath = f"{prefix}.json", f"{prefix}.png"
    with open(jpath, "w") as f:
        json.dump({"meta": meta or {}, "results": results}, f, indent=1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    n = len(results)
    width = 0.8 / max(n, 1)
    for j, (label, r) in enumerate(results.items()):
        ks = np.arange(1, r["block_size"] + 1)
        counts = np.asarray([r["histogram"][str(k)] for k in ks], dtype=float)
        share = counts / max(counts.sum(), 1)
        tau = r["mean_tau"]
        name = f"{label} (tau {tau:.2f})" if tau is not None else label
        ax1.bar(ks + (j - (n - 1) / 2) * width, share, width=width, label=name)
        taus = [p["tau"] for p in r["per_prompt"] if p["tau"] is not None]
        ax2.plot(range(len(taus)), taus, "o-", ms=3, label=name)
    ax1.set_xlabel("acceptance length (tokens per verification step)")
    ax1.set_ylabel("share of steps")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("held-out prompt")
    ax2.set_ylabel("tau")
    ax2.legend(fontsize=8)
    fig.suptitle("DFlash acceptance length, greedy (dflash 0.1.0 dflash_generate)")
    fig.tight_layout()
    fig.savefig(ppath, dpi=100)
    plt.close(fig)
    return jpath, ppath
