"""Plain batches (no shared prefix) with stacked and list-of-layers parameters.

With stacked parameters a plain batch runs ``jax.vmap`` over an empty prefix cache (no array to
infer the layer count from: it is passed explicitly).  Greedy tokens must equal a naive full-recompute greedy loop (``Llama.forward`` over the
whole sequence at every step) for both backends and both layer layouts.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Llama, LlamaConfig, PromptBatch, generate, init_params, prefill_prefix_cache, unstack_layers
from models.generate import resolve_layout

CFG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
NEW = 6


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(4), jnp.float32, std=0.3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 9, 1, 6)]
    model = Llama(CFG)
    # naive greedy: recompute every whole sequence at every step.  Sequences are right-padded to
    # one length (one compile); causal attention makes column len-1 independent of the padding.
    fwd = jax.jit(model.forward)
    lens = np.asarray([len(p) for p in prompts])
    seqs = np.full((len(prompts), max(lens) + NEW), 7, np.int32)
    for b, p in enumerate(prompts):
        seqs[b, :len(p)] = p
    for i in range(NEW):
        logits = np.asarray(fwd(params, seqs))
        rows = np.arange(len(prompts))
        seqs[rows, lens + i] = logits[rows, lens + i - 1].argmax(-1)
    want = np.stack([seqs[b, lens[b]:lens[b] + NEW] for b in range(len(prompts))])
    return model, params, PromptBatch.plain(prompts), want


@pytest.mark.parametrize("layout", ["stacked", "list"])
def test_plain_batch_greedy_matches_full_recompute(setup, layout):
    model, params, pb, want = setup
    if layout == "list":
        params = unstack_layers(params)
    assert len({tuple(r) for r in want}) >= 2  # not a degenerate constant continuation
    for backend in ("flat", "shared"):
        out = generate(model, params, pb, max_new_tokens=NEW, attention=backend, eos_token_ids=())
        np.testing.assert_array_equal(out.tokens, want, err_msg=f"{layout} {backend}")
        np.testing.assert_array_equal(out.lengths, np.full(pb.batch, NEW))
        np.testing.assert_array_equal(np.asarray(out.cache.lengths), pb.suffix_lengths() + NEW - 1)


def test_layout_option_and_prefix_cache_conversion(setup):
    """layout="list" on stacked params (the GPU default of layout="auto") gives the stacked
    tokens, also with a prefix cache prefilled in the stacked layout; conversion is cached."""
    model, params, _, _ = setup
    rng = np.random.default_rng(8)
    pb = PromptBatch.shared(rng.integers(0, CFG.vocab_size, 11).tolist(),
                            suffixes=[rng.integers(0, CFG.vocab_size, n).tolist() for n in (2, 0, 4)])
    base = generate(model, params, pb, max_new_tokens=NEW, layout="stacked", eos_token_ids=())
    pc = prefill_prefix_cache(model, params, pb, layout="stacked")
    out = generate(model, params, pb, max_new_tokens=NEW, layout="list", prefix_cache=pc, eos_token_ids=())
    np.testing.assert_array_equal(out.tokens, base.tokens)
    assert isinstance(out.cache.layers, list) and not isinstance(base.cache.layers, list)
    assert len({tuple(r) for r in base.tokens}) >= 2
    listed = resolve_layout(model, params, "list")
    assert resolve_layout(model, params, "list") is listed  # converted once
    assert resolve_layout(model, listed, "auto") is listed
    if jax.default_backend() != "gpu":
        assert resolve_layout(model, params, "auto") is params
    with pytest.raises(ValueError, match="layout must be one of"):
        generate(model, params, pb, max_new_tokens=2, layout="paged")


def test_tree_attention_option_matches_levels(setup, monkeypatch):
    """Llama(shared_impl="tree") (levels + suffix through jax_prefix_attn.tree_attention) gives
    the default path's logits and greedy tokens on a two-level batch with ragged nodes."""
    import jax_prefix_attn  # noqa: PLC0415
    calls = []
    real = jax_prefix_attn.tree_attention
    monkeypatch.setattr(jax_prefix_attn, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, params, _, _ = setup
    rng = np.random.default_rng(9)
    tok = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    pb = PromptBatch.two_level(tok(13), [tok(5), tok(9)], num_samples=2, suffixes=[tok(2), [], tok(3), tok(1)])
    tree_model = Llama(CFG, shared_impl="tree")
    base = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=())
    got = generate(tree_model, params, pb, max_new_tokens=NEW, eos_token_ids=())
    np.testing.assert_array_equal(got.tokens, base.tokens)
    assert len({tuple(r) for r in base.tokens}) >= 2
    assert calls  # the tree path was really taken
    pc = prefill_prefix_cache(tree_model, params, pb)
    assert pc.tree_nodes == ((13,), (5, 9))
    toks, n = pb.suffix_arrays()
    logits_t, cache_t = tree_model.prefill_jit(params, pc, toks, n, capacity=8, backend="shared")
    logits_l, cache_l = model.prefill_jit(params, prefill_prefix_cache(model, params, pb), toks, n,
                                          capacity=8, backend="shared")
    assert np.isfinite(np.asarray(logits_t)).all()
    np.testing.assert_allclose(np.asarray(logits_t), np.asarray(logits_l), rtol=2e-5, atol=2e-5)
    for name in ("k", "v"):  # the continuations wrote the same keys/values
        np.testing.assert_allclose(np.asarray(cache_t.layers[name]), np.asarray(cache_l.layers[name]),
                                   rtol=2e-5, atol=2e-5)


def test_long_prefix_level_is_stored_aligned(setup):
    """A prefix longer than ``PREFIX_ALIGN`` is stored with its length rounded up (masked rows,
    so the Mosaic GPU prefix kernel applies); the shared backend's greedy tokens equal a naive
    full recompute of each whole sequence."""
    from models.llama import PREFIX_ALIGN
    model, params, _, _ = setup
    rng = np.random.default_rng(9)
    prefix = rng.integers(0, CFG.vocab_size, PREFIX_ALIGN + 13).tolist()
    sufs = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 1)]
    pb = PromptBatch.shared(prefix, suffixes=sufs)
    pc = prefill_prefix_cache(model, params, pb, layout="stacked")
    assert pc.layers["k"][0].shape[2] == 2 * PREFIX_ALIGN       # [L, G, P', Hkv, D]
    np.testing.assert_array_equal(np.asarray(pc.lengths[0]), [PREFIX_ALIGN + 13])
    out = generate(model, params, pb, max_new_tokens=NEW, attention="shared", prefix_cache=pc, eos_token_ids=())
    fwd = jax.jit(model.forward)
    for b, s in enumerate(sufs):
        seq = list(prefix) + list(s)
        for _ in range(NEW):
            seq.append(int(np.asarray(fwd(params, np.asarray([seq], np.int32)))[0, -1].argmax()))
        np.testing.assert_array_equal(out.tokens[b], seq[-NEW:], err_msg=f"sequence {b}")
