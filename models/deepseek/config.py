"""DeepSeek-V2/V3 configuration: a frozen, hashable dataclass read from a Hugging Face
``config.json`` of ``DeepseekV2ForCausalLM`` or ``DeepseekV3ForCausalLM``.

* :class:`DeepseekConfig` -- the fields the decoder needs: multi-head latent attention (MLA)
  with decoupled RoPE (``q_lora_rank`` (``None``: a direct query projection), ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), the mixture of experts
  (``first_k_dense_replace``, ``moe_layer_freq``, ``n_routed_experts``, ``n_shared_experts``,
  ``num_experts_per_tok``, ``routed_scaling_factor``, ``scoring_func``, ``topk_method`` with
  ``n_group``/``topk_group``, ``norm_topk_prob``, ``moe_intermediate_size``) and YaRN RoPE
  scaling (:class:`YarnRopeScaling`).
* :data:`PRESETS` -- architecture presets of public checkpoints (``"DeepSeek-V2-Lite"``: the
  fields of its ``config.json``), for benchmarks with random weights.
* :meth:`DeepseekConfig.from_hf_config(path_or_dict)` -- a checkpoint directory, the file or the
  parsed dict; both the transformers < 5 layout (``rope_theta`` + ``rope_scaling``) and the
  transformers >= 5 layout (``rope_parameters``) are read.  An architecture other than the two
  above raises ``ValueError`` naming it; so do fields that would change the computation and are
  not implemented (biases, other activations, quantised weights, other RoPE types) and fields
  this module does not know.

Defaults follow each architecture's reference code: ``DeepseekV2ForCausalLM`` scores experts with
a softmax and picks them greedily, ``DeepseekV3ForCausalLM`` with a sigmoid and ``noaux_tc``
(group-limited, with the ``e_score_correction_bias``); both are overridden by ``scoring_func``
and ``topk_method`` when the config gives them.  Layer ``i`` is a mixture-of-experts layer when
``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``, else a dense SwiGLU MLP.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Any, Mapping

from models.config import hf_config_dict

__all__ = ["ARCHITECTURES", "DeepseekConfig", "PRESETS", "YarnRopeScaling"]

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MODEL_TYPES = types.MappingProxyType({"deepseek_v2": "DeepseekV2ForCausalLM",
                                       "deepseek_v3": "DeepseekV3ForCausalLM"})
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling as DeepSeek configures it (transformers' ``rope_type = "yarn"``).

    ``attention_factor`` (``None``: ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
    when both are set, else ``mscale(factor)``) multiplies cos and sin of the rotary part;
    ``mscale_all_dim`` also multiplies the softmax scale by ``mscale(factor, mscale_all_dim)**2``
    (:attr:`DeepseekConfig.softmax_scale`)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Hyper-parameters of a DeepSeek-V2/V3 decoder (see the module docstring)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnRopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "moe_layer_freq", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if isinstance(self.first_k_dense_replace, bool) or not isinstance(self.first_k_dense_replace, int) \
                or self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be an int >= 0, got {self.first_k_dense_replace!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            self._check_moe()
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    def _check_moe(self):
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive_int(name, getattr(self, name))
        if self.n_shared_experts is not None and (isinstance(self.n_shared_experts, bool)
                                                  or not isinstance(self.n_shared_experts, int)
                                                  or self.n_shared_experts < 0):
            raise ValueError(f"n_shared_experts must be an int >= 0 or None, got {self.n_shared_experts!r}")
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if k > e:
            raise ValueError(f"num_experts_per_tok ({k}) must be <= n_routed_experts ({e})")
        if self.topk_method != "greedy":
            _positive_int("n_group", self.n_group)
            _positive_int("topk_group", self.topk_group)
            if e % self.n_group:
                raise ValueError(f"n_routed_experts ({e}) must be a multiple of n_group ({self.n_group}) "
                                 f"for topk_method={self.topk_method!r}")
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
            if k > self.topk_group * (e // self.n_group):
                raise ValueError(f"num_experts_per_tok ({k}) exceeds the experts of topk_group="
                                 f"{self.topk_group} groups of {e // self.n_group}")
            if self.topk_method == "noaux_tc" and e // self.n_group < 2:
                raise ValueError(f"topk_method='noaux_tc' scores a group by its two best experts: "
                                 f"n_routed_experts / n_group must be >= 2, got {e} / {self.n_group}")

    # -- derived ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        scale = self.qk_head_dim ** -0.5
        sc = self.rope_scaling
        if sc is not None and sc.mscale_all_dim:
            scale *= yarn_get_mscale(sc.factor, sc.mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    def replace(self, **kw) -> "DeepseekConfig":
        return dataclasses.replace(self, **kw)

    # -- Hugging Face ----------------------------------------------------------------------
    @staticmethod
    def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "DeepseekConfig":
        """Build a config from a Hugging Face ``config.json`` (dir, file path or dict)."""
        return _from_hf_dict(hf_config_dict(path_or_dict))


def _positive_int(name: str, val: Any) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


# Fields of a DeepSeek config.json that do not change the computation (training-only losses,
# expert-parallel degree, generation defaults, derived values checked below).
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "_name_or_path", "auto_map", "output_router_logits",
    "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "num_mtp_layers",
    "pretraining_tp", "pad_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "_attn_implementation_autoset", "tokenizer_class", "id2label", "label2id", "problem_type",
    "router_aux_loss_coef", "num_key_value_heads", "tie_encoder_decoder", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size", "tf_legacy_loss",
    "pruned_heads", "torchscript", "use_bfloat16", "prefix", "bad_words_ids",
    "begin_suppress_tokens", "suppress_tokens", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty",
})
_KNOWN_HF_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "head_dim", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor",
    "scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act", "attention_bias",
    "mlp_bias", "quantization_config",
})
_DEFAULTS = types.MappingProxyType({  # architecture -> (scoring_func, topk_method)
    "DeepseekV2ForCausalLM": ("softmax", "greedy"),
    "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc"),
})


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if archs:
        known = [a for a in archs if a in ARCHITECTURES]
        if len(archs) != 1 or not known:
            raise ValueError(f"unsupported architecture {archs!r} (model_type={model_type!r}): this "
                             f"decoder reads {list(ARCHITECTURES)}")
        arch = known[0]
        if model_type is not None and _MODEL_TYPES.get(model_type) != arch:
            raise ValueError(f"config.json's model_type {model_type!r} does not match its "
                             f"architecture {arch!r}")
        return arch
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"unsupported model_type {model_type!r} (no architectures given): this decoder "
                     f"reads {sorted(_MODEL_TYPES)}")


def _rope_from_hf(raw: Mapping[str, Any]) -> tuple[float, YarnRopeScaling | None]:
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ValueError(f"config gives both rope_parameters={params!r} and rope_scaling={scaling!r}")
    rope = dict(params if params is not None else (scaling or {}))
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    if rope_type == "default":
        if rope:
            raise ValueError(f"unsupported RoPE parameters {rope!r} for rope_type 'default'")
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_type {rope_type!r}: supported are 'default' and 'yarn'")
    known = {f.name for f in dataclasses.fields(YarnRopeScaling)}
    unknown = sorted(set(rope) - known)
    if unknown:
        raise ValueError(f"unsupported yarn RoPE scaling fields {unknown}; known: {sorted(known)}")
    for name in ("factor", "original_max_position_embeddings"):
        if rope.get(name) is None:
            raise ValueError(f"yarn RoPE scaling is missing {name!r}")
    opt = lambda k, d: d if rope.get(k) is None else float(rope[k])  # noqa: E731
    return theta, YarnRopeScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=opt("beta_fast", 32.0) or 32.0, beta_slow=opt("beta_slow", 1.0) or 1.0,
        mscale=opt("mscale", None), mscale_all_dim=opt("mscale_all_dim", None),
        attention_factor=opt("attention_factor", None), truncate=bool(rope.get("truncate", True)))


def _from_hf_dict(raw: Mapping[str, Any]) -> DeepseekConfig:
    arch = _architecture(raw)
    unknown = sorted(k for k in raw if k not in _KNOWN_HF_FIELDS and k not in _IGNORED_HF_FIELDS)
    if unknown:
        raise ValueError(f"unknown Hugging Face config fields {unknown} for {arch}")

    def require(field, ok, want):
        if field in raw and not ok(raw[field]):
            raise ValueError(f"unsupported Hugging Face config value {field}={raw[field]!r}: this "
                             f"decoder implements {want} only")

    require("hidden_act", lambda v: v == "silu", "hidden_act='silu' (SwiGLU)")
    require("attention_bias", lambda v: not v, "attention_bias=false")
    require("mlp_bias", lambda v: not v, "mlp_bias=false")
    if arch == "DeepseekV2ForCausalLM":
        require("rope_interleave", bool, "rope_interleave=true (DeepSeek-V2 rotates interleaved pairs)")
    require("quantization_config", lambda v: v is None, "unquantised weights (no quantization_config)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                           "qk_rope_head_dim", "v_head_dim") if raw.get(k) is None]
    if missing:
        raise ValueError(f"Hugging Face config of {arch} is missing required fields {missing}")
    if raw.get("qk_head_dim") is not None and raw["qk_head_dim"] != raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]:
        raise ValueError(f"qk_head_dim={raw['qk_head_dim']} is not qk_nope_head_dim + qk_rope_head_dim = "
                         f"{raw['qk_nope_head_dim'] + raw['qk_rope_head_dim']}")
    if raw.get("head_dim") is not None and raw["head_dim"] != raw["qk_rope_head_dim"]:
        raise ValueError(f"head_dim={raw['head_dim']} differs from qk_rope_head_dim={raw['qk_rope_head_dim']} "
                         f"(transformers' DeepSeek configs set head_dim to the rotary width)")
    scoring, topk = _DEFAULTS[arch]
    scoring = raw.get("scoring_func") or scoring
    topk = raw.get("topk_method") or topk
    norm_topk = bool(raw.get("norm_topk_prob", arch == "DeepseekV3ForCausalLM"))
    if arch == "DeepseekV2ForCausalLM" and norm_topk and int(raw.get("num_experts_per_tok") or 1) > 1:
        raise ValueError("unsupported Hugging Face config value norm_topk_prob=true for "
                         "DeepseekV2ForCausalLM: DeepSeek's V2 code renormalises the top-k weights "
                         "and then skips routed_scaling_factor, transformers ignores the flag; this "
                         "decoder implements norm_topk_prob=false only for V2")
    theta, scaling = _rope_from_hf(raw)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    opt_int = lambda k: None if raw.get(k) is None else int(raw[k])  # noqa: E731
    return DeepseekConfig(
        architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=int(raw["num_attention_heads"]), kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]), q_lora_rank=opt_int("q_lora_rank"),
        moe_intermediate_size=opt_int("moe_intermediate_size"),
        n_routed_experts=opt_int("n_routed_experts"), n_shared_experts=opt_int("n_shared_experts"),
        num_experts_per_tok=opt_int("num_experts_per_tok"),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), scoring_func=scoring,
        topk_method=topk, n_group=opt_int("n_group"), topk_group=opt_int("topk_group"),
        norm_topk_prob=norm_topk, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids)


#: Architecture presets of public checkpoints (values from their config.json files).
PRESETS: types.MappingProxyType = types.MappingProxyType({
    "DeepSeek-V2-Lite": _from_hf_dict({
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 100000,
        "eos_token_id": 100001}),
})
