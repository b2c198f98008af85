"""Context-parallel planning for Split-KV: LPT load balancing and baselines (docs/lpt.md)."""

from .cost import CostModel, chunk_pair_counts, chunk_window_pair_counts
from .plan import MAX_TOKENS, STRATEGIES, Plan, auto_chunk_size, plan_context_parallel

__all__ = ["CostModel", "MAX_TOKENS", "Plan", "STRATEGIES", "auto_chunk_size", "chunk_pair_counts",
           "chunk_window_pair_counts", "plan_context_parallel"]
