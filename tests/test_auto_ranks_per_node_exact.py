"""The automatic CP ranks per node (`megatron.arguments.auto_cp_ranks_per_node`, chosen by
`validate_splitkv_args` when --splitkv-cp-ranks-per-node is unset) and the automatic pipeline across nodes
(`auto_pipeline`: num_chunks=2, chunk_axis="heads") reach the op through the Megatron path's `SplitKVConfig`
(args.splitkv_config) and the op is exact with them.

CPU, gloo, one spawn of 8 ranks. Per job every rank of the CP group passes the launcher's variable
(LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE, as `launcher_env`), validates the flags (TP and CP as given; the CP group of the op is
the P gloo ranks), and calls the op with the config WITHOUT cp_ranks_per_node; the jobs with num_chunks given
pass chunk_axis="rows" too (as before the automatic pipeline), the others neither, so that the op takes the
config's pipeline:

- the chosen L is the documented one (launcher size / TP, 1 < L < P, L divides P);
- the op ran the two-level all-to-all with it (".intra" records over L ranks, ".inter" over P / L);
- the automatic pipeline is chosen where the group spans nodes with >= 2 kv heads per TP rank (validated as
  fa4 or not: `have_fa4` with --splitkv-kernel auto; the same choice either way), and the op then ran 2 head
  chunks (each data collective issued twice);
- output, lse and all five gradients equal the single-process float64 reference (`_splitkv_helpers.check`).
Source: DESIGN.md section 2 (exact CP); docs/lab/perf-notes.md item 9 (two-level all-to-all).
"""

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_splitkv as msk  # noqa: E402
from _dist import run_distributed  # noqa: E402
from _splitkv_helpers import GRAD_NAMES, build, case, check, local, loss_of, new_seed  # noqa: E402
from megatron_splitkv import comm_stats  # noqa: E402

KEYS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
WORLD = 8


def _validated_L(c, tp, env, fa4):
    """What validate_splitkv_args chooses for case c's CP size and heads (per TP rank) and TP tp under the launcher
    variables `env`, FlashAttention-4 taken as installed or not: (the config, L, its record, the pipeline's
    fields, its record)."""
    from megatron_splitkv.megatron.arguments import validate_splitkv_args

    args = argparse.Namespace(
        context_parallel_impl="splitkv", tensor_model_parallel_size=tp, context_parallel_size=c["P"],
        num_attention_heads=c["Hq"] * tp, num_query_groups=c["Hkv"] * tp, group_query_attention=True,
        micro_batch_size=1, dflash_num_anchors=c["P"], dflash_block_size=4, cp_chunk_size=None, cp_balance="lpt",
        transformer_impl="local", attention_dropout=0.0, sequence_parallel=False, bf16=True)
    validate_splitkv_args(args, have_te=False, have_fa4=fa4, launcher_env=env)
    cfg = args.splitkv_config
    pipeline = {k: v for k, v in (("num_chunks", cfg.num_chunks), ("chunk_axis", cfg.chunk_axis)) if v not in (None, "rows")}
    return cfg, cfg.cp_ranks_per_node, args.splitkv_cp_ranks_per_node_auto, pipeline, args.splitkv_pipeline_auto


def _worker(rank, world, jobs):
    import torch.distributed as dist

    groups = {P: dist.new_group(list(range(P))) for P in sorted({c["P"] for c, *_ in jobs}) if P < world}
    out = {}
    for j, (c, tp, env, k, fa4) in enumerate(jobs):
        if rank >= c["P"]:
            continue
        config, exported, why, pipeline, pipeline_why = _validated_L(c, tp, env, fa4)
        t = build(c)
        x, meta, dout, dlse = local(t, c, rank)
        chunking = {} if k is None else dict(num_chunks=k, chunk_axis="rows")  # None: the config's pipeline
        with comm_stats() as st:
            o, lse = msk.splitkv_attention(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], meta["q_seq"],
                                           meta["q_anchor"], meta["kv_seq"], meta["kv_pos"], block_size=c["B"],
                                           cp_group=groups.get(c["P"]), backend="math", return_lse=True, config=config,
                                           **chunking)
            loss_of(o, lse, dout, dlse).backward()
        res = dict(out=o.detach().double(), lse=lse.detach().double(), exported=exported, why=why,
                   pipeline=pipeline, pipeline_why=pipeline_why, sizes={(r.op, r.group_size) for r in st.records},
                   issued=[r.op for r in st.records])
        for name, key in zip(GRAD_NAMES, KEYS):
            res[name] = x[key].grad.double()
        out[j] = res
    return out


@pytest.fixture(scope="module")
def run8():
    seed = new_seed()
    jobs = [  # (case, TP, launcher variables, num_chunks (None: as exported), FA4 installed) -> the automatic L
        (case(seed, 4, blocks=[2, 0, 3, 1], ctx=[0, 14, 13, 13]), 1, {"LOCAL_WORLD_SIZE": "2"}, 1, False),  # L = 2
        (case(seed + 1, 8, blocks=[3, 0, 5, 2, 1, 0, 4, 2], ctx=[9, 0, 6, 5, 4, 7, 9, 0], poison=True,
              p_invalid=0.3), 2, {"LOCAL_WORLD_SIZE": "8"}, 2, False),  # TP 2: L = 4
        (case(seed + 2, 8, dtype="float32", Hq=4, Hkv=1, blocks=[2, 4, 1, 3, 2, 1, 0, 0]), 1,
         {"SLURM_NTASKS_PER_NODE": "2(x4)"}, None, True),  # Slurm: L = 2; 1 kv head: no automatic pipeline
        # the automatic pipeline: 2 head chunks (Hkv 2 per TP rank), + 2 lanes (validated as fa4; CPU: no-op)
        (case(seed + 3, 4, blocks=[1, 3, 0, 2], ctx=[11, 0, 15, 14]), 1, {"LOCAL_WORLD_SIZE": "2"}, None, False),
        (case(seed + 4, 8, Hq=8, Hkv=4, blocks=[2, 1, 0, 3, 1, 2, 4, 0], ctx=[5, 9, 0, 7, 6, 8, 3, 2], poison=True,
              p_invalid=0.3), 2, {"LOCAL_WORLD_SIZE": "8"}, None, True),  # TP 2: L = 4
    ]
    want = [2, 4, 2, 2, 4]
    return jobs, want, run_distributed(_worker, WORLD, jobs, timeout=500)


def test_auto_L_is_chosen_and_used_and_exact(run8):
    jobs, want, results = run8

    for j, ((c, tp, env, k, fa4), L) in enumerate(zip(jobs, want)):
        P = c["P"]
        per_rank = [results[r][j] for r in range(P)]
        auto = c["Hkv"] >= 2  # every group here spans nodes: exported wherever there are 2 kv heads per TP rank
        pipeline = {"num_chunks": 2, "chunk_axis": "heads"}
        for r, res in enumerate(per_rank):
            assert res["exported"] == L, (j, r, res["exported"], res["why"])
            assert res["why"].startswith(f"auto -> {L} ("), res["why"]
            assert res["pipeline"] == (pipeline if auto else {}), (j, res["pipeline"], res["pipeline_why"])
            assert res["pipeline_why"].startswith("auto -> 2 head chunks" if auto else "auto -> off ("), res["pipeline_why"]
            sizes = res["sizes"]
            assert ("splitkv.fwd.out.intra", L) in sizes and ("splitkv.fwd.out.inter", P // L) in sizes, sizes
            assert ("splitkv.bwd.dq.intra", L) in sizes and ("splitkv.bwd.dq.inter", P // L) in sizes, sizes
            chunks = k if k is not None else 2 if auto else 1  # the op's chunks: given, else as exported
            assert res["issued"].count("splitkv.bwd.dq.inter") == chunks, (j, res["issued"])
        check("splitkv", c, per_rank)
