"""A torch reference of the two FlashInfer wrappers ``bench/peers.py`` drives, with their
constructor, ``plan`` and ``run`` signatures (FlashInfer 0.7): exact float32 attention over
the page tables, each level's partial states merged by their log-sum-exp.

It stands in for FlashInfer where FlashInfer cannot run (``bench/peers.py --flashinfer-module
bench.flashinfer_reference``, CPU smoke runs), so that the page tables, the call sequence and the
parity check are exercised end to end, and it checks what FlashInfer requires of its inputs:
int32 page tables, ``1 <= last_page_len <= page_size``, the cache's page size equal to the
planned one, ``q`` of the planned dtype with ``qo_indptr[-1]`` rows.

* :class:`MultiLevelCascadeAttentionWrapper` -- ``(num_levels, float_workspace_buffer,
  kv_layout="NHD", ...)``; ``plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, ...,
  q_data_type=..., kv_data_type=...)``; ``run(q, paged_kv_cache)``.
* :class:`BatchDecodeWithPagedKVCacheWrapper` -- ``(float_workspace_buffer, kv_layout="NHD",
  use_cuda_graph=False, use_tensor_cores=False, ...)``; ``plan(indptr, indices, last_page_len,
  num_qo_heads, num_kv_heads, head_dim, page_size, *, q_data_type=..., kv_data_type=...)``;
  ``run(q, paged_kv_cache)``.

Queries are decode queries (each sees all its request's keys: FlashInfer's bottom-right causal
rule for one query per request, and its non-causal upper levels).
"""
from __future__ import annotations

import math

import torch

__version__ = "torch-reference"


def _dtype(x):
    if isinstance(x, torch.dtype):
        return x
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[x]


def _check_table(name, qo_indptr, kv_indptr, kv_indices, last_page_len, page_size):
    for n, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                 ("last_page_len", last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name}: {n} must be a 1-D int32 tensor, got {t!r:.80}")
    r = last_page_len.shape[0]
    if qo_indptr.shape[0] != r + 1 or kv_indptr.shape[0] != r + 1:
        raise ValueError(f"{name}: {r} requests need indptr arrays of {r + 1} entries, got "
                         f"{qo_indptr.shape[0]} and {kv_indptr.shape[0]}")
    if int(kv_indptr[-1]) != kv_indices.shape[0]:
        raise ValueError(f"{name}: kv_indptr[-1] = {int(kv_indptr[-1])} but {kv_indices.shape[0]} indices")
    npages = kv_indptr[1:] - kv_indptr[:-1]
    if (npages < 1).any():
        raise ValueError(f"{name}: every request needs at least one page")
    if ((last_page_len < 1) | (last_page_len > page_size)).any():
        raise ValueError(f"{name}: last_page_len must lie in [1, {page_size}]")
    if ((qo_indptr[1:] - qo_indptr[:-1]) < 1).any():
        raise ValueError(f"{name}: every request needs at least one query")


def _attend(q, cache, table, page_size, num_kv_heads, scale):
    """``(out [N, Hq, D] float32, lse [N, Hq])`` of one page table."""
    qo_indptr, kv_indptr, kv_indices, last = (t.cpu().long() for t in table)
    n, hq, d = q.shape
    if cache.dim() != 5 or cache.shape[1] != 2 or cache.shape[2] != page_size or cache.shape[3] != num_kv_heads:
        raise ValueError(f"paged_kv_cache must be [pages, 2, {page_size}, {num_kv_heads}, D] (NHD), "
                         f"got {tuple(cache.shape)}")
    if int(kv_indices.max()) >= cache.shape[0] or int(kv_indices.min()) < 0:
        raise ValueError(f"page index outside the cache of {cache.shape[0]} pages")
    g = hq // num_kv_heads
    out = torch.zeros(n, hq, d, dtype=torch.float32)
    lse = torch.full((n, hq), -math.inf, dtype=torch.float32)
    qf = q.float().cpu()
    for r in range(last.shape[0]):
        pages = kv_indices[kv_indptr[r]:kv_indptr[r + 1]]
        kv = cache[pages.to(cache.device)].float().cpu()               # [n_pages, 2, ps, Hkv, D]
        length = (pages.shape[0] - 1) * page_size + int(last[r])
        k = kv[:, 0].reshape(-1, num_kv_heads, d)[:length].repeat_interleave(g, dim=1)
        v = kv[:, 1].reshape(-1, num_kv_heads, d)[:length].repeat_interleave(g, dim=1)
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        s = torch.einsum("nhd,khd->hnk", qf[rows], k) * scale
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        out[rows] = torch.einsum("hnk,khd->nhd", p / den, v)
        lse[rows] = (m + torch.log(den))[..., 0].transpose(0, 1)
    return out, lse


def _merge(states):
    out, lse = states[0]
    for o2, l2 in states[1:]:
        m = torch.maximum(lse, l2)
        w1, w2 = torch.exp(lse - m), torch.exp(l2 - m)
        out = (w1[..., None] * out + w2[..., None] * o2) / (w1 + w2)[..., None]
        lse = m + torch.log(w1 + w2)
    return out


class _Planned:
    def _set(self, tables, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, sm_scale):
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self._tables = tables
        self._heads = (num_qo_heads, num_kv_heads, head_dim)
        self._page_size = page_size
        self._q_dtype = _dtype(q_data_type)
        self._scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_tables"):
            raise RuntimeError("plan() must be called before run()")
        hq, hkv, d = self._heads
        if q.dtype != self._q_dtype or q.shape[1:] != (hq, d):
            raise ValueError(f"q must be [N, {hq}, {d}] of {self._q_dtype}, got {tuple(q.shape)} {q.dtype}")
        n = int(self._tables[0][0][-1])
        if q.shape[0] != n or any(int(t[0][-1]) != n for t in self._tables):
            raise ValueError(f"q has {q.shape[0]} rows, every level's qo_indptr[-1] must equal it")
        states = [_attend(q, paged_kv_cache, t, self._page_size, hkv, self._scale) for t in self._tables]
        return _merge(states[::-1]).to(q.dtype).to(q.device)


class MultiLevelCascadeAttentionWrapper(_Planned):
    """Reference of ``flashinfer.MultiLevelCascadeAttentionWrapper`` (see the module doc)."""

    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None):
        if kv_layout != "NHD":
            raise ValueError(f"this reference implements kv_layout 'NHD', got {kv_layout!r}")
        self._num_levels = num_levels

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None):
        tables = list(zip(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                          paged_kv_last_page_len, strict=True))
        if len(tables) != self._num_levels:
            raise ValueError(f"{self._num_levels} levels, got page tables of {len(tables)}")
        for i, t in enumerate(tables):
            _check_table(f"level {i}", *t, page_size)
        self._set(tables, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, sm_scale)


class BatchDecodeWithPagedKVCacheWrapper(_Planned):
    """Reference of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (see the module doc)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
        if kv_layout != "NHD":
            raise ValueError(f"this reference implements kv_layout 'NHD', got {kv_layout!r}")
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, sm_scale=None, **kwargs):
        qo = torch.arange(last_page_len.shape[0] + 1, dtype=torch.int32)
        _check_table("decode", qo, indptr, indices, last_page_len, page_size)
        self._set([(qo, indptr, indices, last_page_len)], num_qo_heads, num_kv_heads, head_dim,
                  page_size, q_data_type, sm_scale)
