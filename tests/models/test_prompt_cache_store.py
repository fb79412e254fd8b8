"""Prompt Cache storage: identities of model, tokenizer and schema; the safetensors round trip
(bit-identical K/V); refusal of a cache made for another model, dtype, tokenizer or schema; LRU
eviction order and byte accounting across the device, host and disk tiers; statistics."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import PC_CONFIG, ModTokenizer, numbered_schema, tiny_tokenizer_meta
from models import Llama, LlamaConfig, init_params, unstack_layers
from models.prompt_cache import (CacheBudgets, PromptCache, kv_bytes_per_token, model_identity, module, schema,
                                 tokenizer_identity)
from models.prompt_cache.encode import encode_schema
from models.prompt_cache.layout import layout_schema
from models.prompt_cache.store import load_encoded, save_encoded
from models.tokenizer import Tokenizer

CFG = LlamaConfig(**PC_CONFIG)


make_schema = numbered_schema


SCHEMAS = [make_schema(i) for i in range(4)]


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(3), jnp.float32, std=0.3)
    model = Llama(CFG, impl="reference")
    tok = ModTokenizer()
    encoded = {s.name: encode_schema(model, params, layout_schema(s, tok)) for s in SCHEMAS}
    return model, params, tok, encoded


def entry_bytes(enc):
    return sum(np.asarray(x).size * np.asarray(x).dtype.itemsize
               for x in (enc.k, enc.v, enc.positions, enc.token_ids, enc.keep, enc.offsets))


def hf_meta(merges):
    m = tiny_tokenizer_meta()
    return {"tokenizer.ggml.model": m["model"], "tokenizer.ggml.pre": m["pre"], "tokenizer.ggml.tokens": m["tokens"],
            "tokenizer.ggml.token_type": m["token_types"], "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def test_identities(setup):
    model, params, _, _ = setup
    ident = model_identity(CFG, params)
    assert model_identity(CFG, unstack_layers(params)) == ident             # layer layout does not matter
    one = dict(params, layers=dict(params["layers"]))
    one["layers"]["w_down"] = params["layers"]["w_down"].at[1, 7, 3].add(1e-3)   # one weight of layer 1
    assert model_identity(CFG, one) != ident
    swapped = dict(params, final_norm=params["final_norm"][::-1])            # same values, other order
    assert model_identity(CFG, swapped) != ident
    other_cfg = dataclasses.replace(CFG, rope_theta=20000.0)
    assert model_identity(other_cfg, params) != ident
    merges = tiny_tokenizer_meta()["merges"]
    a, b = Tokenizer.from_gguf(hf_meta(merges)), Tokenizer.from_gguf(hf_meta(merges))
    assert tokenizer_identity(a) == tokenizer_identity(b)
    assert tokenizer_identity(Tokenizer.from_gguf(hf_meta(merges[:-1]))) != tokenizer_identity(a)
    with pytest.raises(TypeError, match="pass tokenizer_id="):
        tokenizer_identity(ModTokenizer())
    assert kv_bytes_per_token(CFG, jnp.float32) == 2 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token(CFG, jnp.bfloat16) == 2 * 2 * 2 * 8 * 2


def test_save_load_round_trip_is_bit_identical(setup, tmp_path):
    model, params, tok, encoded = setup
    cache = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")
    first = cache.encode_or_load(SCHEMAS[0])
    assert os.path.exists(tmp_path / "s0.safetensors")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["identity"] == {"model": model_identity(CFG, params), "dtype": "float32", "tokenizer": "mod"}
    assert set(manifest["schemas"]) == {"s0"} and manifest["schemas"]["s0"]["file"] == "s0.safetensors"
    again = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")   # a new process
    loaded = again.encode_or_load(SCHEMAS[0])
    assert again.stats().hits == {"device": 0, "host": 0, "disk": 1}
    assert loaded.names == first.names and loaded.schema == "s0"
    for a in ("k", "v", "positions", "token_ids", "keep", "offsets"):
        x, y = np.asarray(getattr(first, a)), np.asarray(getattr(loaded, a))
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), a
    np.testing.assert_array_equal(np.asarray(first.k), np.asarray(encoded["s0"].k))
    # bf16 K/V through the file functions
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    enc16 = encode_schema(model, p16, layout_schema(SCHEMAS[1], tok))
    c16 = PromptCache(model, p16, tok, tokenizer_id="mod")
    key = c16.schema_key(SCHEMAS[1])
    size = save_encoded(str(tmp_path / "x.safetensors"), enc16, c16.identity, key)
    assert size == os.path.getsize(tmp_path / "x.safetensors")
    back = load_encoded(str(tmp_path / "x.safetensors"), c16.identity, "s1", key)
    assert back.k.dtype == jnp.bfloat16 and np.asarray(enc16.k).tobytes() == back.k.tobytes()
    with pytest.raises(ValueError, match=r"dtype: stored bfloat16, expected float32"):
        load_encoded(str(tmp_path / "x.safetensors"), cache.identity, "s1", key)
    whole = (tmp_path / "x.safetensors").read_bytes()               # damaged files: a ValueError naming the file
    for cut, msg in ((len(whole) - 3, "truncated"), (0, "empty file"), (3, "truncated: 3 bytes")):
        (tmp_path / "y.safetensors").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"y.safetensors: {msg}"):
            load_encoded(str(tmp_path / "y.safetensors"), c16.identity, "s1", key)
    with pytest.raises(ValueError, match="made for another model, dtype or tokenizer"):   # a directory too
        PromptCache(model, p16, tok, directory=tmp_path, tokenizer_id="mod")


def test_mismatched_model_tokenizer_or_schema_is_refused(setup, tmp_path):
    model, params, tok, encoded = setup
    PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod").encode_or_load(SCHEMAS[0])
    other = dict(params, embed=params["embed"].at[5, 5].multiply(2.0))
    with pytest.raises(ValueError, match=r"made for another model.*model: stored [0-9a-f]{12}, expected"):
        PromptCache(model, other, tok, directory=tmp_path, tokenizer_id="mod")
    with pytest.raises(ValueError, match="tokenizer: stored mod, expected other") as err:
        PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="other")
    assert "model:" not in str(err.value) and "dtype:" not in str(err.value)
    assert not [f for f in os.listdir(tmp_path) if ".corrupt-" in f]      # refused, not repaired
    cache = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")
    edited = make_schema(0, extra=" (edited)")                    # same name, other text
    with pytest.raises(ValueError, match="schema 's0': the disk tier holds an encoding of other schema text"):
        cache.encode_or_load(edited)
    with pytest.raises(ValueError, match="expected schema 's0' hash"):
        load_encoded(str(tmp_path / "s0.safetensors"), cache.identity, "s0", cache.schema_key(edited))
    with pytest.raises(ValueError, match="holds schema 's0'"):
        load_encoded(str(tmp_path / "s0.safetensors"), cache.identity, "s1", cache.schema_key(SCHEMAS[1]))
    fresh = cache.encode_or_load(edited, replace=True)
    assert not np.array_equal(np.asarray(fresh.token_ids), np.asarray(encoded["s0"].token_ids))
    with pytest.raises(ValueError, match="the device tier holds an encoding of other schema text"):
        cache.lookup(SCHEMAS[0])
    with pytest.raises(ValueError, match="encodes schema 's1', expected 's0'"):
        cache.insert(SCHEMAS[0], encoded["s1"])


def test_lru_eviction_across_tiers_and_stats(setup, tmp_path):
    model, params, tok, encoded = setup
    nb = entry_bytes(encoded["s0"])
    assert all(entry_bytes(e) == nb for e in encoded.values())
    for directory in (None, tmp_path):
        cache = PromptCache(model, params, tok, directory=directory, tokenizer_id="mod",
                            budgets=CacheBudgets(device=2 * nb, host=nb))
        for s in SCHEMAS[:3]:
            cache.insert(s, encoded[s.name])
        assert cache.names("device") == ("s1", "s2") and cache.names("host") == ("s0",)
        assert isinstance(cache.lookup(SCHEMAS[1], promote=True).k, jax.Array)      # device hit: s1 most recent
        assert cache.names("device") == ("s2", "s1")
        host_hit = cache.lookup(SCHEMAS[0], promote=False)                        # host hit, stays there
        assert isinstance(host_hit.k, np.ndarray) and cache.names("host") == ("s0",)
        cache.lookup(SCHEMAS[0])                          # host hit, promoted: s2 (LRU) goes to the host
        assert cache.names("device") == ("s1", "s0") and cache.names("host") == ("s2",)
        cache.insert(SCHEMAS[3], encoded["s3"])           # s1 -> host, which then evicts s2
        assert cache.names("device") == ("s0", "s3") and cache.names("host") == ("s1",)
        st = cache.stats()
        assert st.hits == {"device": 1, "host": 2, "disk": 0}
        assert st.misses == {"device": 2, "host": 0, "disk": 0}
        assert st.evictions == {"device": 3, "host": 1, "disk": 0}
        assert st.entries["device"] == 2 and st.bytes["device"] == 2 * nb and st.bytes["host"] == nb
        assert st.bytes_per_token == kv_bytes_per_token(CFG, jnp.float32)
        ntok = encoded["s0"].tokens
        assert st.tokens["device"] == 2 * ntok and st.tokens["host"] == ntok
        if directory is None:                             # s2 was dropped
            assert cache.lookup(SCHEMAS[2]) is None and cache.names("disk") == ()
            assert cache.stats().misses == {"device": 3, "host": 1, "disk": 0}
        else:                                             # every entry was written when inserted
            assert set(cache.names("disk")) == {"s0", "s1", "s2", "s3"} and st.entries["disk"] == 4
            assert st.bytes["disk"] == sum(os.path.getsize(tmp_path / f"s{i}.safetensors") for i in range(4))
            got = cache.lookup(SCHEMAS[2])
            np.testing.assert_array_equal(np.asarray(got.v), np.asarray(encoded["s2"].v))
            assert cache.stats().hits["disk"] == 1 and cache.names("device") == ("s3", "s2")


def test_disk_budget_and_oversized_entries(setup, tmp_path):
    model, params, tok, encoded = setup
    nb = entry_bytes(encoded["s0"])
    cache = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod",
                        budgets=CacheBudgets(device=nb - 1, host=0, disk=2 * nb + nb // 2))
    for s in SCHEMAS[:3]:
        cache.insert(s, encoded[s.name])
    # larger than the device budget, nothing kept on the host: only the disk holds entries
    assert cache.names("device") == () and cache.names("host") == ()
    assert cache.names("disk") == ("s1", "s2")                   # s0 (least recently used) deleted
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "s1.safetensors", "s2.safetensors"]
    assert set(json.loads((tmp_path / "manifest.json").read_text())["schemas"]) == {"s1", "s2"}
    assert cache.stats().evictions == {"device": 3, "host": 3, "disk": 1}
    cache.lookup(SCHEMAS[1])                                     # disk hit: s1 most recent on disk
    cache.insert(SCHEMAS[3], encoded["s3"])
    assert cache.names("disk") == ("s1", "s3")
    reopened = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")
    assert reopened.names("disk") == ("s1", "s3")
    cache.remove("s1")
    assert cache.names("disk") == ("s3",) and not os.path.exists(tmp_path / "s1.safetensors")
    with pytest.raises(ValueError, match="CacheBudgets.host: received -1"):
        CacheBudgets(host=-1)
    with pytest.raises(ValueError, match="tier: received 'gpu'"):
        cache.names("gpu")


def test_file_larger_than_the_disk_budget_is_not_kept(setup, tmp_path):
    """An entry whose in-memory bytes fit the disk budget but whose file (with its header) does
    not is not kept on disk: no file, no manifest record, the budget holds."""
    model, params, tok, encoded = setup
    probe = PromptCache(model, params, tok, directory=tmp_path / "probe", tokenizer_id="mod")
    probe.insert(SCHEMAS[0], encoded["s0"])
    budget = os.path.getsize(tmp_path / "probe" / "s0.safetensors") - 1
    assert entry_bytes(encoded["s0"]) <= budget
    d = tmp_path / "c"
    cache = PromptCache(model, params, tok, directory=d, tokenizer_id="mod", budgets=CacheBudgets(disk=budget))
    cache.insert(SCHEMAS[0], encoded["s0"])
    assert cache.names("disk") == () and not os.path.exists(d / "s0.safetensors")
    assert json.loads((d / "manifest.json").read_text())["schemas"] == {}
    assert cache.stats().bytes["disk"] <= budget


def test_storage_scales_with_real_tokens(setup, tmp_path):
    """A 3-token module next to a 300-token one: entries, files and stats count the real tokens
    (K/V plus 9 index bytes per token and the row offsets), never the longest row per module."""
    model, params, tok, _ = setup
    s = schema("long", module("short", "abc"), module("long", "x" * 300))
    cache = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")
    enc = cache.encode_or_load(s)
    rows = [3, 300]
    assert enc.tokens == sum(rows) and enc.lengths.tolist() == rows
    bpt = kv_bytes_per_token(CFG, jnp.float32)
    want = sum(rows) * (bpt + 4 + 4 + 1) + 8 * (len(rows) + 1)
    st = cache.stats()
    assert entry_bytes(enc) == want and st.bytes["device"] == want and st.tokens["device"] == sum(rows)
    padded = 2 * 300 * bpt                                  # what one padded [M, T] buffer would hold
    size = os.path.getsize(tmp_path / "long.safetensors")
    assert st.bytes["disk"] == size and want <= size < want + 4096 < padded
    assert st.tokens["disk"] == sum(rows)
    assert json.loads((tmp_path / "manifest.json").read_text())["schemas"]["long"]["tokens"] == sum(rows)
    reopened = PromptCache(model, params, tok, directory=tmp_path, tokenizer_id="mod")
    assert reopened.stats().tokens["disk"] == sum(rows)
    back = reopened.encode_or_load(s)
    np.testing.assert_array_equal(np.asarray(back.module("long")[1]), np.asarray(enc.module("long")[1]))
