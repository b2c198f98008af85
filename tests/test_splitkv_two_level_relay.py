"""The relay of Split-KV's two-level all-to-all (`ops.common.RelayStream`, `ops.transport._TwoStage`;
docs/lab/perf-notes.md item 18).

On CUDA the op waits for each chunk's stage 1, node-merges (forward) or node-sums (dQ) the L partials and
issues stage 2 on a relay stream, so the caller's stream never waits for stage 1. Off CUDA there is no
relay (`RelayStream.get` is None). The code path is exercised here on CPU / gloo with a stand-in relay
(`_Recorder`: the same `mark` / `run` / `taken` calls, no streams) patched into the op:

- exactness: output, lse and all five gradients against the single-process float64 reference, P = 4
  (L = 2) and P = 8 (L = 2, 4), num_chunks 1, 2, 3, uneven and empty shards (ranks or a whole node
  without query blocks, ranks without context), NaN / inf in invalid blocks, fp64 / fp32 / bf16, with and
  without the early query gather, k_blk = v_blk = None;
- bit-identical to the same call without the relay (the schedule before item 18);
- the protocol: every stage-2 collective ("splitkv.fwd.out.inter", "splitkv.bwd.dq.inter") and only those
  is issued inside `run`, once per exchange (per chunk and direction), each after the `mark` made when its stage 1 was issued, and every stage-2
  result the owner consumes passes through `taken`;
- `RelayStream.get` is None on CPU.

The stream semantics themselves (the relay waiting for stage 1, the consumer for stage 2, record_stream)
need CUDA and a CP group of >= 4 GPUs (1 < L < P): tests/nightly (tests/nightly/run.sh) on x4 / x8.
"""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import RelayRecorder as _Recorder, case, check, delayed_pending, new_seed





def _run(c, rank, group, L, k, early, own, relay):
    """This rank's results (and protocol log) of case c with cp_ranks_per_node=L, num_chunks=k."""
    import _splitkv_helpers as h
    import megatron_splitkv as msk
    from megatron_splitkv.ops import query_gather as qg
    from megatron_splitkv.ops import splitkv as sk
    from megatron_splitkv.ops import transport as tr

    log = []
    rec = _Recorder(log) if relay else None
    orig = tr.all_to_all, sk.all_gather, qg.all_gather, tr.RelayStream.get

    def wrap(fn):
        def coll(x, g, op, async_op=False):
            log.append(("coll", op, rec.inside if rec is not None else False))
            return fn(x, g, op, async_op=async_op)
        return coll

    tr.all_to_all, sk.all_gather, qg.all_gather = wrap(orig[0]), wrap(orig[1]), wrap(orig[2])
    tr.RelayStream.get = staticmethod(lambda device: rec)
    try:
        t = h.build(c)
        x, meta, dout, dlse = h.local(t, c, rank)
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=group, num_chunks=k,
                                          cp_ranks_per_node=L)
        q = x["q"] * 1.0 if early else x["q"]
        handle = msk.splitkv_start_query_gather(q, metadata=md) if early else None
        kb, vb = (x["k_blk"], x["v_blk"]) if own else (None, None)
        out, lse = msk.splitkv_attention(q, x["k_ctx"], x["v_ctx"], kb, vb, metadata=md, backend="math",
                                         return_lse=True, query_gather=handle)
        h.loss_of(out, lse, dout, dlse).backward()
    finally:
        tr.all_to_all, sk.all_gather, qg.all_gather, tr.RelayStream.get = orig
    return h.raw_and_double_results(out, lse, x, log=log, k_used=md.num_chunks,
                                    n_fwd=md.num_chunks)


def _worker(rank, world, jobs):
    import torch.distributed as dist

    sizes = sorted({c["P"] for c, *_ in jobs})
    groups = {P: dist.new_group(list(range(P))) for P in sizes if P < world}
    out = {}
    for j, (c, L, k, early, own) in enumerate(jobs):
        if rank < c["P"]:
            out[j] = (_run(c, rank, groups.get(c["P"]), L, k, early, own, True),
                      _run(c, rank, groups.get(c["P"]), L, k, early, own, False))
    return out


def _check_protocol(log, k, n_fwd):
    """Per direction, one stage-1 all-to-all per exchange (k in backward, n_fwd = k in forward: one per
    chunk) each followed (in issue order) by its mark; one
    relay run per exchange, each issuing exactly one stage-2 all-to-all of its direction and nothing else;
    every collective outside the relay not a stage 2; a `taken` per consumed stage-2 result."""
    colls = [e for e in log if e[0] == "coll"]
    for op, inside in [(e[1], e[2]) for e in colls]:
        assert inside == op.endswith(".inter") and op in (
            "splitkv.fwd.out.inter", "splitkv.bwd.dq.inter") or not inside and not op.endswith(".inter"), (op, inside)
    for d, m in (("fwd.out", n_fwd), ("bwd.dq", k)):
        assert sum(e[1] == f"splitkv.{d}.intra" for e in colls) == m
        assert sum(e[1] == f"splitkv.{d}.inter" for e in colls) == m
    runs = [i for i, e in enumerate(log) if e[0] == "run"]
    assert len(runs) == n_fwd + k and sum(e[0] == "mark" for e in log) == n_fwd + k
    for i in runs:  # the run's stage 2 is the next collective, issued inside it
        nxt = next(e for e in log[i + 1:] if e[0] == "coll")
        assert nxt[1].endswith(".inter") and nxt[2]
        mark = log[i][1]  # the mark of that chunk: made right after its stage 1
        j = log.index(("mark", mark))
        prev = [e for e in log[:j] if e[0] == "coll"][-1]
        assert prev[1].endswith(".intra") and prev[1][:-6] == nxt[1][:-6], (prev, nxt)
    assert sum(e[0] == "taken" for e in log) == n_fwd + k


def _jobs(seed):
    c4 = [
        case(seed, 4, dtype="float64", blocks=[3, 0, 5, 2], ctx=[10, 0, 25, 5], poison=True, p_invalid=0.3),
        case(seed + 1, 4, dtype="bfloat16", Hq=4, Hkv=1, blocks=[3, 3, 3, 3]),
        case(seed + 2, 4, dtype="float32", blocks=[3, 2, 0, 0], ctx=[0, 20, 15, 5]),  # node 1 without blocks
    ]
    c8 = case(seed + 3, 8, dtype="float64", blocks=[2, 0, 3, 1, 4, 2, 0, 3], ctx=[8, 0, 12, 6, 4, 3, 0, 7],
              p_invalid=0.2)
    jobs = []
    for c in c4:
        for k in (1, 2, 3):
            jobs.append((c, 2, k, False, True))
    jobs += [(c4[0], 2, 2, True, True), (c4[2], 2, 2, False, False)]  # early query gather; no own block
    jobs += [(c8, 2, 2, False, True), (c8, 4, 3, True, True), (c8, 4, 1, False, True)]
    return jobs


def test_relay_exact_bit_identical_and_protocol():
    jobs = _jobs(new_seed())
    results = run_distributed(_worker, 8, jobs, timeout=600)
    for j, (c, L, k, early, own) in enumerate(jobs):
        with_relay = [results[r][j][0] for r in range(c["P"])]
        without = [results[r][j][1] for r in range(c["P"])]
        if own:
            check("splitkv", c, with_relay)
        for r in range(c["P"]):
            a, b = with_relay[r]["raw"], without[r]["raw"]
            for key in a:
                assert (a[key] is None) == (b[key] is None), key
                if a[key] is not None:
                    assert torch.equal(a[key], b[key]), f"{key}: relay vs none differ (P={c['P']}, L={L}, k={k}, r={r})"
            assert not any(e[0] != "coll" for e in without[r]["log"])  # no relay: no protocol calls
            # the same collectives in the same host order (comm_stats bytes are per collective: unchanged)
            assert [e[1] for e in with_relay[r]["log"] if e[0] == "coll"] == [e[1] for e in without[r]["log"]]
            _check_protocol(with_relay[r]["log"], with_relay[r]["k_used"], with_relay[r]["n_fwd"])


def test_relay_is_none_on_cpu():
    from megatron_splitkv.ops.common import RelayStream

    assert RelayStream.get("cpu") is None and RelayStream.get(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_relay_stream_on_cuda():
    """One relay stream per device, reused."""
    from megatron_splitkv.ops.common import RelayStream

    a, b = RelayStream.get("cuda"), RelayStream.get(torch.device("cuda", torch.cuda.current_device()))
    assert a is not None and a.stream == b.stream and a.stream != torch.cuda.current_stream()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_stage_relay_waits_for_delayed_stages():
    """`_TwoStage` with the relay over DELAYED stages (each result NaN until a side stream writes it after a
    GPU sleep, `wait()` a stream wait, as NCCL's asynchronous work behaves): the relay's reduce must read
    stage 1 only after it landed, the consumer stage 2 only after it landed; the caller's stream issues
    nothing that waits for stage 1."""
    from megatron_splitkv.ops.common import RelayStream
    from megatron_splitkv.ops.transport import _TwoStage

    side = torch.cuda.Stream()

    def delayed(x):
        return delayed_pending(x, side)

    relay = RelayStream.get("cuda")
    for _ in range(3):
        x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
        stage = _TwoStage(delayed(x * 1.0), lambda p: delayed(p.take() * 2 + 1), relay)
        stage.advance()
        got = stage.take().clone()
        torch.cuda.synchronize()
        assert torch.equal(got, x * 2 + 1)
