"""Tensor- and data-parallel decoding on a ("data", "model") mesh of 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): greedy tokens equal one device's for
tensor parallel 2 and 4, data parallel 2 and 2 x 2, with 4 kv heads and with SmolLM2-like head
counts (9 query / 3 kv heads: padded to 12 / 4); the loaded parameters sit in their shards;
impossible meshes and batches raise."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import (Llama, LlamaConfig, PromptBatch, SamplingConfig, generate, generate_stream, init_params,
                    params_from_hf_state_dict)
from models.sampling import sample_keys
from models.sharded_llama import ShardedLlama
from models.sharding import make_mesh, padded_shapes, param_spec, shard_params
from helpers import tiny_config, tiny_state_dict

NEW = 5
MESHES = ((2, 1), (4, 1), (1, 2), (2, 2))   # (tensor_parallel, data_parallel)


def _state_dict(cfg, seed, scale):
    """Random weights; projections scaled so the layers, not the residual, decide the tokens."""
    sd = tiny_state_dict(cfg, seed=seed)
    return {k: v * scale if k.endswith("_proj.weight") else v for k, v in sd.items()}


def _case(name):
    rng = np.random.default_rng(5)
    if name == "kv4":   # 4 kv heads (no padding), a two-level prefix tree
        cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
        tok = lambda n: rng.integers(3, cfg["vocab_size"], n).tolist()  # noqa: E731
        pb = PromptBatch.two_level(tok(19), [tok(7), tok(12)], num_samples=2, suffixes=[tok(2), [], tok(1), tok(3)])
        sd = _state_dict(cfg, 1, 1.0)
    else:               # SmolLM2-like heads, tied embedding; FFN width and vocabulary padded at tp=4
        cfg = tiny_config(num_attention_heads=9, num_key_value_heads=3, vocab_size=98, intermediate_size=90,
                          tie_word_embeddings=True)
        tok = lambda n: rng.integers(3, cfg["vocab_size"], n).tolist()  # noqa: E731
        pb = PromptBatch.shared(tok(20), suffixes=[tok(2), tok(1)], num_samples=2)
        sd = _state_dict(cfg, 2, 3.0)
    config = LlamaConfig(**cfg)
    return config, sd, pb


@pytest.fixture(scope="module", params=["kv4", "kv3"])
def case(request):
    config, sd, pb = _case(request.param)
    model = Llama(config)
    params = params_from_hf_state_dict(config, sd, jnp.float32)
    base = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=())
    # a meaningful reference: the rows and the steps differ
    assert len({tuple(r) for r in base.tokens}) >= 2
    assert all(len(set(r)) >= 3 for r in base.tokens.tolist())
    return config, model, params, pb, base


@pytest.mark.parametrize("tp,dp", MESHES)
def test_greedy_tokens_equal_one_device(case, tp, dp):
    config, model, params, pb, base = case
    mesh = make_mesh(tp, dp)
    out = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), mesh=mesh)
    np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_allclose(out.logprobs, base.logprobs, atol=2e-5)
    # the cache is split by sequences and kv heads (padded to a multiple of tp)
    k = out.cache.layers["k"]
    shapes = padded_shapes(config, tp)
    assert k.shape[-2] == shapes.heads_kv
    assert k.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", None, "model", None)), k.ndim)
    assert {s.data.shape[-2] for s in k.addressable_shards} == {shapes.heads_kv // tp}
    assert {s.data.shape[1] for s in k.addressable_shards} == {pb.batch // dp}


@pytest.mark.parametrize("case", ["kv3"], indirect=True)
def test_sampling_flat_cache_and_stream_on_2x2(case):
    """Temperature sampling, alone and with top-k and top-p, draws one device's tokens; the flat cache layout and the step-by-step
    stream decode one device's greedy tokens."""
    _, model, params, pb, base = case
    mesh = make_mesh(2, 2)
    hot = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
    keys = sample_keys(3, np.arange(pb.batch), np.zeros(pb.batch))
    want = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=hot, keys=keys)
    got = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=hot, keys=keys, mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert (want.tokens != base.tokens).any()
    nucleus = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)   # top-k and top-p on a mesh
    want = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=nucleus, keys=keys)
    got = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), sampling=nucleus, keys=keys, mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    flat = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), attention="flat", mesh=mesh)
    np.testing.assert_array_equal(flat.tokens, base.tokens)
    steps = list(generate_stream(model, params, pb, max_new_tokens=NEW, eos_token_ids=(), logprobs=True, mesh=mesh))
    np.testing.assert_array_equal(np.stack([t for t, _ in steps], axis=1), base.tokens)
    np.testing.assert_allclose(np.stack([lp for _, lp in steps], axis=1), base.logprobs, atol=2e-5)


def _padded(host, shape):
    out = np.zeros(shape, host.dtype)
    out[tuple(slice(0, n) for n in host.shape)] = host
    return out


def test_loaded_params_sit_in_their_shards():
    """Every split parameter is placed block by block: each device holds 1/tp of it (padded heads,
    FFN columns and vocabulary rows are zeros), replicated ones (norms) are whole everywhere."""
    config, sd, _ = _case("kv3")
    whole = params_from_hf_state_dict(config, sd, jnp.float32)
    mesh = make_mesh(4, 1)
    placed = params_from_hf_state_dict(config, sd, jnp.bfloat16, mesh=mesh)
    assert jax.tree_util.tree_structure(placed) == jax.tree_util.tree_structure(whole)
    shapes = padded_shapes(config, 4)
    assert (shapes.heads_q, shapes.heads_kv, shapes.intermediate, shapes.vocab) == (12, 4, 92, 100)
    flat_whole = dict(jax.tree_util.tree_leaves_with_path(whole))
    for path, x in jax.tree_util.tree_leaves_with_path(placed):
        name = str(path[-1].key)
        assert x.dtype == jnp.bfloat16
        assert x.sharding.spec == param_spec(name, x.ndim), name
        pad = shapes.padded_axis(name, config)
        blocks = [s.data.shape for s in x.addressable_shards]
        assert len(blocks) == 4
        if pad is None:
            assert all(b == x.shape for b in blocks), name
        else:
            axis = pad[0] % x.ndim
            assert x.shape[axis] == pad[2], name
            assert all(b[axis] == pad[2] // 4 and b[:axis] + b[axis + 1:] == x.shape[:axis] + x.shape[axis + 1:]
                       for b in blocks), name
        want = _padded(np.asarray(flat_whole[path]).astype(jnp.bfloat16), x.shape)
        np.testing.assert_array_equal(np.asarray(x), want, err_msg=name)
    # already placed parameters are kept; a list layout is placed per layer
    assert shard_params(config, placed, mesh)["layers"]["wq"] is placed["layers"]["wq"]
    listed = shard_params(config, {**whole, "layers": [jax.tree_util.tree_map(lambda a, i=i: a[i], whole["layers"])
                                                        for i in range(config.num_hidden_layers)]}, mesh)
    assert listed["layers"][1]["wo"].sharding.spec == P("model", None)
    np.testing.assert_array_equal(np.asarray(listed["layers"][1]["wo"])[:144], np.asarray(whole["layers"]["wo"][1]))


def test_impossible_meshes_and_batches_raise():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {2 * n} devices, but only {n}"):
        make_mesh(n, 2)
    with pytest.raises(ValueError, match="needs 3 devices, but only 2"):
        make_mesh(3, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        make_mesh(0)
    with pytest.raises(ValueError, match="data_parallel must be an int >= 1"):
        make_mesh(1, 1.5)
    config, sd, pb = _case("kv4")
    model = Llama(config)
    with pytest.raises(ValueError, match="mesh axes must be"):
        ShardedLlama(model, Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("x", "y")))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        ShardedLlama(model, "mesh")
    with pytest.raises(ValueError, match="shared_impl='tree'"):
        ShardedLlama(Llama(config, shared_impl="tree"), make_mesh(2))
    odd = PromptBatch(levels=pb.levels[:1], suffixes=pb.suffixes[:3])
    with pytest.raises(ValueError, match=r"batch \(3 sequences\) must be a multiple of data_parallel \(2\)"):
        generate(model, params_from_hf_state_dict(config, sd), odd, max_new_tokens=2, mesh=make_mesh(1, 2))


@pytest.mark.gpu
@pytest.mark.two_gpus
def test_two_gpus_match_one_at_llama8b_layer_shapes():
    """2 GPUs (the kernels run per shard inside shard_map): Llama-3.1-8B layer and vocabulary
    shapes (2 layers, float32 random weights), B = 8 over a shared 1K-token prefix: tp 2 and dp 2
    give one GPU's greedy tokens and log-probabilities."""
    config = LlamaConfig.preset("Llama-3.1-8B").replace(num_hidden_layers=2)
    params = init_params(config, jax.random.PRNGKey(0), jnp.float32, std=0.05)
    model = Llama(config)
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(0, config.vocab_size, n).tolist()  # noqa: E731
    pb = PromptBatch.shared(tok(1024), suffixes=[tok(5), tok(3), tok(9), tok(1)], num_samples=2)
    base = generate(model, params, pb, max_new_tokens=8, eos_token_ids=())
    assert len({tuple(r) for r in base.tokens}) >= 2
    for tp, dp in ((2, 1), (1, 2)):
        out = generate(model, params, pb, max_new_tokens=8, eos_token_ids=(), mesh=make_mesh(tp, dp))
        np.testing.assert_array_equal(out.tokens, base.tokens, err_msg=f"tp={tp} dp={dp}")
        np.testing.assert_allclose(out.logprobs, base.logprobs, atol=2e-3, err_msg=f"tp={tp} dp={dp}")
