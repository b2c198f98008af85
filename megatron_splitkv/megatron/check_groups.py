"""Gloo mirrors of the context-parallel groups: the host-side groups of the ops' per-call rank agreement.

Every op call with group-wide checks exchanges one [1, 12] int64 verdict row over its CP group before its first
data collective (`ops.agreement.check_call`). Over an NCCL CP group that is a device tensor, a collective on the
compute stream and a host read that waits for everything queued on the stream, at every layer. All the row's
values are known on the host, so the ops take a `check_group` (`prepare_splitkv_metadata(..., check_group=)`,
`SplitKVMetadata.bind(..., check_group=)`, the ops' keyword): a gloo group with the CP group's ranks, over which
the rows travel as CPU tensors while the GPU keeps running (docs/lab/agreement_cost.md).

Megatron-Core 0.19's `parallel_state` creates gloo groups for data parallelism but none for context parallelism.
`create_cp_check_groups` creates one per CP group at start-up and `cp_check_group` returns this rank's to the
layers (`SplitKVCoreAttention`, the target's `CausalCPCoreAttention`) and to the step's `bind`.

Source: issue 24 item 2; torch.distributed's `new_group` contract (every rank creates every group, in the same
order), as `megatron.core.parallel_state.initialize_model_parallel` does.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["create_cp_check_groups", "cp_check_group"]

#: (default group object, the CP group's global ranks) -> this rank's gloo mirror of that CP group
_CHECK_GROUPS: dict = {}
#: (default group object, CP group object) -> its mirror: `cp_check_group`'s per-call lookup
_BY_CP_GROUP: dict = {}


def _cp_ranks(cp_group) -> tuple:
    """The global ranks of `cp_group` (None: the default group) in its rank order."""
    if cp_group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(cp_group))


def create_cp_check_groups(cp_group=None, *, timeout=None):
    """Create a gloo mirror of every CP group of the job (once) and return this rank's: a gloo ProcessGroup with
    the global ranks of `cp_group` (None: the default group), in its rank order, for the ops' `check_group`.

    Collective over the default group: every rank calls it once at start-up, after the CP groups exist (e.g.
    after `parallel_state.initialize_model_parallel`, in the model provider) with its own CP group. The CP
    groups' rank lists are all-gathered (`all_gather_object`), deduplicated and sorted, and every rank creates
    every group of two or more ranks with `torch.distributed.new_group(ranks, backend="gloo")` in that order
    (torch's contract for `new_group`). A later call with a CP group of the same ranks returns the same group
    without communicating (every rank must then be in the same case: call it the same number of times on
    every rank).

    Returns None where there is nothing to check: torch.distributed not initialised, or a CP group of one rank.

    Raises:
        ValueError (on every rank, the same message, before any group is created): the ranks' CP groups do not
        partition the default group (a rank in two different CP groups: each rank must pass its own CP group of
        one CP layout), or a CP group does not rank its members by global rank (a mirror could not follow it).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = _cp_ranks(cp_group)
    key = (dist.group.WORLD, mine)
    if key in _CHECK_GROUPS:
        return _CHECK_GROUPS[key]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    layout = sorted(set(everyone))
    seen = [r for ranks in layout for r in ranks]
    if sorted(seen) != list(range(dist.get_world_size())):
        raise ValueError("create_cp_check_groups: the ranks' CP groups must partition the default group (each rank "
                         f"passes its own CP group of one layout); got {everyone} by rank")
    if any(list(ranks) != sorted(ranks) for ranks in layout):  # new_group ranks its members by global rank
        raise ValueError("create_cp_check_groups: a gloo mirror ranks its members by global rank, so every CP group "
                         f"must too; got {everyone} by rank")
    own = None
    for ranks in layout:
        if len(ranks) < 2:  # a CP group of one rank exchanges nothing
            continue
        group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if ranks == mine:
            own = group
    _CHECK_GROUPS[key] = own
    return own


def cp_check_group(cp_group=None):
    """This rank's gloo mirror of `cp_group` (None: the default group) made by `create_cp_check_groups`, or None
    when none was made (then the ops exchange their verdict rows over the CP group itself, as before)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = (dist.group.WORLD, cp_group)  # the layers ask at every call: the rank list is read once per group
    if key not in _BY_CP_GROUP:
        mirror = _CHECK_GROUPS.get((dist.group.WORLD, _cp_ranks(cp_group)))
        if mirror is None:
            return None  # not made (yet): asked again next time
        _BY_CP_GROUP[key] = mirror
    return _BY_CP_GROUP[key]
