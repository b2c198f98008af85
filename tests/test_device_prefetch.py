"""megatron_splitkv.data.prefetch.DevicePrefetcher: the next item prepared one step ahead on request
(examples/pretrain_dflash.py --dflash-device-prefetch). Order kept, nothing dropped or repeated, errors and the
end of the source surface at the `next()` that needs the item, `prepare` runs exactly once per item and only
when asked; the flag's parsing."""

import argparse
import itertools
import random

import pytest

from megatron_splitkv.data.prefetch import DevicePrefetcher


class _Source:
    """A finite source that counts how many items were taken and can fail at a given index."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.taken, self.closed = n, fail_at, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken == self.fail_at:
            self.taken += 1
            raise ValueError(f"bad batch {self.fail_at}")
        if self.taken >= self.n:
            raise StopIteration
        self.taken += 1
        return self.taken - 1

    def close(self):
        self.closed = True


@pytest.mark.parametrize("seed", range(6))
def test_same_sequence_as_without_prefetch(seed):
    """Any interleaving of next() and prefetch() yields map(prepare, source) in order, each prepared once."""
    rng = random.Random(seed)
    n = rng.randint(0, 12)
    calls = []

    def prepare(x):
        calls.append(x)
        return ("dev", x * x)

    p = DevicePrefetcher(_Source(n), prepare)
    got = []
    while True:
        if rng.random() < 0.6:
            p.prefetch()
            if rng.random() < 0.3:
                p.prefetch()  # a second call before next() prepares nothing more
        try:
            got.append(next(p))
        except StopIteration:
            break
    assert got == [("dev", i * i) for i in range(n)]
    assert calls == list(range(n))
    with pytest.raises(StopIteration):  # stays ended
        next(p)


def test_prefetch_takes_exactly_one_item_ahead():
    src = _Source(5)
    p = DevicePrefetcher(src, lambda x: x)
    assert not p.ready and src.taken == 0  # nothing is taken before asked
    assert next(p) == 0 and src.taken == 1
    p.prefetch()
    assert p.ready and src.taken == 2
    p.prefetch()
    assert src.taken == 2
    assert next(p) == 1 and not p.ready and src.taken == 2
    assert list(p) == [2, 3, 4]


def test_error_in_prefetch_raised_at_the_next_that_needs_it():
    """A bad batch found while prefetching is raised by the next() of that batch (the step that uses it),
    unchanged; the items before it are delivered and the source goes on after it."""
    p = DevicePrefetcher(_Source(4, fail_at=1), lambda x: x)
    assert next(p) == 0
    p.prefetch()  # takes the failing item: no raise here
    assert p.ready
    with pytest.raises(ValueError, match="bad batch 1"):
        next(p)
    assert next(p) == 2  # the source goes on after the failing item (index 1), which it consumed


def test_error_in_prepare_deferred_too():
    def prepare(x):
        if x == 2:
            raise RuntimeError("upload failed")
        return x

    p = DevicePrefetcher(_Source(4), prepare)
    got = []
    for _ in range(2):
        got.append(next(p))
        p.prefetch()
    with pytest.raises(RuntimeError, match="upload failed"):
        next(p)
    assert got == [0, 1] and next(p) == 3


def test_end_of_source_during_prefetch():
    p = DevicePrefetcher(_Source(1), lambda x: x)
    assert next(p) == 0
    p.prefetch()  # the source ends here: no StopIteration from prefetch
    assert p.ready
    with pytest.raises(StopIteration):
        next(p)


def test_close_and_attributes_pass_through():
    src = _Source(3)
    src.num_workers = 2
    p = DevicePrefetcher(src, lambda x: x)
    assert p.num_workers == 2  # the source's descriptive attributes (pretrain_dflash.py logs them)
    p.prefetch()
    p.close()
    assert src.closed and not p.ready
    with pytest.raises(AttributeError):
        p.no_such_attribute
    with pytest.raises(ValueError, match="prepare"):
        DevicePrefetcher(src, prepare=None)


def test_endless_source_prefetch_never_runs_ahead_more_than_one():
    taken = itertools.count()
    p = DevicePrefetcher((next(taken) for _ in itertools.repeat(None)), lambda x: x)
    for i in range(50):
        assert next(p) == i
        p.prefetch()
    assert next(taken) == 51  # 50 delivered + one prepared ahead


def test_device_prefetch_flag():
    from megatron_splitkv.megatron.arguments import (
        DEVICE_PREFETCH_CHOICES,
        SplitKVArgumentError,
        add_splitkv_args,
        device_prefetch_from_args,
        validate_splitkv_args,
    )

    assert DEVICE_PREFETCH_CHOICES == ("on", "off")
    parser = add_splitkv_args(argparse.ArgumentParser())
    assert device_prefetch_from_args(parser.parse_args([])) is True  # default on
    assert device_prefetch_from_args(parser.parse_args(["--dflash-device-prefetch", "off"])) is False
    assert device_prefetch_from_args(parser.parse_args(["--dflash-device-prefetch", "on"])) is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--dflash-device-prefetch", "yes"])
    with pytest.raises(SplitKVArgumentError, match="--dflash-device-prefetch"):
        device_prefetch_from_args(argparse.Namespace(dflash_device_prefetch="maybe"))
    bad = parser.parse_args(["--context-parallel-impl", "splitkv"])
    bad.dflash_device_prefetch = 1
    with pytest.raises(SplitKVArgumentError, match="--dflash-device-prefetch"):
        validate_splitkv_args(bad, have_te=False)


def _stop_on(bad):
    def prepare(x):
        if x == bad:
            raise StopIteration("from prepare")
        return x
    return prepare


@pytest.mark.parametrize("ahead", [False, True])
def test_prepare_raising_stop_iteration_is_an_error_not_the_end(ahead):
    """A StopIteration raised by `prepare` (e.g. a `next()` on an exhausted iterator inside it) is an error of
    that item, not the end of the source: the iteration must not end silently after 2 of 5 items."""
    p = DevicePrefetcher(iter(range(5)), _stop_on(2))
    got = []
    with pytest.raises(RuntimeError, match="prepare raised StopIteration"):
        for _ in range(5):
            got.append(next(p))
            if ahead:
                p.prefetch()
    assert got == [0, 1]
    assert next(p) == 3  # the source was not ended: the next item comes
