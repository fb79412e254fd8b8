"""The built-in SmolLM2-135M-Instruct GGUF: our loader + Flax Llama vs transformers loading the
same file (fp32, both dequantising it): identical weights, logits within 1e-3, identical greedy
continuations (32 tokens, plain and chat prompts), and "Paris" for the capital of France."""
import os

import numpy as np
import pytest

from helpers import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models.config import LlamaConfig  # noqa: E402
from models.generate import PromptBatch, generate  # noqa: E402
from models.gguf import default_gguf_path, load_gguf, open_gguf  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from models.weights import params_from_hf_state_dict  # noqa: E402

pytestmark = pytest.mark.slow

PLAIN = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
STEPS = 32


@pytest.fixture(scope="module")
def ours():
    f = open_gguf(default_gguf_path())
    hf_cfg, state = load_gguf(f)
    config = LlamaConfig.from_hf_config(hf_cfg)
    params = params_from_hf_state_dict(config, state, jnp.float32)
    return config, params, Tokenizer.from_gguf(f), state


@pytest.fixture(scope="module")
def hf_model():
    path = default_gguf_path()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    return model


def _prompts(tok):
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return [tok.encode(p) for p in PLAIN] + [tok.encode(c, add_special_tokens=False) for c in chats]


def _hf_greedy(model, ids, steps):
    out = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            t = int(res.logits[0, -1].argmax())
            out.append(t)
            res = model(torch.tensor([[t]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def test_weights_identical_to_transformers(ours, hf_model):
    _, _, _, state = ours
    hf_state = hf_model.state_dict()
    assert set(state) == set(hf_state) - {"lm_head.weight"}  # tied embeddings
    for name, w in state.items():
        np.testing.assert_array_equal(w, hf_state[name].numpy(), err_msg=name)


def test_logits_match_transformers(ours, hf_model):
    config, params, tok, _ = ours
    prompts = _prompts(tok)
    t = max(len(p) for p in prompts)
    padded = np.zeros((len(prompts), t), np.int32)  # right padding: causal, so never seen
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    got_all = np.asarray(jax.jit(Llama(config, impl="reference").forward)(params, jnp.asarray(padded)))
    errs = []
    for i, ids in enumerate(prompts):
        got = got_all[i, :len(ids)]
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].numpy()
        assert got.shape == want.shape and np.isfinite(got).all()
        errs.append(rel_err(got, want))
    print("logits rel err per prompt:", errs)
    assert max(errs) < 1e-3, errs


@pytest.fixture(scope="module")
def hf_continuations(ours, hf_model):
    _, _, tok, _ = ours
    return [_hf_greedy(hf_model, ids, STEPS) for ids in _prompts(tok)]


def _check(tok, got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (i, tok.decode(g), tok.decode(w))


def test_greedy_continuations_match_transformers_flat(ours, hf_continuations):
    """Plain and chat prompts, one cache per sequence (flat backend), 32 greedy tokens each."""
    config, params, tok, _ = ours
    prompts = _prompts(tok)
    batch = PromptBatch(levels=(tuple(tuple(p) for p in prompts),), suffixes=tuple(() for _ in prompts))
    out = generate(Llama(config), params, batch, max_new_tokens=STEPS, attention="flat", eos_token_ids=())
    _check(tok, out.tokens.tolist(), hf_continuations)


def test_greedy_continuations_match_transformers_shared(ours, hf_continuations):
    """The chat prompts share the template's system prefix: stored once, shared attention.
    The answer to the France question (up to the end-of-turn token) is "...Paris."."""
    config, params, tok, _ = ours
    chats = _prompts(tok)[len(PLAIN):]
    n = next(i for i in range(min(map(len, chats))) if len({c[i] for c in chats}) > 1)
    assert n > 10
    batch = PromptBatch(levels=((tuple(chats[0][:n]),),), suffixes=tuple(c[n:] for c in chats))
    out = generate(Llama(config), params, batch, max_new_tokens=STEPS, attention="shared", eos_token_ids=())
    got = out.tokens.tolist()
    _check(tok, got, hf_continuations[len(PLAIN):])
    france = got[0]
    end = next(i for i, t in enumerate(france) if t in tok.stop_token_ids)
    assert tok.decode(france[:end]) == "The capital of France is Paris."
