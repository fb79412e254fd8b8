"""bench/prompt_cache_accuracy.py's core on a tiny random model and two items: the schema it
builds, the three paths, the replayed first-token distributions that agree with each call's
first token, and, where no union leaves a position gap, the prefill at the schema's positions
equal to ordinary generation. No accuracy figure is asserted."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import prompt_cache_accuracy as acc  # noqa: E402
from helpers import tiny_config, tiny_state_dict, tiny_tokenizer_meta  # noqa: E402
from models import LLM  # noqa: E402
from models.gguf import write_llama_gguf  # noqa: E402

# documents of one slot have the same length in tokens (byte-level, no merge applies), so no
# union member leaves a gap in the position ids
DATA = {"system": "Be brief.",
        "header": "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
        "document": "Doc: {text}\n",
        "question": "Q: {question}<|im_end|>\n<|im_start|>assistant\n",
        "documents": {"kim": "Kim: 7 kg.", "rex": "Rex: 9 kg.", "sue": "Sue: 5 cm.", "ray": "Ray: 8 cm."},
        "items": [{"id": "kim", "docs": ["kim", "sue"], "question": "Kim?", "answer": "7"},
                  {"id": "ray", "docs": ["rex", "ray"], "question": "Ray?", "answer": "8"}]}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    meta = tiny_tokenizer_meta()
    cfg = tiny_config(vocab_size=len(meta["tokens"]), bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    sd = tiny_state_dict(cfg, seed=5)
    sd["lm_head.weight"] = sd["lm_head.weight"] * 30      # peaked logits, as a trained model's
    path = tmp_path_factory.mktemp("tiny_acc") / "tiny.gguf"
    write_llama_gguf(path, cfg, sd, tensor_type=lambda n: "F32", tokenizer=meta)
    llm = LLM.load(str(path), dtype="float32")
    return llm.tokenizer, acc.evaluate(llm.model, llm.params, llm.tokenizer, DATA, max_new_tokens=4,
                                       eos_token_ids=())


def test_schema_of_unions_per_slot():
    sch, prompts = acc.build_schema(DATA, DATA["items"])
    assert [len(u.members) for u in sch.children[1:]] == [2, 2]
    assert [m.name for m in sch.children[1].members] == ["s0_kim", "s0_rex"]
    assert [tuple(i.module for i in p.items[:-1]) for p in prompts] == [("s0_kim", "s1_sue"), ("s0_rex", "s1_ray")]
    assert prompts[1].items[-1] == "Q: Ray?<|im_end|>\n<|im_start|>assistant\n"


def test_three_paths_on_two_items(result):
    tok, res = result
    assert res["setup"]["items"] == 2 and res["setup"]["modules"] == 5     # header + 2 slots x 2 documents
    assert [it["gap_positions"] for it in res["items"]] == [0, 0]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    header = DATA["header"].format(system=DATA["system"])
    assert res["items"][1]["prompt_tokens"] == len(enc(header) + enc("Doc: Rex: 9 kg.\n") + enc("Doc: Ray: 8 cm.\n")
                                                   + enc(DATA["question"].format(question="Ray?")))
    for item in res["items"]:
        for path in ("cached", "prefill", "ordinary"):
            assert len(item[path]["token_ids"]) == 4 and item[path]["text"] == tok.decode(item[path]["token_ids"],
                                                                                            skip_special_tokens=True)
    for pair in ("cached_vs_prefill", "cached_vs_ordinary", "prefill_vs_ordinary"):
        s = res["summary"][pair]
        assert 0 <= s["exact_match_rate"] <= 1 and 0 <= s["first_token_agreement"] <= 1
        assert np.isfinite(s["kl_max"]) and -1e-9 <= s["kl_mean"] <= s["kl_max"] + 1e-12
    # the cached path drops attention across modules: its first-token distribution differs
    assert res["summary"]["cached_vs_prefill"]["kl_max"] > 1e-6
    # no gap: the prefill at the schema's positions is ordinary generation of the same tokens
    assert res["summary"]["prefill_vs_ordinary"]["exact_match_rate"] == 1.0
    assert res["summary"]["prefill_vs_ordinary"]["kl_max"] < 1e-6
    assert res["checks"]["replay_first_token_mismatches"] == {"cached": 0, "prefill": 0, "ordinary": 0}
    assert max(res["checks"]["replay_first_logprob_max_abs_diff"].values()) < 1e-4


def test_kl_divergence():
    rng = np.random.default_rng(0)
    p, q = rng.standard_normal((3, 11)), rng.standard_normal((3, 11))
    want = [sum(np.exp(a) / np.exp(a).sum() * (np.log(np.exp(a) / np.exp(a).sum()) - np.log(np.exp(b) / np.exp(b).sum())))
            for a, b in zip(p, q)]
    np.testing.assert_allclose(acc.kl_divergence(p, q), want, rtol=1e-10)
    np.testing.assert_allclose(acc.kl_divergence(p, p + 5.0), 0, atol=1e-12)
