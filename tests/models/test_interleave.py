"""Interleaved micro-batches (:mod:`models.interleave`): a decode step of two groups, run layer
by layer on a tensor-parallel mesh of CPU devices, equals ordinary decode steps of each group
alone; on one device the groups equal :meth:`models.llama.Llama.extend`; prefixes with several
nodes per level are refused."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from models import Llama, LlamaConfig, params_from_hf_state_dict
from models.interleave import Group, extend_groups
from models.kv_cache import KVCache, PrefixCache
from models.sharded_llama import ShardedLlama
from models.sharding import make_mesh
from helpers import tiny_config, tiny_state_dict

VOCAB = 98


def _random_prefix(rng, cfg, layers, p):
    shape = (1, p, cfg.num_key_value_heads, cfg.head_dim)
    kv = [{"k": (jnp.asarray(rng.standard_normal(shape), jnp.float32),),
           "v": (jnp.asarray(rng.standard_normal(shape), jnp.float32),)} for _ in range(layers)]
    return PrefixCache(layers=kv, lengths=(jnp.array([p], jnp.int32),), last_logits=None)


def _random_suffix(rng, cfg, layers, b, s):
    shape = (b, s, cfg.num_key_value_heads, cfg.head_dim)
    return [{"k": jnp.asarray(rng.standard_normal(shape), jnp.float32),
             "v": jnp.asarray(rng.standard_normal(shape), jnp.float32)} for _ in range(layers)]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB)
    config = LlamaConfig(**cfg)
    model = Llama(config)
    params = params_from_hf_state_dict(config, tiny_state_dict(cfg, seed=2), jnp.float32)
    return config, model, params


def test_groups_on_a_mesh_equal_each_group_alone(setup):
    config, model, params = setup
    sm = ShardedLlama(model, make_mesh(2, 1))
    pp = sm.place_params(sm.params_in_layout(params, stacked=False))
    rng = np.random.default_rng(0)
    nl = config.num_hidden_layers
    prefix = _random_prefix(rng, config, nl, 11)
    layers = tuple(_random_suffix(rng, config, nl, 4, 6) for _ in range(2))
    lengths = (jnp.array([3, 0, 2, 5], jnp.int32), jnp.array([1, 4, 2, 3], jnp.int32))
    pos = (jnp.full((4,), 11, jnp.int32),) * 2
    tokens = tuple(jnp.asarray(rng.integers(3, VOCAB, 4), jnp.int32) for _ in range(2))
    step = jax.jit(lambda pp, prefix, layers, lengths, pos, tok: sm.decode_step_groups(pp, prefix, layers, lengths,
                                                                                        pos, tok))
    args = (pp, prefix, layers, lengths, pos, tokens)
    compiled = step.lower(*args).compile()
    logits, new_layers, new_lengths = compiled(*args)
    one = jax.jit(sm.decode_step)
    for m in range(2):
        cache = KVCache(prefix=prefix, layers=layers[m], lengths=lengths[m], pos_offset=pos[m], backend="shared")
        want_logits, want = one(pp, cache, tokens[m])
        np.testing.assert_allclose(logits[m], want_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(new_lengths[m], want.lengths)
        for got_l, want_l in zip(new_layers[m], want.layers):
            np.testing.assert_allclose(got_l["k"], want_l["k"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_l["v"], want_l["v"], rtol=1e-5, atol=1e-6)


def test_groups_on_one_device_equal_extend(setup):
    _, model, params = setup
    rng = np.random.default_rng(1)
    prefix = model.prefill_prefixes(params, (jnp.asarray(rng.integers(3, VOCAB, (1, 9))),), (jnp.array([9]),))
    groups, want = [], []
    for b in (2, 3):
        _, cache = model.prefill(params, prefix, jnp.asarray(rng.integers(3, VOCAB, (b, 2))), jnp.full((b,), 2),
                                 capacity=6)
        tok = jnp.asarray(rng.integers(3, VOCAB, (b, 1)))
        groups.append(Group(cache.layers, cache.lengths, cache.pos_offset, tok, jnp.ones((b,), jnp.int32)))
        want.append(model.extend(params, prefix, cache.layers, cache.lengths, cache.pos_offset, tok,
                                 jnp.ones((b,), jnp.int32), backend="shared"))
    logits, layers, lengths = extend_groups(model, params, prefix, tuple(groups), backend="shared")
    for m, (w_logits, w_layers, w_lengths) in enumerate(want):
        np.testing.assert_allclose(logits[m], w_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(lengths[m], w_lengths)
        np.testing.assert_allclose(layers[m]["k"], w_layers["k"], rtol=1e-5, atol=1e-6)


def test_prefix_of_several_nodes_is_refused(setup):
    _, model, params = setup
    rng = np.random.default_rng(2)
    prefix = model.prefill_prefixes(params, (jnp.asarray(rng.integers(3, VOCAB, (2, 5))),), (jnp.array([5, 4]),))
    _, cache = model.prefill(params, prefix, jnp.asarray(rng.integers(3, VOCAB, (2, 1))), jnp.ones((2,)),
                             capacity=3)
    g = Group(cache.layers, cache.lengths, cache.pos_offset, jnp.ones((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"one node each .* levels of \(2,\) nodes"):
        extend_groups(model, params, prefix, (g,), backend="shared")
    with pytest.raises(ValueError, match="backend must be 'shared' or 'none'"):
        extend_groups(model, params, prefix, (g,), backend="flat")
