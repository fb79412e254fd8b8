"""Bad input raises ValueError naming the numbers, before anything is compiled; strict weight loading."""
import numpy as np
import pytest

import jax.numpy as jnp

from models import Llama, LlamaConfig, PromptBatch, generate, params_from_hf_state_dict
from models.weights import hf_param_shapes, load_hf_checkpoint

CFG = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def _gen(pb, **kw):
    # params=None: if validation did not raise first, generate would fail on the params instead
    kw.setdefault("max_new_tokens", 4)
    return generate(Llama(CFG), None, pb, **kw)


@pytest.mark.parametrize("pb,kw,match", [
    (PromptBatch.shared(list(range(10)), [[1, 2, 3]]), dict(capacity=6),
     r"prompt \(suffix: 3 tokens\) \+ max_new_tokens \(4\) = 7 exceeds the cache capacity 6"),
    (PromptBatch.shared(list(range(10)), [[1, 2, 3]]), dict(capacity=16, attention="flat"),
     r"prefix path \+ suffix: 13 tokens\) \+ max_new_tokens \(4\) = 17 exceeds the cache capacity 16"),
    (PromptBatch.plain([[1, 2], []]), {}, "empty prompt: sequence 1 has 0 tokens"),
    (PromptBatch.shared([], [[1]]), {}, "empty prompt: prefix node 0 of level 0 has 0 tokens"),
    (PromptBatch.plain([[1, 300]]), {}, r"token id 300 in suffixes\[0\] is outside the vocabulary \[0, 300\)"),
    (PromptBatch.shared([5, -1], [[1]]), {}, r"token id -1 in levels\[0\]\[0\] is outside"),
    (PromptBatch(levels=(([1],), ([2], [3])), suffixes=[[1]] * 3), {},
     "3 sequences cannot be split evenly over the 2 nodes"),
    (PromptBatch(levels=(([1], [2]), ([2], [3], [4])), suffixes=[[1]] * 3), {},
     "level 1 has 3 nodes, not a multiple of the 2 nodes of level 0"),
    (PromptBatch.plain([[1]]), dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (PromptBatch.plain([[1]]), dict(attention="paged"), "attention must be one of"),
])
def test_generate_rejects_before_compiling(pb, kw, match):
    with pytest.raises(ValueError, match=match):
        _gen(pb, **kw)


def test_prompt_batch_rejects_non_tokens():
    with pytest.raises(ValueError, match="1-D sequence of integer token ids"):
        PromptBatch.plain([[1.5, 2.0]])


def _state(cfg=CFG):
    rng = np.random.default_rng(0)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in hf_param_shapes(cfg).items()}


def test_state_dict_round_trip_and_strictness():
    sd = _state()
    params = params_from_hf_state_dict(CFG, sd, jnp.float32)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1]), sd["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), sd["lm_head.weight"].T)
    assert params["layers"]["w_down"].shape == (2, 128, 64)
    bf = params_from_hf_state_dict(CFG, sd, jnp.bfloat16)
    assert bf["embed"].dtype == jnp.bfloat16

    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \(1\): \['model.layers.1.mlp.up_proj.weight'\]"):
        params_from_hf_state_dict(CFG, missing)
    extra = dict(sd, **{"model.layers.2.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"]})
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): \['model.layers.2.mlp.up_proj.weight'\]"):
        params_from_hf_state_dict(CFG, extra)
    wrong = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(ValueError, match=r"k_proj.weight: got \(64, 64\), expected \(32, 64\)"):
        params_from_hf_state_dict(CFG, wrong)
    # tied embeddings: lm_head.weight is optional (ignored when present); old rotary buffers ignored
    tied = CFG.replace(tie_word_embeddings=True)
    p_tied = params_from_hf_state_dict(tied, dict(sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8)}))
    assert "lm_head" not in p_tied
    del sd["lm_head.weight"]
    assert "lm_head" not in params_from_hf_state_dict(tied, sd)
    with pytest.raises(ValueError, match="missing tensors"):
        params_from_hf_state_dict(CFG, sd)


def test_sharded_checkpoint_loads_like_single(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    c1, p1 = load_hf_checkpoint(tmp_path / "single")
    c2, p2 = load_hf_checkpoint(tmp_path / "sharded")
    assert c1 == c2
    for a, b in zip(jax_leaves(p1), jax_leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(p1["layers"]["wo"][0]),
                               hf.model.layers[0].self_attn.o_proj.weight.detach().numpy().T)
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_checkpoint(tmp_path / "nope")


def jax_leaves(tree):
    import jax  # noqa: PLC0415
    return jax.tree_util.tree_leaves(tree)


def test_cache_pytrees_and_abstract_shapes():
    import jax  # noqa: PLC0415

    from models.kv_cache import abstract_kv_cache, empty_prefix_cache, init_kv_cache  # noqa: PLC0415
    for stacked in (True, False):
        prefix = empty_prefix_cache(CFG, jnp.float32, stacked=stacked)
        cache = init_kv_cache(CFG, prefix, 4, 10, jnp.bfloat16, backend="none", stacked=stacked)
        abstract = abstract_kv_cache(CFG, prefix, 4, 10, jnp.bfloat16, backend="none", stacked=stacked)
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        assert [l.shape for l in leaves] == [a.shape for a in jax.tree_util.tree_leaves(abstract)]
        # k and v (stacked, or one pair per layer) + lengths + pos_offset; the empty prefix has no leaf
        assert len(leaves) == (2 if stacked else 2 * CFG.num_hidden_layers) + 2
        assert cache.capacity == 10 and cache.batch == 4
        assert jax.tree_util.tree_unflatten(treedef, leaves).backend == "none"  # static metadata
        if stacked:
            assert cache.layers["k"].shape == (2, 4, 10, 2, 16) and cache.layers["k"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="backend must be one of"):
        init_kv_cache(CFG, prefix, 4, 10, jnp.float32, backend="paged")


def test_layer_layout_mismatch_is_reported():
    import jax  # noqa: PLC0415

    from models import init_params  # noqa: PLC0415
    from models.kv_cache import empty_prefix_cache, init_kv_cache  # noqa: PLC0415
    params = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)  # stacked
    prefix = empty_prefix_cache(CFG, jnp.float32, stacked=False)
    cache = init_kv_cache(CFG, prefix, 2, 8, jnp.float32, stacked=False)
    with pytest.raises(ValueError, match="layer layout mismatch"):
        Llama(CFG).decode_step(params, cache, jnp.zeros((2,), jnp.int32))
