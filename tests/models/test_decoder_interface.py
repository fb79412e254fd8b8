"""One decoder interface for both families: ``LLM.load`` picks DeepSeek-V2 from a tiny random
``DeepseekV2ForCausalLM`` checkpoint (saved by transformers, with the tiny byte-level tokenizer),
and ``generate`` / ``stream`` / ``events`` run it through the engine of the Llama family --
greedy tokens equal transformers' greedy ``generate``, sampling is reproducible per seed and the
same fused and step by step -- while the Llama-only features say so by name."""
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import assert_one_error_line, run_cli, write_tiny_gguf  # noqa: E402
from models import LLM  # noqa: E402
from models.decoder import Decoder, DecoderFacts  # noqa: E402
from models.deepseek import Deepseek  # noqa: E402
from models.families import family_of_hf_config  # noqa: E402
from models.generate import generate, prefill_prefix_cache  # noqa: E402
from models.gguf import CheckpointError  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.training.logprobs import completion_logprobs  # noqa: E402
from models.prefix_sharing import PromptBatch  # noqa: E402
from models.prompt_cache import PromptCache  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

SHARED = "In the beginning the cat sat on the mat, "   # > MIN_SHARED_TOKENS tokens
PROMPTS = [SHARED + "then", SHARED + "and the dog", SHARED + "so it"]
M = 6
V2 = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
          v_head_dim=6, first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.2,
          q_lora_rank=12, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2,
          topk_method="group_limited_greedy", n_group=3, topk_group=2, routed_scaling_factor=1.5,
          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                           "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1,
                           "rope_theta": 10000.0},
          eos_token_id=None)


def _tokenizer_files(d, tok: Tokenizer) -> None:
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
         "chat_template": tok.chat_template}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, directory with config.json, model.safetensors, tokenizer.json)."""
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path_factory.mktemp("tok") / "t.gguf", seed=1, lm_head_scale=1))
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(vocab_size=tok.vocab_size, **V2)).eval()
    with torch.no_grad():   # peaked logits, so that greedy tokens are not decided by rounding
        hf.lm_head.weight.mul_(8.0)
    d = tmp_path_factory.mktemp("deepseek_v2")
    hf.save_pretrained(d)
    _tokenizer_files(d, tok)
    return hf, d


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM.load(checkpoint[1], dtype="float32")


def _hf_greedy(hf, ids, m):
    x = torch.tensor([ids])
    with torch.no_grad():
        return hf.generate(x, max_new_tokens=m, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


def _ids(result):
    return [[list(c.token_ids) for c in cs] for cs in result]



def test_deepseek_v3_checkpoint_greedy_equals_transformers(tmp_path):
    """A ``DeepseekV3ForCausalLM`` directory (sigmoid routing with ``noaux_tc`` groups and a
    correction bias, rotate-half RoPE) through ``LLM.load`` and ``generate``."""
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", seed=2, lm_head_scale=1))
    kw = dict(V2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, rope_interleave=False)
    kw.pop("topk_method")
    torch.manual_seed(1)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(vocab_size=tok.vocab_size, **kw)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
        for mod in hf.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.2 * torch.randn_like(mod.e_score_correction_bias))
    hf.save_pretrained(tmp_path / "v3")
    _tokenizer_files(tmp_path / "v3", tok)
    llm = LLM.load(tmp_path / "v3", dtype="float32")
    assert llm.config.architecture == "DeepseekV3ForCausalLM" and llm.config.topk_method == "noaux_tc"
    out = llm.generate(PROMPTS, max_new_tokens=M, temperature=0, ignore_eos=True)
    assert _ids(out) == [[_hf_greedy(hf, llm.prompt_ids(p), M)] for p in PROMPTS]

def test_load_picks_the_family_and_both_models_implement_the_interface(llm):
    assert isinstance(llm.model, Deepseek) and isinstance(llm.model, Decoder)
    assert llm.config.architecture == "DeepseekV2ForCausalLM"
    facts = llm.model.facts
    assert facts == DecoderFacts(family="deepseek", vocab_size=llm.tokenizer.vocab_size, eos_token_ids=(),
                                 pad_token_id=None, max_position_embeddings=256,
                                 cache_values_per_token=3 * (16 + 4), nested_prefixes=False)
    assert llm.kv_bytes_per_token == 3 * 20 * 4
    assert "3 layers" in repr(llm)
    assert family_of_hf_config({"architectures": ["DeepseekV3ForCausalLM"]}) == "deepseek"
    assert family_of_hf_config({"model_type": "deepseek_v2"}) == "deepseek"
    assert family_of_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) == "llama"
    assert family_of_hf_config({}) == "llama"


def test_llama_implements_the_interface(tmp_path):
    llama = LLM.load(write_tiny_gguf(tmp_path / "tiny.gguf", seed=11, lm_head_scale=12))
    assert isinstance(llama.model, Llama) and isinstance(llama.model, Decoder)
    c = llama.config
    assert llama.model.facts.family == "llama"
    assert llama.model.facts.cache_values_per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim


@pytest.mark.parametrize("attention", ["auto", "flat"])
def test_greedy_generate_and_stream_equal_transformers(llm, checkpoint, attention):
    """Three prompts sharing a prefix (stored once with ``"auto"``, per sequence with ``"flat"``):
    greedy ``generate`` (fused loop), ``stream`` and ``events`` (step by step) give transformers'
    greedy tokens one prompt at a time."""
    hf, _ = checkpoint
    out = llm.generate(PROMPTS, n=1, max_new_tokens=M, temperature=0, ignore_eos=True, attention=attention)
    assert (out.sharing.tokens_shared > 0) == (attention == "auto")
    want = [[_hf_greedy(hf, llm.prompt_ids(p), M)] for p in PROMPTS]
    assert _ids(out) == want
    streamed = {}
    for j, i, delta, (tok, lp, top) in llm.stream(PROMPTS, max_new_tokens=M, temperature=0, ignore_eos=True,
                                                   attention=attention, logprobs=True):
        streamed.setdefault((j, i), []).append(tok)
    assert [[streamed[(j, 0)]] for j in range(len(PROMPTS))] == want
    texts = [c[0].text for c in out]
    assert texts == [llm.tokenizer.decode(w[0], skip_special_tokens=True) for w in want]


def test_greedy_samples_of_each_prompt_share_one_folded_level(llm, checkpoint):
    """``n=2``: a shared root and each prompt shared by its samples, folded into one level (each
    prompt stored once, whole); every sample equals transformers' greedy continuation, and the
    sharing report describes what is stored."""
    hf, _ = checkpoint
    out = llm.generate(PROMPTS[:2], n=2, max_new_tokens=M, temperature=0, ignore_eos=True)
    ids = [llm.prompt_ids(p) for p in PROMPTS[:2]]
    assert out.sharing.levels == ((2, tuple(len(i) for i in ids)),)   # the root folded into both prompts
    for j, p in enumerate(PROMPTS[:2]):
        want = _hf_greedy(hf, llm.prompt_ids(p), M)
        assert [list(c.token_ids) for c in out[j]] == [want, want]


@pytest.fixture(scope="module")
def forward_log_softmax(llm):
    """``f(seqs)``: log-softmax of the plain forward's logits ``[len(seq), V]`` of each token
    sequence, from one jitted program for every call: the sequences are right-padded to 64
    tokens and run as one batch (the forward is causal: a position does not see the padding
    after it)."""
    width = 64
    fn = jax.jit(lambda params, tokens: jax.nn.log_softmax(llm.model.forward(params, tokens), axis=-1))

    def f(seqs):
        assert len(seqs) <= 2 and max(map(len, seqs)) <= width
        tokens = np.zeros((2, width), np.int32)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = seq
        out = np.asarray(fn(llm.params, tokens))
        return [out[i, :len(seq)] for i, seq in enumerate(seqs)]
    return f


def test_logprobs_are_log_softmax_of_the_forward(llm, forward_log_softmax):
    out = llm.generate(PROMPTS[:2], n=1, max_new_tokens=M, temperature=0, ignore_eos=True, logprobs=2)
    for j, p in enumerate(PROMPTS[:2]):
        c = out[j][0]
        seq = llm.prompt_ids(p) + list(c.token_ids)
        ref = forward_log_softmax([seq[:-1]])[0][-M:]
        np.testing.assert_allclose(c.logprobs, ref[np.arange(M), c.token_ids], atol=1e-4)
        assert [t[0][0] for t in c.top_logprobs] == np.argmax(ref, axis=-1).tolist()


def test_prompt_logprobs_are_log_softmax_of_the_forward(llm, forward_log_softmax):
    out = llm.generate(PROMPTS[:2], max_new_tokens=1, temperature=0, prompt_logprobs=2)
    for j, p in enumerate(PROMPTS[:2]):
        ids = llm.prompt_ids(p)
        entries = out[j][0].prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        ref = forward_log_softmax([ids])[0]
        for i in range(1, len(ids)):
            chosen, top = entries[i]
            np.testing.assert_allclose(chosen, ref[i - 1, ids[i]], atol=1e-4)
            assert [t for t, _ in top] == np.argsort(-ref[i - 1])[:2].tolist()


def test_seeded_sampling_is_reproducible_fused_and_stepped(llm):
    kw = dict(n=2, max_new_tokens=M, temperature=0.9, top_k=20, top_p=0.95, ignore_eos=True,
              repetition_penalty=1.2)
    a = llm.generate(PROMPTS, seed=5, **kw)
    assert _ids(a) == _ids(llm.generate(PROMPTS, seed=5, **kw))
    assert _ids(a) != _ids(llm.generate(PROMPTS, seed=6, **kw))
    stepped = [ev.result for ev in llm.events(PROMPTS, seed=5, **kw) if hasattr(ev, "result")][0]
    assert _ids(stepped) == _ids(a)
    assert _ids(llm.generate(PROMPTS, seed=5, stop="zzz", **kw)) == _ids(a)   # stop strings: the stepped loop


def test_llama_only_features_name_the_feature_and_the_family(llm):
    msg = "implemented for the llama family only, not for the deepseek family"
    with pytest.raises(NotImplementedError, match=f"Prompt Cache: {msg}"):
        PromptCache(llm.model, llm.params, llm.tokenizer)
    batch = PromptBatch.shared([5, 6, 7], [[8], [9]])
    with pytest.raises(NotImplementedError, match=rf"prefill_prefix_cache \(a reusable prefix cache\): {msg}"):
        prefill_prefix_cache(llm.model, llm.params, batch)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(NotImplementedError, match=f"mesh / tensor_parallel / data_parallel: {msg}"):
        LLM(llm.config, llm.params, llm.tokenizer, mesh=mesh)
    with pytest.raises(NotImplementedError, match=rf"mesh \(tensor- and data-parallel decoding\): {msg}"):
        generate(llm.model, llm.params, batch, max_new_tokens=2, mesh=mesh)
    with pytest.raises(ValueError, match="layout: received 'stacked', expected 'list' or 'auto' for the deepseek"):
        generate(llm.model, llm.params, batch, max_new_tokens=2, layout="stacked")
    with pytest.raises(ValueError, match="attention: received 'none', expected one of .* for the deepseek family"):
        generate(llm.model, llm.params, batch, max_new_tokens=2, attention="none")


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     r"unsupported architecture \['MistralForCausalLM'\]: supported architectures are LlamaForCausalLM, "
     r"DeepseekV2ForCausalLM, DeepseekV3ForCausalLM"),
    ({"architectures": None, "model_type": "qwen2"},
     r"unsupported model_type 'qwen2' \(and no architectures\): supported model types are llama, deepseek_v2, "
     r"deepseek_v3"),
])
def test_load_names_an_unknown_architecture_and_the_supported_ones(checkpoint, tmp_path, change, match):
    d = tmp_path / "m"
    d.mkdir()
    _, src = checkpoint
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(CheckpointError, match=match):
        LLM.load(d)


def test_cli_runs_deepseek_and_names_what_it_lacks(llm, checkpoint, tmp_path, capsys):
    """``jpa-sample --model DIR`` samples from the DeepSeek checkpoint (greedy: transformers'
    tokens, and ``--prompt-logprobs`` records); ``--schema`` is one error line naming the family."""
    hf, d = checkpoint
    out = tmp_path / "o.jsonl"
    rc, _, err = run_cli(["--model", d, "-p", PROMPTS[0], "-n", 1, "-m", M, "-t", 0, "--ignore-eos",
                          "--output", out, "--overwrite"], capsys)
    assert rc == 0, err
    rec, = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["token_ids"] == _hf_greedy(hf, llm.prompt_ids(PROMPTS[0]), M)
    msg = "implemented for the llama family only, not for the deepseek family"
    rc, out, err = run_cli(["--model", d, "-p", PROMPTS[0], "-m", 2, "--prompt-logprobs", "--output", "-"],
                           capsys)
    assert rc == 0, err
    rec, = [json.loads(line) for line in out.splitlines()]
    assert len(rec["prompt_logprobs"]) == len(llm.prompt_ids(PROMPTS[0]))
    (tmp_path / "s.pml").write_text('<schema name="s"><module name="a">the cat sat</module></schema>')
    (tmp_path / "p.pml").write_text('<prompt schema="s"><a/> then</prompt>')
    assert_one_error_line(*run_cli(["--model", d, "--schema", tmp_path / "s.pml", "--prompt-pml",
                                    tmp_path / "p.pml", "-m", 2], capsys), f"Prompt Cache: {msg}")


def test_single_level_folds_each_deepest_node_with_its_path():
    batch = PromptBatch.two_level([1, 2, 3], [[4], [5, 6]], num_samples=2, suffixes=[[7], [], [8, 9], []])
    folded = batch.single_level()
    assert folded.levels == (((1, 2, 3, 4), (1, 2, 3, 5, 6)),) and folded.suffixes == batch.suffixes
    assert [folded.full_prompt(b) for b in range(4)] == [batch.full_prompt(b) for b in range(4)]
    one = PromptBatch.shared([1, 2], [[3], [4]])
    assert one.single_level() is one
