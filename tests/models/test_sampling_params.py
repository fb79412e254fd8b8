"""`SamplingParams` through `models.LLM` on a tiny random Llama GGUF: penalties in the decode loop
against a naive NumPy decode that recomputes every step, min-p, stop token ids, ignore_eos,
include_stop_str_in_output and stop_reason, top-k log-probabilities and prompt log-probabilities
against a forward pass, seed=None, the fused loop equal to the step-by-step one; the Python API's
rough edges (stream logprobs, logprobs=k, stop=5, timings, stream(n=0), whitespace prompts); and
the `jpa-sample` flags into the JSONL records."""
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import write_tiny_gguf
from models import LLM, PromptBatch, SamplingConfig, SamplingParams
from models import cli
from models.cli.args import build_parser, parse_args, sampling_params
from models.token_step import choose_tokens
from models import llm as llm_module
from models import prompt_logprobs as prompt_logprobs_module
from models.generate import _decode_loop, _sample_step, generate, generate_from_cache, prefill_prefix_cache

PROMPTS = ["In the beginning the cat sat on the mat, then", "In the beginning the cat sat on the mat, and"]
M = 10


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    # peaked logits, but samples still vary
    return write_tiny_gguf(tmp_path_factory.mktemp("sp") / "tiny.gguf", seed=11, lm_head_scale=12)


@pytest.fixture(scope="module")
def llm(gguf):
    return LLM.load(gguf)


def _ids(result):
    return [[c.token_ids for c in row] for row in result]


# -- penalties in the decode loop ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def raw_logits(llm):
    fwd = jax.jit(llm.model.forward)

    def last(seq):
        toks = np.zeros((1, 128), np.int32)
        toks[0, :len(seq)] = seq
        return np.asarray(fwd(llm.params, jnp.asarray(toks)), np.float64)[0, len(seq) - 1]
    return last


def _reference(llm, last_logits, prompt, steps, rep, pres, freq):
    """Greedy tokens by recomputation: logits of the whole sequence, vLLM's penalty rules in NumPy
    (repetition on prompt + generated ids, presence / frequency on generated counts), argmax."""
    v = llm.config.vocab_size
    out = []
    for _ in range(steps):
        x = last_logits(list(prompt) + out)
        counts = np.bincount(np.asarray(out, np.int64), minlength=v)
        seen = np.zeros(v, bool)
        seen[list(prompt) + out] = True
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * (counts > 0)
        out.append(int(np.argmax(x)))
        if out[-1] in llm.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("rep,pres,freq", [(1.6, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 1.2), (1.3, 0.5, 0.5)])
def test_penalties_in_the_decode_loop_equal_a_naive_numpy_decode(llm, raw_logits, rep, pres, freq):
    """Greedy with penalties: the fused loop and the step-by-step loop (events) give the tokens of a
    NumPy decode applying the rules to recomputed logits; the penalties change the tokens."""
    kw = dict(n=1, max_new_tokens=M, temperature=0.0, repetition_penalty=rep, presence_penalty=pres,
              frequency_penalty=freq)
    fused = llm.generate(PROMPTS, **kw)
    stepped = [ev.result for ev in llm.events(PROMPTS, **kw) if hasattr(ev, "result")][0]
    plain = llm.generate(PROMPTS, n=1, max_new_tokens=M, temperature=0.0)
    assert _ids(fused) == _ids(stepped)
    for j, p in enumerate(PROMPTS):
        want = _reference(llm, raw_logits, llm.prompt_ids(p), M, rep, pres, freq)
        assert list(fused[j][0].token_ids) == want
    assert _ids(fused) != _ids(plain), "the penalties should change the greedy tokens"


def test_penalties_with_shared_prefix_sampling_are_per_sequence(llm):
    """Sampled with penalties and n=3 (two sharing levels): sample 0 of each prompt equals its run
    with n=1 and alone (its counts are its own), the fused loop equals the stepped one."""
    kw = dict(max_new_tokens=M, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.4, frequency_penalty=0.6,
              seed=3)
    many = llm.generate(PROMPTS, n=3, **kw)
    assert many.sharing.attention == "shared" and many.sharing.levels
    alone = llm.generate(PROMPTS[0], n=1, **kw)
    assert alone.sharing.levels == () and alone[0][0].token_ids == many[0][0].token_ids
    single = llm.generate(PROMPTS, n=1, **kw)
    assert [row[0].token_ids for row in single] == [row[0].token_ids for row in many]
    stepped = [ev.result for ev in llm.events(PROMPTS, n=3, **kw) if hasattr(ev, "result")][0]
    assert _ids(stepped) == _ids(many)
    plain = llm.generate(PROMPTS, n=3, **{k: v for k, v in kw.items() if "penalty" not in k})
    assert _ids(plain) != _ids(many)


def test_penalties_and_top_logprobs_on_a_mesh_equal_one_device(llm, gguf):
    """Tensor parallel over 2 devices (the vocabulary split, padded): penalised greedy tokens,
    min-p sampling and top-k log-probabilities equal one device's."""
    mp = LLM.load(gguf, tensor_parallel=2)
    for kw in (dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
               dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, presence_penalty=0.8, seed=2)):
        want = llm.generate(PROMPTS, max_new_tokens=6, logprobs=2, **kw)
        got = mp.generate(PROMPTS, max_new_tokens=6, logprobs=2, **kw)
        assert _ids(got) == _ids(want)
        for gr, wr in zip(got, want):
            assert [[a[0] for a in alts] for alts in gr[0].top_logprobs] == [[a[0] for a in alts]
                                                                             for alts in wr[0].top_logprobs]
            np.testing.assert_allclose([[a[1] for a in alts] for alts in gr[0].top_logprobs],
                                       [[a[1] for a in alts] for alts in wr[0].top_logprobs], atol=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs: received True, expected False with tensor_parallel=2"):
        mp.generate(PROMPTS, prompt_logprobs=True)


def test_generate_from_cache_with_penalties_equals_generate(llm):
    """The decode loop from a cache the caller prefilled counts the prompt given as
    ``prompt_token_ids`` (a repetition penalty needs it) and gives `generate`'s tokens."""
    ids = [llm.prompt_ids(p) for p in PROMPTS]
    batch = PromptBatch.plain(ids)
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.4)
    want = generate(llm.model, llm.params, batch, max_new_tokens=M, sampling=cfg, attention="flat",
                    top_logprobs=2)
    prefix = prefill_prefix_cache(llm.model, llm.params, batch)
    toks, n = batch.suffix_arrays()
    logits, cache = llm.model.prefill_jit(llm.params, prefix, toks, n, capacity=max(map(len, ids)) + M,
                                          backend="flat")
    with pytest.raises(ValueError, match="prompt_token_ids: received None"):
        generate_from_cache(llm.model, llm.params, cache, logits, max_new_tokens=M, sampling=cfg)
    got = generate_from_cache(llm.model, llm.params, cache, logits, max_new_tokens=M, sampling=cfg,
                              prompt_token_ids=ids, top_logprobs=2)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    assert got.top_ids.shape == (2, M, 2)


def test_neutral_options_add_no_work_to_the_step(llm):
    """Defaults trace no count array and no scatter; penalties trace them (a static choice)."""
    logits = jnp.zeros((2, llm.config.vocab_size))
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    done = jnp.zeros((2,), bool)

    def prims(cfg, counts, k=0):
        jaxpr = jax.make_jaxpr(lambda x, c: choose_tokens(llm.model, x, keys, 1, done, c, None, cfg=cfg, pad_id=0, top_k=k))(
            logits, counts)
        return {e.primitive.name for e in jaxpr.jaxpr.eqns}

    default = prims(SamplingConfig(), None)
    assert not any("scatter" in p for p in default) and "top_k" in default   # top-k sampling itself
    pen = prims(SamplingConfig(presence_penalty=0.5), jnp.zeros((2, llm.config.vocab_size), jnp.int32))
    assert any("scatter" in p for p in pen)
    greedy = prims(SamplingConfig(temperature=0.0), None)
    assert "top_k" not in greedy and "top_k" in prims(SamplingConfig(temperature=0.0), None, k=3)


def test_other_sampling_values_reuse_the_compiled_loops(llm):
    """Temperature, top-p, min-p and penalty values are traced arguments: with the same options
    on, other values reuse the fused loop's and the step-by-step sampling's compilations, and
    still change the tokens."""
    base = dict(max_new_tokens=M, top_k=0, seed=5)
    first = dict(temperature=0.9, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                 frequency_penalty=0.2)
    other = dict(temperature=0.6, top_p=0.8, min_p=0.1, repetition_penalty=1.7, presence_penalty=-0.4,
                 frequency_penalty=0.0)
    a = llm.generate(PROMPTS, **base, **first)
    loops = _decode_loop._cache_size()
    b = llm.generate(PROMPTS, **base, **other)
    assert _decode_loop._cache_size() == loops
    assert _ids(a) != _ids(b)
    stepped = [ev.result for ev in llm.events(PROMPTS, **base, **first) if hasattr(ev, "result")][0]
    steps = _sample_step._cache_size()
    stepped_b = [ev.result for ev in llm.events(PROMPTS, **base, **other) if hasattr(ev, "result")][0]
    assert _sample_step._cache_size() == steps
    assert _ids(stepped) == _ids(a) and _ids(stepped_b) == _ids(b)


def test_sampling_modes_are_static_and_values_are_leaves():
    """The mode (which options are on) is the pytree structure, the values its leaves."""
    a = SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3)
    b = SamplingConfig(temperature=1.2, top_p=0.5, repetition_penalty=0.9)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for c in (SamplingConfig(temperature=0.7, top_p=1.0, repetition_penalty=1.3),
              SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3, min_p=0.1),
              SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.1),
              SamplingConfig(temperature=0.0, top_p=0.9, repetition_penalty=1.3),
              SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)):
        assert jax.tree_util.tree_structure(c) != jax.tree_util.tree_structure(a), c
    leaves = jax.tree_util.tree_leaves(a)
    assert [float(x) for x in leaves] == [np.float32(v) for v in (0.7, 0.9, 0.0, 1.3, 0.0, 0.0)]
    assert all(x.dtype == np.float32 for x in leaves)
    back = jax.tree_util.tree_map(lambda x: x, a)
    assert back.mode == a.mode and back.top_k == a.top_k and hash(a) == hash(SamplingConfig(**dataclasses.asdict(a)))


# -- ends: stop token ids, ignore_eos, include_stop_str_in_output, stop_reason -------------------------

@pytest.fixture(scope="module")
def greedy(llm):
    return llm.generate(PROMPTS, max_new_tokens=M, temperature=0.0, logprobs=True)


def test_stop_token_ids_end_a_sample_with_their_id_as_stop_reason(llm, greedy):
    ids = greedy[0][0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    for run in (llm.generate, lambda *a, **k: [e.result for e in llm.events(*a, **k) if hasattr(e, "result")][0]):
        c = run(PROMPTS, max_new_tokens=M, temperature=0.0, stop_token_ids=[stop_id])[0][0]
        assert c.finish_reason == "stop" and c.stop_reason == stop_id and c.token_ids == ids[:first + 1]
        assert c.text == llm.tokenizer.decode(ids[:first], skip_special_tokens=True)
    kept = llm.generate(PROMPTS, max_new_tokens=M, temperature=0.0, stop_token_ids=[stop_id],
                        include_stop_str_in_output=True)[0][0]
    assert kept.token_ids == ids[:first + 1] and kept.text == llm.tokenizer.decode(ids[:first + 1],
                                                                                   skip_special_tokens=True)
    assert greedy[0][0].stop_reason is None


def test_ignore_eos_runs_to_the_length_limit(llm, greedy):
    ids = greedy[0][0].token_ids
    eos = ids[2]
    other = LLM(dataclasses.replace(llm.config, eos_token_ids=(eos,)), llm.params, llm.tokenizer)
    stopped = other.generate(PROMPTS, max_new_tokens=M, temperature=0.0)[0][0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None and len(stopped.token_ids) < len(ids)
    free = other.generate(PROMPTS, max_new_tokens=M, temperature=0.0, ignore_eos=True)
    assert _ids(free) == _ids(greedy) and free[0][0].finish_reason == "length"


def test_include_stop_str_and_the_matched_stop_string(llm, greedy):
    text = greedy[1][0].text
    stop = text[2:4]
    at = text.find(stop)
    for include in (False, True):
        out = llm.generate(PROMPTS, max_new_tokens=M, temperature=0.0, stop=["never-there", stop],
                           include_stop_str_in_output=include)
        c = out[1][0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (text[:at + len(stop)] if include else text[:at])
        joined = "".join(d for j, i, d in llm.stream(PROMPTS, max_new_tokens=M, temperature=0.0, stop=stop,
                                                      include_stop_str_in_output=include) if j == 1)
        assert joined == c.text


# -- log-probabilities ---------------------------------------------------------------------------------

def _log_softmax_rows(llm, raw_logits, prompt, tokens):
    rows = []
    for t in range(len(tokens)):
        x = raw_logits(list(prompt) + list(tokens[:t]))
        rows.append(x - x.max() - np.log(np.exp(x - x.max()).sum()))
    return np.stack(rows)


def test_top_k_logprobs_in_completions_and_the_stream(llm, raw_logits):
    """logprobs=3: three (id, logprob) per token, the largest of a forward pass's log_softmax, the
    same in generate, events and stream; logprobs=True keeps its meaning (no top-k)."""
    kw = dict(n=2, max_new_tokens=6, seed=5, temperature=1.0)
    out = llm.generate(PROMPTS, logprobs=3, **kw)
    c = out[0][1]
    assert len(c.top_logprobs) == len(c.token_ids) == len(c.logprobs)
    ref = _log_softmax_rows(llm, raw_logits, llm.prompt_ids(PROMPTS[0]), c.token_ids)
    for t, alts in enumerate(c.top_logprobs):
        assert len(alts) == 3
        want = np.argsort(-ref[t], kind="stable")[:3]
        assert [a[0] for a in alts] == want.tolist()
        np.testing.assert_allclose([a[1] for a in alts], ref[t][want], atol=2e-4)
    np.testing.assert_allclose(c.logprobs, ref[np.arange(len(c.token_ids)), list(c.token_ids)], atol=2e-4)
    streamed = {}
    for j, i, delta, (tok, lp, top) in llm.stream(PROMPTS, logprobs=3, **kw):
        streamed.setdefault((j, i), []).append((tok, lp, top))
    for j in range(2):
        for i in range(2):
            cc = out[j][i]
            assert streamed[j, i] == list(zip(cc.token_ids, cc.logprobs, cc.top_logprobs))
    plain = llm.generate(PROMPTS, logprobs=True, **kw)
    assert plain[0][1].top_logprobs is None and plain[0][1].logprobs == c.logprobs


def test_stream_delivers_logprobs(llm):
    """stream(logprobs=True) yields one item per token with its log-probability (it dropped them)."""
    kw = dict(n=2, max_new_tokens=6, seed=5)
    out = llm.generate(PROMPTS, logprobs=True, **kw)
    items = list(llm.stream(PROMPTS, logprobs=True, **kw))
    assert all(len(it) == 4 for it in items)
    for j in range(2):
        for i in range(2):
            mine = [it for it in items if it[:2] == (j, i)]
            assert [m[3][1] for m in mine] == list(out[j][i].logprobs)
            assert [m[3][0] for m in mine] == list(out[j][i].token_ids) and all(m[3][2] is None for m in mine)
            assert "".join(m[2] for m in mine) == out[j][i].text
    assert all(len(it) == 3 and it[2] for it in llm.stream(PROMPTS, **kw))


@pytest.mark.parametrize("k", [True, 2])
def test_prompt_logprobs_equal_a_forward_pass(llm, raw_logits, k):
    out = llm.generate(PROMPTS, n=2, max_new_tokens=3, prompt_logprobs=k)
    for j, p in enumerate(PROMPTS):
        ids = llm.prompt_ids(p)
        got = out[j][0].prompt_logprobs
        assert got == out[j][1].prompt_logprobs and len(got) == len(ids) and got[0] is None
        ref = _log_softmax_rows(llm, raw_logits, ids[:1], ids[1:])
        chosen = [e if k is True else e[0] for e in got[1:]]
        np.testing.assert_allclose(chosen, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
        if k is not True:
            for t, (_, alts) in enumerate(got[1:]):
                want = np.argsort(-ref[t], kind="stable")[:2]
                assert [a[0] for a in alts] == want.tolist()
    assert llm.generate(PROMPTS[0], max_new_tokens=2)[0][0].prompt_logprobs is None


def _walk_avals(jaxpr):
    """Every output aval of ``jaxpr``'s equations, sub-jaxprs (scan, cond, jit) included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk_avals(inner)


def test_prompt_logprobs_in_chunks_equal_one_chunk_without_the_whole_logits(llm):
    """A chunk smaller than the prompt gives the values of one chunk over the whole prompt (the
    unchunked computation) up to rounding, and no array of the computation holds more logits than the LM head
    has weights (the whole [T, V] would: T = 128 > H = 64)."""
    ids = llm.prompt_ids(PROMPTS[0]) + llm.prompt_ids(PROMPTS[1])
    assert len(ids) > 16
    whole = prompt_logprobs_module.prompt_token_logprobs(llm.model, llm.params, ids, 3, chunk=4096)
    parts = prompt_logprobs_module.prompt_token_logprobs(llm.model, llm.params, ids, 3, chunk=4)
    assert len(whole) == len(parts) == len(ids) and whole[0] is None is parts[0]
    # the same numbers up to float32 rounding of logits ~50 (the head is another program per chunk size)
    np.testing.assert_allclose([e[0] for e in parts[1:]], [e[0] for e in whole[1:]], rtol=2e-6, atol=3e-5)
    assert [[a[0] for a in e[1]] for e in parts[1:]] == [[a[0] for a in e[1]] for e in whole[1:]]
    np.testing.assert_allclose([[a[1] for a in e[1]] for e in parts[1:]], [[a[1] for a in e[1]] for e in whole[1:]],
                               rtol=2e-6, atol=3e-5)
    t, h, v = 128, llm.config.hidden_size, llm.config.vocab_size
    assert t > h
    fn = functools.partial(prompt_logprobs_module.prompt_logprob_arrays, llm.model, k=3, chunk=8)
    jaxpr = jax.make_jaxpr(fn)(llm.params, jnp.zeros((1, t), jnp.int32))
    sizes = [int(np.prod(a.shape)) for a in _walk_avals(jaxpr.jaxpr) if v in getattr(a, "shape", ())]
    assert sizes and max(sizes) <= h * v, max(sizes)


def test_identical_prompts_share_one_prompt_logprobs_computation(llm, monkeypatch):
    calls = []
    real = prompt_logprobs_module.prompt_token_logprobs

    def counted(model, params, ids, *args, **kwargs):
        calls.append(tuple(ids))
        return real(model, params, ids, *args, **kwargs)

    monkeypatch.setattr(prompt_logprobs_module, "prompt_token_logprobs", counted)
    out = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], n=2, max_new_tokens=2, prompt_logprobs=2)
    assert sorted(calls) == sorted({tuple(llm.prompt_ids(p)) for p in PROMPTS})
    assert out[0][0].prompt_logprobs == out[2][1].prompt_logprobs != out[1][0].prompt_logprobs


# -- seeds, timings and argument handling ---------------------------------------------------------------

def test_seed_none_draws_a_reported_seed_that_reproduces_the_run(llm):
    kw = dict(n=2, max_new_tokens=M, temperature=1.0, top_k=0, top_p=1.0)
    a = llm.generate(PROMPTS, seed=None, **kw)
    b = llm.generate(PROMPTS, seed=None, **kw)
    assert isinstance(a.seed, int) and a.seed != b.seed
    assert _ids(llm.generate(PROMPTS, seed=a.seed, **kw)) == _ids(a)
    assert llm.generate(PROMPTS, seed=4, **kw).seed == 4
    done = [ev.result for ev in llm.events(PROMPTS, seed=None, **kw) if hasattr(ev, "result")][0]
    assert isinstance(done.seed, int)


def test_sampling_params_object_equals_keywords(llm):
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.9, min_p=0.1, seed=9, logprobs=2)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.9, min_p=0.1, seed=9, logprobs=2)
    assert a == b and llm.generate(PROMPTS, sampling=params, seed=9, n=2) == a
    with pytest.raises(ValueError, match=r"seed=1 vs sampling.seed=9"):
        llm.generate(PROMPTS, params, seed=1)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_ids((2,)) == (5,)
    assert SamplingParams(stop_token_ids=[5]).stop_ids((2,)) == (2, 5)


@pytest.mark.parametrize("fused", [True, False])
def test_timings_add_up_and_count_the_prompt_logprobs_in_the_prefill(llm, monkeypatch, fused):
    """Fused loop (no stop string) and step by step (a stop string): every field is set, the
    phases fit in the total, and the prompt log-probabilities (made 0.3 s slower here) fall in
    prefill_s, first_token_s and total_s."""
    real = llm_module.prompt_logprobs

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    kw = dict(max_new_tokens=4, prompt_logprobs=True) if fused else dict(max_new_tokens=4, prompt_logprobs=True,
                                                                         stop="never in this text")
    llm.generate(PROMPTS, **kw)   # compiled: the prefill phase is then short but for the sleep
    monkeypatch.setattr(llm_module, "prompt_logprobs", slow)
    out = llm.generate(PROMPTS, **kw)
    t = out.timings
    for name in ("prefill_s", "first_token_s", "decode_s", "decode_compile_s"):
        assert getattr(t, name) is not None and getattr(t, name) >= 0, name
    eps = 1e-3
    assert t.prefill_s + t.decode_s <= t.total_s + eps, t
    assert t.prefill_s <= t.first_token_s + eps and t.first_token_s <= t.total_s, t
    assert t.decode_compile_s <= t.decode_s + eps and t.compile_s <= t.total_s + eps, t
    assert t.prefill_s >= 0.3 and t.total_s >= 0.3 + t.decode_s, t
    assert t.decode_tokens_per_s is not None and out[0][0].prompt_logprobs is not None


def test_the_fused_loop_is_compiled_before_on_prefill_waits_for_the_prefill(llm):
    """generate dispatches the decode loop (tracing and compiling it while the prefill runs on
    the device) before it waits for the prefill: when on_prefill is called, the loop of this new
    shape is compiled already."""
    batch = PromptBatch.plain([llm.prompt_ids(p) for p in PROMPTS])
    before = _decode_loop._cache_size()
    at_prefill = []
    out = generate(llm.model, llm.params, batch, max_new_tokens=11, attention="flat",
                   sampling=SamplingConfig(temperature=0.5, top_k=3, top_p=1.0, min_p=0.01),
                   on_prefill=lambda: at_prefill.append(_decode_loop._cache_size()))
    assert at_prefill == [before + 1] and _decode_loop._cache_size() == before + 1
    assert out.tokens.shape == (2, 11)


def test_stream_checks_arguments_at_the_call(llm):
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        llm.stream(PROMPTS, n=0)
    with pytest.raises(TypeError, match="stop: received int 5"):
        llm.stream(PROMPTS, stop=5)
    with pytest.raises(ValueError, match="prompts: prompt 0 is '   '"):
        llm.stream("   ")


# -- the CLI ---------------------------------------------------------------------------------------------

def _parse(argv):
    return parse_args(build_parser(), [str(a) for a in argv])


def test_cli_flags_parse_into_sampling_params():
    a = _parse(["--min-p", 0.1, "--repetition-penalty", 1.2, "--presence-penalty", -0.5, "--frequency-penalty", 0.3,
                "--stop-token-ids", "5,6", "--stop-token-ids", 9, "--ignore-eos", "--include-stop-str",
                "--logprobs", 4, "--prompt-logprobs", "-o", "x.jsonl", "--seed", "random"])
    p = sampling_params(a)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.1, 1.2, -0.5, 0.3)
    assert p.stop_token_ids == (5, 6, 9) and p.ignore_eos and p.include_stop_str_in_output
    assert p.logprobs == 4 and p.prompt_logprobs is True and isinstance(p.seed, int) and a.seed == p.seed
    assert _parse(["--logprobs", "-o", "x"]).logprobs is True and _parse(["--logprobs", 0, "-o", "x"]).logprobs is True
    d = sampling_params(_parse([]))
    assert d == SamplingParams(seed=0) and d.config() == SamplingConfig()


@pytest.mark.parametrize("argv,msg", [
    (["--min-p", 2], "argument --min-p: must be in [0, 1]"),
    (["--repetition-penalty", 0], "argument --repetition-penalty: must be in (0, 1000000], got 0"),
    (["--presence-penalty", 3], "argument --presence-penalty: must be in [-2, 2]"),
    (["--stop-token-ids", "4,x"], "argument --stop-token-ids: expected an integer"),
    (["--seed", "lucky"], "argument --seed: expected an integer or 'random', got 'lucky'"),
    (["--logprobs", -1, "-o", "x"], "argument --logprobs: must be >= 0"),
    (["--prompt-logprobs"], "--prompt-logprobs needs --output"),
    (["--schema", "s.pml", "--prompt-pml", "p.pml", "--ignore-eos"], "--ignore-eos cannot be used with --schema"),
    (["--schema", "s.pml", "--prompt-pml", "p.pml", "--logprobs", 3, "-o", "x"],
     "--logprobs K cannot be used with --schema"),
])
def test_cli_flag_errors(argv, msg, capsys):
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_cli_records_carry_the_new_options(gguf, llm, tmp_path, capsys):
    """One run with every option: the records hold the settings, the drawn seed, stop_reason,
    top-k and prompt log-probabilities, and the completions `LLM.generate` gives for them."""
    out = tmp_path / "o.jsonl"
    greedy = llm.generate("the cat sat on", max_new_tokens=6, temperature=0.0)[0][0]
    stop_id = greedy.token_ids[2]
    argv = ["--model", gguf, "-p", "the cat sat on", "-n", 2, "-m", 6, "-t", 0.9, "--min-p", 0.05,
            "--repetition-penalty", 1.3, "--presence-penalty", 0.2, "--frequency-penalty", 0.1,
            "--stop-token-ids", stop_id, "--include-stop-str", "--logprobs", 2, "--prompt-logprobs",
            "--seed", "random", "-o", out]
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 0, err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2
    seed = recs[0]["seed"]
    want = llm.generate("the cat sat on", n=2, max_new_tokens=6, temperature=0.9, min_p=0.05, repetition_penalty=1.3,
                        presence_penalty=0.2, frequency_penalty=0.1, stop_token_ids=[stop_id],
                        include_stop_str_in_output=True, logprobs=2, prompt_logprobs=True, seed=seed)
    n_prompt = len(llm.prompt_ids("the cat sat on"))
    for i, r in enumerate(recs):
        c = want[0][i]
        assert isinstance(seed, int) and r["seed"] == seed
        assert r["sampling"] | {"stop_token_ids": [stop_id]} == r["sampling"] and r["sampling"]["min_p"] == 0.05
        assert (r["sampling"]["repetition_penalty"], r["sampling"]["presence_penalty"],
                r["sampling"]["frequency_penalty"], r["sampling"]["include_stop_str"],
                r["sampling"]["ignore_eos"]) == (1.3, 0.2, 0.1, True, False)
        assert r["token_ids"] == list(c.token_ids) and r["completion"] == c.text
        assert r["stop_reason"] == c.stop_reason and (c.stop_reason is None or c.stop_reason == stop_id)
        assert r["top_logprobs"] == [[list(p) for p in alts] for alts in c.top_logprobs]
        assert all(len(alts) == 2 for alts in r["top_logprobs"])
        assert len(r["prompt_logprobs"]) == n_prompt and r["prompt_logprobs"][0] is None
        assert r["prompt_logprobs"] == list(c.prompt_logprobs)
