"""Cached inference: the exact case equals ordinary generation token for token; batched prompts
(different module sets, arguments, unions, samples) equal one-by-one calls; modules are stored
once per batch as shared prefix levels; an empty level node, host-tier K/V and the tree
attention path give the one-by-one tokens; the level planner's plans cover every prompt exactly."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Llama, LlamaConfig, PromptBatch, generate, init_params
from models.generate import generate_from_cache
from models.prompt_cache import (cached_generate, module, param, parse_prompt, plan_levels, prefill_generate, schema,
                                 union)
from models.prompt_cache.encode import encode_schema
from models.prompt_cache.infer import assemble, prompt_segments
from models.prompt_cache.layout import layout_prompt, layout_schema
from models.sampling import SamplingConfig, sample_keys

CFG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


class ModTokenizer:
    """One token per character, scrambled into the tiny vocabulary."""

    def encode(self, text, add_special_tokens=True):
        return [(ord(c) * 7 + 3) % CFG.vocab_size for c in text]


SCHEMA = schema("t",
                module("intro", "You are a helpful guide. "),
                module("rules", "Answer briefly. "),
                module("trip", "Plan a trip of ", param("days", 3), " days to the coast. "),
                union(module("en", "Answer in English."), module("fr", "Reponds en francais, vite.")),
                module("notes", " Bring water and a hat."))


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.PRNGKey(5), jnp.float32, std=0.3)
    model = Llama(CFG, impl="reference")
    tok = ModTokenizer()
    lay = layout_schema(SCHEMA, tok)
    enc = encode_schema(model, params, lay, scaffolds=[("intro", "rules")])

    def prompts(*docs):
        return [layout_prompt(parse_prompt(f'<prompt schema="t">{d}</prompt>', SCHEMA), SCHEMA, lay, tok) for d in docs]

    return model, params, lay, enc, prompts


def test_exact_case_equals_ordinary_generation(setup):
    """One leading module, and a scaffold of the two leading modules (contiguous positions from
    0, no parameters), then new text: the tokens of `models.generate` on the same token ids."""
    model, params, lay, enc, prompts = setup
    ps = prompts("<intro/> Where should I go?", "<intro/><rules/> What is there to see?")
    assert prompt_segments(enc, ps[1]) == (enc.names.index("intro+rules"),)
    ids = [assemble(enc, p) for p in ps]
    texts = ["You are a helpful guide.  Where should I go?",
             "You are a helpful guide. Answer briefly.  What is there to see?"]
    for (i, pos), text in zip(ids, texts):
        np.testing.assert_array_equal(pos, np.arange(len(i)))
        np.testing.assert_array_equal(i, ModTokenizer().encode(text))
    want = generate(model, params, PromptBatch.plain([i.tolist() for i, _ in ids]), max_new_tokens=10,
                    eos_token_ids=())
    got = cached_generate(model, params, enc, ps, max_new_tokens=10, eos_token_ids=(), logprobs=True)
    base = prefill_generate(model, params, enc, ps, max_new_tokens=10, eos_token_ids=(), logprobs=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(base.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    np.testing.assert_allclose(base.logprobs, want.logprobs, atol=1e-4)
    assert len(set(map(tuple, want.tokens))) == 2                         # the prompts differ
    assert got.cached_tokens == sum(len(i) for i, _ in ids) - sum(len(p.new_token_ids) for p in ps)
    assert got.ttft_s > 0 and got.total_s >= got.ttft_s and base.ttft_s > 0
    first = cached_generate(model, params, enc, ps, max_new_tokens=1, eos_token_ids=(), logprobs=True)
    np.testing.assert_array_equal(first.tokens, want.tokens[:, :1])                   # no decode step
    np.testing.assert_allclose(first.logprobs, want.logprobs[:, :1], atol=1e-4)
    assert (first.lengths == 1).all() and (np.asarray(first.cache.lengths) == [len(p.new_token_ids) for p in ps]).all()


def test_penalties_equal_ordinary_generation(setup):
    """Repetition, presence and frequency penalties count each prompt's assembled ids: the exact
    case gives the tokens of `models.generate` with the same sampling, the first token too
    (`max_new_tokens=1`, no decode step), greedy and sampled; a batch of prompts with padding
    rows in its plan gives each prompt's one-by-one tokens; the penalties change the first token."""
    model, params, lay, enc, prompts = setup
    ps = prompts("<intro/> Lazy zebra, where?", "<intro/><rules/> What is there to see? Quiz")
    ids = [assemble(enc, p)[0].tolist() for p in ps]
    batch = PromptBatch.plain(ids)
    for sampling, kw in ((SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=4.0,
                                         presence_penalty=0.5, frequency_penalty=1.0), {}),
                         (SamplingConfig(temperature=1.2, top_k=0, top_p=1.0, repetition_penalty=2.5),
                          {"keys": sample_keys(3, [0, 1], [0, 0])})):
        want = generate(model, params, batch, max_new_tokens=8, eos_token_ids=(), sampling=sampling, **kw)
        plain = generate(model, params, batch, max_new_tokens=8, eos_token_ids=(),
                         sampling=dataclasses.replace(sampling, repetition_penalty=1.0, presence_penalty=0.0,
                                                      frequency_penalty=0.0), **kw)
        assert (want.tokens[:, 0] != plain.tokens[:, 0]).any()               # the penalties matter at once
        for run in (cached_generate, prefill_generate):
            got = run(model, params, enc, ps, max_new_tokens=8, eos_token_ids=(), sampling=sampling, logprobs=True, **kw)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
            first = run(model, params, enc, ps, max_new_tokens=1, eos_token_ids=(), sampling=sampling, **kw)
            np.testing.assert_array_equal(first.tokens, want.tokens[:, :1])
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=3.0, frequency_penalty=0.7)
    ps = prompts('<intro/><trip days="3"/><en/> Any tips?', '<intro/><trip days="5"/><en/> More?',
                 '<intro/><rules/><fr/> Quoi voir?')
    got = cached_generate(model, params, enc, ps, max_new_tokens=6, n=2, eos_token_ids=(), sampling=sampling)
    assert got.row_padding.any()                                           # rows of a padded group
    for j, p in enumerate(ps):
        one = cached_generate(model, params, enc, [p], max_new_tokens=6, eos_token_ids=(), sampling=sampling)
        np.testing.assert_array_equal(got.tokens[2 * j:2 * j + 2], np.repeat(one.tokens, 2, axis=0))


def test_batched_prompts_equal_one_by_one(setup):
    """Prompts importing different module sets, arguments of several lengths (an empty one too), both
    union members, two samples each: one batched call gives every prompt's one-by-one tokens,
    greedy and sampled (keys follow (prompt, sample), not the batch order)."""
    model, params, lay, enc, prompts = setup
    ps = prompts('<intro/><trip days="3"/><en/> Any tips?',
                 '<intro/><rules/><fr/> Quoi voir?',
                 '<trip days="12"/><notes/> How much water?',
                 '<intro/><trip days=""/><en/><notes/> Pack list?')
    ids = [assemble(enc, p)[0] for p in ps]
    assert len({len(i) for i in ids}) == 4
    batched = cached_generate(model, params, enc, ps, max_new_tokens=6, n=2, eos_token_ids=(), shape_buckets=True)
    assert batched.tokens.shape == (8, 6)
    for j, p in enumerate(ps):
        one = cached_generate(model, params, enc, [p], max_new_tokens=6, eos_token_ids=(), shape_buckets=True)
        np.testing.assert_array_equal(batched.tokens[2 * j], one.tokens[0])
        np.testing.assert_array_equal(batched.tokens[2 * j + 1], one.tokens[0])
        np.testing.assert_array_equal(batched.prompt_token_ids[j], ids[j])
    hot = SamplingConfig(temperature=1.5, top_k=0, top_p=1.0)
    sampled = cached_generate(model, params, enc, ps, max_new_tokens=6, n=2, eos_token_ids=(), sampling=hot, seed=4,
                              shape_buckets=True)
    j = 2
    one = cached_generate(model, params, enc, [ps[j]], max_new_tokens=6, n=2, eos_token_ids=(), sampling=hot,
                          keys=sample_keys(4, [j, j], [0, 1]), shape_buckets=True)
    np.testing.assert_array_equal(sampled.tokens[2 * j:2 * j + 2], one.tokens)
    assert not np.array_equal(one.tokens[0], one.tokens[1])


def test_modules_stored_once_per_batch(setup):
    """Two groups of prompts: the modules every prompt imports form one root node, each group's
    own modules one node of the next level; the decode state holds each module's tokens once
    for the whole batch (3 samples per prompt), equal to the encoded K/V."""
    model, params, lay, enc, prompts = setup
    ps = prompts('<intro/><trip days="3"/><en/> Q1?', '<intro/><trip days="5"/><fr/> Q2?',
                 '<intro/><trip days="9"/><en/> Q3, longer?', '<intro/><trip days=""/><fr/> Q4?')
    out = cached_generate(model, params, enc, ps, max_new_tokens=3, n=3, eos_token_ids=())
    kept = {n: len(enc.kept(i)) for i, n in enumerate(enc.names)}
    prefix = out.cache.prefix
    assert out.cache.batch == 12 and prefix.level_sizes() == (1, 2)
    assert out.plan.order == (0, 2, 1, 3)                      # the en prompts, then the fr ones
    lengths = [np.asarray(x).tolist() for x in prefix.lengths]
    assert lengths == [[kept["intro"] + kept["trip"]], [kept["en"], kept["fr"]]]
    assert out.cached_tokens == kept["intro"] + kept["trip"] + kept["en"] + kept["fr"]
    root_k = np.asarray(prefix.layers["k"][0])[:, 0, :lengths[0][0]]      # [L, n, Hkv, D]
    want = np.concatenate([np.asarray(enc.k)[:, enc.kept(enc.names.index(m))] for m in ("intro", "trip")], axis=1)
    np.testing.assert_array_equal(root_k, want)
    fr_v = np.asarray(prefix.layers["v"][1])[:, 1, :kept["fr"]]
    np.testing.assert_array_equal(fr_v, np.asarray(enc.module("fr")[1]))
    assert (np.asarray(out.cache.lengths) == np.repeat([len(ps[j].new_token_ids) + 3 - 1 for j in (0, 2, 1, 3)],
                                                        3)).all()
    np.testing.assert_array_equal(out.row_prompt, np.repeat([0, 2, 1, 3], 3))
    # three prompts, groups of 2 and 1: the fr group is padded with a dropped copy of its prompt
    pad = cached_generate(model, params, enc, [ps[0], ps[2], ps[1]], max_new_tokens=3, eos_token_ids=())
    assert pad.plan.order == (0, 1, 2, 2) and pad.plan.padding == (False, False, False, True)
    assert pad.cache.batch == 4 and pad.cache.prefix.level_sizes() == (1, 2) and pad.tokens.shape == (3, 3)
    np.testing.assert_array_equal(pad.row_padding, [False, False, False, True])
    np.testing.assert_array_equal(pad.tokens, out.tokens[[0, 6, 3]])


def test_empty_node_host_tier_and_tree_attention(setup):
    """A prompt that imports only the root's modules hangs from an empty (length 0) node of the
    second level; with the K/V as host-tier NumPy arrays and through the tree attention path
    the batch gives the one-by-one tokens too."""
    model, params, lay, enc, prompts = setup
    ps = prompts('<intro/><trip days="3"/><en/> Q1?', '<intro/> Q2?')
    want = np.concatenate([cached_generate(model, params, enc, [p], max_new_tokens=4, eos_token_ids=()).tokens
                           for p in ps])
    got = cached_generate(model, params, enc, ps, max_new_tokens=4, eos_token_ids=())
    assert got.plan.order == (1, 0) and [list(t) for t in got.plan.node_tokens] == [
        [len(enc.kept(0))], [0, len(enc.kept(2)) + len(enc.kept(3))]]
    np.testing.assert_array_equal(got.tokens, want)
    host = dataclasses.replace(enc, k=np.asarray(enc.k), v=np.asarray(enc.v))
    np.testing.assert_array_equal(cached_generate(model, params, host, ps, max_new_tokens=4,
                                                  eos_token_ids=()).tokens, want)
    tree = Llama(CFG, impl="reference", shared_impl="tree")
    np.testing.assert_array_equal(cached_generate(tree, params, enc, ps, max_new_tokens=4,
                                                  eos_token_ids=()).tokens, want)


def test_errors(setup):
    model, params, lay, enc, prompts = setup
    with pytest.raises(ValueError, match=r"prompts\[1\]: its last uncached token \(position 5\) is not at its last "
                                         r"position \(modules reach 24\)"):
        cached_generate(model, params, enc, prompts("<intro/> q", "Hello <intro/>"), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[0\]: no uncached token"):
        cached_generate(model, params, enc, prompts("<intro/>"), max_new_tokens=2)
    other = schema("u", module("intro", "x"))
    p_other = layout_prompt(parse_prompt('<prompt schema="u"><intro/> q</prompt>', other), other,
                            layout_schema(other, ModTokenizer()), ModTokenizer())
    with pytest.raises(ValueError, match=r"prompts\[0\]: laid out for schema 'u', expected 't'"):
        cached_generate(model, params, enc, [p_other], max_new_tokens=2)
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="encoded: K/V of dtype float32, expected the parameters' bfloat16"):
        cached_generate(model, p16, enc, prompts("<intro/> q"), max_new_tokens=2)
    with pytest.raises(ValueError, match="n: received 0"):
        cached_generate(model, params, enc, prompts("<intro/> q"), max_new_tokens=2, n=0)
    with pytest.raises(ValueError, match="prompts: received no prompt"):
        prefill_generate(model, params, enc, [], max_new_tokens=2)
    out = cached_generate(model, params, enc, prompts("<intro/> q"), max_new_tokens=2, eos_token_ids=())
    logits = jnp.zeros((1, CFG.vocab_size))
    with pytest.raises(ValueError, match="cache: capacity"):
        generate_from_cache(model, params, out.cache, logits, max_new_tokens=out.cache.capacity)
    with pytest.raises(ValueError, match=r"logits_bv: received shape \(2, 97\)"):
        generate_from_cache(model, params, out.cache, jnp.zeros((2, 97)), max_new_tokens=1)


def test_prompt_importing_no_module_and_encoding_of_another_model(setup):
    """A prompt that imports no module is served from both tiers as an ordinary prefill would
    serve it; an encoding made for another model shape is refused before any compile."""
    model, params, lay, enc, prompts = setup
    ps = prompts(" Hello there")
    want = prefill_generate(model, params, enc, ps, max_new_tokens=3, eos_token_ids=()).tokens
    host = dataclasses.replace(enc, k=np.asarray(enc.k), v=np.asarray(enc.v))
    for e in (enc, host):
        np.testing.assert_array_equal(cached_generate(model, params, e, ps, max_new_tokens=3,
                                                      eos_token_ids=()).tokens, want)
    wide = dataclasses.replace(CFG, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"\(layers, kv heads, head_dim\) \(2, 2, 8\), expected float32 and "
                                         r"\(2, 4, 8\)"):
        cached_generate(Llama(wide, impl="reference"), params, enc, ps, max_new_tokens=2)


def test_level_plans_cover_every_prompt():
    """Hand-made import lists: the plan's node path of every prompt holds exactly its segments,
    level sizes divide each other and the prompt count, and shared runs are stored once when the
    groups line up."""
    tokens = [40, 30, 20, 10, 5, 60]
    cases = [
        ([(0, 1), (0, 1), (0, 1)], [(1,)]),                          # all equal: one root node
        ([(0, 1, 2), (0, 3), (0, 1, 2), (0, 3)], [(1,), (2,)]),       # root + one node per group
        ([(5,), (0, 1), (2,), (0, 1)], None),
        ([(0, 2, 4), (1, 3), (0, 2), (0, 2, 4, 5), (1,), (1, 3, 5)], None),
        ([(), (0,)], None),
    ]
    unbalanced = [(0, 1), (0, 3), (0, 1), (0, 1)]         # groups of 3 and 1
    cases.append((unbalanced, [(1,), (2,)]))
    for units, sizes in cases:
        plan = plan_levels(units, tokens, level_cost=16)
        u_count = len(plan.order)
        assert sorted(j for j, pad in zip(plan.order, plan.padding) if not pad) == list(range(len(units)))
        prev = 1
        for lv in plan.levels:
            assert len(lv) % prev == 0 and u_count % len(lv) == 0
            prev = len(lv)
        for u, j in enumerate(plan.order):
            path = [r for lv in plan.levels for r in lv[u // (u_count // len(lv))]]
            assert sorted(path) == list(units[j]) and len(path) == len(set(path)), (units, plan)
        for lv, toks in zip(plan.levels, plan.node_tokens):
            assert [sum(tokens[r] for r in node) for node in lv] == list(toks)
        if sizes is not None:
            assert [len(lv) for lv in plan.levels] == [s[0] for s in sizes]
    # 40 + 16 (root) + 2 * 30 + 16 (one node per group) + 2 padding units * 16 = 164 beats
    # 40 + 16 + 4 * 30 + 16 = 192 (module 1 copied for each of its three prompts) ...
    plan = plan_levels(unbalanced, tokens, level_cost=16)
    assert plan.order == (0, 2, 3, 1, 1, 1) and plan.padding == (False,) * 4 + (True, True)
    assert plan.levels == (((0,),), ((1,), (3,)))
    # ... but not with 3 samples per prompt (2 * 3 padding rows * 16 = 96)
    plan = plan_levels(unbalanced, tokens, samples=3, level_cost=16)
    assert plan.padding == (False,) * 4 and plan.levels == (((0,),), ((1,), (1,), (1,), (3,)))
    with pytest.raises(ValueError, match=r"units\[1\]: received \[2, 1\]"):
        plan_levels([(0,), (2, 1)], tokens)


@pytest.mark.gpu
def test_gpu_cached_inference_at_realistic_sizes():
    """bf16 through the GPU kernels, Llama-3 shaped layers (2 of them), a 1500-token leading
    module, a parameterized module and a union of 700/900 tokens: the exact case gives the
    tokens and first-token log-probs of an ordinary prefill of the same ids; three prompts with
    other module sets in one batch (prefix levels longer than 128, stored padded to multiples
    of 128) give their one-by-one tokens. The LM head is scaled up so greedy choices are clear."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, rope_theta=500000.0)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    params["lm_head"] = params["lm_head"] * 30
    rng = np.random.default_rng(0)

    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            return [int(w[1:]) % cfg.vocab_size for w in text.split()]

    def words(n):
        return " ".join(f"w{i}" for i in rng.integers(0, 10**6, n))

    tok = WordTokenizer()
    s = schema("g", module("lead", words(1500)), module("a", words(300), param("p", 16), words(200)),
               union(module("b", words(700)), module("c", words(900))))
    lay = layout_schema(s, tok, placeholder_id=0)
    model = Llama(cfg)
    enc = encode_schema(model, params, lay, pad_multiple=128)

    def prompts(*docs):
        return [layout_prompt(parse_prompt(f'<prompt schema="g">{d}</prompt>', s), s, lay, tok) for d in docs]

    exact = prompts(f"<lead/> {words(64)}")
    got = cached_generate(model, params, enc, exact, max_new_tokens=6, eos_token_ids=(), logprobs=True)
    base = prefill_generate(model, params, enc, exact, max_new_tokens=6, eos_token_ids=(), logprobs=True)
    ref = generate(model, params, PromptBatch.plain([assemble(enc, exact[0])[0].tolist()]), max_new_tokens=6,
                   eos_token_ids=())
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(base.tokens, ref.tokens)
    np.testing.assert_allclose(got.logprobs[:, 0], ref.logprobs[:, 0], atol=5e-2)
    batch = prompts(f'<lead/><a p="{words(9)}"/><b/> {words(40)}', f"<lead/><c/> {words(70)}",
                    f'<a p="{words(16)}"/><b/> {words(20)}')
    both = cached_generate(model, params, enc, batch, max_new_tokens=4, n=2, eos_token_ids=())
    assert any(max(t) > 128 for t in both.plan.node_tokens)
    for j, p in enumerate(batch):
        one = cached_generate(model, params, enc, [p], max_new_tokens=4, eos_token_ids=())
        np.testing.assert_array_equal(both.tokens[2 * j:2 * j + 2], np.repeat(one.tokens, 2, axis=0))
