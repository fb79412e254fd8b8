"""Module encoding: the batched encoding of every module of a schema, stored packed without
padding, equals a hand-built reference (one unpadded sequence of all modules, a dense
block-diagonal causal mask so each module attends only to itself); a module at the start of the
schema, and a scaffold of the modules that fill the schema's first positions, equal the model's
own prefill of that text."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers import PC_CONFIG, ModTokenizer, rel_err
from models import Llama, LlamaConfig, init_params, unstack_layers
from models.prompt_cache import module, param, schema, union
from models.prompt_cache.encode import encode_schema, pack_rows, schema_rows
from models.prompt_cache.layout import layout_schema

CFG = LlamaConfig(**PC_CONFIG)


SCHEMA = schema("e", "System: be brief. ",
                module("doc", "The first document ", param("who", 3), " talks ",
                       module("aside", "(an aside) "), "about rivers."),
                union(module("en", "Answer in English."), module("fr", "Reponds en francais, vite.")),
                " Question:")


@pytest.fixture(scope="module")
def encoded():
    params = init_params(CFG, jax.random.PRNGKey(11), jnp.float32, std=0.3)
    model = Llama(CFG, impl="reference")
    lay = layout_schema(SCHEMA, ModTokenizer())
    return model, params, lay, encode_schema(model, params, lay, scaffolds=[("doc", "#0", "aside")])


def reference_kv(model, params, lay):
    """All modules' tokens in one sequence; token a sees token b iff same module and b <= a."""
    ids = np.concatenate([m.token_ids for m in lay.modules])[None]
    pos = np.concatenate([m.positions for m in lay.modules])[None]
    owner = np.concatenate([np.full(len(m.token_ids), i) for i, m in enumerate(lay.modules)])
    idx = np.arange(len(owner))
    mask = (owner[:, None] == owner[None, :]) & (idx[None, :] <= idx[:, None])
    group = CFG.num_attention_heads // CFG.num_key_value_heads

    def attend(q, k, v):
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(mask[None, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    x = params["embed"][ids]
    ks, vs = [], []
    for lp in unstack_layers(params)["layers"]:
        x, (k, v) = model.layer_forward(lp, x, jnp.asarray(pos), attend)
        ks.append(np.asarray(k[0]))
        vs.append(np.asarray(v[0]))
    bounds = np.cumsum([0] + [len(m.token_ids) for m in lay.modules])
    return {m.name: (np.stack(ks)[:, a:b], np.stack(vs)[:, a:b]) for m, a, b in zip(lay.modules, bounds, bounds[1:])}


def test_modules_equal_the_masked_full_forward(encoded):
    model, params, lay, enc = encoded
    assert enc.names == tuple(m.name for m in lay.modules) + ("#0+doc+aside",)
    L, M = CFG.num_hidden_layers, len(lay.modules) + 1
    n_scaffold = sum(len(lay.module(m).token_ids) for m in ("#0", "doc", "aside"))
    n = sum(len(m.token_ids) for m in lay.modules) + n_scaffold
    assert n % 8 and enc.tokens == n                          # packed: no row is padded, nor the total
    assert enc.k.shape == enc.v.shape == (L, n, CFG.num_key_value_heads, CFG.head_dim)
    assert enc.offsets.tolist() == np.cumsum([0] + [len(m.token_ids) for m in lay.modules] + [n_scaffold]).tolist()
    assert enc.positions.shape == enc.token_ids.shape == enc.keep.shape == (n,)
    want = reference_kv(model, params, lay)
    for m in lay.modules:
        k, v, pos = enc.module(m.name)
        np.testing.assert_array_equal(pos, m.positions)
        np.testing.assert_allclose(np.asarray(k), want[m.name][0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(v), want[m.name][1], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(enc.token_ids[enc.span(enc.names.index(m.name))], m.token_ids)
        np.testing.assert_array_equal(enc.keep[enc.span(enc.names.index(m.name))], m.keep_mask)
    per_token = 2 * L * CFG.num_key_value_heads * CFG.head_dim * 4
    assert enc.nbytes == n * per_token
    doc = enc.names.index("doc")
    kept = enc.kept(doc)
    assert len(kept) == len(lay.module("doc").token_ids) - 3 and not np.isin(
        np.arange(enc.offsets[doc], enc.offsets[doc + 1])[~lay.module("doc").keep_mask], kept).any()


def test_leading_module_and_scaffold_equal_plain_prefill(encoded):
    model, params, lay, enc = encoded
    text = "System: be brief. The first document " + "   " + " talks (an aside) about rivers."
    ids = ModTokenizer().encode(text)
    n = len(ids)
    prefix = model.prefill_prefixes(params, (jnp.asarray(ids)[None],), (jnp.asarray([n]),))
    want_k, want_v = np.asarray(prefix.layers["k"][0][:, 0, :n]), np.asarray(prefix.layers["v"][0][:, 0, :n])
    k, v, pos = enc.module("#0+doc+aside")             # the scaffold: the exact case
    np.testing.assert_array_equal(pos, np.arange(n))
    np.testing.assert_array_equal(enc.token_ids[enc.span(enc.names.index("#0+doc+aside"))], ids)
    np.testing.assert_allclose(np.asarray(k), want_k, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(v), want_v, atol=1e-5, rtol=1e-5)
    k, v, pos = enc.module("#0")                       # alone at the start: a causal prefix of it
    m = len(pos)
    np.testing.assert_array_equal(pos, np.arange(m))
    np.testing.assert_allclose(np.asarray(k), want_k[:, :m], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(v), want_v[:, :m], atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(enc.module("doc")[0][:, :5]), want_k[:, m:m + 5], atol=1e-3)  # masking effect
    keep = enc.keep[enc.span(enc.names.index("#0+doc+aside"))]
    assert len(keep) == n and (~keep).sum() == 3


def test_pack_modules_and_errors(encoded):
    model, params, lay, enc = encoded
    ids, pos, keep, lengths = pack_rows(schema_rows(lay), pad_multiple=5)
    assert ids.shape[1] % 5 == 0 and ids.shape[1] - 5 < lengths.max() <= ids.shape[1]
    for i, m in enumerate(lay.modules):
        assert ids[i, :lengths[i]].tolist() == m.token_ids.tolist() and not ids[i, lengths[i]:].any()
        assert pos[i, :lengths[i]].tolist() == m.positions.tolist()
        assert keep[i, :lengths[i]].tolist() == m.keep_mask.tolist() and not keep[i, lengths[i]:].any()
    with pytest.raises(ValueError, match="pad_multiple: received 0"):
        pack_rows(schema_rows(lay), pad_multiple=0)
    for bad, words in ((["doc"], "two or more"), (["doc", "x"], "unknown"), (["doc", "doc"], "repeated"),
                       (["en", "fr"], "one union"), ("doc", "two or more")):
        with pytest.raises(ValueError, match=words):
            schema_rows(lay, [bad])
    with pytest.raises(ValueError, match="no module 'nope'"):
        enc.module("nope")
    bad_offsets = enc.offsets.copy()
    bad_offsets[2] = bad_offsets[3] + 1
    with pytest.raises(ValueError, match="offsets: received .* non-decreasing offsets from 0"):
        dataclasses.replace(enc, offsets=bad_offsets)
    with pytest.raises(ValueError, match=r"keep: received shape \(\d+,\), expected"):
        dataclasses.replace(enc, keep=enc.keep[:-1])
    with pytest.raises(ValueError, match=r"k, v: received shapes"):
        dataclasses.replace(enc, v=enc.v[:, :-1])
    big = layout_schema(schema("b", module("m", "x", param("p", 1))), ModTokenizer(), placeholder_id=500)
    with pytest.raises(ValueError, match=r"token ids span \[\d+, 500\], expected \[0, 97\)"):
        encode_schema(model, params, big)
    with pytest.raises(TypeError, match="expected SchemaLayout"):
        encode_schema(model, params, "layout")


@pytest.mark.gpu
def test_gpu_encoding_matches_the_reference_at_realistic_sizes():
    """bf16 encoding through the Pallas kernels (Llama-3 shaped layers, 2 of them, modules of
    up to 1500 tokens and a scaffold) against the fp32 pure-JAX reference encoding."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, rope_theta=500000.0)
    p32 = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p32)
    rng = np.random.default_rng(0)

    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            return [int(w[1:]) % cfg.vocab_size for w in text.split(" ")]

    def words(n):
        return " ".join(f"w{i}" for i in rng.integers(0, 10**6, n))

    s = schema("g", words(300), module("a", words(1500), param("p", 16), words(200)),
               union(module("b", words(700)), module("c", words(900))), words(50))
    lay = layout_schema(s, WordTokenizer(), placeholder_id=0)
    want = encode_schema(Llama(cfg, impl="reference"), p32, lay, scaffolds=[("#0", "a")], pad_multiple=128)
    got = encode_schema(Llama(cfg), p16, lay, scaffolds=[("#0", "a")], pad_multiple=128)
    for name in want.names:
        for x, y in zip(got.module(name)[:2], want.module(name)[:2]):
            assert rel_err(x.astype(jnp.float32), y) < 3e-2, (name, rel_err(x.astype(jnp.float32), y))
