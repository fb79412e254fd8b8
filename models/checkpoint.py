"""Reading a model for :class:`models.LLM`: a GGUF file, a Hugging Face directory or the built-in
SmolLM2, with its tokenizer and a description of what was read; every problem with the files is
one :class:`~models.gguf.CheckpointError` line.

* :func:`load_checkpoint` -- ``(config, params, tokenizer, info)``; with ``mesh=`` the
  parameters are placed straight into their shards (:func:`models.sharding.place_params`).
* :func:`missing_model_file` -- the first file a Hugging Face directory lacks.
* :func:`resolve_dtype` -- the parameter dtype of a ``dtype=`` argument.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig, hf_config_dict
from models.deepseek.config import DeepseekConfig
from models.deepseek.weights import hf_param_shapes as deepseek_param_shapes
from models.deepseek.weights import load_hf_checkpoint as load_deepseek_checkpoint
from models.families import family_of_hf_config
from models.gguf import CheckpointError, default_gguf_path, gguf_config_to_hf, load_gguf, open_gguf
from models.tokenizer import Tokenizer
from models.weights import hf_param_shapes, load_hf_checkpoint, params_from_hf_state_dict

__all__ = ["DTYPES", "load_checkpoint", "missing_model_file", "resolve_dtype"]

DTYPES = ("float32", "bfloat16", "float16")


def missing_model_file(path: str) -> str | None:
    """The first file a Hugging Face directory lacks, in the order ``config.json``, the
    safetensors weights, ``tokenizer.json``; None when all are there."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "config.json"
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return "safetensors weights (model.safetensors, model.safetensors.index.json or *.safetensors)"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json"
    return None


def resolve_dtype(dtype) -> Any:
    """``dtype`` (one of :data:`DTYPES`, as a name or a dtype) as a numpy dtype; ``None``:
    bfloat16 on GPU, float32 elsewhere.  ``ValueError`` for anything else."""
    if dtype is None:
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (None: bfloat16 on GPU, float32 elsewhere), got {dtype!r}")
    return jnp.dtype(name)


def _directory_config(path: str) -> LlamaConfig | DeepseekConfig:
    """The config of a Hugging Face directory after checking that its files are there, in the
    family its ``config.json`` names."""
    missing = missing_model_file(path)
    if missing is not None:
        raise CheckpointError(f"model directory {path} has no {missing}")
    raw = hf_config_dict(path)
    return (DeepseekConfig if family_of_hf_config(raw) == "deepseek" else LlamaConfig).from_hf_config(raw)


def read_config(path: str | os.PathLike | None) -> LlamaConfig | DeepseekConfig:
    """The model config of a GGUF file, a Hugging Face directory or (``None``) the built-in model,
    read without the weights (GGUF metadata, ``config.json``).  Problems with the files raise
    :class:`~models.gguf.CheckpointError`."""
    path = default_gguf_path() if path is None else os.fspath(path)
    try:
        if os.path.isdir(path):
            return _directory_config(path)
        f = open_gguf(path)
        return LlamaConfig.from_hf_config(gguf_config_to_hf(f.metadata, {t.name for t in f.tensors}))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"cannot load {path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def load_checkpoint(path: str | os.PathLike | None, dtype=None, *,
                    mesh: jax.sharding.Mesh | None = None) -> tuple[LlamaConfig | DeepseekConfig, dict, Tokenizer,
                                                                     dict]:
    """``(config, params, tokenizer, info)`` of a GGUF file, a Hugging Face directory or (``None``)
    the built-in model.  A directory's family (Llama or DeepSeek-V2/V3) is picked from its
    ``config.json`` (:func:`models.families.family_of_hf_config`); GGUF files are Llama models.
    A directory is checked for missing files first (:func:`missing_model_file`), then read
    cheapest first: config, tokenizer, weights.  Every
    problem with the files raises :class:`~models.gguf.CheckpointError` (one line).  ``mesh``: the
    parameters are padded and placed block by block into their shards on that
    ``("data", "model")`` mesh (never whole on one device).  ``info``: ``path``, ``format``,
    ``name``, ``bytes`` (weight files), ``config_sha256`` (of the config, not of the weights),
    ``num_parameters`` (of the checkpoint, without padding), ``dtype``."""
    from safetensors import SafetensorError  # noqa: PLC0415

    dt = resolve_dtype(dtype)
    path = default_gguf_path() if path is None else os.fspath(path)
    try:
        if os.path.isdir(path):
            # first: missing files and an unsupported config are the errors to report
            family = "deepseek" if isinstance(_directory_config(path), DeepseekConfig) else "llama"
            if family == "deepseek" and mesh is not None:
                raise NotImplementedError("tensor_parallel / data_parallel / mesh: implemented for the llama "
                                          "family only, not for the deepseek family")
            tokenizer = Tokenizer.from_hf_dir(path)
            if family == "deepseek":
                config, params = load_deepseek_checkpoint(path, dt)
            else:
                config, params = load_hf_checkpoint(path, dt, mesh=mesh)
            weights = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
            name, fmt = os.path.basename(os.path.abspath(path)), "hf"
        else:
            f = open_gguf(path)
            hf_config, state = load_gguf(f)  # first: an unsupported architecture is the error to report
            tokenizer = Tokenizer.from_gguf(f)
            config = LlamaConfig.from_hf_config(hf_config)
            params = params_from_hf_state_dict(config, state, dt, mesh=mesh)
            weights, fmt = [path], "gguf"
            name = f.metadata.get("general.name") or os.path.basename(path)
    except CheckpointError:
        raise
    except ValueError as e:  # config / weight / tokenizer checks
        raise CheckpointError(f"cannot load {path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except (KeyError, TypeError, AttributeError, SafetensorError) as e:  # malformed JSON or safetensors
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    shapes = deepseek_param_shapes if isinstance(config, DeepseekConfig) else hf_param_shapes
    cfg_json = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    info = {"path": os.path.abspath(path), "format": fmt, "name": str(name),
            "bytes": int(sum(os.path.getsize(w) for w in weights)),
            "config_sha256": hashlib.sha256(cfg_json.encode()).hexdigest(),
            "num_parameters": int(sum(int(np.prod(s)) for s in shapes(config).values())),
            "dtype": jnp.dtype(dt).name}
    return config, params, tokenizer, info
