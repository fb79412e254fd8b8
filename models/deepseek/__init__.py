"""DeepSeek-V2/V3-shaped decoders: multi-head latent attention with decoupled (YaRN) RoPE, low-rank
q/kv projections, mixture-of-experts MLPs, Hugging Face checkpoints, and decoding over a latent KV
cache whose prompt is shared through :func:`jax_prefix_attn.mla_attention`.

* :class:`DeepseekConfig` (:mod:`.config`), :func:`load_hf_checkpoint`,
  :func:`params_from_hf_state_dict`, :func:`init_params` (:mod:`.weights`);
* :class:`Deepseek` (:mod:`.model`) over :class:`LatentPrefix` / :class:`LatentCache`
  (:mod:`.cache`); the layer pieces in :mod:`.attention`, :mod:`.moe`, :mod:`.rope`;
* :func:`greedy_generate` (:mod:`.generate`).
"""
from models.deepseek.cache import LatentCache, LatentPrefix, init_latent_cache
from models.deepseek.config import DeepseekConfig, YarnRopeScaling
from models.deepseek.generate import greedy_generate
from models.deepseek.model import Deepseek
from models.deepseek.weights import hf_param_shapes, init_params, load_hf_checkpoint, params_from_hf_state_dict

__all__ = ["Deepseek", "DeepseekConfig", "LatentCache", "LatentPrefix", "YarnRopeScaling", "greedy_generate",
           "hf_param_shapes", "init_params", "init_latent_cache", "load_hf_checkpoint",
           "params_from_hf_state_dict"]
