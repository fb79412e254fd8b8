"""`models.LLM`: text in, completions out, on a tiny random Llama GGUF (and the built-in SmolLM2
against transformers): samples independent of `n` and of the other prompts, automatic sharing
equal to flat, stream deltas joining to the generated text, stop strings, EOS, log-probs equal to
a log-softmax of a forward pass, prompt formats, argument errors; the sharing planner; tensor and
data parallel on the 4 CPU devices equal to one device; batch-size buckets (no new compile)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from helpers import tiny_config, tiny_state_dict, tiny_tokenizer_meta, write_tiny_gguf
from models import LLM, Completion, PromptBatch, SamplingParams, plan_prompt_batch
from models.batch_buckets import batch_bucket, pad_batch
from models.gguf import CheckpointError, load_gguf, write_llama_gguf
from models.llm import FinishEvent, PhaseEvent, StepEvent, TokenEvent
from models.sharding import make_mesh, padded_shapes, param_spec

SHARED = "In the beginning the cat sat on the mat, "            # > MIN_SHARED_TOKENS tokens
PROMPTS = [SHARED + "then", SHARED + "and the dog", SHARED + "so it"]
M = 10
SEED = 7


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # peaked logits, but samples still vary
    return LLM.load(write_tiny_gguf(tmp_path_factory.mktemp("llm") / "tiny.gguf", seed=11,
                                    lm_head_scale=12))


@pytest.fixture(scope="module")
def base(llm):
    """Two prompts x 2 samples, default sampling, log-probs (fused loop, shared layout)."""
    return llm.generate(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED, logprobs=True)


def _ids(result):
    return [[c.token_ids for c in row] for row in result]


def test_result_shape_and_types(base):
    assert len(base) == 2 and all(len(row) == 2 for row in base)
    for row in base:
        for c in row:
            assert isinstance(c, Completion) and c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= M and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == "stop" or len(c.token_ids) == M
    assert base[0][0].token_ids != base[0][1].token_ids, "two samples of one prompt should differ"
    assert base.sharing.attention == "shared" and base.timings.new_tokens == sum(
        len(c.token_ids) for row in base for c in row)


def test_samples_depend_only_on_seed_prompt_and_sample_index(llm, base):
    """Sample i of prompt j: the same with n=3 and a third prompt (two-level sharing of 9
    sequences), and alone (one sequence, nothing shared); another seed changes it."""
    more = llm.generate(PROMPTS, n=3, max_new_tokens=M, seed=SEED)
    assert [row[:2] for row in _ids(more)[:2]] == _ids(base)
    alone = llm.generate(PROMPTS[0], max_new_tokens=M, seed=SEED)   # prompt 0, sample 0
    assert alone.sharing.levels == () and alone.sharing.attention == "flat"
    assert _ids(alone) == [[base[0][0].token_ids]]
    other = llm.generate(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED + 1)
    assert _ids(other) != _ids(base)


def _common(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_automatic_sharing_equals_flat_and_reports_savings(llm, base):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    root = _common(*ids)
    assert root >= 16
    rep = base.sharing
    assert rep.levels == ((1, (root,)), (2, (len(ids[0]) - root, len(ids[1]) - root)))
    assert rep.prompt_tokens == 2 * (len(ids[0]) + len(ids[1]))
    assert rep.tokens_shared == rep.prompt_tokens - (len(ids[0]) + len(ids[1]) - root)
    c = llm.config
    assert rep.bytes_saved == rep.tokens_shared * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert rep.kv_bytes < rep.kv_bytes_flat and "stored once" in str(rep)
    flat = llm.generate(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED, logprobs=True, attention="flat")
    assert flat.sharing.attention == "flat" and flat.sharing.tokens_shared == 0
    assert _ids(flat) == _ids(base) and [[c.text for c in r] for r in flat] == [[c.text for c in r] for r in base]
    for fr, br in zip(flat, base):
        for f, b in zip(fr, br):
            assert f.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # an explicit shared prompt is shared even when short; without it nothing is
    short = llm.generate(["so", "then"], shared_prompt="A cat", max_new_tokens=2, temperature=0)
    assert short.sharing.levels[0][0] == 1 and short.sharing.attention == "shared"
    assert llm.generate(["A catso", "A catthen"], max_new_tokens=2, temperature=0).sharing.levels == ()


def test_stream_deltas_join_to_the_generated_text(llm, base):
    texts, events = {}, []
    for ev in llm.events(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED, logprobs=True):
        events.append(ev)
        if isinstance(ev, TokenEvent):
            texts[ev.prompt_index, ev.sample_index] = texts.get((ev.prompt_index, ev.sample_index), "") + ev.text
    assert [e.name for e in events if isinstance(e, PhaseEvent)] == ["prefill", "decode"]
    finished = {(e.prompt_index, e.sample_index): e.completion for e in events if isinstance(e, FinishEvent)}
    assert finished == {(j, i): base[j][i] for j in range(2) for i in range(2)}
    assert {k: v for k, v in texts.items()} == {(j, i): base[j][i].text for j in range(2) for i in range(2)}
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps[-1].new_tokens == base.timings.new_tokens and steps[-1].running == 0
    done = events[-1].result
    assert done == base and done.timings.first_token_s <= done.timings.total_s
    streamed = {}
    for j, i, delta in llm.stream(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED):
        assert delta
        streamed[j, i] = streamed.get((j, i), "") + delta
    assert streamed == {k: v for k, v in texts.items() if v}


def _pieces(llm, ids):
    dec = llm.tokenizer.stream_decoder(skip_special_tokens=True)
    return [dec.push(t) for t in ids]


def test_stop_string_spanning_two_tokens(llm, base):
    """A stop string made of the last character of one token's text and the first of the
    next: the sample ends at the token completing its first occurrence, the text before it."""
    j, i = max(((j, i) for j in range(2) for i in range(2)), key=lambda ji: len(base[ji[0]][ji[1]].token_ids))
    ids = base[j][i].token_ids
    pieces = _pieces(llm, ids)
    at = next(k for k in range(1, len(pieces)) if pieces[k] and any(pieces[:k]))
    before = next(p for p in reversed(pieces[:at]) if p)
    stop = before[-1] + pieces[at][0]
    cumulative = np.cumsum([len(p) for p in pieces])
    text = "".join(pieces)
    first = text.find(stop)
    end = int(np.searchsorted(cumulative, first + len(stop)))    # token completing the occurrence
    out = llm.generate(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED, stop=[stop, "zzzz-never"], logprobs=True)
    c = out[j][i]
    assert c.finish_reason == "stop" and c.text == text[:first]
    assert c.token_ids == ids[:end + 1] and c.logprobs == pytest.approx(base[j][i].logprobs[:end + 1], abs=1e-5)
    for jj in range(2):
        for ii in range(2):
            o, b = out[jj][ii], base[jj][ii]
            assert stop not in o.text and b.token_ids[:len(o.token_ids)] == o.token_ids
            if stop not in b.text:
                assert o == b
    joined = {}
    for jj, ii, delta in llm.stream(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED, stop=stop):
        assert stop not in delta
        joined[jj, ii] = joined.get((jj, ii), "") + delta
    assert joined.get((j, i), "") == c.text


def test_end_of_sequence_id_always_stops(llm, base):
    ids = base[0][0].token_ids
    eos = ids[2]
    first = ids.index(eos)
    other = LLM(dataclasses.replace(llm.config, eos_token_ids=(eos,)), llm.params, llm.tokenizer)
    assert set(other.eos_token_ids) == {eos} | set(llm.tokenizer.stop_token_ids)
    c = other.generate(PROMPTS[:2], n=2, max_new_tokens=M, seed=SEED)[0][0]
    assert c.finish_reason == "stop" and c.token_ids == ids[:first + 1]
    assert c.text == llm.tokenizer.decode(ids[:first], skip_special_tokens=True)


def test_logprobs_are_log_softmax_of_a_forward_pass(llm, base):
    rows, starts = [], []
    for j in range(2):
        prompt = llm.tokenizer.encode(PROMPTS[j])
        for i in range(2):
            rows.append(prompt + list(base[j][i].token_ids))
            starts.append(len(prompt))
    width = max(map(len, rows))
    padded = np.zeros((len(rows), width), np.int32)   # right padding: causal, never seen
    for r, seq in enumerate(rows):
        padded[r, :len(seq)] = seq
    logits = np.asarray(jax.jit(llm.model.forward)(llm.params, jnp.asarray(padded)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for r, (seq, s) in enumerate(zip(rows, starts)):
        c = base[r // 2][r % 2]
        want = [logp[r, s - 1 + t, tok] for t, tok in enumerate(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, want, atol=2e-4)


def test_prompt_forms(llm):
    tok = llm.tokenizer
    q = "what is a cat"
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
    assert llm.prompt_ids(q, chat=True) == chat_ids
    assert llm.prompt_ids([{"role": "user", "content": q}], chat=True) == chat_ids
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]
    assert llm.prompt_ids(q, chat=True, shared_prompt="Be brief.") == tok.encode(
        tok.apply_chat_template(system), add_special_tokens=False)
    assert llm.prompt_ids([5, 6], shared_prompt="Hi") == tok.encode("Hi") + [5, 6]
    assert llm.prompt_ids("the cat", shared_prompt="Hi ") == tok.encode("Hi the cat")
    with pytest.raises(ValueError, match="system message"):
        llm.prompt_ids(system, chat=True, shared_prompt="x")
    with pytest.raises(TypeError, match="chat=True"):
        llm.prompt_ids([5, 6], chat=True)
    with pytest.raises(TypeError, match="need chat=True"):
        llm.prompt_ids(system)


@pytest.mark.parametrize("kw,err,match", [
    (dict(n=0), ValueError, "n must be an int >= 1, got 0"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(temperature=-1.0), ValueError, r"temperature: received -1.0, expected a finite float >= 0"),
    (dict(top_p=0.0), ValueError, r"top_p: received 0.0, expected a float in \(0, 1\]"),
    (dict(top_k=-1), ValueError, "top_k: received -1, expected an int >= 0"),
    (dict(seed=2**32), ValueError, "seed must be an int in"),
    (dict(stop=""), ValueError, "stop must be a non-empty string"),
    (dict(stop=["a", 3]), ValueError, "stop must be"),
    (dict(attention="paged"), ValueError, "attention must be one of"),
    (dict(max_new_tokens=200), ValueError, r"\+ max_new_tokens \(200\) = \d+ exceeds the model's context of 128"),
    (dict(prompts=[]), ValueError, "at least one prompt"),
    (dict(prompts=""), ValueError, "prompts: prompt 0 is '', expected text"),
    (dict(prompts=["the cat", " \n\t "]), ValueError, r"prompts: prompt 1 is ' \\n\\t ', expected text"),
    (dict(stop=5), TypeError, "stop: received int 5, expected a string or a list of strings"),
    (dict(logprobs=-1), ValueError, "logprobs: received -1, expected a bool or an int"),
    (dict(min_p=1.5), ValueError, r"min_p: received 1.5, expected a float in \[0, 1\]"),
    (dict(min_p="0.1"), TypeError, r"min_p: received str '0.1', expected a float in \[0, 1\]"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty: received 0.0, expected a finite float > 0"),
    (dict(repetition_penalty=None), TypeError, "repetition_penalty: received NoneType None, expected a finite float"),
    (dict(presence_penalty=3.0), ValueError, r"presence_penalty: received 3.0, expected a float in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), ValueError, r"frequency_penalty: received -2.5, expected a float in \[-2, 2\]"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids: received int 5, expected a list of ints"),
    (dict(stop_token_ids=[10**6]), ValueError, r"stop_token_ids: received \[1000000\], expected ids below"),
    (dict(ignore_eos=1), TypeError, "ignore_eos: received 1, expected a bool"),
    (dict(best_of=2), TypeError, "unexpected keyword argument.*'best_of'"),
    (dict(sampling={"n": 2}), TypeError, "sampling: received dict, expected SamplingParams"),
    (dict(sampling=SamplingParams(n=2), n=3), ValueError, "n=3 vs sampling.n=2"),
    (dict(prompts=3), TypeError, "prompts must be"),
    (dict(shared_prompt=3), TypeError, "shared_prompt must be a string"),
])
def test_argument_errors(llm, kw, err, match):
    prompts = kw.pop("prompts", "the cat")
    with pytest.raises(err, match=match):
        llm.generate(prompts, **kw)
    with pytest.raises(err, match=match):
        llm.events(prompts, **kw)   # checked at the call, before anything runs


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="model file not found"):
        LLM.load(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match="has no config.json"):
        LLM.load(tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM.load(tmp_path / "missing.gguf", dtype="int8")
    with pytest.raises(ValueError, match="attention must be one of"):
        LLM.load(attention="fast")


def test_plan_prompt_batch():
    rng = np.random.default_rng(0)
    root = rng.integers(3, 99, 20).tolist()
    a, b = root + [1, 2, 3], root + [4]
    assert plan_prompt_batch([a]) == PromptBatch.plain([a])
    assert plan_prompt_batch([a], 3) == PromptBatch(levels=((tuple(a),),), suffixes=((),) * 3)
    assert plan_prompt_batch([a, b]) == PromptBatch.shared(root, suffixes=[[1, 2, 3], [4]])
    assert plan_prompt_batch([a, b], 2) == PromptBatch.two_level(root, [[1, 2, 3], [4]], num_samples=2)
    assert plan_prompt_batch([a, root], 2) == PromptBatch.two_level(root[:-1], [root[-1:] + [1, 2, 3], root[-1:]],
                                                                     num_samples=2)  # no empty node
    assert plan_prompt_batch([a, a]) == PromptBatch.shared(a, suffixes=[[], []])
    short = [root[:5] + [1], root[:5] + [2]]
    assert plan_prompt_batch(short) == PromptBatch.plain(short)
    assert plan_prompt_batch(short, min_shared_tokens=5) == PromptBatch.shared(root[:5], suffixes=[[1], [2]])
    assert plan_prompt_batch(short, 2) == PromptBatch(levels=(tuple(map(tuple, short)),), suffixes=((),) * 4)
    for batch in (plan_prompt_batch([a, b], 2), plan_prompt_batch([a, b, root + [9]], 3)):
        batch.validate(100)
        n = batch.batch // len(batch.levels[-1])
        assert [batch.full_prompt(r) for r in range(batch.batch)][::n] == [a, b] + ([root + [9]] if n == 3 else [])
    with pytest.raises(ValueError, match="empty prompt: prompt 1"):
        plan_prompt_batch([a, []])


# ---------------------------------------------------------------------------------------------
# the built-in model against transformers
# ---------------------------------------------------------------------------------------------
DOC = "Here is a short Python function that computes the n-th Fibonacci number.\n\n"
PLAIN = [DOC + "def fibonacci(n):", DOC + "def fib(n):\n    \"\"\""]
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
STEPS = 10


@pytest.mark.slow
def test_builtin_model_greedy_text_equals_transformers():
    """Chat prompts (their template prefix shared) in one call, plain prompts (a shared
    document) in another: greedy token ids and text equal transformers' greedy decoding with the
    same weights (the GGUF's, identical to transformers' own GGUF loading: test_gguf_smollm.py).
    The second call has the first call's bucketed shapes, so it compiles nothing."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    llm = LLM.load(dtype="float32")
    hf_config, state = load_gguf(llm.info["path"])
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).eval()
    hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=False)
    hf.tie_weights()
    stops = set(llm.eos_token_ids)
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # torch's thread pool spins against XLA's on the 2 CI cores
    try:
        _compare(llm, hf, torch, stops, results)
    finally:
        torch.set_num_threads(threads)
    assert results[0][0][0].text == "The capital of France is Paris."
    assert results[1].timings.compile_s == 0.0


def _compare(llm, hf, torch, stops, results):
    for prompts, chat in ((CHAT, True), (PLAIN, False)):
        out = llm.generate(prompts, chat=chat, temperature=0, max_new_tokens=STEPS)
        assert out.sharing.attention == "shared" and len(out.sharing.levels) == 1
        results.append(out)
        for j, p in enumerate(prompts):
            ids = llm.prompt_ids(p, chat=chat)
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                  eos_token_id=sorted(stops), pad_token_id=0)[0, len(ids):].tolist()
            end = next((k for k, t in enumerate(gen) if t in stops), None)
            want = gen if end is None else gen[:end + 1]
            c = out[j][0]
            assert c.token_ids == tuple(want), (p, c.text)
            assert c.text == llm.tokenizer.decode(want[:end] if end is not None else want, skip_special_tokens=True)
            assert c.finish_reason == ("length" if end is None else "stop")


def _smollm2_shaped_gguf(tmp_path):
    """A random checkpoint with SmolLM2-135M's shapes (30 layers, 9 query / 3 kv heads of 64,
    tied embeddings) and the tiny tokenizer."""
    meta = tiny_tokenizer_meta()
    cfg = tiny_config(vocab_size=len(meta["tokens"]), bos_token_id=1, eos_token_id=2, hidden_size=576,
                      intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    weights = tiny_state_dict(cfg, seed=5)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 4
    path = tmp_path / "smol_shaped.gguf"
    write_llama_gguf(path, cfg, weights, tokenizer=meta)
    return path


@pytest.mark.gpu
def test_smollm2_shaped_model_on_gpu_shared_equals_flat(tmp_path):
    """On a GPU (Pallas kernels), a random checkpoint with SmolLM2-135M's shapes (30 layers,
    9 query / 3 kv heads of 64, tied embeddings): float32 samples through the shared kernels
    equal the flat ones; bfloat16 (the GPU default) gives finite log-probs.  (The built-in
    model's own answers are checked against transformers on the CPU.)"""
    path = _smollm2_shaped_gguf(tmp_path)
    llm = LLM.load(path, dtype="float32")
    prompts = [SHARED * 8 + q for q in ("then", "and the dog", "so it")]
    outs = {a: llm.generate(prompts, n=4, max_new_tokens=24, seed=1, attention=a, logprobs=True)
            for a in ("shared", "flat")}
    assert outs["shared"].sharing.tokens_shared > 0 and outs["flat"].sharing.tokens_shared == 0
    assert _ids(outs["shared"]) == _ids(outs["flat"])
    bf16 = LLM.load(path)
    assert bf16.info["dtype"] == "bfloat16"
    out = bf16.generate(prompts, n=4, max_new_tokens=24, seed=1, logprobs=True)
    for row in out:
        for c in row:
            assert c.finish_reason in ("stop", "length") and np.isfinite(c.logprobs).all()


# ---------------------------------------------------------------------------------------------
# several devices (the 4 CPU devices of tests/conftest.py) and batch-size buckets
# ---------------------------------------------------------------------------------------------
def test_tensor_and_data_parallel_give_one_devices_tokens(llm):
    """`LLM.load(tensor_parallel=2, data_parallel=2)`: every split parameter sits in blocks on its
    devices (none holds it whole), and greedy decoding of three prompts (padded to four rows, two
    per data shard) gives one device's tokens and log-probabilities."""
    mp = LLM.load(llm.info["path"], tensor_parallel=2, data_parallel=2)
    assert (mp.tensor_parallel, mp.data_parallel) == (2, 2) and mp.mesh.devices.size == 4
    assert mp.info["num_parameters"] == llm.info["num_parameters"]
    shapes = padded_shapes(mp.config, 2)
    for path, x in jax.tree_util.tree_leaves_with_path(mp.params):
        name = str(path[-1].key)
        assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mp.mesh, name
        assert x.sharding.spec == param_spec(name, x.ndim), name
        if shapes.padded_axis(name, mp.config) is not None:
            assert all(s.data.size * 2 == x.size for s in x.addressable_shards), name
    want = llm.generate(PROMPTS, max_new_tokens=M, temperature=0, logprobs=True)
    got = mp.generate(PROMPTS, max_new_tokens=M, temperature=0, logprobs=True)
    assert len({c.token_ids for row in want for c in row}) == 3, "a meaningful reference: the prompts differ"
    assert _ids(got) == _ids(want) and [[c.text for c in r] for r in got] == [[c.text for c in r] for r in want]
    for gr, wr in zip(got, want):
        assert gr[0].logprobs == pytest.approx(wr[0].logprobs, abs=1e-4)
    assert got.sharing == want.sharing and got.timings.new_tokens == want.timings.new_tokens


def test_several_devices_argument_errors(llm):
    """Mesh problems are ValueErrors naming the argument, raised before any file is read."""
    n = len(jax.devices())
    missing = os.path.join(os.path.dirname(llm.info["path"]), "missing.gguf")
    with pytest.raises(ValueError, match=rf"tensor_parallel={2 * n} x data_parallel=1 needs {2 * n} devices, "
                                         rf"but only {n}"):
        LLM.load(missing, tensor_parallel=2 * n)
    with pytest.raises(ValueError, match=rf"tensor_parallel=2 x data_parallel={n} needs {2 * n} devices"):
        LLM.load(missing, tensor_parallel=2, data_parallel=n)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1, got 0"):
        LLM.load(missing, tensor_parallel=0)
    with pytest.raises(ValueError, match="data_parallel must be an int >= 1, got 1.5"):
        LLM.load(missing, data_parallel=1.5)
    with pytest.raises(ValueError, match="pass mesh= or tensor_parallel= / data_parallel=, not both"):
        LLM.load(missing, tensor_parallel=2, mesh=make_mesh(2))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        LLM.load(missing, mesh="two devices")


def test_three_and_four_prompts_share_one_compile(llm):
    """The rows are padded to a bucket (copies of row 0, dropped from the results): a call with
    four prompts after one with three compiles nothing, and the three prompts' samples are the
    same in both calls."""
    three = llm.generate(PROMPTS, max_new_tokens=M, seed=SEED, logprobs=True)
    four = llm.generate(PROMPTS + [SHARED + "but the"], max_new_tokens=M, seed=SEED, logprobs=True)
    assert four.timings.compile_s == 0.0
    assert len(three) == 3 and len(four) == 4 and _ids(four)[:3] == _ids(three)
    assert three.sharing.sequences == 3 and three.timings.new_tokens == sum(len(r[0].token_ids) for r in three)


def test_pad_batch_copies_real_rows_into_a_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 24]
    assert [batch_bucket(b, 3) for b in (1, 3, 5, 9)] == [3, 6, 9, 18]
    rng = np.random.default_rng(3)
    tok = lambda k: rng.integers(3, 99, k).tolist()  # noqa: E731
    cases = [  # (batch, multiple, padded rows)
        (PromptBatch.plain([tok(3), tok(5), tok(2)]), 1, 4),
        (PromptBatch.plain([tok(3), tok(5), tok(2)]), 3, 6),
        (PromptBatch.shared(tok(20), num_samples=3), 2, 4),              # one node: rows appended
        (PromptBatch.shared(tok(20), suffixes=[tok(2), [], tok(4)]), 1, 4),
        (PromptBatch.two_level(tok(20), [tok(3), tok(1), tok(2)], num_samples=2), 1, 8),   # 3 -> 4 groups
        (PromptBatch.two_level(tok(20), [tok(3), tok(1), tok(2)], num_samples=3), 2, 12),  # 4 groups: 12 rows
        (plan_prompt_batch([tok(5) for _ in range(5)], 3), 1, 24),       # one level of 5 prompts -> 8
        (PromptBatch.two_level(tok(20), [tok(3), tok(1), tok(2), tok(4)], num_samples=2), 1, 8),  # a bucket
    ]
    for batch, multiple, rows in cases:
        p = pad_batch(batch, multiple=multiple)
        assert p.rows == batch.batch and p.batch.batch == rows and rows % multiple == 0
        p.batch.validate(100)
        assert p.source.tolist()[:batch.batch] == list(range(batch.batch))
        assert all(p.batch.full_prompt(r) == batch.full_prompt(int(s)) for r, s in enumerate(p.source))
        assert [lv[:len(ol)] for lv, ol in zip(p.batch.levels, batch.levels)] == list(batch.levels)


@pytest.mark.gpu
@pytest.mark.two_gpus
def test_two_gpus_llm_samples_equal_one(tmp_path):
    """2 GPUs, the SmolLM2-shaped checkpoint in float32 (3 kv heads: padded to 4 at tp 2):
    `LLM.load(tensor_parallel=2)` and `LLM.load(data_parallel=2)` draw one GPU's samples with
    the default sampling (top-k 50, top-p 0.95, through the Pallas kernels on each shard), three
    prompts x 2 samples (padded rows), in the fused loop and step by step (a stop string)."""
    path = _smollm2_shaped_gguf(tmp_path)
    prompts = [SHARED * 8 + q for q in ("then", "and the dog", "so it")]
    one = LLM.load(path, dtype="float32")
    for kw in (dict(), dict(stop="zzzz-never")):
        want = one.generate(prompts, n=2, max_new_tokens=24, seed=1, logprobs=True, **kw)
        assert len({c.token_ids for row in want for c in row}) > 3
        for tp, dp in ((2, 1), (1, 2)):
            got = LLM.load(path, dtype="float32", tensor_parallel=tp, data_parallel=dp).generate(
                prompts, n=2, max_new_tokens=24, seed=1, logprobs=True, **kw)
            assert _ids(got) == _ids(want), (tp, dp, kw)
            for gr, wr in zip(got, want):
                for g, w in zip(gr, wr):
                    assert g.logprobs == pytest.approx(w.logprobs, abs=2e-3)
