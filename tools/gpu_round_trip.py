#!/usr/bin/env python
"""One larger round trip on a GPU machine, in one command with a time budget per stage:

    python tools/gpu_round_trip.py --out out/gpu_round_trip          # defaults: about 6 min on one H100

1. target: a Qwen3 of a few hundred million parameters (defaults: hidden 1024, 12 layers, head dim 16, compact
   vocabulary of the --limit ShareGPT conversations; `examples/demo_target.py` `make_demo_target`, the
   demo's maker with a larger `DemoTargetSpec`) trained briefly with transformers on --device, capped at
   --target-seconds, saved in Hugging Face format to WORK/target-hf;
2. regenerated responses: the target's greedy responses to the conversations' prompts on --device
   (`megatron_splitkv.data.regenerate`, WORK/regenerated.npz);
3. drafter: the demo's trainer (`python examples/train_demo.py`, CP=--cp gloo processes on the host's
   CPU cores, CUDA hidden from it) on the regenerated corpus, imported through `megatron.hf.load_hf_target`,
   exported before and after training (WORK/drafter-hf-init, WORK/drafter-hf); killed at --drafter-seconds;
4. tau: z-lab's dflash `dflash_generate` on --device (`megatron_splitkv.acceptance`, as
   tools/eval_acceptance.py) on --eval-prompts held-out ShareGPT prompts (records >= 17000), untrained vs
   trained drafter.

Writes under --out: summary.json (sizes, settings, seconds per stage, losses, tau), tau.json and tau.png
(both drafters), train.log (the drafter trainer's output), run.log (this script's lines). Model
directories stay in --work (default /tmp/gpu_round_trip). Exit status: 0 when every stage finished, 1 when
a stage failed or ran out of its budget (summary.json says which).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_splitkv._ints import float_arg, int_arg, output_dir  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=output_dir, required=True, help="directory for summary.json, tau.json/png, train.log, run.log")
    p.add_argument("--work", default="/tmp/gpu_round_trip", help="directory for the model directories")
    p.add_argument("--device", default="cuda", help="device for target training, regeneration and tau")
    p.add_argument("--limit", type=int_arg(1, 17000), default=2000, help="ShareGPT conversations (default 2000)")
    p.add_argument("--hidden", type=int_arg(16, 8192), default=1024, help="target and drafter hidden size")
    p.add_argument("--target-layers", type=int_arg(2, 128), default=12)
    p.add_argument("--target-steps", type=int_arg(1, 10 ** 6), default=1500)
    p.add_argument("--target-seq-len", type=int_arg(8, 8192), default=256)
    p.add_argument("--target-batch", type=int_arg(1, 4096), default=32)
    p.add_argument("--target-lr", type=float_arg(0, above=True), default=1e-3)
    p.add_argument("--target-seconds", type=float_arg(1), default=120, help="target training budget (default 120)")
    p.add_argument("--regen-new-tokens", type=int_arg(1, 4096), default=64)
    p.add_argument("--regen-batch", type=int_arg(1, 4096), default=128)
    p.add_argument("--draft-layers", type=int_arg(1, 16), default=2)
    p.add_argument("--drafter-steps", type=int_arg(1, 10 ** 6), default=30)
    p.add_argument("--drafter-lr", type=float_arg(0, above=True), default=3e-3)
    p.add_argument("--cp", type=int_arg(1, 16), default=2)
    p.add_argument("--threads", type=int_arg(1, 256), default=7, help="torch threads per CP process")
    p.add_argument("--max-tokens", type=int_arg(64, 1 << 20), default=2048, help="tokens per drafter batch")
    p.add_argument("--num-anchors", type=int_arg(1, 4096), default=16)
    p.add_argument("--drafter-seconds", type=int_arg(10, 3600), default=210, help="drafter stage budget (default 210)")
    p.add_argument("--eval-prompts", type=int_arg(1, 600), default=32)
    p.add_argument("--eval-new-tokens", type=int_arg(1, 4096), default=64)
    args = p.parse_args(argv)
    if args.draft_layers > 1 and args.target_layers < 4:
        p.error(f"--target-layers {args.target_layers}: a drafter of {args.draft_layers} layers taps a target of "
                f">= 4 layers (megatron_splitkv.dflash.target_layer_ids)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    logf = open(os.path.join(args.out, "run.log"), "w")

    def log(text):
        print(text, flush=True)
        logf.write(text + "\n")
        logf.flush()

    import torch

    from megatron_splitkv.acceptance import evaluate_acceptance, format_report, heldout_prompts, load_pair
    from megatron_splitkv.acceptance import write_report
    from megatron_splitkv.data.regenerate import RegenerateSpec, ensure_regenerated
    from examples.demo_target import DemoTargetSpec, make_demo_target

    summary = {"args": vars(args), "seconds": {}, "failed": None,
               "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device}
    spath = os.path.join(args.out, "summary.json")

    def save():
        with open(spath, "w") as f:
            json.dump(summary, f, indent=1)

    t0 = time.time()
    target = os.path.join(args.work, "target-hf")
    spec = DemoTargetSpec(limit=args.limit, hidden=args.hidden, num_layers=args.target_layers, steps=args.target_steps,
                          seq_len=args.target_seq_len, batch=args.target_batch, lr=args.target_lr,
                          max_positions=max(4096, args.max_tokens))
    log(f"[1/4] target: {spec}")
    summary["target"] = make_demo_target(spec, target, device=args.device, max_seconds=args.target_seconds, log=log)
    summary["seconds"]["target"] = round(time.time() - t0, 1)
    log(f"      {summary['target']['parameters']:,} parameters, {summary['target']['steps_run']} steps, loss "
        f"{summary['target']['loss_first']:.2f} -> {summary['target']['loss_last']:.2f}, "
        f"{summary['seconds']['target']} s")
    save()

    t1 = time.time()
    rspec = RegenerateSpec(limit=args.limit, max_new_tokens=args.regen_new_tokens, batch_size=args.regen_batch)
    log(f"[2/4] regenerated responses: {rspec}")
    _, summary["regenerated"], _ = ensure_regenerated(target, rspec, os.path.join(args.work, "regenerated.npz"),
                                                      device=args.device, log=log)
    summary["seconds"]["regenerate"] = round(time.time() - t1, 1)
    log(f"      {summary['regenerated']}")
    save()

    t2 = time.time()
    cmd = [sys.executable, os.path.join(REPO, "examples", "train_demo.py"), "--target-hf-path", target, "--out-dir", args.work,
           "--limit", str(args.limit), "--hidden", str(args.hidden), "--target-layers", str(args.target_layers),
           "--draft-layers", str(args.draft_layers), "--steps", str(args.drafter_steps), "--lr", str(args.drafter_lr),
           "--cp", str(args.cp), "--threads", str(args.threads), "--max-tokens", str(args.max_tokens),
           "--num-anchors", str(args.num_anchors), "--regen-new-tokens", str(args.regen_new_tokens),
           "--eval-prompts", "0"]
    log(f"[3/4] drafter: {' '.join(cmd)}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [REPO] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    with open(os.path.join(args.out, "train.log"), "w") as tl:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=tl, stderr=subprocess.STDOUT,
                                timeout=args.drafter_seconds).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    summary["seconds"]["drafter"] = round(time.time() - t2, 1)
    summary["drafter_exit"] = rc
    with open(os.path.join(args.out, "train.log")) as tl:
        summary["drafter_log_tail"] = tl.read().splitlines()[-14:]
    log("      " + "\n      ".join(summary["drafter_log_tail"]))
    if rc not in (0, 1) or not os.path.isfile(os.path.join(args.work, "drafter-hf", "config.json")):
        summary["failed"] = f"drafter stage: exit {rc} after {summary['seconds']['drafter']} s (train.log)"
        log(summary["failed"])
        save()
        return 1
    save()

    t3 = time.time()
    log(f"[4/4] tau on {args.eval_prompts} held-out prompts, {args.eval_new_tokens} new tokens, {args.device}")
    prompts = heldout_prompts(args.eval_prompts)
    results = {}
    for label, name in (("untrained", "drafter-hf-init"), ("trained", "drafter-hf")):
        tgt, vocab, drafter = load_pair(target, os.path.join(args.work, name), device=args.device)
        results[label] = evaluate_acceptance(tgt, vocab, drafter, prompts, max_new_tokens=args.eval_new_tokens,
                                             desc=f"tau {label}", progress=False)
        log(format_report(results[label], label))
        del tgt, drafter
    write_report(results, os.path.join(args.out, "tau"), {"target": target, "summary": "summary.json"})
    summary["seconds"]["tau"] = round(time.time() - t3, 1)
    summary["tau"] = {label: r["mean_tau"] for label, r in results.items()}
    summary["seconds"]["total"] = round(time.time() - t0, 1)
    log(f"held-out tau: untrained {summary['tau']['untrained']:.3f} -> trained {summary['tau']['trained']:.3f}; "
        f"total {summary['seconds']['total']} s")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
