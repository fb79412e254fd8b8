"""Llama-family model configuration: a frozen, hashable dataclass (usable as a static jit argument).

* :class:`LlamaConfig` -- the fields the decoder needs, with presets
  (:meth:`LlamaConfig.preset`: ``SmolLM2-135M``, ``Llama-2-7B``, ``CodeLlama-7B``, ``CodeLlama-13B``,
  ``CodeLlama-34B``, ``Llama-3-8B``, ``Llama-3.1-8B``).
* :meth:`LlamaConfig.from_hf_config(path_or_dict)` -- reads a Hugging Face ``config.json``
  (a checkpoint directory, the file itself, or the already-parsed dict).  Both the
  transformers < 5 layout (``rope_theta`` + ``rope_scaling``) and the transformers >= 5 layout
  (``rope_parameters``) are accepted.  Fields that would change the computation and that this
  decoder does not implement (biases, other activations, other RoPE types, tensor-parallel
  pretraining splits, interleaved RoPE...) raise ``ValueError`` naming the field and value;
  fields this module does not know at all raise ``ValueError`` too (listing them), so a
  checkpoint of another architecture cannot be half-loaded silently.  Purely descriptive fields
  (``architectures``, ``torch_dtype``, ``transformers_version``, ``initializer_range``, ...) are
  ignored.

RoPE scaling: ``rope_scaling`` is ``None`` (plain RoPE) or a :class:`Llama3RopeScaling`
(the Llama-3.1 frequency-dependent scaling, ``rope_type = "llama3"``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any, Mapping

__all__ = ["Llama3RopeScaling", "LlamaConfig", "PRESETS", "hf_config_dict"]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (transformers' ``rope_type = "llama3"``)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder.

    ``eos_token_ids`` is a tuple (Llama-3 instruct models stop on several ids).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2 \
                or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) (GQA)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        eos = self.eos_token_ids
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in eos))
        for e in self.eos_token_ids:
            if not 0 <= e < self.vocab_size:
                raise ValueError(f"eos token id {e} is outside the vocabulary [0, {self.vocab_size})")

    # -- derived ---------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        per_layer = (h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
                     + 3 * h * f + 2 * h)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    # -- presets ---------------------------------------------------------------------------
    @staticmethod
    def preset(name: str) -> "LlamaConfig":
        """One of :data:`PRESETS` (architecture hyper-parameters of the public checkpoints)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return PRESETS[name]

    # -- Hugging Face ----------------------------------------------------------------------
    @staticmethod
    def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "LlamaConfig":
        """Build a config from a Hugging Face Llama ``config.json`` (dir, file path or dict)."""
        return _from_hf_dict(hf_config_dict(path_or_dict))


def hf_config_dict(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a Hugging Face ``config.json`` given as its directory, its path or a dict;
    ``ValueError`` when the file is not there."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no Hugging Face config file at {path!r}")
    with open(path) as f:
        return json.load(f)


# Fields of a HF config.json that do not change the computation.
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "_name_or_path", "is_llama_config", "output_attentions",
    "output_hidden_states", "return_dict", "tie_encoder_decoder", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "id2label", "label2id",
    "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size", "tf_legacy_loss",
    "pruned_heads", "torchscript", "use_bfloat16", "bad_words_ids", "begin_suppress_tokens",
    "suppress_tokens", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "_attn_implementation_autoset",
})
_KNOWN_HF_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "hidden_act", "attention_bias", "mlp_bias", "pretraining_tp", "rope_interleaved",
})


def _require(raw: Mapping[str, Any], field: str, ok, want: str) -> None:
    if field in raw and not ok(raw[field]):
        raise ValueError(f"unsupported Hugging Face config value {field}={raw[field]!r}: this Llama "
                         f"decoder implements {want} only")


def _rope_from_hf(raw: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ValueError(f"config gives both rope_parameters={params!r} and rope_scaling={scaling!r}")
    rope = dict(params if params is not None else (scaling or {}))
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type == "default":
        if rope.get("partial_rotary_factor", 1.0) == 1.0:
            rope.pop("partial_rotary_factor", None)
        if rope:
            raise ValueError(f"unsupported RoPE parameters {rope!r} for rope_type 'default'")
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}: supported are 'default' and 'llama3'")
    known = {f.name for f in dataclasses.fields(Llama3RopeScaling)}
    unknown = sorted(set(rope) - known)
    if unknown:
        raise ValueError(f"unsupported llama3 RoPE scaling fields {unknown}; known: {sorted(known)}")
    missing = sorted(known - set(rope))
    if missing:
        raise ValueError(f"llama3 RoPE scaling is missing fields {missing}")
    return float(theta), Llama3RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))


def _from_hf_dict(raw: Mapping[str, Any]) -> LlamaConfig:
    unknown = sorted(k for k in raw if k not in _KNOWN_HF_FIELDS and k not in _IGNORED_HF_FIELDS)
    if unknown:
        raise ValueError(f"unknown Hugging Face config fields {unknown}: not a plain Llama config "
                         f"(model_type={raw.get('model_type')!r})")
    if raw.get("model_type", "llama") != "llama":
        raise ValueError(f"unsupported model_type {raw.get('model_type')!r}: expected 'llama'")
    _require(raw, "hidden_act", lambda v: v == "silu", "hidden_act='silu' (SwiGLU)")
    _require(raw, "attention_bias", lambda v: not v, "attention_bias=false")
    _require(raw, "mlp_bias", lambda v: not v, "mlp_bias=false")
    _require(raw, "pretraining_tp", lambda v: v in (None, 1), "pretraining_tp=1")
    _require(raw, "rope_interleaved", lambda v: not v, "rope_interleaved=false (rotate-half RoPE)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise ValueError(f"Hugging Face config is missing required fields {missing}")
    theta, scaling = _rope_from_hf(raw)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=None if raw.get("head_dim") is None else int(raw["head_dim"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids, pad_token_id=raw.get("pad_token_id"))


_LLAMA2_7B = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,))
_LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
                         eos_token_ids=(128001,))

#: Architecture presets of public checkpoints (values from their config.json files).
PRESETS: types.MappingProxyType = types.MappingProxyType({
    "SmolLM2-135M": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                                bos_token_id=0, eos_token_ids=(0,)),
    "Llama-2-7B": _LLAMA2_7B,
    "CodeLlama-7B": _LLAMA2_7B.replace(vocab_size=32016, rope_theta=1e6, max_position_embeddings=16384),
    "CodeLlama-13B": _LLAMA2_7B.replace(vocab_size=32016, hidden_size=5120, intermediate_size=13824,
                                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                                        rope_theta=1e6, max_position_embeddings=16384, head_dim=128),
    "CodeLlama-34B": _LLAMA2_7B.replace(vocab_size=32000, hidden_size=8192, intermediate_size=22016,
                                        num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                                        rope_theta=1e6, max_position_embeddings=16384, head_dim=128),
    "Llama-3-8B": _LLAMA3_8B,
    "Llama-3.1-8B": _LLAMA3_8B.replace(max_position_embeddings=131072, rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
})
