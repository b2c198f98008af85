"""Reproduction cases C1, C2, C3, C5, C6 and C10 of /work/shared/cases/README.md for the CP attention
ops, in ONE 8-rank gloo spawn (smaller CP sizes run on subgroups); each case also through Split-KV's head chunks
(chunk_axis "heads", k = 2, heads doubled where Hkv = 1: `_heads`), through Split-KV's row chunks (num_chunks 2
with `metadata=` and group_check, 3 without) and through the baselines with `metadata=`. Expected values come from the
single-process float64 reference. Source: DESIGN.md section 2."""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import case, check, contiguous_ctx, errors, job_results, jobs_worker, new_seed, rel_rms_err

ALL_OPS = ["splitkv", "allgather_kv", "ring_kv"]


def _c1(seed):
    # Lq=4, Lk=8, P=2, H=1, d=16, fp32; every query sees every context key (and its own block).
    return case(seed, 2, dtype="float32", B=2, Hq=1, Hkv=1, D=16, seq_lens=[8], blocks=[1, 1],
                anchors=[8, 8], q_seqs=[0, 0])


def _c2(seed):
    # P=2; block 0: anchor 0 (context part empty on every rank), block 1: invalid (its row sees no key
    # at all, own block excluded), block 2: anchor 0 on the rank without that sequence's context.
    return case(seed, 2, dtype="float32", B=2, seq_lens=[6, 5], blocks=[2, 2], anchors=[0, -1, 0, 4],
                q_seqs=[0, 1, 1, 0], ctx_idx=[list(range(6)), list(range(6, 11))])


def _c3(seed):
    # Lq=256 (16 blocks of 16), Lk=4096, P=8, bf16; 8 sequences of 512, rank r holds sequence r, so
    # each query sees keys on exactly one rank (and 7 ranks give fully empty tiles).
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1, 513, (16,), generator=g).tolist()
    return case(seed, 8, dtype="bfloat16", B=16, Hq=2, Hkv=1, D=16, seq_lens=[512] * 8, blocks=[2] * 8,
                anchors=anchors, q_seqs=torch.randint(0, 8, (16,), generator=g).tolist(),
                ctx_idx=[list(range(512 * r, 512 * (r + 1))) for r in range(8)])


def _c5(seed):
    # lengths that do not split evenly (contiguous ceil split); one block sees the last key.
    return [
        case(seed, 2, dtype="float64", B=4, seq_lens=[7], blocks=[1, 1], anchors=[7, 3], q_seqs=[0, 0],
             ctx_idx=contiguous_ctx(7, 2)),
        case(seed + 1, 8, dtype="float32", B=16, Hq=2, Hkv=1, seq_lens=[4097], blocks=[1, 0, 1, 0, 1, 0, 0, 1],
             anchors=[4097, 100, 4000, 4096], q_seqs=[0] * 4, ctx_idx=contiguous_ctx(4097, 8)),
        case(seed + 2, 4, dtype="float32", B=1, Hq=2, Hkv=1, seq_lens=[2999], blocks=[10, 9, 9, 9],
             q_seqs=[0] * 37, anchors=[2999] + torch.randint(0, 3000, (36,),
                                                             generator=torch.Generator().manual_seed(seed)).tolist(),
             ctx_idx=contiguous_ctx(2999, 4)),
    ]


def _c6(seed):
    # fewer context tokens than ranks.
    return [
        case(seed, 4, dtype="float64", B=2, seq_lens=[2], blocks=[1, 1, 1, 1], anchors=[2, 1, 2, 0],
             q_seqs=[0] * 4, ctx_idx=[[0], [], [1], []]),
        case(seed + 1, 3, dtype="float64", B=2, seq_lens=[10], blocks=[1, 2, 1], q_seqs=[0] * 4,
             anchors=[10, 5, 1, 10], ctx_idx=contiguous_ctx(10, 3)),
    ]


def _c10(seed):
    # bf16, Lk=32K (4 sequences of 8192), Lq=256 (16 blocks of 16), P in {2, 4, 8}; same global inputs.
    return [case(seed, P, dtype="bfloat16", B=16, Hq=2, Hkv=1, D=16, seq_lens=[8192] * 4,
                 blocks=[16 // P] * P, p_invalid=0.0, p_zero=0.0) for P in (2, 4, 8)]


def _heads(c, metadata=False):
    """Case c through the head-chunked pipeline (chunk_axis "heads", k = 2; ops/chunking.py `HeadChunks`):
    with Hkv = 1 (k would clamp to one chunk) the heads are doubled, Hq = 2 G, Hkv = 2 (same GQA ratio G), so
    that the two chunks really split the heads; `metadata`: through prepare_splitkv_metadata / metadata=."""
    h = dict(c, num_chunks=2, chunk_axis="heads", metadata=metadata)
    if c["Hkv"] == 1:
        h.update(Hq=2 * c["Hq"], Hkv=2)
    return h


@pytest.fixture(scope="module")
def cases_run():
    seed = new_seed()
    named = [("C1", _c1(seed)), ("C2", _c2(seed)), ("C3", _c3(seed))]
    named += [("C5", c) for c in _c5(seed)] + [("C6", c) for c in _c6(seed)]
    jobs, names = [], []
    for name, c in named:
        for op in ALL_OPS:
            jobs.append((op, c))
            names.append(name)
    for i, (name, c) in enumerate(named):  # every case again through Split-KV's head chunks
        jobs.append(("splitkv", _heads(c, metadata=bool(i % 2))))
        names.append(name)
    for name, c in named:
        # the baselines through prepare_splitkv_metadata / metadata=; Split-KV's row chunks: 2 through
        # metadata= prepared with group_check, 3 (uneven chunks) without metadata
        for op, extra in (("allgather_kv", dict(metadata=True)), ("ring_kv", dict(metadata=True)),
                          ("splitkv", dict(metadata=True, num_chunks=2, group_check=True)),
                          ("splitkv", dict(num_chunks=3))):
            jobs.append((op, dict(c, **extra)))
            names.append(name)
    for c in _c10(seed):
        jobs.append(("splitkv", c))
        names.append("C10")
    for c in _c10(seed):
        jobs.append(("splitkv", _heads(c)))
        names.append("C10 heads")
    for k in (2, 3):  # row chunks (2: through metadata=)
        for c in _c10(seed):
            jobs.append(("splitkv", dict(c, num_chunks=k, metadata=k == 2)))
            names.append(f"C10 k={k}")
    results = run_distributed(jobs_worker, 8, jobs, timeout=600)
    return jobs, names, results


def _each(cases_run, name):
    jobs, names, results = cases_run
    for j, (op, c) in enumerate(jobs):
        if names[j] == name:
            yield op, c, job_results(results, j, c["P"])


def test_c1_backward_uses_global_lse(cases_run):
    for op, c, per_rank in _each(cases_run, "C1"):
        errs = check(op, c, per_rank, tol=1e-5)
        print(f"C1 {op}: {errs}")
        for k in ("dq", "dk_ctx", "dv_ctx"):
            assert torch.cat([r[k] for r in per_rank]).abs().max() > 0


def test_c2_empty_partials(cases_run):
    for op, c, per_rank in _each(cases_run, "C2"):
        check(op, c, per_rank)
        r0 = per_rank[0]
        assert (r0["out"][2:4] == 0).all() and (r0["lse"][2:4] == float("-inf")).all()  # invalid block
        assert (r0["dq"][2:4] == 0).all() and (r0["dk_blk"][2:4] == 0).all() and (r0["dv_blk"][2:4] == 0).all()
        assert torch.isfinite(r0["lse"][0:2]).all()  # anchor 0: own block only
        for r in per_rank:
            for k, v in r.items():
                if isinstance(v, torch.Tensor):
                    assert not torch.isnan(v).any(), (op, k)


def test_c3_partially_empty_tiles_bf16(cases_run):
    for op, c, per_rank in _each(cases_run, "C3"):
        errs = check(op, c, per_rank)
        print(f"C3 {op}: {errs}")


def test_c5_uneven_lengths(cases_run):
    for op, c, per_rank in _each(cases_run, "C5"):
        check(op, c, per_rank)
        last = c["seq_lens"][0] - 1
        owner = next(r for r in range(c["P"]) if last in c["ctx_idx"][r])
        pos = c["ctx_idx"][owner].index(last)
        assert per_rank[owner]["dv_ctx"][pos].abs().max() > 0, "the last real key got no attention"


def test_c6_fewer_context_tokens_than_ranks(cases_run):
    for op, c, per_rank in _each(cases_run, "C6"):
        check(op, c, per_rank)
        kinds = [r["comm_kinds"] for r in per_rank]
        if op != "ring_kv":  # ring skips empty point-to-point messages by design (sizes are known)
            assert all(k == kinds[0] for k in kinds), "an empty rank skipped a collective"
        for r in range(c["P"]):
            assert len(c["ctx_idx"][r]) == per_rank[r]["dk_ctx"].shape[0]


@pytest.mark.parametrize("name", ["C10", "C10 heads", "C10 k=2", "C10 k=3"])
def test_c10_bf16_error_does_not_grow_with_p(cases_run, capsys, name):
    errs = {c["P"]: errors(c, per_rank) for _, c, per_rank in _each(cases_run, name)}
    # the errors per P: captured (shown with a failure, not in every run's output)
    for P, e in errs.items():
        print(f"{name} splitkv bf16 Lk=32K Lq=256 P={P}: rel. max error vs float64 reference: "
              + ", ".join(f"{k}={v:.2e}" for k, v in e.items()))
    report = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in report] == [f"{name} splitkv bf16 Lk=32K Lq=256 P={P}" for P in errs], report
    print("\n".join(report))  # back into the captured output of the test
    for k in errs[2]:  # every P within the bf16 tolerance (max-norm)
        assert all(e[k] < 2e-2 for e in errs.values()), (k, errs)
    # growth with P on the relative RMS error (all elements): the max-norm errors of bf16 results are single
    # elements' roundings, ~2^-9, and moved non-monotonically with P (seed 386857571, C10 heads dq: P = 2 / 4 / 8 =
    # 2.66e-3 / 5.04e-3 / 1.46e-3, the same before session 11's changes), which failed the earlier bound
    # max <= 2 x min + 1e-3 on the max-norm. A merge that loses precision with P (bf16 sums, per-rank lse) moves
    # the RMS error of every row
    rms = {c["P"]: errors(c, per_rank, norm=rel_rms_err) for _, c, per_rank in _each(cases_run, name)}
    for P, e in rms.items():
        print(f"{name} splitkv bf16 P={P}: rel. RMS error vs float64 reference: "
              + ", ".join(f"{k}={v:.2e}" for k, v in e.items()))
    for k in rms[2]:
        assert max(e[k] for e in rms.values()) <= 1.25 * rms[2][k] + 1e-6, (k, rms)
