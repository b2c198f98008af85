"""The automatic CP ranks per node (`megatron.arguments.auto_cp_ranks_per_node`, exported by
`validate_splitkv_args` when neither --splitkv-cp-ranks-per-node nor MEGATRON_SPLITKV_RANKS_PER_NODE is set)
reaches the op through the Megatron path and the op is exact with it.

CPU, gloo, one spawn of 8 ranks. Per job every rank of the CP group sets the launcher's variable
(LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE), clears MEGATRON_SPLITKV_RANKS_PER_NODE, validates the flags
(TP and CP as given; the CP group of the op is the P gloo ranks), and calls the op WITHOUT
cp_ranks_per_node, so that it reads the exported variable:

- the exported L is the documented one (launcher size / TP, 1 < L < P, L divides P);
- the op ran the two-level all-to-all with it (".intra" records over L ranks, ".inter" over P / L);
- output, lse and all five gradients equal the single-process float64 reference (`_splitkv_helpers.check`).
Source: DESIGN.md section 2 (exact CP); docs/perf-notes.md item 9 (two-level all-to-all).
"""

import argparse
import os

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_splitkv as msk  # noqa: E402
from _dist import run_distributed  # noqa: E402
from _splitkv_helpers import GRAD_NAMES, build, case, check, local, loss_of, new_seed  # noqa: E402
from megatron_splitkv import comm_stats  # noqa: E402

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
WORLD = 8
RPN = "MEGATRON_SPLITKV_RANKS_PER_NODE"


def _validated_L(P, tp, env):
    """What validate_splitkv_args exports for CP size P and TP tp under the launcher variables `env`."""
    from megatron_splitkv.megatron.arguments import LOCAL_SIZE_ENVS, validate_splitkv_args

    for name in (RPN, *LOCAL_SIZE_ENVS):
        os.environ.pop(name, None)
    os.environ.update(env)
    args = argparse.Namespace(
        context_parallel_impl="splitkv", tensor_model_parallel_size=tp, context_parallel_size=P,
        num_attention_heads=4 * tp, num_query_groups=2 * tp, group_query_attention=True, micro_batch_size=1,
        dflash_num_anchors=P, dflash_block_size=4, cp_chunk_size=None, cp_balance="lpt",
        transformer_impl="local", attention_dropout=0.0, sequence_parallel=False)
    validate_splitkv_args(args, have_te=False, have_fa4=False)
    return os.environ.get(RPN), args.splitkv_cp_ranks_per_node_auto


def _worker(rank, world, jobs):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c, *_ in jobs}) if P < world}
    out = {}
    for j, (c, tp, env, k) in enumerate(jobs):
        if rank >= c["P"]:
            continue
        exported, why = _validated_L(c["P"], tp, env)
        t = build(c)
        x, meta, dout, dlse = local(t, c, rank)
        with comm_stats() as st:
            o, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], meta["q_seq"],
                                           meta["q_anchor"], meta["kv_seq"], meta["kv_pos"], block_size=c["B"],
                                           cp_group=groups.get(c["P"]), backend="math", return_lse=True,
                                           num_chunks=k)
            loss_of(o, lse, dout, dlse).backward()
        res = dict(out=o.detach().double(), lse=lse.detach().double(), exported=exported, why=why,
                   sizes={(r.op, r.group_size) for r in st.records})
        for name, key in zip(GRAD_NAMES, KEYS):
            res[name] = x[key].grad.double()
        out[j] = res
    for name in (RPN, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        os.environ.pop(name, None)
    return out


@pytest.fixture(scope="module")
def run8():
    seed = new_seed()
    jobs = [  # (case, TP, launcher variables, num_chunks) -> the automatic L
        (case(seed, 4, blocks=[2, 0, 3, 1], ctx=[0, 14, 13, 13]), 1, {"LOCAL_WORLD_SIZE": "2"}, 1),  # L = 2
        (case(seed + 1, 8, blocks=[3, 0, 5, 2, 1, 0, 4, 2], ctx=[9, 0, 6, 5, 4, 7, 9, 0], poison=True,
              p_invalid=0.3), 2, {"LOCAL_WORLD_SIZE": "8"}, 2),  # TP 2: L = 4
        (case(seed + 2, 8, dtype="float32", Hq=4, Hkv=1, blocks=[2, 4, 1, 3, 2, 1, 0, 0]), 1,
         {"SLURM_NTASKS_PER_NODE": "2(x4)"}, 1),  # Slurm: L = 2
    ]
    want = [2, 4, 2]
    return jobs, want, run_distributed(_worker, WORLD, jobs, timeout=500)


def test_auto_L_is_exported_and_used_and_exact(run8):
    jobs, want, results = run8
    for j, ((c, tp, env, k), L) in enumerate(zip(jobs, want)):
        P = c["P"]
        per_rank = [results[r][j] for r in range(P)]
        for r, res in enumerate(per_rank):
            assert res["exported"] == str(L), (j, r, res["exported"], res["why"])
            assert res["why"].startswith(f"auto -> {L} ("), res["why"]
            sizes = res["sizes"]
            assert ("splitkv.fwd.out.intra", L) in sizes and ("splitkv.fwd.out.inter", P // L) in sizes, sizes
            assert ("splitkv.bwd.dq.intra", L) in sizes and ("splitkv.bwd.dq.inter", P // L) in sizes, sizes
        check("splitkv", c, per_rank)
