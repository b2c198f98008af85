"""The verdict rows' gloo group (`check_group`): a bad one raises on every rank, naming it; the Megatron setup
creates one per CP group with the CP group's ranks.

`check_group` is validated on every rank before any exchange (`ops.validation.resolve_check_group`): not a
ProcessGroup, or a group whose ranks are not the CP group's (here: each rank's own one-rank group), raises
ValueError naming check_group on each rank, in every entry point (prepare, bind, the three ops without
`metadata=`, `raise_on_every_rank`); a `metadata=` call on one rank passing another check_group than its
metadata's raises on every rank naming that rank (its error travels in the metadata's verdict row). After the
errors the group is still in step. Megatron: `create_cp_check_groups` in a gloo world of 4 with TP 2 x CP 2
(CP groups [0, 2] and [1, 3], not contiguous) gives every rank a gloo group with its CP group's global ranks, the
one `cp_check_group` and the core attention return; with CP 1 there is none. Source: issue 24 item 2.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _splitkv_helpers import OPS

from megatron_splitkv.ops import prepare_splitkv_metadata, prepare_splitkv_metadata_from_plan
from megatron_splitkv.ops.agreement import raise_on_every_rank
from megatron_splitkv.planning import plan_context_parallel

B, HQ, HKV, D = 4, 4, 2, 8


def _inputs(rank, tk):
    g = torch.Generator().manual_seed(7 + rank)
    x = {n: torch.randn(*s, generator=g) for n, s in (("q", (2 * B, HQ, D)), ("k_ctx", (tk, HKV, D)),
                                                        ("v_ctx", (tk, HKV, D)), ("k_blk", (2 * B, HKV, D)),
                                                        ("v_blk", (2 * B, HKV, D)))}
    m = dict(q_seq=torch.zeros(2, dtype=torch.int64), q_anchor=torch.tensor([2 * rank + 1, 2 * rank + 3]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk) + 10 * rank)
    return x, m


def _raises(name, fn, *needles):
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), (name, needle, str(exc))
        return name
    raise AssertionError(f"{name}: no ValueError")


def _bad_group_worker(rank, world_size):
    good = dist.new_group([0, 1], backend="gloo")
    singles = [dist.new_group([r], backend="gloo") for r in range(2)]  # every rank creates every group
    x, m = _inputs(rank, tk=5 + rank)
    meta_kw = dict(block_size=B, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, dtype=torch.float32)
    plan = plan_context_parallel([13, 7], [np.array([0, 3, 5, 11]), np.array([2])], block_size=B, cp_size=2,
                                 chunk_size=4)
    host = prepare_splitkv_metadata_from_plan(plan, rank, **meta_kw)
    seen = []
    for bad, needles in ((singles[rank], ("check_group must hold the CP group's global ranks", "[0, 1]", f"[{rank}]")),
                         ("gloo", ("check_group must be None or a torch.distributed ProcessGroup", "str")),
                         (singles[1 - rank], ("check_group must hold the CP group's global ranks",
                                              f"this rank ({rank}) is not in it"))):
        what = {str: "a string", int: "another rank's group"}.get(type(bad), "own group")
        seen.append(_raises(f"prepare, {what}", lambda: prepare_splitkv_metadata(
            *m.values(), **meta_kw, check_group=bad), "prepare_splitkv_metadata: ", *needles))
        seen.append(_raises(f"bind, {what}", lambda: host.bind(None, "cpu", check_group=bad),
                            "SplitKVMetadata.bind: ", *needles))
        for impl, op in OPS.items():
            seen.append(_raises(f"{impl}, {what}", lambda: op(*x.values(), *m.values(), block_size=B,
                                                              check_group=bad), f"{impl}: ", *needles))
        seen.append(_raises(f"raise_on_every_rank, {what}", lambda: raise_on_every_rank(
            "layer", None, ValueError("rank's own error"), None, bad), *needles))
    # a metadata= call passing another check_group than its metadata's, on rank 1 only: every rank raises
    meta = prepare_splitkv_metadata(*m.values(), **meta_kw, check_group=good)
    other = dist.new_group([0, 1], backend="gloo")
    seen.append(_raises("metadata=, another check_group on rank 1", lambda: OPS["splitkv"](
        *x.values(), metadata=meta, check_group=other if rank == 1 else None),
        "invalid input on CP rank(s) [1]", "check_group differs from the metadata's"))
    # still in step: with the good group, the bound metadata, metadata= and the plain call give the same output
    bound = host.bind(None, "cpu", check_group=good)
    assert bound.check_group.pg is good and bound.check_group.size == 2 and bound.check_group.rank == rank
    plain = OPS["splitkv"](*x.values(), *m.values(), block_size=B, check_group=good)
    assert torch.equal(OPS["splitkv"](*x.values(), metadata=meta), plain)
    assert torch.equal(OPS["splitkv"](*x.values(), *m.values(), block_size=B), plain)
    return seen


def test_bad_check_group_raises_on_every_rank():
    seen = run_distributed(_bad_group_worker, 2, timeout=120)
    assert seen[0] == seen[1] and len(seen[0]) == 3 * (3 + len(OPS)) + 1, seen


def _megatron_worker(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_splitkv.megatron import SplitKVCoreAttention, cp_check_group, create_cp_check_groups

    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                 create_gloo_process_groups=False)
    try:
        cp = ps.get_context_parallel_group()
        assert cp_check_group(cp) is None  # nothing before the setup: the rows go over the CP group
        cg = create_cp_check_groups(cp)
        ranks = dist.get_process_group_ranks(cg)
        assert dist.get_backend(cg) == "gloo" and ranks == ps.get_context_parallel_global_ranks(), ranks
        assert create_cp_check_groups(cp) is cg and cp_check_group(cp) is cg
        cfg = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                                kv_channels=D, use_cpu_initialization=True, attention_dropout=0.0)
        core = SplitKVCoreAttention(cfg, 1, AttnMaskType.no_mask, "cross")
        assert core.cp_group is cp and core._check_group() is cg
        got = torch.zeros(2, dtype=torch.int64)
        dist.all_gather_into_tensor(got, torch.tensor([rank]), group=cg)  # the mirror works, in CP rank order
        # an op call over the CP group with its mirror: the same output as without
        cp_rank = ps.get_context_parallel_rank()
        x, m = _inputs(cp_rank, tk=5 + cp_rank)
        out = OPS["splitkv"](*x.values(), *m.values(), block_size=B, cp_group=cp, check_group=cg)
        assert torch.equal(out, OPS["splitkv"](*x.values(), *m.values(), block_size=B, cp_group=cp))
        mirror = (ranks, got.tolist())
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=4, create_gloo_process_groups=False)
    try:  # CP 1: nothing to check, no group
        assert create_cp_check_groups(ps.get_context_parallel_group()) is None
    finally:
        ps.destroy_model_parallel()
    return mirror


def test_megatron_setup_creates_a_gloo_mirror_per_cp_group():
    pytest.importorskip("megatron.core")
    got = run_distributed(_megatron_worker, 4, timeout=180)
    assert got == [([0, 2], [0, 2]), ([1, 3], [1, 3]), ([0, 2], [0, 2]), ([1, 3], [1, 3])], got
