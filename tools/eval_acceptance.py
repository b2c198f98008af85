"""Acceptance length (tau) of an exported DFlash drafter on held-out ShareGPT prompts.

    python tools/eval_acceptance.py --target-hf-path out/demo/target-hf --drafter out/demo/drafter-hf \\
        --num-prompts 16 --max-new-tokens 64 --device cpu --out out/demo/tau

Greedy speculative decoding with the official DFlash inference code (z-lab `dflash` 0.1.0:
`DFlashDraftModel.from_pretrained`, `dflash_generate(..., return_stats=True)`) against the Hugging Face
Qwen3 target (`Qwen3ForCausalLM`). Prompts: ShareGPT V3 records 17000 and later (held out from training
runs with `--limit <= 17000`; `megatron_splitkv.acceptance`). Prints the mean tau, the per-prompt tau and the
histogram of acceptance lengths; writes PREFIX.json (every prompt's acceptance lengths and tokens) and
PREFIX.png. Runs on CPU (tiny models) or a GPU (`--device cuda`, `--dtype bfloat16`).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_splitkv._ints import hf_model_dir, int_arg  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-hf-path", required=True, type=hf_model_dir,
                   help="Hugging Face Qwen3 target directory (config.json + *.safetensors [+ token_map.json])")
    p.add_argument("--drafter", required=True, type=hf_model_dir,
                   help="exported DFlash drafter directory (python -m megatron_splitkv.export)")
    p.add_argument("--num-prompts", type=int_arg(1, 600), default=16, help="held-out prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int_arg(1, 65536), default=64, help="tokens per prompt (default 64)")
    p.add_argument("--max-prompt-tokens", type=int_arg(8, 1 << 20), default=256,
                   help="longer prompts keep their last N tokens (default 256)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at <|im_end|> / <|endoftext|>")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.json and PREFIX.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int_arg(1, 1024), default=None,
                   help="torch CPU threads (default: torch's; 1 is faster on a loaded 2-core machine)")
    args = p.parse_args(argv)
    import torch

    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r}: not a torch device (cpu, cuda, cuda:N)")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        p.error(f"--out {args.out}: {out_dir} is not a directory")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from megatron_splitkv.acceptance import (HELDOUT_FIRST_RECORD, evaluate_acceptance, format_report,
                                             heldout_prompts, load_pair, write_report)

    try:
        target, vocab, drafter = load_pair(args.target_hf_path, args.drafter, device=args.device,
                                           dtype=getattr(torch, args.dtype))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = heldout_prompts(args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    res = evaluate_acceptance(target, vocab, drafter, prompts, max_new_tokens=args.max_new_tokens,
                              stop_at_eos=not args.ignore_eos, progress=not args.no_progress)
    meta = {"target": os.path.abspath(args.target_hf_path), "drafter": os.path.abspath(args.drafter),
            "prompts": f"ShareGPT V3 records >= {HELDOUT_FIRST_RECORD}, first {args.num_prompts} usable, "
                       f"last {args.max_prompt_tokens} tokens",
            "device": str(args.device), "dtype": args.dtype, "torch": torch.__version__}
    print(format_report(res, label=os.path.basename(os.path.normpath(args.drafter))))
    jpath, ppath = write_report({"drafter": res}, args.out, meta)
    print(f"wrote {jpath} and {ppath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
