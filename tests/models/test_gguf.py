"""GGUF reading: dequantisation vs an independent numpy implementation, q/k permutation,
config from metadata, tiny Llama files round trip, error messages."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from models.gguf import (  # noqa: E402
    SUPPORTED_TENSOR_TYPES,
    CheckpointError,
    dequantize_tensor,
    load_gguf,
    open_gguf,
    permute_qk_rows,
    unpermute_qk_rows,
    write_llama_gguf,
)
from helpers import tiny_config, tiny_state_dict  # noqa: E402

QK_K = 256


# ---------------------------------------------------------------------------------------------
# Independent scalar dequantisers, written from ggml's block layouts (ggml-common.h /
# dequantize_row_* in ggml-quants.c). Deliberately loop-based: nothing shared with gguf.quants.
# ---------------------------------------------------------------------------------------------
def _f16(b, off):
    return float(np.frombuffer(bytes(b[off:off + 2]), dtype="<f2")[0])


def _deq_q8_0(b):  # d:f16, qs:int8[32]
    d = _f16(b, 0)
    return [d * int(np.int8(np.uint8(b[2 + j]))) for j in range(32)]


def _deq_q4_0(b):  # d:f16, qs:u8[16]; low nibbles -> 0..15, high -> 16..31, minus 8
    d = _f16(b, 0)
    y = [0.0] * 32
    for j in range(16):
        y[j] = ((b[2 + j] & 0x0F) - 8) * d
        y[j + 16] = ((b[2 + j] >> 4) - 8) * d
    return y


def _deq_q4_1(b):  # d:f16, m:f16, qs:u8[16]
    d, m = _f16(b, 0), _f16(b, 2)
    y = [0.0] * 32
    for j in range(16):
        y[j] = (b[4 + j] & 0x0F) * d + m
        y[j + 16] = (b[4 + j] >> 4) * d + m
    return y


def _deq_q5_0(b):  # d:f16, qh:u32, qs:u8[16]
    d = _f16(b, 0)
    qh = int.from_bytes(bytes(b[2:6]), "little")
    y = [0.0] * 32
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        y[j] = (((b[6 + j] & 0x0F) | xh0) - 16) * d
        y[j + 16] = (((b[6 + j] >> 4) | xh1) - 16) * d
    return y


def _deq_q5_1(b):  # d:f16, m:f16, qh:u32, qs:u8[16]
    d, m = _f16(b, 0), _f16(b, 2)
    qh = int.from_bytes(bytes(b[4:8]), "little")
    y = [0.0] * 32
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        y[j] = ((b[8 + j] & 0x0F) | xh0) * d + m
        y[j + 16] = ((b[8 + j] >> 4) | xh1) * d + m
    return y


def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _deq_q4_k(b):  # d:f16, dmin:f16, scales:u8[12], qs:u8[128]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, qs = b[4:16], b[16:144]
    y, q, is_ = [], 0, 0
    for _ in range(0, QK_K, 64):
        sc, m = _scale_min_k4(is_, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = _scale_min_k4(is_ + 1, scales)
        d2, m2 = d * sc, dmin * m
        y += [d1 * (qs[q + l] & 0xF) - m1 for l in range(32)]
        y += [d2 * (qs[q + l] >> 4) - m2 for l in range(32)]
        q += 32
        is_ += 2
    return y


def _deq_q5_k(b):  # d:f16, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, qh, ql = b[4:16], b[16:48], b[48:176]
    y, q, is_, u1, u2 = [], 0, 0, 1, 2
    for _ in range(0, QK_K, 64):
        sc, m = _scale_min_k4(is_, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = _scale_min_k4(is_ + 1, scales)
        d2, m2 = d * sc, dmin * m
        y += [d1 * ((ql[q + l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * ((ql[q + l] >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)]
        q += 32
        is_ += 2
        u1 <<= 2
        u2 <<= 2
    return y


def _deq_q6_k(b):  # ql:u8[128], qh:u8[64], scales:i8[16], d:f16
    ql, qh = b[0:128], b[128:192]
    sc = [int(np.int8(np.uint8(x))) for x in b[192:208]]
    d = _f16(b, 208)
    y = [0.0] * QK_K
    for n in range(2):
        L, H, S, Y = 64 * n, 32 * n, 8 * n, 128 * n
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[L + l] & 0xF) | (((qh[H + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[L + l + 32] & 0xF) | (((qh[H + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[L + l] >> 4) | (((qh[H + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[L + l + 32] >> 4) | (((qh[H + l] >> 6) & 3) << 4)) - 32
            y[Y + l] = d * sc[S + is_] * q1
            y[Y + l + 32] = d * sc[S + is_ + 2] * q2
            y[Y + l + 64] = d * sc[S + is_ + 4] * q3
            y[Y + l + 96] = d * sc[S + is_ + 6] * q4
    return y


# name -> (elements per block, bytes per block, byte offsets of f16 fields, dequantiser)
_BLOCKS = {
    "Q8_0": (32, 34, (0,), _deq_q8_0),
    "Q4_0": (32, 18, (0,), _deq_q4_0),
    "Q4_1": (32, 20, (0, 2), _deq_q4_1),
    "Q5_0": (32, 22, (0,), _deq_q5_0),
    "Q5_1": (32, 24, (0, 2), _deq_q5_1),
    "Q4_K": (QK_K, 144, (0, 2), _deq_q4_k),
    "Q5_K": (QK_K, 176, (0, 2), _deq_q5_k),
    "Q6_K": (QK_K, 210, (208,), _deq_q6_k),
}


def _random_blocks(rng, name, rows, blocks_per_row):
    """Random bytes for `rows x blocks_per_row` blocks, with finite random f16 scales."""
    _, nbytes, f16_offsets, _ = _BLOCKS[name]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, nbytes), dtype=np.uint8)
    for off in f16_offsets:
        scale = (rng.standard_normal((rows, blocks_per_row)) * 0.05).astype("<f2")
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * nbytes)


def _reference_dequant(name, raw_rows):
    n_el, nbytes, _, fn = _BLOCKS[name]
    out = []
    for row in raw_rows:
        vals = []
        for k in range(len(row) // nbytes):
            vals += fn([int(x) for x in row[k * nbytes:(k + 1) * nbytes]])
        out.append(vals)
    return np.asarray(out, dtype=np.float64)


def test_supported_types_cover_the_common_llama_files():
    for t in ("Q4_0", "Q4_1", "Q8_0", "F16", "F32"):
        assert t in SUPPORTED_TENSOR_TYPES


def test_dequantize_matches_independent_numpy_on_random_blocks(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raws = {}
    for name in _BLOCKS:
        bpr = 2 if _BLOCKS[name][0] == QK_K else 3
        raw = _random_blocks(rng, name, rows=3, blocks_per_row=bpr)
        raws[name] = raw
        w.add_tensor(f"t_{name}", raw, raw_dtype=gguf.GGMLQuantizationType[name])
    f32 = rng.standard_normal((4, 6)).astype(np.float32)
    f16 = rng.standard_normal((5, 8)).astype(np.float16)
    w.add_tensor("t_F32", f32)
    w.add_tensor("t_F16", f16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tensors = {t.name: t for t in open_gguf(path).tensors}
    for name, raw in raws.items():
        t = tensors[f"t_{name}"]
        assert gguf.GGMLQuantizationType(t.tensor_type).name == name
        np.testing.assert_array_equal(np.asarray(t.data), raw)  # the bytes we wrote
        got = dequantize_tensor(t)
        want = _reference_dequant(name, raw)
        assert got.dtype == np.float32 and got.shape == want.shape, (name, got.shape, want.shape)
        assert np.isfinite(got).all()
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=name)
    np.testing.assert_array_equal(dequantize_tensor(tensors["t_F32"]), f32)
    np.testing.assert_array_equal(dequantize_tensor(tensors["t_F16"]), f16.astype(np.float32))


@pytest.mark.parametrize("name,tol", [("Q8_0", 0.01), ("Q4_0", 0.15), ("Q4_1", 0.12), ("Q5_0", 0.07), ("Q5_1", 0.06)])
def test_quantize_then_dequantize_is_close_to_original(name, tol):
    """Sanity of the whole chain on real data (quantised by gguf, our dequantiser read back)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])
    y = _reference_dequant(name, q)
    err = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert err < tol, (name, err)


# ---------------------------------------------------------------------------------------------
# q/k permutation
# ---------------------------------------------------------------------------------------------
def _rope_rotate_half(x_hd, pos, theta=10000.0):
    """Hugging Face RoPE: pairs (i, i + D/2)."""
    d = x_hd.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos * inv
    c, s = np.cos(ang), np.sin(ang)
    a, b = x_hd[..., : d // 2], x_hd[..., d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def _rope_interleaved(x_hd, pos, theta=10000.0):
    """GGML's normal RoPE: pairs (2i, 2i + 1)."""
    d = x_hd.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos * inv
    c, s = np.cos(ang), np.sin(ang)
    a, b = x_hd[..., 0::2], x_hd[..., 1::2]
    out = np.empty_like(x_hd)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def test_permutation_is_what_makes_ggml_rope_equal_hf_rope():
    rng = np.random.default_rng(2)
    n_heads, n_kv, d, hidden = 4, 2, 8, 16
    wq = rng.standard_normal((n_heads * d, hidden))
    wk = rng.standard_normal((n_kv * d, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    pq, pk = 7.0, 3.0
    hf_q = _rope_rotate_half((wq @ x_q).reshape(n_heads, d), pq)
    hf_k = _rope_rotate_half((wk @ x_k).reshape(n_kv, d), pk)
    gg_q = _rope_interleaved((permute_qk_rows(wq, n_heads) @ x_q).reshape(n_heads, d), pq)
    gg_k = _rope_interleaved((permute_qk_rows(wk, n_kv) @ x_k).reshape(n_kv, d), pk)
    group = n_heads // n_kv
    for h in range(n_heads):
        np.testing.assert_allclose(gg_q[h] @ gg_k[h // group], hf_q[h] @ hf_k[h // group], rtol=1e-10)
    # and the scores differ without the permutation (the test can fail)
    bad_q = _rope_interleaved((wq @ x_q).reshape(n_heads, d), pq)
    bad_k = _rope_interleaved((wk @ x_k).reshape(n_kv, d), pk)
    assert not np.allclose(bad_q[0] @ bad_k[0], hf_q[0] @ hf_k[0])
    np.testing.assert_array_equal(unpermute_qk_rows(permute_qk_rows(wq, n_heads), n_heads), wq)


def test_unpermute_matches_transformers():
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    rng = np.random.default_rng(3)
    proc = mod.LlamaTensorProcessor(config={"num_attention_heads": 6, "num_key_value_heads": 2})
    w = rng.standard_normal((6 * 8, 12)).astype(np.float32)
    k = rng.standard_normal((2 * 8, 12)).astype(np.float32)
    np.testing.assert_array_equal(proc.process(w, "blk.0.attn_q.weight").weights, unpermute_qk_rows(w, 6))
    np.testing.assert_array_equal(proc.process(k, "blk.0.attn_k.weight").weights, unpermute_qk_rows(k, 2))


# ---------------------------------------------------------------------------------------------
# tiny Llama files
# ---------------------------------------------------------------------------------------------
def test_f32_round_trip_is_exact_and_config_matches(tmp_path):
    cfg = tiny_config()
    sd = tiny_state_dict(cfg)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, cfg, sd, tensor_type="F32",
                     tokenizer={"tokens": [f"t{i}" for i in range(96)], "bos_token_id": 1, "eos_token_id": 2})
    got_cfg, got = load_gguf(path)
    assert set(got) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(got[k], sd[k], err_msg=k)
    for k, v in cfg.items():
        assert got_cfg[k] == pytest.approx(v), k
    assert got_cfg["bos_token_id"] == 1 and got_cfg["eos_token_id"] == 2
    assert got_cfg["model_type"] == "llama"


def test_mixed_quant_types_and_dtype(tmp_path):
    import ml_dtypes

    cfg = tiny_config(tie_word_embeddings=True)
    sd = tiny_state_dict(cfg, seed=4)
    types = {"q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "F16", "gate_proj": "Q5_0",
             "up_proj": "Q5_1", "down_proj": "BF16", "embed_tokens": "Q8_0"}

    def pick(name):
        return next(t for key, t in types.items() if key in name)

    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, cfg, sd, tensor_type=pick)
    reader = gguf.GGUFReader(str(path))
    seen = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert seen == set(types.values()) | {"F32"}

    got_cfg, got = load_gguf(path)
    assert got_cfg["tie_word_embeddings"] is True and "lm_head.weight" not in got
    for name, x in sd.items():
        ttype = "F32" if x.ndim == 1 else pick(name)
        if ttype == "F32":
            want = x
        elif ttype == "F16":
            want = x.astype(np.float16).astype(np.float32)
        else:  # quantisation acts on rows, so it commutes with the q/k row permutation
            want = _reference_dequant(ttype, gguf.quants.quantize(x, gguf.GGMLQuantizationType[ttype])) \
                if ttype != "BF16" else x.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
        assert np.linalg.norm(got[name] - x) / np.linalg.norm(x) < 0.15, name

    _, got_bf16 = load_gguf(path, dtype="bfloat16")
    assert all(v.dtype == np.dtype(ml_dtypes.bfloat16) for v in got_bf16.values())
    np.testing.assert_array_equal(got_bf16["model.norm.weight"], got["model.norm.weight"].astype(ml_dtypes.bfloat16))


def test_config_feeds_the_model_config(tmp_path):
    config_mod = pytest.importorskip("models.config")
    cfg = tiny_config()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, cfg, tiny_state_dict(cfg), tensor_type="F16",
                     tokenizer={"tokens": [f"t{i}" for i in range(96)], "bos_token_id": 1, "eos_token_id": 2})
    hf_cfg, _ = load_gguf(path)
    c = config_mod.LlamaConfig.from_hf_config(hf_cfg)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 16)
    assert c.eos_token_ids == (2,) and c.tie_word_embeddings is False


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_parser_agrees_with_gguf_reader(tmp_path):
    """Our GGUF parser vs the gguf package's GGUFReader: metadata values, tensor table, bytes."""
    cfg = tiny_config()
    path = tmp_path / "tiny.gguf"
    tok = {"tokens": ["<s>", "a b", "\u00e9\U0001F600"] + [f"t{i}" for i in range(93)],
           "token_types": [3] + [1] * 95, "merges": ["a b", "t 1"], "bos_token_id": 0, "eos_token_id": 0,
           "add_bos_token": True, "chat_template": "{{ messages }}", "pre": "smollm"}
    write_llama_gguf(path, cfg, tiny_state_dict(cfg), tensor_type=lambda n: "Q8_0" if "mlp" in n else "F16",
                     tokenizer=tok)
    ours, ref = open_gguf(path), gguf.GGUFReader(str(path))
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == ref_meta
    assert ours.metadata["tokenizer.ggml.tokens"][2] == "\u00e9\U0001F600"
    assert ours.metadata["tokenizer.ggml.add_bos_token"] is True
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == int(b.tensor_type) and a.shape == tuple(int(x) for x in reversed(b.shape))
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
        assert a.data.shape == b.data.shape


def test_truncated_file(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, cfg, tiny_state_dict(cfg))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="not a readable GGUF.*truncated"):
        load_gguf(cut)


def test_missing_file_and_directory_and_garbage(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="directory"):
        load_gguf(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(256))
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_gguf(junk)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = tmp_path / "qwen.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'qwen2'; supported: llama"):
        load_gguf(path)


def test_unsupported_tensor_type_lists_supported(tmp_path):
    cfg = tiny_config(hidden_size=256, head_dim=64, num_hidden_layers=1)
    sd = tiny_state_dict(cfg)
    path = tmp_path / "q2k.gguf"
    write_llama_gguf(path, cfg, sd, tensor_type="F32")
    # rewrite with one Q2_K tensor (84 bytes per 256 values)
    path2 = tmp_path / "q2k2.gguf"
    reader = open_gguf(path)
    w = gguf.GGUFWriter(str(path2), "llama")
    for key, val in reader.metadata.items():
        if key.startswith("llama."):
            (w.add_uint32 if isinstance(val, int) else w.add_float32)(key, val)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            w.add_tensor(t.name, np.zeros((96, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"unsupported type Q2_K; supported: F32, F16, BF16, Q4_0"):
        load_gguf(path2)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_gguf("whatever.gguf", dtype="int8")
