"""DCP-style hypergraph partition of context chunks with KaHyPar (baseline strategy "hypergraph").

Source: DCP (Jiang et al., "DCP: Addressing Input Dynamism in Long-Context Training via Dynamic
Context Parallelism", 2025) plans context parallelism by partitioning a hypergraph of data and
computation blocks with a balance constraint, minimising communication. Split-KV (arXiv 2611.05926)
compares LPT against it. Our adaptation to the Split-KV setting: vertices are the context chunks
(weight = realized cost, scaled to integers); every query block is a hyperedge connecting the chunks
it attends to (the chunks of its sequence that start before its anchor: its query must reach every
rank holding one of them). Query blocks with the same pin set are merged into one hyperedge weighted
by their count. Objective connectivity - 1 (km1, = query traffic beyond one rank), balance constraint
epsilon. Real DCP also has computation-block vertices, so its hypergraphs (and run times) are larger.
Requires the optional extra
``kahypar`` (``pip install megatron-splitkv[hypergraph]``).
"""

import os
import tempfile

import numpy as np

# Our KaHyPar preset: direct k-way multilevel partitioning, heavy-edge coarsening, pooled initial
# partitioning, k-way FM refinement on (connectivity - 1). No sparsifier/community detection (our
# hypergraphs are small: one vertex per chunk).
_CONFIG = """\
mode=direct
objective=km1
seed=-1
cmaxnet=-1
vcycles=0
p-use-sparsifier=false
p-detect-communities=false
p-detect-communities-in-ip=false
p-reuse-communities=false
p-max-louvain-pass-iterations=100
p-min-eps-improvement=0.0001
p-louvain-edge-weight=hybrid
p-large-he-threshold=1000
p-smallest-maxnet-threshold=50000
p-maxnet-removal-factor=0.01
c-type=ml_style
c-s=1
c-t=160
c-rating-score=heavy_edge
c-rating-use-communities=false
c-rating-heavy_node_penalty=no_penalty
c-rating-acceptance-criterion=best_prefer_unmatched
c-fixed-vertex-acceptance-criterion=fixed_vertex_allowed
i-mode=recursive
i-technique=multi
i-c-type=ml_style
i-c-s=1
i-c-t=150
i-c-rating-score=heavy_edge
i-c-rating-use-communities=false
i-c-rating-heavy_node_penalty=no_penalty
i-c-rating-acceptance-criterion=best_prefer_unmatched
i-c-fixed-vertex-acceptance-criterion=fixed_vertex_allowed
i-algo=pool
i-runs=20
i-bp-algorithm=worst_fit
i-bp-heuristic-prepacking=false
i-bp-early-restart=true
i-bp-late-restart=true
i-r-type=twoway_fm
i-r-runs=-1
i-r-fm-stop=simple
i-r-fm-stop-i=50
r-type=kway_fm_km1
r-runs=-1
r-fm-stop=adaptive_opt
r-fm-stop-alpha=1
r-fm-stop-i=350
"""

_config_path = None


def _kahypar():
    try:
        import kahypar  # noqa: F401, PLC0415 - optional: kahypar
    except ImportError as exc:
        raise ImportError(
            "strategy='hypergraph' needs the optional extra 'hypergraph' (the kahypar package): "
            "pip install 'megatron-splitkv[hypergraph]' or pip install kahypar"
        ) from exc
    return kahypar


def _config_file():
    global _config_path
    if _config_path is None or not os.path.exists(_config_path):
        fd, path = tempfile.mkstemp(prefix="splitkv_kahypar_", suffix=".ini")
        with os.fdopen(fd, "w") as f:
            f.write(_CONFIG)
        _config_path = path
    return _config_path


def hypergraph_assign(costs, chunk_seq, chunk_start, anchors, cp_size, *, epsilon=0.03, seed=0):
    """Assign chunks to ranks with a KaHyPar km1 partition (see module docstring).

    Args:
        costs: [n_chunks] float64 realized chunk costs; chunk_seq, chunk_start: [n_chunks] int64, chunks
            ordered by (sequence, start) (as `plan_context_parallel` cuts them).
        anchors: n_seq sorted int64 anchor arrays.
        cp_size: P; epsilon: KaHyPar balance constraint (block weight <= (1+eps) * ceil(total/P));
        seed: KaHyPar seed (fixed: deterministic plans).

    Returns: [n_chunks] int64 rank per chunk.
    Raises: ImportError naming the extra when kahypar is missing.
    """
    kahypar = _kahypar()
    n = int(costs.shape[0])
    if cp_size == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    if n <= cp_size:  # nothing to partition: one chunk per rank
        return np.arange(n, dtype=np.int64)
    # integer vertex weights (KaHyPar needs ints): scale so the largest chunk is ~1e6
    scale = 1e6 / max(float(costs.max()), 1e-300)
    w = np.maximum(np.rint(costs * scale), 1).astype(np.int64)
    # hyperedges: per sequence, the query blocks that see its first k chunks (k >= 2), merged
    seqs, first, counts = np.unique(chunk_seq, return_index=True, return_counts=True)
    index = [0]
    pins = []
    ew = []
    for j, f, c in zip(seqs.tolist(), first.tolist(), counts.tolist()):
        a = anchors[j]
        if c < 2 or a.shape[0] == 0:
            continue
        seen = np.searchsorted(chunk_start[f:f + c], a, side="left")  # chunks starting before a
        ks, wk = np.unique(seen, return_counts=True)
        for k, wgt in zip(ks.tolist(), wk.tolist()):
            if k >= 2:
                pins.extend(range(f, f + k))
                index.append(len(pins))
                ew.append(int(wgt))
    if not ew:  # no query needs two chunks: balance only (one net over all vertices; a 1-pin net crashes)
        pins, index, ew = list(range(n)), [0, n], [1]
    hg = kahypar.Hypergraph(n, len(ew), index, pins, int(cp_size), ew, w.tolist())
    ctx = kahypar.Context()
    ctx.loadINIconfiguration(_config_file())
    ctx.setK(int(cp_size))
    ctx.setEpsilon(float(epsilon))
    ctx.setSeed(int(seed))
    ctx.suppressOutput(True)
    kahypar.partition(hg, ctx)
    return np.array([hg.blockID(i) for i in range(n)], dtype=np.int64)
