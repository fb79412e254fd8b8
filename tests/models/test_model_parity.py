"""Parity of the Llama decoder with transformers' LlamaForCausalLM (PyTorch, CPU, fp32).

Tiny random HF models are saved with ``save_pretrained`` into a temp dir and loaded with our
loader.  Prompts are longer than 256 tokens (so RoPE errors show), split into a shared prefix and
per-sequence suffixes; we compare the full-forward (prefill) logits, the cached prefill's
last-token logits and 16 teacher-forced decode steps (backend "shared"; "flat" on the GQA config).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import Llama, PromptBatch, load_hf_checkpoint, prefill_prefix_cache  # noqa: E402
from helpers import rel_err  # noqa: E402

CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_llama3_rope": dict(num_attention_heads=4, num_key_value_heads=1,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}
PREFIX, SUFFIXES, STEPS = 200, (70, 57), 16
MEASURED = {}


def make_hf_model(tmp_path, seed=0, **over):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.05)
    kw.update(over)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    model.save_pretrained(tmp_path)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_with_transformers(name, tmp_path):
    hf = make_hf_model(tmp_path, **CONFIGS[name])
    config, params = load_hf_checkpoint(tmp_path, jnp.float32)
    assert config.tie_word_embeddings == ("lm_head" not in params)
    model = Llama(config)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 300, PREFIX).tolist()
    suffixes = [rng.integers(0, 300, n).tolist() for n in SUFFIXES]
    steps = rng.integers(0, 300, (len(SUFFIXES), STEPS))
    full = [prefix + s + steps[b].tolist() for b, s in enumerate(suffixes)]
    ref = [hf_logits(hf, toks) for toks in full]

    # (1) full forward == HF at every position (the prefill logits)
    fwd = np.asarray(jax.jit(model.forward)(params, np.asarray([full[0]])))[0]
    err_fwd = rel_err(fwd, ref[0])
    assert err_fwd < 1e-4, err_fwd

    # (2) cached prefill (prefix once + suffixes) and 16 decode steps, per backend
    pb = PromptBatch.shared(prefix, suffixes)
    pc = prefill_prefix_cache(model, params, pb)
    toks, n = pb.suffix_arrays()
    errs = {}
    # "flat" is checked on one config here (and on every generation test); "shared" on all
    for backend in (("shared", "flat") if name == "gqa" else ("shared",)):
        cap = max(SUFFIXES) + STEPS + (PREFIX if backend == "flat" else 0)
        logits, cache = model.prefill_jit(params, pc, toks, n, capacity=cap, backend=backend)
        got = [np.asarray(logits)]
        for i in range(STEPS):
            logits, cache = model.decode_step_jit(params, cache, jnp.asarray(steps[:, i]))
            got.append(np.asarray(logits))
        got = np.stack(got, axis=1)  # [B, 1 + STEPS, V]
        assert np.isfinite(got).all()
        want = np.stack([ref[b][PREFIX + SUFFIXES[b] - 1: PREFIX + SUFFIXES[b] + STEPS] for b in range(len(SUFFIXES))])
        errs[backend] = rel_err(got, want)
        assert errs[backend] < 1e-4, (backend, errs[backend])
        # prefill + step decode == one full forward of our own model (same tokens)
        own = fwd[PREFIX + SUFFIXES[0] - 1: PREFIX + SUFFIXES[0] + STEPS]
        assert rel_err(got[0], own) < 1e-5
        np.testing.assert_array_equal(np.asarray(cache.lengths),
                                      np.asarray(SUFFIXES) + STEPS + (PREFIX if backend == "flat" else 0))
    # the reused prefix cache was not donated away
    assert np.isfinite(np.asarray(pc.last_logits)).all()
    MEASURED[name] = dict(forward=err_fwd, **errs)
    print(f"\nparity {name}: {MEASURED[name]}")
