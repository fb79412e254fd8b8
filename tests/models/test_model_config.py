"""LlamaConfig: presets, Hugging Face config parsing, and clear errors for unsupported fields."""
import json

import numpy as np
import pytest

from models.config import PRESETS, Llama3RopeScaling, LlamaConfig
from models.layers import rope_inv_freq


def _hf_dict(**over):
    d = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "hidden_act": "silu",
         "max_position_embeddings": 512, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
         "torch_dtype": "float32", "transformers_version": "5.23.0", "bos_token_id": 1, "eos_token_id": 2,
         "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False,
         "rope_theta": 10000.0, "rope_scaling": None}
    d.update(over)
    return d


def test_presets_shapes():
    assert set(PRESETS) == {"SmolLM2-135M", "Llama-2-7B", "CodeLlama-7B", "CodeLlama-13B", "CodeLlama-34B",
                            "Llama-3-8B", "Llama-3.1-8B"}
    l31 = LlamaConfig.preset("Llama-3.1-8B")
    assert (l31.num_attention_heads, l31.num_key_value_heads, l31.head_dim, l31.vocab_size) == (32, 8, 128, 128256)
    assert l31.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192) and l31.rope_theta == 500000.0
    assert LlamaConfig.preset("Llama-3-8B").rope_scaling is None
    # parameter counts of the public checkpoints (billions, rounded)
    assert round(l31.num_params() / 1e9, 2) == 8.03
    assert round(LlamaConfig.preset("Llama-2-7B").num_params() / 1e9, 2) == 6.74
    assert round(LlamaConfig.preset("CodeLlama-34B").num_params() / 1e9, 1) == 33.7
    assert round(LlamaConfig.preset("SmolLM2-135M").num_params() / 1e6) == 135
    assert LlamaConfig.preset("SmolLM2-135M").tie_word_embeddings
    with pytest.raises(ValueError, match="unknown preset"):
        LlamaConfig.preset("Llama-9")
    hash(l31)  # usable as a static jit argument


def test_from_hf_config_both_rope_layouts(tmp_path):
    old = _hf_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    new = _hf_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32})
    del new["rope_theta"], new["rope_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(new))
    a, b = LlamaConfig.from_hf_config(old), LlamaConfig.from_hf_config(tmp_path)
    assert a == b and a.rope_scaling.original_max_position_embeddings == 32 and a.head_dim == 16
    assert LlamaConfig.from_hf_config(tmp_path / "config.json") == a
    c = LlamaConfig.from_hf_config(_hf_dict(eos_token_id=[2, 5], num_key_value_heads=None))
    assert c.eos_token_ids == (2, 5) and c.num_key_value_heads == 4 and c.rope_scaling is None


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("pretraining_tp", 2, "pretraining_tp"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ("sliding_window", 4096, r"unknown Hugging Face config fields \['sliding_window'\]"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
])
def test_from_hf_config_rejects(field, value, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_config(_hf_dict(**{field: value}))


def test_from_hf_config_missing_field():
    d = _hf_dict()
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"missing required fields \['hidden_size'\]"):
        LlamaConfig.from_hf_config(d)


def test_llama3_inv_freq_bands():
    """Llama-3 scaling: short wavelengths kept, long ones divided by factor, middle band smooth."""
    base = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, rope_theta=10000.0)
    sc = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    inv = rope_inv_freq(base)
    inv_s = rope_inv_freq(base.replace(rope_scaling=sc))
    wavelen = 2 * np.pi / inv
    short, long_ = wavelen < 32 / 4, wavelen > 32 / 1
    mid = ~short & ~long_
    assert short.any() and long_.any() and mid.any()
    np.testing.assert_allclose(inv_s[short], inv[short], rtol=1e-6)
    np.testing.assert_allclose(inv_s[long_], inv[long_] / 8, rtol=1e-6)
    assert np.all((inv_s[mid] < inv[mid]) & (inv_s[mid] > inv[mid] / 8))
