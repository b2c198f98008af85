"""The local attention kernel contract shared by every backend (math, FlexAttention, Transformer Engine).

Split-KV (arXiv 2611.05926, section 3; DESIGN.md section 2) runs, on each CP rank, attention of ALL
gathered queries against this rank's context keys only, then merges partial results by their lse. The
context part of the DFlash mask is, after sorting the local context keys by (sequence id, position), one
contiguous key interval per query block:

    query row i (block b = i // block_size) sees sorted keys j with lo[b] <= j < hi[b]

(`lo[b] == hi[b]` means it sees none: anchor at 0, another sequence, an invalid block or an empty rank).
`IntervalMask` carries exactly that; no dense Tq x Tk mask is ever materialised.

Union with the own block (optional second intervals, DESIGN.md sections 1-2: "all B tokens of its own
block"): the ops append the query blocks' own keys after the context keys and give each query block a
second interval, so ONE kernel call covers the context and the B x B own-block attention:

    keys = [ sorted context keys (Tk), zero padding up to num_ctx_keys ; own-block keys ]
    block b sees [lo[b], hi[b])  UNION  [lo2[b], hi2[b])

Contract of the second intervals (`IntervalMask.validate` checks it; the ops validate where they build the
mask, once per step, never in a kernel's hot path; the Transformer Engine kernel relies on it):
    * 0 <= lo[b] <= hi[b] <= num_ctx_keys for non-empty first intervals (region 1 = [0, num_ctx_keys));
    * hi2[b] - lo2[b] is 0 or block_size; a non-empty one lies in [num_ctx_keys, num_keys) (region 2);
    * the non-empty second intervals are pairwise disjoint (each own key belongs to one block).
Per-row bounds (optional; sliding-window and causal layers, `reference.dflash_attention_mask` with window /
causal): row r of block b = r // B then sees [row_lo[r], hi[b]) UNION [row_lo2[r], row_hi2[r]) instead,
with lo[b] <= row_lo[r] <= hi[b] and lo2[b] <= row_lo2[r] <= row_hi2[r] <= hi2[b]: the block intervals stay
the union over the block's rows and drive tile skipping; the row bounds refine it. A kernel that reads the
per-row bounds says so with the class attribute `row_intervals = True` (math, flex, fa4); the ops refuse
the others for such a mask (`IntervalMask.has_rows`).

The ops round num_ctx_keys up to a multiple of 128 (`ops.common.OWN_KEY_ALIGN`, FlexAttention's key
tile), so no key tile mixes the two regions; the padding keys are zeros and lie in no interval.

Kernels implement:

    forward(q, k, v, mask, scale) -> (out, lse, state)
        q [Tq, Hq, D], k/v [Tk, Hkv, D] (same dtype: fp16/bf16/fp32/fp64; Hq % Hkv == 0, query head h
        uses kv head h // (Hq // Hkv); Tk = mask.num_keys, own keys included). out [Tq, Hq, D] float32
        (float64 for float64 inputs), lse [Tq, Hq] float32 (float64 for float64 inputs), natural log of
        sum(exp(scale * q.k)) over visible keys (both intervals); rows with no visible key: out = 0,
        lse = -inf. `state` is whatever the kernel wants back in backward (may be None).

    backward(q, k, v, mask, scale, dout, lse, delta, state) -> (dq, dk, dv)
        dout [Tq, Hq, D] (any float dtype), lse [Tq, Hq] and delta [Tq, Hq] float32/64 are the GLOBAL
        merged log-sum-exp and rowsum(dO * O_final) (DESIGN.md section 2, backward step 2: using this
        rank's own lse or O here is the known bug class, case C1). Returns dq [Tq, Hq, D], dk, dv
        [Tk, Hkv, D], all float32 (float64 for float64 inputs):
            P = exp(scale * q k^T - lse) on visible entries, 0 elsewhere (and on rows with lse = -inf)
            dV = P^T dO ;  dS = P * (dO V^T - delta) ;  dQ = scale * dS K ;  dK = scale * dS^T Q
        The rows of dk/dv of region 2 are the own-block gradients (dk_blk, dv_blk in the ops).

    native_dtype_results (optional class attribute, default False): when True, forward and backward also
        take a keyword native=True and then return out (forward) and dq, dk, dv (backward) in the INPUT
        dtype, any strides, and lse with any strides: exactly the values whose upcast the default call
        returns (a kernel that stores them in the input dtype anyway, like FlexAttention). Split-KV uses it
        to skip the fp32 round trip of results it sends in the input dtype (`ops.common.native_results`);
        results are bit-identical either way.

    strided_heads (optional class attribute, default False): when True, forward and backward take q, k, v
        and dout with any row and head strides (unit stride on D), e.g. the head slices [:, g0:g1] of wider
        tensors, reading them in place with the same results as on contiguous copies. Split-KV's head chunks
        then pass every chunk's local keys / values as views of one tensor instead of a copy per chunk
        (`ops.chunking.HeadChunks.local_keys`; docs/lab/perf-notes.md item 24). Set for math (its tiles are gathered /
        selected into new tensors first); not for fa4 (reading head slices in place through its strides was not
        measured faster, docs/lab/perf-notes.md item 24, nor verified on the GPU: its inputs are copied
        contiguous), flex (its leaves are copied contiguous inside the kernel anyway) or te (copies its inputs
        contiguous), nor staircase (its cuDNN graphs are keyed by the inputs' strides; not tried with head
        slices).

    check_dtype(dtype, device=None, head_dim=None) (optional): raise ValueError when the kernel cannot run
        `dtype` with head dim `head_dim` (D; None: unknown) on `device`. The ops call it once per call, with
        the call's D, before their first data collective, so that every rank raises (a rank without queries
        or keys never calls forward/backward, whose own checks would then fire on the other ranks only and
        leave this one waiting in a collective). It must refuse everything forward/backward refuse for
        the dtype, device and head dim.
"""

from dataclasses import dataclass

import torch


@dataclass
class IntervalMask:
    """Visibility of query blocks as key intervals over the local keys (see the module docstring).

    Attributes:
        block_size: B, query rows per block (rows are grouped block by block).
        lo, hi: [n_blocks] int64 on the kernel's device; block b sees keys [lo[b], hi[b]) (region 1).
        num_keys: Tk, the total number of keys the kernel gets (context, padding and own keys).
        lo2, hi2: optional [n_blocks] int64 (both or neither): block b ALSO sees [lo2[b], hi2[b])
            (region 2, the own block); None: no second intervals.
        num_ctx_keys: where region 2 starts (first intervals end at or before it); defaults to
            num_keys (no region 2).
        row_lo: optional [n_blocks * B] int64: row r sees [row_lo[r], hi[r // B]) of region 1 instead of
            the block's [lo, hi) (lo <= row_lo <= hi); None: every row its block's interval.
        row_lo2, row_hi2: optional [n_blocks * B] int64 (both or neither, only with lo2 / hi2): row r sees
            [row_lo2[r], row_hi2[r]) of region 2 (inside its block's [lo2, hi2)); None: the block's.

    Raises:
        ValueError: only one of lo2 / hi2 (row_lo2 / row_hi2) given, row bounds of region 2 without
            lo2 / hi2, or num_ctx_keys outside [0, num_keys].
    """

    block_size: int
    lo: torch.Tensor
    hi: torch.Tensor
    num_keys: int
    lo2: torch.Tensor = None
    hi2: torch.Tensor = None
    num_ctx_keys: int = None
    row_lo: torch.Tensor = None
    row_lo2: torch.Tensor = None
    row_hi2: torch.Tensor = None

    def __post_init__(self):
        if (self.lo2 is None) != (self.hi2 is None):
            raise ValueError("IntervalMask: lo2 and hi2 must both be tensors or both be None")
        if (self.row_lo2 is None) != (self.row_hi2 is None) or (self.row_lo2 is not None and self.lo2 is None):
            raise ValueError("IntervalMask: row_lo2 and row_hi2 must both be tensors (with lo2 / hi2) or both be None")
        if self.num_ctx_keys is None:
            self.num_ctx_keys = self.num_keys
        if not 0 <= self.num_ctx_keys <= self.num_keys:
            raise ValueError(f"IntervalMask: num_ctx_keys={self.num_ctx_keys} must lie in [0, "
                             f"num_keys={self.num_keys}]")

    @property
    def num_blocks(self) -> int:
        return int(self.lo.shape[0])

    @property
    def has_union(self) -> bool:
        """True when the mask has second (own-block) intervals."""
        return self.lo2 is not None

    @property
    def has_rows(self) -> bool:
        """True when the mask has per-row bounds (row_lo or row_lo2 / row_hi2: a windowed or causal layer)."""
        return self.row_lo is not None or self.row_lo2 is not None

    def row_bounds(self) -> torch.Tensor:
        """[2 or 4, n_blocks * B] int64 rows (lo, hi[, lo2, hi2]) of every query row: the per-row bounds where
        the mask has them, else the block's intervals repeated over its B rows."""
        bsz = self.block_size
        rows = [self.lo.repeat_interleave(bsz) if self.row_lo is None else self.row_lo,
                self.hi.repeat_interleave(bsz)]
        if self.has_union:
            rows += ([self.lo2.repeat_interleave(bsz), self.hi2.repeat_interleave(bsz)] if self.row_lo2 is None
                     else [self.row_lo2, self.row_hi2])
        return torch.stack(rows)

    def validate(self) -> "IntervalMask":
        """Check the contract of the module docstring (one host sync); returns self.

        Raises:
            ValueError naming the violated property (shapes, region bounds, second-interval lengths,
            overlapping second intervals).
        """
        flags = self.validate_flags()
        if flags:
            self.raise_flags(torch.stack(flags).tolist())
        return self

    def validate_flags(self) -> list:
        """The contract checks of `validate` WITHOUT the host sync: the shape / dtype checks run here
        (ValueError), the value checks are returned as 0-dim bool tensors on the mask's device (True =
        violated, in `raise_flags`' order: 1 without second intervals, 4 with, 3 for a single block; [] for
        a mask without blocks), for a caller that
        reads many checks with one `.tolist()` and passes the values to `raise_flags`."""
        n = self.num_blocks
        tensors = [("lo", self.lo), ("hi", self.hi)]
        if self.has_union:
            tensors += [("lo2", self.lo2), ("hi2", self.hi2)]
        for name, t in tensors:
            if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int64:
                raise ValueError(f"IntervalMask.{name} must be [{n}] int64, got {tuple(t.shape)} {t.dtype}")
        rows = n * self.block_size
        for name in ("row_lo", "row_lo2", "row_hi2"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 1 or t.shape[0] != rows or t.dtype != torch.int64):
                raise ValueError(f"IntervalMask.{name} must be [{rows}] int64, got {tuple(t.shape)} {t.dtype}")
        if n == 0:
            return []
        live = self.hi > self.lo
        checks = [(live & ((self.lo < 0) | (self.hi > self.num_ctx_keys))).any()]
        if self.has_union:
            length = self.hi2 - self.lo2
            own = length > 0
            checks.append(((length != 0) & (length != self.block_size)).any())
            checks.append((own & ((self.lo2 < self.num_ctx_keys) | (self.hi2 > self.num_keys))).any())
            if n > 1:
                # starts of the non-empty second intervals, ascending, -1 (first) for the empty ones: two
                # neighbours closer than B overlap; starts[:-1] >= 0 implies starts[1:] >= 0 (sorted)
                starts = torch.sort(torch.where(own, self.lo2, -1)).values
                checks.append(((starts[:-1] >= 0) & (starts[1:] - starts[:-1] < self.block_size)).any())
        return checks

    def raise_flags(self, flags) -> "IntervalMask":
        """Raise the ValueError of the first violated check of `validate_flags` (flags: their values,
        host bools / ints in the same order); returns self when none is."""
        names = ["first intervals must lie in [0, num_ctx_keys)",
                 f"second intervals must have length 0 or block_size={self.block_size}",
                 "second intervals must lie in [num_ctx_keys, num_keys)",
                 "second intervals must be pairwise disjoint"]
        for flag, what in zip(flags, names):
            if flag:
                raise ValueError(f"IntervalMask: {what} (num_ctx_keys={self.num_ctx_keys}, "
                                 f"num_keys={self.num_keys})")
        return self


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: IntervalMask) -> None:
    """The contract's shape checks every kernel runs first: q [Tq, Hq, D], k and v [Tk, Hkv, D] of one shape,
    Hkv > 0 dividing Hq, the same head dim and dtype for all three, `mask` covering Tq rows
    (num_blocks * block_size) and Tk keys (num_keys). Raises ValueError saying which differs."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q [Tq,Hq,D], k=v [Tk,Hkv,D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"head dims / GQA groups mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if mask.num_blocks * mask.block_size != q.shape[0]:
        raise ValueError(f"mask covers {mask.num_blocks}x{mask.block_size} rows, q has {q.shape[0]}")
    if mask.num_keys != k.shape[0]:
        raise ValueError(f"mask.num_keys={mask.num_keys} but k has {k.shape[0]} keys")


#: the head dims cuDNN SDPA (the staircase kernel's dense part on CUDA) and FlashAttention-4 take: a multiple
#: of CUDA_HEAD_DIM_MULTIPLE, at most CUDA_HEAD_DIM_MAX (`cuda_head_dim_ok`, `check_cuda_head_dim`)
CUDA_HEAD_DIM_MULTIPLE = 8
CUDA_HEAD_DIM_MAX = 256


def cuda_head_dim_ok(head_dim) -> bool:
    """Whether cuDNN SDPA / FlashAttention-4 take head dim `head_dim` (None: unknown -> True): a positive
    multiple of 8 that is at most 256. The one rule behind `half_precision_cuda_index` (what "auto" may
    pick) and `check_cuda_head_dim` (what the kernels refuse, before the ops' first collective)."""
    return head_dim is None or (0 < head_dim <= CUDA_HEAD_DIM_MAX and head_dim % CUDA_HEAD_DIM_MULTIPLE == 0)


def check_cuda_head_dim(head_dim, backend: str) -> None:
    """Raise ValueError naming `backend`, the head dim (D, q.shape[2]) and the limit when `cuda_head_dim_ok`
    refuses `head_dim`."""
    if not cuda_head_dim_ok(head_dim):
        raise ValueError(f"{backend} needs a head dim D (q.shape[2]) that is a multiple of "
                         f"{CUDA_HEAD_DIM_MULTIPLE} in [{CUDA_HEAD_DIM_MULTIPLE}, {CUDA_HEAD_DIM_MAX}] on CUDA, "
                         f"got {head_dim}")


def half_precision_cuda_index(device, dtype, head_dim=None):
    """The CUDA device index of `device` when it is a CUDA device, `dtype` is bf16 / fp16 and `head_dim` is
    None or a multiple of 8 <= 256 (`cuda_head_dim_ok`: what cuDNN SDPA and FlashAttention-4 take); else
    None. Never raises."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if not cuda_head_dim_ok(head_dim):
        return None
    try:
        return dev.index if dev.index is not None else torch.cuda.current_device()
    except (RuntimeError, AssertionError, AttributeError):  # no driver, torch without CUDA, ...
        return None


def mask_cache(mask, attr: str, key, build):
    """What a kernel derives from an `IntervalMask` (tables, block masks, plans), cached on the mask object in
    the dict attribute `attr` under `key`: build() on first use, the cached value afterwards (the ops share one
    mask per step across layers and, with head chunks, across a layer's chunks). The cache assumes the mask's
    intervals are not modified in place afterwards. Entries put into `attr` by others (the data pipeline's
    host-built tables, bound on the caller's stream) are returned as they are.

    Stream-safe on CUDA: a build records an event on the current stream after build() (whose device work, e.g.
    FA4's block tables or FlexAttention's BlockMask, is issued on that stream), kept in the dict attribute
    `attr + "_ready"`; a use on ANOTHER stream waits for that event before returning the value. Without it,
    two calls with the same mask on two CUDA streams (e.g. head chunks on side streams, as an earlier version of
    the op ran them) read the tables chunk 0's stream was still writing: seen on the H200
    (2026-12-01) as an illegal memory access / cudaErrorInvalidAddressSpace in FA4, intermittently. A use on the
    building stream is ordered already (no wait). Returns build()'s value (or the cached one)."""
    cache = mask.__dict__.setdefault(attr, {})
    dev = mask.lo.device
    if key not in cache:
        cache[key] = build()
        if dev.type == "cuda":
            stream = torch.cuda.current_stream(dev)
            mask.__dict__.setdefault(attr + "_ready", {})[key] = (stream.record_event(), stream)
        return cache[key]
    ready = mask.__dict__.get(attr + "_ready", {}).get(key)
    if ready is not None:
        event, built_on = ready
        stream = torch.cuda.current_stream(dev)
        if stream != built_on:
            stream.wait_event(event)
    return cache[key]
