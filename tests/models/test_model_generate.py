"""Greedy generation equals transformers' generate for the "shared" and "flat" backends, for a
batch with one shared prefix and a two-level batch; EOS handling; prefix-cache reuse; sampling."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import (Llama, PromptBatch, SamplingConfig, generate, generate_stream, load_hf_checkpoint,  # noqa: E402
                    prefill_prefix_cache, unstack_layers)
from models.sampling import sample_keys  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gen")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.1, rms_norm_eps=1e-6)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    config, params = load_hf_checkpoint(path, jnp.float32)
    return hf, Llama(config), params


def hf_greedy(hf, prompt, n=NEW):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _batches():
    rng = np.random.default_rng(7)
    tok = lambda n: rng.integers(3, 300, n).tolist()  # noqa: E731
    shared = PromptBatch.shared(tok(30), suffixes=[tok(3), tok(5)], num_samples=2)
    two_level = PromptBatch.two_level(tok(20), [tok(7), tok(12)], num_samples=2,
                                      suffixes=[tok(2), [], tok(1), tok(3)])
    return {"shared_prefix": shared, "two_level": two_level}


BATCHES = _batches()


@pytest.mark.parametrize("kind", list(BATCHES))
def test_greedy_matches_transformers(setup, kind):
    hf, model, params = setup
    pb = BATCHES[kind]
    want = np.asarray([hf_greedy(hf, pb.full_prompt(b)) for b in range(pb.batch)])
    for attention in ("shared", "flat"):
        out = generate(model, params, pb, max_new_tokens=NEW, attention=attention, eos_token_ids=())
        np.testing.assert_array_equal(out.tokens, want, err_msg=f"{kind} {attention}")
        np.testing.assert_array_equal(out.lengths, np.full(pb.batch, NEW))
    # several distinct continuations actually happened (not a degenerate constant output)
    assert len({tuple(r) for r in want}) >= 2


def test_eos_handling(setup):
    """Rows stop at their first EOS (included in lengths), are padded afterwards, others go on."""
    _, model, params = setup
    pb = BATCHES["two_level"]
    free = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=()).tokens
    eos = int(free[0, 2])
    out = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(eos,), pad_token_id=299)
    for b in range(pb.batch):
        hits = np.flatnonzero(free[b] == eos)
        n = hits[0] + 1 if hits.size else NEW
        assert out.lengths[b] == n
        np.testing.assert_array_equal(out.tokens[b, :n], free[b, :n])
        assert (out.tokens[b, n:] == 299).all()
    assert out.lengths[0] == 3 and out.lengths.max() > 3  # row 0 stopped, some row went on
    # finished rows stopped writing the cache: suffix length = prompt suffix + tokens fed back
    # (every generated token but the last one, EOS or not)
    fed = out.lengths - 1
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), pb.suffix_lengths() + fed)


def test_prefix_cache_reuse_list_layout_and_stream(setup):
    """A prefilled PrefixCache serves two later batches; list-of-layers params give the same
    tokens as stacked ones; the streaming variant yields the same tokens."""
    _, model, params = setup
    pb = BATCHES["shared_prefix"]
    base = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=()).tokens
    pc = prefill_prefix_cache(model, params, pb)
    rng = np.random.default_rng(11)
    other = PromptBatch(levels=pb.levels, suffixes=[rng.integers(3, 300, len(s)).tolist() for s in pb.suffixes])
    for batch, want in ((pb, base), (other, generate(model, params, other, max_new_tokens=NEW,
                                                          eos_token_ids=()).tokens)):
        got = generate(model, params, batch, max_new_tokens=NEW, eos_token_ids=(), prefix_cache=pc).tokens
        np.testing.assert_array_equal(got, want)
    listed = generate(model, unstack_layers(params), pb, max_new_tokens=NEW, eos_token_ids=()).tokens
    np.testing.assert_array_equal(listed, base)
    streamed = np.stack(list(generate_stream(model, params, pb, max_new_tokens=NEW, eos_token_ids=())), axis=1)
    np.testing.assert_array_equal(streamed, base)
    with pytest.raises(ValueError, match="level sizes"):
        generate(model, params, BATCHES["two_level"], max_new_tokens=2, prefix_cache=pc)


def test_sampling_paths(setup):
    """top_k=1 sampling == greedy; same key -> same samples; temperature sampling differs by key;
    the "none" backend runs (functionally wrong by design) and differs from exact attention."""
    _, model, params = setup
    pb = BATCHES["shared_prefix"]
    greedy = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=()).tokens
    k1 = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(),
                  sampling=SamplingConfig(temperature=0.7, top_k=1), key=jax.random.PRNGKey(5)).tokens
    np.testing.assert_array_equal(k1, greedy)
    hot = SamplingConfig(temperature=5.0, top_p=0.95)
    a = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=hot, key=jax.random.PRNGKey(1))
    b = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=hot, key=jax.random.PRNGKey(1))
    c = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=hot, key=jax.random.PRNGKey(2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    # the two samples of each suffix (same prompt, different per-sequence keys) differ
    assert (a.tokens[0] != a.tokens[1]).any()
    none = generate(model, params, pb, max_new_tokens=NEW, attention="none", eos_token_ids=()).tokens
    assert none.shape == greedy.shape and ((none >= 0) & (none < 300)).all()
    assert (none != greedy).any()


def test_keys_stream_and_logprobs(setup):
    """Per-sequence ``keys``: a group run alone (keys of its rows) gives the tokens it gets in
    the whole batch; the step-by-step stream gives the fused loop's tokens and log-probs;
    ``backend=`` is an alias of ``attention=``."""
    _, model, params = setup
    pb = BATCHES["two_level"]
    hot = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
    keys = sample_keys(4, [0, 0, 1, 1], [0, 1, 0, 1])
    kw = dict(max_new_tokens=NEW, eos_token_ids=(), sampling=hot)
    full = generate(model, params, pb, keys=keys, **kw)
    assert (full.tokens[0] != full.tokens[1]).any()
    group1 = PromptBatch(levels=((pb.levels[0][0],), (pb.levels[1][1],)), suffixes=pb.suffixes[2:])
    alone = generate(model, params, group1, keys=keys[2:], **kw)
    np.testing.assert_array_equal(alone.tokens, full.tokens[2:])
    steps = list(generate_stream(model, params, pb, keys=keys, logprobs=True, **kw))
    np.testing.assert_array_equal(np.stack([t for t, _ in steps], axis=1), full.tokens)
    np.testing.assert_allclose(np.stack([lp for _, lp in steps], axis=1), full.logprobs, atol=1e-5)
    assert (full.logprobs < 0).all() and (full.logprobs > -30).all()
    with pytest.raises(ValueError, match="not both"):
        generate(model, params, pb, keys=keys, key=jax.random.PRNGKey(0), **kw)
