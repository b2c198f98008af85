"""Shared test helpers for the CP attention ops: build global DFlash inputs, shard them across ranks, run
an op on every rank (inside `run_distributed`), and compare with the single-process float64 reference.

Expected values always come from `dflash_attention_reference` (float64, dense), never from the ops.

A case is a plain dict (picklable, rebuilt identically on every rank from its seed):
    seed, P, B, Hq, Hkv, D, dtype ("float64" | "float32" | "bfloat16" | "float16"),
    optional: seq_ids (sequence index -> id), poison (NaN/inf in unseen keys and invalid blocks),
    metadata (call through prepare_splitkv_metadata / metadata=), group_check (prepare with it),
    seq_lens: list of context lengths per packed sequence,
    blocks: list (len P) of query block counts per rank (zeros allowed),
    ctx: list (len P) of context token counts per rank (zeros allowed; sum = sum(seq_lens)), or
         "even"; tokens are assigned to ranks at random and given to each rank in shuffled order,
    p_invalid: probability of an invalid block (anchor -1), p_zero: probability of anchor 0,
    full: optional, every block's anchor beyond its sequence end (sees the whole sequence),
    num_chunks: optional, Split-KV's chunk count (passed to the call, or to prepare with metadata),
    chunk_axis: optional, Split-KV's chunk axis ("rows" | "heads"; passed like num_chunks),
    config: optional `SplitKVConfig` (passed to the call, or to prepare with metadata),
    anchors: optional explicit list of anchors (global block order), q_seqs likewise,
    ctx_idx: optional explicit list (len P) of global context token index lists,
    window, causal: optional layer type (sliding window W, causal own block), passed to the op (or to
         prepare with metadata) and to the reference.
"""

import hashlib
import os
import random

import torch

import megatron_splitkv as msk
from megatron_splitkv import dflash_attention_reference

OPS = {
    "splitkv": msk.splitkv_attention,
    "allgather_kv": msk.allgather_kv_attention,
    "ring_kv": msk.ring_kv_attention,
}

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
GRAD_NAMES = ("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")


def new_seed():
    """A fresh seed per run (override with SPLITKV_TEST_SEED); always printed on failure by `check`."""
    env = os.environ.get("SPLITKV_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 30)


def case(seed, P, **kw):
    c = dict(seed=seed, P=P, B=4, Hq=4, Hkv=2, D=8, dtype="float64", seq_lens=[13, 7, 20],
             blocks=None, ctx="even", p_invalid=0.15, p_zero=0.15)
    c.update(kw)
    if c["blocks"] is None:
        c["blocks"] = [2] * P
    return c


def build(c):
    """Global inputs of a case (identical on every process)."""
    g = torch.Generator().manual_seed(c["seed"])
    dt = getattr(torch, c["dtype"])
    P, B, Hq, Hkv, D = c["P"], c["B"], c["Hq"], c["Hkv"], c["D"]
    lens = c["seq_lens"]
    kv_seq = torch.cat([torch.full((n,), j, dtype=torch.int64) for j, n in enumerate(lens)])
    kv_pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    tk = kv_seq.numel()
    nb = sum(c["blocks"])
    if c.get("q_seqs") is not None:
        q_seq = torch.tensor(c["q_seqs"], dtype=torch.int64)
    else:
        q_seq = torch.randint(0, len(lens), (nb,), generator=g)
    if c.get("anchors") is not None:
        anchor = torch.tensor(c["anchors"], dtype=torch.int64)
    else:
        lens_t = torch.tensor(lens)[q_seq]
        anchor = (torch.rand(nb, generator=g) * (lens_t + 1).double()).long()
        if c.get("full"):
            anchor = lens_t + 5
        u = torch.rand(nb, generator=g)
        anchor = torch.where(u < c["p_zero"], torch.zeros_like(anchor), anchor)
        anchor = torch.where(u > 1 - c["p_invalid"], torch.full_like(anchor, -1), anchor)
        if c.get("poison") and nb:
            if not bool((anchor < 0).any()):
                anchor[-1] = -1  # the poison case needs an invalid block (p = 0.85**11 ~ 17% without one)
            # ... and a key no block sees: the last token of the longest sequence (with many blocks, some
            # block of it may have anchor = its length and see all of it)
            j = max(range(len(lens)), key=lambda i: lens[i])
            anchor = torch.where((q_seq == j) & (anchor >= lens[j]), torch.full_like(anchor, lens[j] - 1), anchor)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    t = dict(q=rnd(nb * B, Hq, D), k_ctx=rnd(tk, Hkv, D), v_ctx=rnd(tk, Hkv, D), k_blk=rnd(nb * B, Hkv, D),
             v_blk=rnd(nb * B, Hkv, D), q_seq=q_seq, q_anchor=anchor, kv_seq=kv_seq, kv_pos=kv_pos)
    t["dout"] = rnd(nb * B, Hq, D).double()  # representable in the op's dtype
    t["dlse"] = torch.randn(nb * B, Hq, generator=g, dtype=torch.float64)
    # context assignment: random tokens per rank, shuffled order within the rank
    if c.get("ctx_idx") is not None:
        idx = [torch.tensor(i, dtype=torch.int64) for i in c["ctx_idx"]]
    else:
        counts = c["ctx"]
        if counts == "even":
            counts = [tk // P + (r < tk % P) for r in range(P)]
        assert sum(counts) == tk, (counts, tk)
        perm = torch.randperm(tk, generator=g)
        idx = list(torch.split(perm, counts))
    t["ctx_idx"] = idx
    if c.get("seq_ids") is not None:  # sequence index j -> id seq_ids[j] (e.g. negative / extreme ids)
        ids = torch.tensor(c["seq_ids"], dtype=torch.int64)
        t["kv_seq"], t["q_seq"] = ids[t["kv_seq"]], ids[t["q_seq"]]
    if c.get("poison"):  # NaN/inf where no query looks: must not reach any output or gradient
        from megatron_splitkv.reference import dflash_attention_mask

        seen = dflash_attention_mask(t["q_seq"], t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=B,
                                     own_block=False, **attention_type(c)).any(0)
        inv = (t["q_anchor"] < 0).repeat_interleave(B)
        assert (~seen).any() and inv.any(), "poison case needs unseen keys and invalid blocks"
        t["k_ctx"][~seen], t["v_ctx"][~seen] = float("inf"), float("nan")
        t["q"][inv], t["k_blk"][inv], t["v_blk"][inv] = float("nan"), float("-inf"), float("nan")
    starts = [0]
    for n in c["blocks"]:
        starts.append(starts[-1] + n)
    t["block_range"] = [(starts[r], starts[r + 1]) for r in range(P)]
    return t


def attention_type(c):
    """The case's layer-type keyword arguments (window / causal) for the ops, prepare and the reference: only
    those the case sets (a case without them calls exactly as before)."""
    return {n: c[n] for n in ("window", "causal") if c.get(n) is not None}


def local(t, c, rank):
    """This rank's inputs (leaf tensors requiring grad) and its dout/dlse slices."""
    b0, b1 = t["block_range"][rank]
    B = c["B"]
    rows = slice(b0 * B, b1 * B)
    idx = t["ctx_idx"][rank]
    x = dict(q=t["q"][rows], k_ctx=t["k_ctx"][idx], v_ctx=t["v_ctx"][idx], k_blk=t["k_blk"][rows],
             v_blk=t["v_blk"][rows])
    x = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    meta = dict(q_seq=t["q_seq"][b0:b1], q_anchor=t["q_anchor"][b0:b1], kv_seq=t["kv_seq"][idx],
                kv_pos=t["kv_pos"][idx])
    return x, meta, t["dout"][rows], t["dlse"][rows]


def loss_of(out, lse, dout, dlse):
    """sum(out * dO) + sum(lse * dlse) over rows with finite lse (exercises the lse gradient too)."""
    lse_f = lse.double().masked_fill(~torch.isfinite(lse), 0.0)
    return (out.double() * dout).sum() + (lse_f * dlse).sum()


def run_local(op, c, rank, cp_group=None):
    """Run `op` on this rank's slice of case `c` (on c["device"], default cpu, with c["backend"],
    default "math"); returns a dict of CPU float64 results."""
    t = build(c)
    x, meta, dout, dlse = local(t, c, rank)
    dev, backend = torch.device(c.get("device", "cpu")), c.get("backend", "math")
    if dev.type != "cpu":
        x = {k: v.detach().to(dev).requires_grad_(True) for k, v in x.items()}
        meta = {k: v.to(dev) for k, v in meta.items()}
        dout, dlse = dout.to(dev), dlse.to(dev)
    if c.get("metadata"):  # the per-step metadata path (prepare once, call with metadata=)
        md = msk.prepare_splitkv_metadata(meta["q_seq"], meta["q_anchor"], meta["kv_seq"], meta["kv_pos"],
                                          block_size=c["B"], num_heads_q=c["Hq"], num_heads_kv=c["Hkv"],
                                          head_dim=c["D"], dtype=x["q"].dtype, cp_group=cp_group, impl=op,
                                          device=dev, num_chunks=c.get("num_chunks"),
                                          group_check=c.get("group_check", False), config=c.get("config"),
                                          **({"chunk_axis": c["chunk_axis"]} if c.get("chunk_axis") else {}),
                                          **attention_type(c))
        out, lse = OPS[op](x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], metadata=md,
                           backend=backend, return_lse=True, **attention_type(c))
    else:
        extra = {n: c[n] for n in ("num_chunks", "chunk_axis") if c.get(n) is not None}  # splitkv only
        out, lse = OPS[op](x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], meta["q_seq"],
                           meta["q_anchor"], meta["kv_seq"], meta["kv_pos"], block_size=c["B"],
                           cp_group=cp_group, backend=backend, return_lse=True, config=c.get("config"), **extra,
                           **attention_type(c))
    assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
    loss_of(out, lse, dout, dlse).backward()
    res = dict(out=out.detach().double().cpu(), lse=lse.detach().double().cpu())
    for name, key in zip(GRAD_NAMES, ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")):
        res[name] = x[key].grad.double().cpu()
    return res


class RelayRecorder:
    """Stand-in for `ops.common.RelayStream` (no streams) in the two-level tests: records the protocol's calls
    (mark, run, taken) in `log`, a list shared with the patched collectives; a nested run or a run with a mark
    that was never made fails."""

    def __init__(self, log):
        self.log, self.inside, self.marks = log, False, 0

    def mark(self):
        self.marks += 1
        self.log.append(("mark", self.marks))
        return self.marks

    def run(self, mark, pending, fn):
        assert not self.inside, "relay runs nested"
        assert isinstance(mark, int) and 1 <= mark <= self.marks
        self.log.append(("run", mark))
        self.inside = True
        try:
            return fn()
        finally:
            self.inside = False

    def taken(self, t):
        self.log.append(("taken", tuple(t.shape)))
        return t


def errors_of_every_op(c, rank, group, exc_type, extras=({}, {"metadata": True})):
    """Run every CP op (splitkv, allgather_kv, ring_kv) on case `c` with each of `extras` merged into it, expecting
    each call to raise `exc_type` on this rank (the refusal must reach every rank before any collective of the
    op). Returns the messages in call order; AssertionError naming the op when one does not raise."""
    seen = []
    for op in ("splitkv", "allgather_kv", "ring_kv"):
        for extra in extras:
            try:
                run_local(op, {**c, **extra}, rank, group)
            except exc_type as exc:
                seen.append(str(exc))
            else:
                raise AssertionError(f"{op} {extra}: no {exc_type.__name__} on rank {rank}")
    return seen


def raw_and_double_results(out, lse, x, **extra):
    """An op run's results for the two-level tests: out / lse and the five input gradients (None where an input
    got none) in float64, the same as raw tensors under "raw" (for bit-identity checks), plus `extra`."""
    res = dict(out=out.detach().double(), lse=lse.detach().double(), raw=dict(out=out.detach(), lse=lse.detach()),
               **extra)
    for name, key in zip(GRAD_NAMES, ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")):
        g = x[key].grad
        res[name] = None if g is None else g.double()
        res["raw"][name] = None if g is None else g.detach()
    return res


def aggregate_records(recs):
    """{(op, kind): (count, total bytes)} of comm_stats-style records (op, kind, bytes)."""
    out = {}
    for op, kind, nbytes in recs:
        n, b = out.get((op, kind), (0, 0))
        out[(op, kind)] = (n + 1, b + nbytes)
    return out


#: the last few float64 reference results, keyed by the global problem's inputs (`_problem_key`): a case is
#: checked once per op and norm, the cases of a P sweep share their global inputs (C10: P = 2, 4, 8), and the
#: reference of a long case (C10: 32K keys) is most of its test's time
_REFERENCES: dict = {}
_REFERENCES_KEPT = 8
_REFERENCE_INPUTS = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "q_seq", "q_anchor", "kv_seq", "kv_pos", "dout", "dlse")


def _problem_key(c, t):
    """Digest of everything the reference reads: the block size and the global inputs' dtypes, shapes and bytes."""
    h = hashlib.sha1(repr((c["B"], attention_type(c))).encode())
    for name in _REFERENCE_INPUTS:
        x = t[name]
        h.update(f"{name} {x.dtype} {tuple(x.shape)}".encode())
        h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference(c):
    """Global float64 reference results of case c (same loss as `run_local`): (build(c), results). The results
    are the same objects for cases with equal global inputs (the last `_REFERENCES_KEPT` kept): read them,
    never write them."""
    t = build(c)
    key = _problem_key(c, t)
    if key not in _REFERENCES:
        if len(_REFERENCES) >= _REFERENCES_KEPT:
            del _REFERENCES[next(iter(_REFERENCES))]
        _REFERENCES[key] = _reference(c, t)
    return t, _REFERENCES[key]


def _reference(c, t):
    x = {k: t[k].double().clone().requires_grad_(True) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")}
    out, lse = dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], x["k_blk"], x["v_blk"], t["q_seq"],
                                          t["q_anchor"], t["kv_seq"], t["kv_pos"], block_size=c["B"],
                                          **attention_type(c))
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    ref = dict(out=out.detach(), lse=lse.detach())
    for name, key in zip(GRAD_NAMES, ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")):
        ref[name] = x[key].grad
    return ref


def assemble(t, c, per_rank):
    """Glue per-rank results into global tensors (rows by block range, context by token index)."""
    g = {}
    for key in ("out", "lse", "dq", "dk_blk", "dv_blk"):
        g[key] = torch.cat([per_rank[r][key] for r in range(c["P"])], 0)
    for key in ("dk_ctx", "dv_ctx"):
        full = torch.zeros((t["kv_seq"].numel(),) + tuple(per_rank[0][key].shape[1:]), dtype=torch.float64)
        for r in range(c["P"]):
            full[t["ctx_idx"][r]] = per_rank[r][key]
        g[key] = full
    return g


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def rel_rms_err(a, b):
    """||a - b||_2 / ||b||_2 (float64): the relative error over all elements, far less noisy than the max-norm one."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


def errors(c, per_rank, norm=rel_err):
    """Relative errors (`norm`: `rel_err`, max-norm, the default; or `rel_rms_err`) of out, lse and all five
    gradients vs the float64 reference."""
    t, ref = reference(c)
    got = assemble(t, c, per_rank)
    errs = {}
    for key, r in ref.items():
        a = got[key]
        assert torch.isfinite(a).all() or key == "lse", f"non-finite {key}"
        assert not torch.isnan(a).any(), f"NaN in {key}"
        if key == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(fin, torch.isfinite(a)), "lse -inf pattern differs from the reference"
            assert (a[~fin] == float("-inf")).all()
            a, r = a[fin], r[fin]
        errs[key] = norm(a, r)
    return errs


def check(op, c, per_rank, tol=None):
    tol = TOL[c["dtype"]] if tol is None else tol
    errs = errors(c, per_rank)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{op} case {c} (seed {c['seed']}): errors {bad} above tol {tol}; all {errs}"
    return errs


def check_no_own(c, per_rank):
    """Per-rank results of a k_blk = v_blk = None run of case c against the float64 reference without the
    own-block part: out, lse's -inf pattern, dq, dk_ctx, dv_ctx within TOL; no own-block gradients."""
    t = build(c)
    x = {k: t[k].double().clone().requires_grad_(True) for k in ("q", "k_ctx", "v_ctx")}
    out, lse = dflash_attention_reference(x["q"], x["k_ctx"], x["v_ctx"], None, None, t["q_seq"], t["q_anchor"],
                                          t["kv_seq"], t["kv_pos"], block_size=c["B"])
    loss_of(out, lse, t["dout"], t["dlse"]).backward()
    rows = [slice(b0 * c["B"], b1 * c["B"]) for b0, b1 in t["block_range"]]
    tol = TOL[c["dtype"]]
    for r, pr in enumerate(per_rank):
        assert pr["dk_blk"] is None and pr["dv_blk"] is None
        for key, ref in (("out", out), ("dq", x["q"].grad)):
            assert rel_err(pr[key], ref.detach()[rows[r]]) <= tol, (c["seed"], key, r)
        fin = torch.isfinite(lse[rows[r]])
        assert torch.equal(torch.isfinite(pr["lse"]), fin), (c["seed"], r)
        for key, ref in (("dk_ctx", x["k_ctx"].grad), ("dv_ctx", x["v_ctx"].grad)):
            assert rel_err(pr[key], ref[t["ctx_idx"][r]]) <= tol, (c["seed"], key, r)


def cp_subgroups(sizes, world_size):
    """{P: process group of ranks 0..P-1} for each CP size P < world_size in `sizes` (every rank creates
    every subgroup, in the same ascending order, as torch.distributed.new_group requires)."""
    import torch.distributed as dist

    return {P: dist.new_group(list(range(P))) for P in sorted(set(sizes)) if P < world_size}


def run_jobs(rank, world_size, jobs, run, case_index):
    """The body of a run_distributed target for mixed CP sizes in ONE spawn: {job index: run(job, group)} for
    every job whose case (`job[case_index]`, with its CP size "P") has rank < P; `group` is the job's
    `cp_subgroups` group, None where P = world_size."""
    groups = cp_subgroups([job[case_index]["P"] for job in jobs], world_size)
    return {j: run(job, groups.get(job[case_index]["P"])) for j, job in enumerate(jobs) if rank < job[case_index]["P"]}


def expect_value_error(name, fn, needle, rank):
    """Call fn(); it must raise ValueError with `needle` in its text. Returns (name, the text);
    AssertionError naming `name` and `rank` otherwise."""
    try:
        fn()
    except ValueError as exc:
        assert needle in str(exc), (name, str(exc))
        return name, str(exc)
    raise AssertionError(f"{name}: no ValueError on rank {rank}")


def jobs_worker(rank, world_size, jobs):
    """run_distributed target for mixed CP sizes in ONE spawn: `jobs` is a list of (op, case); a case
    with P < world_size runs on the subgroup of ranks 0..P-1 (`cp_subgroups`). Returns {job index:
    result} with the comm records' summary added."""

    def one(job, group):
        op, c = job
        with msk.comm_stats() as stats:
            res = run_local(op, c, rank, cp_group=group)
        res["n_collectives"] = len(stats.records)
        res["comm_kinds"] = [(r.op, r.kind) for r in stats.records]
        res["comm_bytes"] = stats.total_bytes
        res["bytes_by_collective"] = stats.bytes_by_collective
        res["bytes_by_op"] = stats.bytes_by_op
        return res

    return run_jobs(rank, world_size, jobs, one, case_index=1)


def job_results(results, j, P):
    return [results[r][j] for r in range(P)]


def check_jobs(jobs, results):
    """`check` every (op, case) job of a `jobs_worker` run (its per-rank results) against the reference."""
    for j, (op, c) in enumerate(jobs):
        check(op, c, job_results(results, j, c["P"]))


def contiguous_ctx(tk, P):
    """Context split into P contiguous chunks of ceil(tk / P) tokens (the last ones shorter or empty)."""
    step = -(-tk // P)
    return [list(range(min(r * step, tk), min((r + 1) * step, tk))) for r in range(P)]


def prefix_intervals(gen, n_blocks, seq_lens, p_empty=0.2):
    """First intervals of a packed DFlash-like IntervalMask over sorted context keys of len(seq_lens)
    sequences: block b belongs to a random sequence s and sees a random prefix [start_s, start_s + n) of it
    (n = 0 for a fraction p_empty). Returns (lo [n_blocks] int64, hi [n_blocks] int64, n_ctx)."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    lo, hi = [], []
    for _ in range(n_blocks):
        s = int(torch.randint(len(seq_lens), (1,), generator=gen))
        n = 0 if float(torch.rand((), generator=gen)) < p_empty else int(
            torch.randint(seq_lens[s] + 1, (1,), generator=gen))
        lo.append(starts[s])
        hi.append(starts[s] + n)
    return torch.tensor(lo, dtype=torch.int64), torch.tensor(hi, dtype=torch.int64), starts[-1]


def with_random_own_slots(gen, lo, hi, num_ctx, B, p_own, align):
    """IntervalMask with first intervals (lo, hi) over num_ctx context keys and own-block second intervals:
    own keys after C = num_ctx rounded up to `align`, a random subset (fraction p_own) of the blocks owning
    disjoint B-key slots in random order (n_blocks slots). Validated."""
    from megatron_splitkv.kernels.base import IntervalMask

    n_blocks = lo.shape[0]
    c0 = -(-num_ctx // align) * align
    slot = torch.randperm(n_blocks, generator=gen)
    has = torch.rand(n_blocks, generator=gen) < p_own
    lo2 = torch.where(has, c0 + slot * B, torch.full_like(slot, c0))
    hi2 = torch.where(has, lo2 + B, lo2)
    return IntervalMask(B, lo, hi, c0 + n_blocks * B, lo2, hi2, num_ctx_keys=c0).validate()


def small_inputs(rank=0):
    """A tiny fp32 Split-KV input for error-path tests: 4 blocks of B = 4 rows (one invalid, anchor -1),
    Hq 4 / Hkv 2, D 8, 9 context tokens of one sequence. Returns (x: q, k_ctx, v_ctx, k_blk, v_blk; m: the
    metadata keyword arguments q_seq, q_anchor, kv_seq, kv_pos)."""
    g = torch.Generator().manual_seed(rank)
    nb, B, tk = 4, 4, 9
    x = {k: torch.randn(n, h, 8, generator=g) for k, n, h in (("q", nb * B, 4), ("k_ctx", tk, 2), ("v_ctx", tk, 2),
                                                                 ("k_blk", nb * B, 2), ("v_blk", nb * B, 2))}
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([0, 3, -1, 9]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk))
    return x, m


def prepare_small(m, **kw):
    """`prepare_splitkv_metadata` for `small_inputs`' metadata keywords `m` (B 4, Hq 4 / Hkv 2, D 8, fp32, no group:
    one process); `kw` the further keywords (num_chunks, chunk_axis, head_split, ...)."""
    return msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, **kw)


def run_in_triton_interpreter(code: str, expect: str, timeout: int):
    """Run `code` (a Python program) in a fresh interpreter with TRITON_INTERPRET=1 (Triton kernels on the
    CPU) and the repository on PYTHONPATH; assert exit status 0 and that stdout contains `expect`."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and expect in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])


class _DelayedWork:
    """The `work` of a delayed collective: `wait()` is a stream wait on its event (as NCCL's async work)."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)


def delayed_pending(x, stream):
    """A `comm.Pending` whose result lands late (CUDA): the buffer is NaN-filled (floats; else empty) on the
    caller's stream, then `stream` (after the caller's work so far, like NCCL) sleeps ~1-2 ms and copies `x`
    in, so any read that does not wait for it sees the NaN."""
    from megatron_splitkv.comm import Pending

    out = torch.full_like(x, float("nan")) if x.is_floating_point() else torch.empty_like(x)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(3_000_000)
        out.copy_(x)
        ev = stream.record_event()
    x.record_stream(stream)
    out.record_stream(stream)
    return Pending(out, _DelayedWork(ev), x)
