"""Pieces shared by Split-KV attention and its two baselines (one copy of each, used by all three ops).

- `prepare`: local input validation plus ONE tiny all-gather of per-rank sizes that checks consistency
  on every rank; an invalid input on any rank raises the same ValueError on all ranks (never a hang).
- context sorting by (sequence id, position) and per-block key intervals (`IntervalMask`).
- the lse merge (`lse_weights`, `finalize`, `merge`): fp32 accumulation, rows whose partial lse are all
  -inf give O = 0 and lse = -inf, never NaN.
- dense B x B own-block attention forward/backward (batched matmul, float32/float64).
- empty-input guards around the local kernel.

Source: arXiv 2611.05926 (Split-KV), DESIGN.md sections 1 (mask) and 2 (algorithm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm import CommGroup, all_gather, resolve_group
from ..kernels import BACKENDS, get_kernel
from ..kernels.base import IntervalMask

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_INT32 = 1 << 31  # sequence ids and positions must lie in [-2**31, 2**31)
_MAX_MSG = 1000


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Plan:
    """Validated inputs and group-wide sizes of one op call (built by `prepare`)."""

    name: str
    group: CommGroup
    block_size: int
    scale: float
    kernel: object
    acc: torch.dtype
    n_blocks: list  # per rank
    n_ctx: list  # per rank
    q_seq: torch.Tensor  # [n_blocks_local] int64 (0 on invalid blocks)
    q_anchor: torch.Tensor  # [n_blocks_local] int64 (< 0: invalid)
    kv_seq: torch.Tensor  # [Tk_local] int64
    kv_pos: torch.Tensor  # [Tk_local] int64
    hkv: int

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def valid(self) -> torch.Tensor:
        return self.q_anchor >= 0


def _check_local(q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, block_size,
                 softmax_scale, backend):
    """Local checks; raises ValueError naming the argument and the limit. Returns int64 metadata."""
    names = ("q", "k_ctx", "v_ctx", "k_blk", "v_blk")
    tensors = (q, k_ctx, v_ctx, k_blk, v_blk)
    for n, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{n} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of bf16/fp16/fp32/fp64, got {q.dtype}")
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise ValueError(f"{n}.dtype ({t.dtype}) must equal q.dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{n}.device ({t.device}) must equal q.device ({q.device})")
    tq, hq, d = q.shape
    tk, hkv, dk = k_ctx.shape
    if hkv < 1 or dk != d:
        raise ValueError(f"k_ctx.shape {tuple(k_ctx.shape)} must be [Tk_local, Hkv >= 1, D={d}]")
    if tuple(v_ctx.shape) != tuple(k_ctx.shape):
        raise ValueError(f"v_ctx.shape {tuple(v_ctx.shape)} must equal k_ctx.shape {tuple(k_ctx.shape)}")
    for n, t in (("k_blk", k_blk), ("v_blk", v_blk)):
        if tuple(t.shape) != (tq, hkv, d):
            raise ValueError(f"{n}.shape {tuple(t.shape)} must be [Tq_local={tq}, Hkv={hkv}, D={d}]")
    if hq % hkv:
        raise ValueError(
            f"Hq % Hkv != 0: q has Hq={hq} heads and k_ctx Hkv={hkv}; Hq must be a multiple of Hkv"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if tq % block_size:
        raise ValueError(f"block_size={block_size} must divide q.shape[0] (Tq_local={tq})")
    nb = tq // block_size
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    meta = []
    for n, t, length in (("q_seq", q_seq, nb), ("q_anchor", q_anchor, nb), ("kv_seq", kv_seq, tk),
                         ("kv_pos", kv_pos, tk)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{n} must be a 1-D integer tensor of length {length}, got {shape}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{n} must have an integer dtype (int64), got {t.dtype}")
        meta.append(t.to(device=q.device, dtype=torch.int64))
    q_seq, q_anchor, kv_seq, kv_pos = meta
    q_seq = torch.where(q_anchor >= 0, q_seq, torch.zeros_like(q_seq))
    checks = [(n, t) for n, t in (("q_seq", q_seq), ("kv_seq", kv_seq), ("kv_pos", kv_pos)) if t.numel()]
    if checks:
        bounds = torch.stack([torch.stack([t.min(), t.max()]) for _, t in checks]).tolist()
        for (n, _), (lo, hi) in zip(checks, bounds):
            if lo < -_INT32 or hi >= _INT32:
                raise ValueError(f"{n} values must lie in [-2**31, 2**31), got range [{lo}, {hi}]")
    return (nb, tk, hq, hkv, d), (q_seq, q_anchor, kv_seq, kv_pos)


def _comm_device(group: CommGroup, q):
    if isinstance(q, torch.Tensor):
        return q.device
    import torch.distributed as dist

    if group.size > 1 and dist.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare(name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size,
            cp_group, softmax_scale, backend) -> Plan:
    """Validate on this rank, then all-gather (error flag, sizes) once and check the group agrees.

    Raises ValueError with the same message on every rank of the CP group when any rank's input is
    invalid or when block_size, Hq, Hkv, D or dtype differ across ranks.
    """
    group = resolve_group(cp_group)
    err, sizes, meta = "", (-1,) * 5, None
    try:
        sizes, meta = _check_local(q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                                   block_size, softmax_scale, backend)
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank, never hang
        text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        if group.size == 1:
            raise ValueError(f"{name}: {text}") from exc
        err = text
    nb, tk, hq, hkv, d = sizes
    msg = err.encode()[:_MAX_MSG]
    dcode = _DTYPE_CODE.get(getattr(q, "dtype", None), -1)
    bs = block_size if isinstance(block_size, int) else -1
    dev = _comm_device(group, q)
    local = torch.tensor([len(msg) if err else -1, nb, tk, bs, hq, hkv, d, dcode], dtype=torch.int64,
                         device=dev)
    table = all_gather(local[None], group, f"{name}.meta").tolist()  # [P, 8]
    bad = [r for r in range(group.size) if table[r][0] >= 0]
    if bad:
        width = max(max(table[r][0] for r in bad), 1)
        buf = torch.zeros(1, width, dtype=torch.uint8, device=dev)
        if msg:
            buf[0, : len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
        texts = all_gather(buf, group, f"{name}.meta").cpu().tolist()
        by_msg: dict = {}
        for r in bad:
            by_msg.setdefault(bytes(texts[r][: table[r][0]]).decode(errors="replace"), []).append(r)
        parts = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in by_msg.items()]
        raise ValueError(f"{name}: invalid input on CP rank(s) {bad}: " + "; ".join(parts))
    for col, what in ((3, "block_size"), (4, "Hq (q.shape[1])"), (5, "Hkv (k_ctx.shape[1])"),
                      (6, "head dim D (q.shape[2])"), (7, "dtype")):
        vals = [row[col] for row in table]
        if len(set(vals)) > 1:
            if col == 7:
                vals = [str(SUPPORTED_DTYPES[v]) for v in vals]
            raise ValueError(f"{name}: {what} must be the same on every CP rank; got {vals} (by rank)")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return Plan(
        name=name, group=group, block_size=block_size, scale=scale,
        kernel=get_kernel(backend, q.device, q.dtype, head_dim=d), acc=acc_dtype(q.dtype),
        n_blocks=[row[1] for row in table], n_ctx=[row[2] for row in table],
        q_seq=meta[0], q_anchor=meta[1], kv_seq=meta[2], kv_pos=meta[3], hkv=hkv,
    )


# ----------------------------------------------------------------------------- sorting and intervals


def context_keys(kv_seq: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """One int64 key per context token, ordered like (seq, pos): seq * 2**32 + (pos + 2**31)."""
    return kv_seq * (1 << 32) + (kv_pos + _INT32)


def sort_keys(keys: torch.Tensor):
    """Return (sorted keys, order) with keys_sorted = keys[order]; order is None when already sorted
    (no copy)."""
    if keys.numel() <= 1 or bool((keys[1:] >= keys[:-1]).all()):
        return keys, None
    return torch.sort(keys, stable=True)


def sort_context(plan: Plan, k_ctx, v_ctx):
    """This rank's context sorted by (seq, pos): returns (keys, order, k_sorted, v_sorted); no copy
    when already sorted (order None)."""
    keys, order = sort_keys(context_keys(plan.kv_seq, plan.kv_pos))
    if order is None:
        return keys, None, k_ctx.contiguous(), v_ctx.contiguous()
    return keys, order, k_ctx[order], v_ctx[order]


def unsort(x_sorted: torch.Tensor, order):
    """Inverse of `x[order]` along dim 0 (identity when order is None)."""
    if order is None:
        return x_sorted
    return torch.empty_like(x_sorted).index_copy_(0, order, x_sorted)


def intervals(keys_sorted, block_seq, block_anchor, block_size) -> IntervalMask:
    """IntervalMask of blocks against sorted context keys: block b sees keys of sequence block_seq[b]
    with position < block_anchor[b] (strictly); blocks with anchor < 0 see nothing."""
    base = block_seq * (1 << 32)
    lo = torch.searchsorted(keys_sorted, base)
    hi = torch.searchsorted(keys_sorted, base + block_anchor.clamp(max=_INT32) + _INT32)
    hi = torch.where(block_anchor >= 0, hi, lo)
    return IntervalMask(block_size, lo, hi, int(keys_sorted.shape[0]))


def pad_rows(x: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    """Pad dim 0 of x to `rows` with `value`."""
    if x.shape[0] == rows:
        return x
    pad = x.new_full((rows - x.shape[0],) + tuple(x.shape[1:]), value)
    return torch.cat([x, pad], 0)


# ----------------------------------------------------------------------------- merge by lse


def lse_weights(lse: torch.Tensor, m: torch.Tensor):
    """(m_safe, exp(lse - m_safe)) with m_safe = m where finite else 0: rows where every partial lse is
    -inf get weight 0, never NaN. m must be >= lse element-wise (a max over partials)."""
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m_safe, torch.exp(lse - m_safe)


def finalize(num: torch.Tensor, den: torch.Tensor, m_safe: torch.Tensor):
    """out = num / den (0 where den = 0), lse = m_safe + log(den) (-inf where den = 0)."""
    out = num / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, m_safe + torch.log(den)


def merge(o1, lse1, o2, lse2):
    """Exact merge of two partial attention states (o [T, H, D], lse [T, H]) in their dtype."""
    m_safe, w1 = lse_weights(lse1, torch.maximum(lse1, lse2))
    _, w2 = lse_weights(lse2, m_safe)
    return finalize(o1 * w1[..., None] + o2 * w2[..., None], w1 + w2, m_safe)


# ----------------------------------------------------------------------------- own block (B x B dense)


def _block_views(q, k_blk, v_blk, block_size, acc):
    tq, hq, d = q.shape
    hkv = k_blk.shape[1]
    nb = tq // block_size
    qb = q.to(acc).view(nb, block_size, hkv, hq // hkv, d)
    kb = k_blk.to(acc).view(nb, block_size, hkv, d)
    vb = v_blk.to(acc).view(nb, block_size, hkv, d)
    return qb, kb, vb


def own_block_forward(q, k_blk, v_blk, valid, block_size, scale, acc):
    """Each query block attends its own B keys (bidirectional); invalid blocks: out 0, lse -inf.
    Returns out [Tq, Hq, D], lse [Tq, Hq] in `acc`."""
    tq, hq, d = q.shape
    qb, kb, vb = _block_views(q, k_blk, v_blk, block_size, acc)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    lse = torch.logsumexp(s, -1)  # [nb, Hkv, G, B]
    o = torch.einsum("nkgij,njkd->nikgd", torch.exp(s - lse[..., None]), vb)
    v5 = valid.view(-1, 1, 1, 1, 1)
    o = torch.where(v5, o, torch.zeros_like(o)).reshape(tq, hq, d)
    lse = torch.where(valid.view(-1, 1, 1, 1), lse, torch.full_like(lse, float("-inf")))
    return o, lse.permute(0, 3, 1, 2).reshape(tq, hq)


def own_block_backward(q, k_blk, v_blk, valid, block_size, scale, dout, lse, delta, acc):
    """Own-block gradients with the GLOBAL lse and delta ([Tq, Hq]); returns dq, dk_blk, dv_blk in acc."""
    tq, hq, d = q.shape
    qb, kb, vb = _block_views(q, k_blk, v_blk, block_size, acc)
    nb, bsz, hkv, g, _ = qb.shape

    def heads_first(x):  # [Tq, Hq] -> [nb, Hkv, G, B, 1]
        return x.to(acc).view(nb, bsz, hkv, g).permute(0, 2, 3, 1)[..., None]

    lse_g = heads_first(lse)
    ok = torch.isfinite(lse_g) & valid.view(-1, 1, 1, 1, 1)
    s = torch.einsum("nikgd,njkd->nkgij", qb, kb) * scale
    p = torch.where(ok, torch.exp(s - torch.where(ok, lse_g, torch.zeros_like(lse_g))), torch.zeros_like(s))
    do = dout.to(acc).view(nb, bsz, hkv, g, d)
    dv = torch.einsum("nkgij,nikgd->njkd", p, do)
    ds = p * (torch.einsum("nikgd,njkd->nkgij", do, vb) - heads_first(delta))
    dq = torch.einsum("nkgij,njkd->nikgd", ds, kb) * scale
    dk = torch.einsum("nkgij,nikgd->njkd", ds, qb) * scale
    return dq.reshape(tq, hq, d), dk.reshape(tq, hkv, d), dv.reshape(tq, hkv, d)


# ----------------------------------------------------------------------------- kernel guards


def kernel_forward(plan: Plan, q, k, v, mask: IntervalMask):
    """Local kernel forward; empty queries or keys short-circuit to (0, -inf, None)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=plan.acc, device=q.device)
        return out, torch.full(q.shape[:2], float("-inf"), dtype=plan.acc, device=q.device), None
    out, lse, state = plan.kernel.forward(q, k, v, mask, plan.scale)
    return out.to(plan.acc), lse.to(plan.acc), state


def kernel_backward(plan: Plan, q, k, v, mask, dout, lse, delta, state):
    """Local kernel backward with the global lse/delta; empty inputs give zero gradients (acc dtype)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        z = lambda t: torch.zeros(t.shape, dtype=plan.acc, device=q.device)  # noqa: E731
        return z(q), z(k), z(v)
    dq, dk, dv = plan.kernel.backward(q, k, v, mask, plan.scale, dout, lse, delta, state)
    return dq.to(plan.acc), dk.to(plan.acc), dv.to(plan.acc)


def delta_and_dout(plan: Plan, dout, dlse, out, lse, like):
    """delta = rowsum(dO * O_final) - dlse (acc dtype; dlse folds the gradient of a returned lse into
    the same formula: d lse / d s = P). Returns (dout as a tensor shaped like `like`, delta)."""
    if dout is None:
        dout = torch.zeros_like(like)
    delta = (dout.to(plan.acc) * out).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse.to(plan.acc), torch.zeros_like(delta))
    return dout, delta


def run_op(fn_cls, name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos, *, block_size,
           cp_group, softmax_scale, backend, return_lse):
    """Shared entry point of the three public ops: validate, apply the autograd Function."""
    plan = prepare(name, q, k_ctx, v_ctx, k_blk, v_blk, q_seq, q_anchor, kv_seq, kv_pos,
                   block_size=block_size, cp_group=cp_group, softmax_scale=softmax_scale, backend=backend)
    out, lse = fn_cls.apply(plan, q, k_ctx, v_ctx, k_blk, v_blk)
    return (out, lse) if return_lse else out
