"""The model families :class:`models.LLM` runs, and how a checkpoint's family is picked.

* :data:`FAMILIES` -- family name -> ``(architectures, model_types)`` of Hugging Face configs:
  ``"llama"`` (``LlamaForCausalLM``, the GGUF files and the built-in SmolLM2) and ``"deepseek"``
  (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).
* :func:`family_of_hf_config` -- the family of a parsed ``config.json``: from its
  ``architectures`` when given, else from its ``model_type`` (absent: ``"llama"``); anything
  else is a ``ValueError`` naming what was received and every supported value.
* :func:`decoder_for` -- the :class:`~models.decoder.Decoder` of a config
  (:class:`~models.llama.Llama` or :class:`~models.deepseek.Deepseek`), one per config so that
  every user of a config shares its compiled functions.

Adding a family: a config class, a model class implementing :class:`~models.decoder.Decoder`,
an entry here and a loader branch in :mod:`models.checkpoint` (``docs/model.md``).
"""
from __future__ import annotations

import functools
import types
from typing import Any, Mapping

from models.config import LlamaConfig
from models.decoder import Decoder
from models.deepseek.config import ARCHITECTURES as DEEPSEEK_ARCHITECTURES
from models.deepseek.config import DeepseekConfig
from models.deepseek.model import Deepseek
from models.llama import Llama

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "decoder_for", "family_of_hf_config"]

FAMILIES = types.MappingProxyType({
    "llama": (("LlamaForCausalLM",), ("llama",)),
    "deepseek": (DEEPSEEK_ARCHITECTURES, ("deepseek_v2", "deepseek_v3")),
})
SUPPORTED_ARCHITECTURES = tuple(a for archs, _ in FAMILIES.values() for a in archs)
SUPPORTED_MODEL_TYPES = tuple(t for _, mts in FAMILIES.values() for t in mts)


def family_of_hf_config(raw: Mapping[str, Any]) -> str:
    """The family name of a Hugging Face config dict (module docstring)."""
    archs = raw.get("architectures")
    if archs:
        if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"architectures: received {archs!r}, expected a list of architecture names")
        for family, (known, _) in FAMILIES.items():
            if any(a in known for a in archs):
                return family
        raise ValueError(f"unsupported architecture {list(archs)}: supported architectures are "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = raw.get("model_type", "llama")
    for family, (_, model_types) in FAMILIES.items():
        if model_type in model_types:
            return family
    raise ValueError(f"unsupported model_type {model_type!r} (and no architectures): supported model types are "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)} (architectures {', '.join(SUPPORTED_ARCHITECTURES)})")


@functools.lru_cache(maxsize=4)
def decoder_for(config) -> Decoder:
    """The model of ``config`` (module docstring); ``TypeError`` naming the received type."""
    if isinstance(config, LlamaConfig):
        return Llama(config)
    if isinstance(config, DeepseekConfig):
        return Deepseek(config)
    raise TypeError(f"config: received {type(config).__name__}, expected LlamaConfig or DeepseekConfig")
