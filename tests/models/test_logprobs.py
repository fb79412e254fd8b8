"""completion_logprobs: parity with transformers (log-softmax of the concatenated sequences) on a
tiny random GQA Llama with ragged prompt and completion lengths, shared vs flat gradients, the
chunked LM head against dense autodiff, bf16, input validation, the built-in SmolLM2 (slow) and
realistic sizes on a GPU."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers import rel_err
from models import Llama, init_params, load_hf_checkpoint, stack_layers, unstack_layers
from models.config import LlamaConfig
from models.training.logprobs import completion_logprobs, default_logits_chunk, resolve_impl, token_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 128
G, N, P, C = 3, 3, 9, 6
PROMPT_LENGTHS = np.array([9, 4, 1])
COMPLETION_LENGTHS = np.array([[6, 1, 3], [1, 6, 0], [2, 5, 1]])


def hf_tiny(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = hf_tiny(path)
    config, params = load_hf_checkpoint(path, jnp.float32)
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, V, (G, P)).astype(np.int32)
    comps = rng.integers(0, V, (G, N, C)).astype(np.int32)
    for g in range(G):       # padding holds ids that would change the result if it were seen
        prompts[g, PROMPT_LENGTHS[g]:] = V - 1
        for n in range(N):
            comps[g, n, COMPLETION_LENGTHS[g, n]:] = V - 1
    want_lp, want_ent = np.zeros((G, N, C)), np.zeros((G, N, C))
    for g in range(G):
        for n in range(N):
            k = COMPLETION_LENGTHS[g, n]
            ids = list(prompts[g, :PROMPT_LENGTHS[g]]) + list(comps[g, n, :k])
            with torch.no_grad():
                ls = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
            rows = ls[PROMPT_LENGTHS[g] - 1: PROMPT_LENGTHS[g] - 1 + k]
            want_lp[g, n, :k] = rows[np.arange(k), comps[g, n, :k]]
            want_ent[g, n, :k] = -(np.exp(rows) * rows).sum(-1)
    args = tuple(map(jnp.asarray, (prompts, PROMPT_LENGTHS, comps, COMPLETION_LENGTHS)))
    return dict(model=Llama(config), params=params, args=args, want_lp=want_lp, want_ent=want_ent)


def _run(model, impl, **kw):
    return jax.jit(lambda p, *a: completion_logprobs(model, p, *a, impl=impl, return_entropy=True, **kw))


def test_matches_transformers_shared_and_flat(case):
    """Shared (stacked layers, remat, small chunks) and flat (layer list, no remat) against
    transformers' log-softmax of each [prompt; completion]; entropies too; exactly 0 past the
    completion lengths."""
    m, p, args = case["model"], case["params"], case["args"]
    valid = np.arange(C)[None, None] < COMPLETION_LENGTHS[..., None]
    runs = {"shared": _run(m, "shared", logits_chunk=8, vocab_chunk=32)(p, *args),
            "flat": _run(m, "flat", remat=False)(unstack_layers(p), *args)}
    for name, (lp, ent) in runs.items():
        lp, ent = np.asarray(lp), np.asarray(ent)
        assert lp.shape == (G, N, C) and lp.dtype == np.float32
        err = np.abs(lp - case["want_lp"]).max()
        assert err < 1e-4, (name, err)
        assert np.abs(ent - case["want_ent"]).max() < 1e-4, name
        assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all(), name
        assert (lp[valid] < 0).all(), name
        print(f"\n{name}: max |logprob - transformers| = {err:.2e}")


def test_gradients_shared_equal_flat(case):
    """jit(value_and_grad(sum(logprobs))): shared (stacked) vs flat (layer list) parameters."""
    m, p, args = case["model"], case["params"], case["args"]

    def total(params, impl, remat):
        return completion_logprobs(m, params, *args, impl=impl, remat=remat).sum()
    vg = jax.jit(jax.value_and_grad(total), static_argnums=(1, 2))
    v_s, g_s = vg(p, "shared", True)
    v_f, g_f = vg(unstack_layers(p), "flat", False)
    g_f = stack_layers(g_f)
    assert abs(float(v_s) - float(v_f)) < 1e-4
    errs = {jax.tree_util.keystr(k): rel_err(a, b) for (k, a), b in
            zip(jax.tree_util.tree_leaves_with_path(g_s), jax.tree_util.tree_leaves(g_f))}
    assert max(errs.values()) < 1e-4, errs
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree_util.tree_leaves(g_s))
    print(f"\ngrad rel err shared vs flat: max {max(errs.values()):.2e}")


def test_bf16_parameters_close_to_float32(case):
    m, p, args = case["model"], case["params"], case["args"]
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p)
    lp16 = np.asarray(jax.jit(lambda q: completion_logprobs(m, q, *args, impl="shared"))(p16))
    assert lp16.dtype == np.float32
    assert rel_err(lp16, case["want_lp"]) < 3e-2


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_matches_dense_autodiff(tied):
    """token_logprobs (token and vocabulary chunks, temperature, entropy; custom VJP) against
    autodiff of the dense log-softmax."""
    rng = np.random.default_rng(int(tied))
    m, h, v = 37, 16, 48
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, h) if tied else (h, v)) * 0.5, jnp.float32)
    params = {"embed": w} if tied else {"embed": jnp.zeros((v, h)), "lm_head": w}
    tgt = jnp.asarray(rng.integers(0, v, m), jnp.int32)
    cot = jnp.asarray(rng.standard_normal((2, m)), jnp.float32)

    def dense(x, w):
        z = (x @ (w.T if tied else w)) / 0.7
        ls = jax.nn.log_softmax(z, -1)
        return jnp.take_along_axis(ls, tgt[:, None], -1)[:, 0], -(jnp.exp(ls) * ls).sum(-1)

    def ours(x, w):
        pr = {"embed": w} if tied else {"embed": params["embed"], "lm_head": w}
        return token_logprobs(x, pr, tgt, logits_chunk=8, vocab_chunk=16, temperature=0.7, entropy=True)

    def scalar(fn):
        return lambda x, w: (fn(x, w)[0] * cot[0]).sum() + (fn(x, w)[1] * cot[1]).sum()
    got, want = jax.jit(ours)(x, w), dense(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    g_ours = jax.jit(jax.grad(scalar(ours), argnums=(0, 1)))(x, w)
    g_dense = jax.grad(scalar(dense), argnums=(0, 1))(x, w)
    for a, b in zip(g_ours, g_dense):
        assert rel_err(a, b) < 1e-5


def test_impl_rule_and_default_chunk():
    assert resolve_impl("auto", 1) == "flat" and resolve_impl("auto", 2) == "shared"
    assert resolve_impl("flat", 8) == "flat"
    assert default_logits_chunk(128256, 10 ** 6) == 1024 and default_logits_chunk(49152, 10 ** 6) == 2048
    assert default_logits_chunk(96, 21) == 24


def test_attention_backward_option(case):
    """``attention_backward`` reaches the shared path's attention: off a GPU the plan is the
    reference's whatever it says (same values); an unknown value names the argument, in
    ``completion_logprobs`` and in ``GRPOConfig``."""
    from models.training.rl import GRPOConfig
    m, p, args = case["model"], case["params"], case["args"]
    got = completion_logprobs(m, p, *args, impl="shared", attention_backward="mgpu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(completion_logprobs(m, p, *args, impl="shared")),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="attention_backward must be one of .*got 'triton'"):
        completion_logprobs(m, p, *args, attention_backward="triton")
    with pytest.raises(ValueError, match="attention_backward must be one of"):
        GRPOConfig(attention_backward="fast")


def test_bad_inputs_raise(case):
    m, p, (pt, pl, ct, cl) = case["model"], case["params"], case["args"]

    def call(**over):
        kw = dict(prompt_tokens=pt, prompt_lengths=pl, completion_tokens=ct, completion_lengths=cl)
        opts = {k: over.pop(k) for k in list(over) if k not in kw}
        kw.update(over)
        return completion_logprobs(m, p, kw["prompt_tokens"], kw["prompt_lengths"], kw["completion_tokens"],
                                   kw["completion_lengths"], **opts)
    cases = [
        (dict(prompt_tokens=pt[0]), "prompt_tokens"),
        (dict(prompt_lengths=pl[:2]), "prompt_lengths"),
        (dict(prompt_lengths=pl.at[1].set(0)), "prompt_lengths"),
        (dict(prompt_lengths=pl.at[1].set(P + 1)), "prompt_lengths"),
        (dict(completion_tokens=ct[:2]), "completion_tokens"),
        (dict(completion_lengths=cl[:, :2]), "completion_lengths"),
        (dict(completion_lengths=cl.at[0, 0].set(C + 1)), "completion_lengths"),
        (dict(completion_lengths=cl.at[0, 0].set(-1)), "completion_lengths"),
        (dict(completion_tokens=ct.at[0, 0, 0].set(V)), "completion_tokens"),
        (dict(prompt_tokens=pt.at[1, 0].set(-3)), "prompt_tokens"),
        (dict(completion_tokens=jnp.zeros((G, N, 65), jnp.int32),
              completion_lengths=jnp.ones((G, N), jnp.int32)), "context"),
        (dict(completion_tokens=jnp.zeros((G, N, 60), jnp.int32),
              completion_lengths=jnp.full((G, N), 60, jnp.int32)), "context"),
        (dict(impl="tree"), "impl"),
        (dict(vocab_chunk=30), "vocab_chunk"),
        (dict(logits_chunk=0), "logits_chunk"),
        (dict(temperature=0.0), "temperature"),
    ]
    for over, word in cases:
        with pytest.raises(ValueError, match=word):
            call(**over)
    with pytest.raises(TypeError, match="completion_tokens"):
        call(completion_tokens=ct.astype(jnp.float32))
    with pytest.raises(TypeError, match="model"):
        completion_logprobs(object(), p, pt, pl, ct, cl)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    """The built-in SmolLM2-135M GGUF: log-probs of two fixed completions of one prompt (shared
    path) equal transformers' LlamaForCausalLM with the file's weights (fp32; that these weights
    are transformers' own reading of the file is checked in test_gguf_smollm.py)."""
    from transformers.initialization import no_init_weights  # noqa: PLC0415
    from models.gguf import default_gguf_path, load_gguf  # noqa: PLC0415
    from models.tokenizer import Tokenizer  # noqa: PLC0415
    from models.weights import params_from_hf_state_dict  # noqa: PLC0415
    path = default_gguf_path()
    hf_cfg, state = load_gguf(path, "float32")
    config = LlamaConfig.from_hf_config(hf_cfg)
    params = params_from_hf_state_dict(config, state, jnp.float32)
    tok = Tokenizer.from_gguf(path)
    prompt = tok.encode("Q: What is the capital of France?\nA:", add_special_tokens=False)
    comps = [tok.encode(c, add_special_tokens=False) for c in (" Paris.", " Lyon is")]
    c = max(map(len, comps))
    ct = np.zeros((1, 2, c), np.int32)
    for i, ids in enumerate(comps):
        ct[0, i, :len(ids)] = ids
    lp = np.asarray(completion_logprobs(Llama(config), params, np.asarray([prompt], np.int32),
                                        np.asarray([len(prompt)]), ct, np.asarray([[len(x) for x in comps]]),
                                        impl="shared", remat=False))
    with no_init_weights():     # the same weights in transformers' Llama (no GGUF dequantisation twice)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg))
    missing, unexpected = hf.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in state.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    hf.eval()
    for i, ids in enumerate(comps):
        with torch.no_grad():
            ls = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0].double(), -1).numpy()
        want = ls[np.arange(len(prompt) - 1, len(prompt) - 1 + len(ids)), ids]
        err = np.abs(lp[0, i, :len(ids)] - want).max()
        assert err < 2e-4, (i, err)
        assert (lp[0, i, len(ids):] == 0).all()
    assert lp[0, 0, 0] > lp[0, 1, 0]          # " Paris" is likelier than " Lyon"


@pytest.mark.gpu
def test_gpu_mgpu_attention_backward_matches_kernels():
    """On an H200, bf16, G=2 prompts of 1K tokens and N=8 completions of 256: parameter
    gradients with the Mosaic GPU shared-prefix backward (``attention_backward="mgpu"``) against
    the Triton one."""
    cfg = LlamaConfig.preset("Llama-3.1-8B").replace(num_hidden_layers=2, hidden_size=1024, intermediate_size=2048,
                                                     num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                                     vocab_size=32000, eos_token_ids=(2,), bos_token_id=1)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, jax.random.PRNGKey(1), jnp.float32))
    rng = np.random.default_rng(1)
    args = tuple(jnp.asarray(a, jnp.int32) for a in (
        rng.integers(0, cfg.vocab_size, (2, 1024)), np.array([1024, 700]),
        rng.integers(0, cfg.vocab_size, (2, 8, 256)), rng.integers(1, 257, (2, 8))))
    model = Llama(cfg)
    grad = jax.jit(jax.grad(lambda q, bw: completion_logprobs(model, q, *args, impl="shared",
                                                              attention_backward=bw).sum()),
                   static_argnums=1)
    want, got = grad(params, "kernels"), grad(params, "mgpu")
    errs = [rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))]
    assert max(errs) < 3e-2, errs


@pytest.mark.gpu
def test_gpu_parity_realistic_sizes():
    """bf16 shared path (Pallas kernels) against the fp32 pure-JAX flat reference at realistic
    sizes (Llama-3 shaped layers, 2 of them, G=2 prompts of up to 1000 tokens, N=8 completions of
    up to 256): log-probs and parameter gradients."""
    cfg = LlamaConfig.preset("Llama-3.1-8B").replace(num_hidden_layers=2, hidden_size=1024, intermediate_size=2048,
                                                     num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                                     vocab_size=32000, eos_token_ids=(2,), bos_token_id=1)
    p32 = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p32)
    rng = np.random.default_rng(0)
    g, n, p, c = 2, 8, 1024, 256
    args = (rng.integers(0, cfg.vocab_size, (g, p)), np.array([1000, 517]),
            rng.integers(0, cfg.vocab_size, (g, n, c)), rng.integers(1, c + 1, (g, n)))
    args = tuple(jnp.asarray(a, jnp.int32) for a in args)

    def total(params, model, impl):
        return completion_logprobs(model, params, *args, impl=impl)
    ref_model, fast = Llama(cfg, impl="reference"), Llama(cfg)
    want = jax.jit(total, static_argnums=(1, 2))(p32, ref_model, "flat")
    got16 = jax.jit(total, static_argnums=(1, 2))(p16, fast, "shared")
    got32 = jax.jit(total, static_argnums=(1, 2))(p32, fast, "shared")
    assert rel_err(got32, want) < 1e-3, rel_err(got32, want)
    assert rel_err(got16, want) < 3e-2, rel_err(got16, want)
    grad = jax.jit(jax.grad(lambda q, m, i: total(q, m, i).sum()), static_argnums=(1, 2))
    g_ref = grad(p32, ref_model, "flat")
    for params, tol in ((p32, 1e-3), (p16, 1e-1)):
        g_fast = grad(params, fast, "shared")
        errs = [rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(g_fast), jax.tree_util.tree_leaves(g_ref))]
        assert max(errs) < tol, errs
