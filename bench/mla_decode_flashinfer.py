"""FlashInfer's column of ``bench/mla_decode.py``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
(MLA paged decode in the absorbed form, PyTorch CUDA) over a paged latent cache in which every
sequence's page list is the shared prefix's pages (the same page indices for every sequence, as a
paged cache with prefix caching holds them) followed by its own suffix pages; and a torch
reference of that wrapper's API for runs without FlashInfer.

The wrapper's API (FlashInfer 0.7): ``BatchMLAPagedAttentionWrapper(float_workspace_buffer,
use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None,
backend="auto")``; ``plan(qo_indptr [N+1], kv_indptr [N+1], kv_indices [pages], kv_len_arr [N],
num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)``
(int32 tables, ``kv_len_arr`` each request's cached tokens, planned on the host);
``run(q_nope [rows, H, ckv], q_pe [rows, H, kpe], ckv_cache [pages, page_size, ckv], kpe_cache
[pages, page_size, kpe], out=None)`` (contiguous tensors) -> ``[rows, H, ckv]``.

* :func:`load` -- the wrapper class of FlashInfer (or of :class:`ReferenceMLAWrapper` for
  ``"reference"``), or why there is none.
* :func:`page_table` / :func:`paged_cache` -- the page tables of a point and its paged cache
  built from the arrays our functions read (the prefix's pages first, then each sequence's).
* :func:`measure` -- FlashInfer's entry of one point: planned outside the timed region, timed as
  a CUDA graph of many calls (:func:`bench.peers_flashinfer.graph_time`), its output compared
  with ours.
* :func:`warm_up` -- plan and run once per head count on tiny shapes (FlashInfer compiles its
  kernels with nvcc on first use); :func:`start` runs it in a background thread.
"""
from __future__ import annotations

import importlib
import math
import os
import threading
import time
from typing import NamedTuple

import numpy as np

from bench.peers_flashinfer import device, empty_graph_ms, graph_time, to_torch
from bench.peers_flashinfer import load as load_module
from bench.peers_flashinfer import versions as module_versions
from bench.timing import is_oom

__all__ = ["load", "versions", "page_table", "paged_cache", "measure", "start", "warm_up", "workspace",
           "PageTable", "ReferenceMLAWrapper", "WORKSPACE_BYTES", "WRAPPER"]

WRAPPER = "flashinfer.mla.BatchMLAPagedAttentionWrapper"
# The float workspace holds the partial outputs of FlashInfer's key splits (512 floats per row).
WORKSPACE_BYTES = 512 << 20


def load(module: str = "flashinfer"):
    """``(wrapper class, module, None)``, or ``(None, None, reason)``; ``module="reference"``:
    :class:`ReferenceMLAWrapper` (needs torch only)."""
    if module == "reference":
        try:
            importlib.import_module("torch")
        except Exception as e:  # noqa: BLE001
            return None, None, f"torch not importable ({type(e).__name__}: {e})"[:200]
        return ReferenceMLAWrapper, None, None
    fi, why = load_module(module)
    if fi is None:
        return None, None, why
    try:
        cls = importlib.import_module(f"{module}.mla").BatchMLAPagedAttentionWrapper
    except Exception as e:  # noqa: BLE001
        return None, None, f"{module}.mla.BatchMLAPagedAttentionWrapper: {type(e).__name__}: {e}"[:200]
    return cls, fi, None


def versions(cls, fi) -> dict:
    """torch's and FlashInfer's versions of what :func:`load` gave (``flashinfer:
    "torch-reference"`` for the reference)."""
    out = module_versions(fi)
    if cls is ReferenceMLAWrapper:
        out["flashinfer"] = "torch-reference"
    return out


def workspace():
    """FlashInfer's float workspace on the torch device."""
    import torch  # noqa: PLC0415
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device())


class PageTable(NamedTuple):
    """int32 page tables of ``N`` decode requests: ``qo_indptr [N+1]``, ``kv_indptr [N+1]``,
    ``kv_indices [N * pages_per_request]``, ``kv_len [N]``; ``num_pages`` in the cache."""
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_len: np.ndarray
    num_pages: int


def page_table(batch: int, prefix: int, suffix: int, page_size: int) -> PageTable:
    """Request ``b`` = the prefix's pages ``[0, P / page)`` (shared) + its own suffix pages
    ``P / page + b * S / page + [0, S / page)``; ``P`` and ``S`` whole pages (a shared page
    that is only partly filled would be copied per sequence)."""
    if prefix % page_size or suffix % page_size:
        raise ValueError(f"prefix {prefix} and suffix {suffix} must be multiples of the page size {page_size}")
    pp, sp = prefix // page_size, suffix // page_size
    own = pp + np.arange(batch, dtype=np.int64)[:, None] * sp + np.arange(sp)[None, :]
    shared = np.broadcast_to(np.arange(pp), (batch, pp))
    indices = np.concatenate([shared, own], axis=1).reshape(-1)
    return PageTable(np.arange(batch + 1, dtype=np.int32), (np.arange(batch + 1) * (pp + sp)).astype(np.int32),
                     indices.astype(np.int32), np.full(batch, prefix + suffix, np.int32), pp + batch * sp)


def paged_cache(prefix, suffix, page_size: int):
    """``prefix [P, X]`` and ``suffix [B, S, X]`` (JAX) as one paged cache ``[(P + B S) / page,
    page, X]``: the prefix's pages, then sequence 0's suffix pages, sequence 1's, ..."""
    import jax.numpy as jnp  # noqa: PLC0415
    x = prefix.shape[-1]
    flat = jnp.concatenate([prefix, suffix.reshape(-1, x)], axis=0)
    return flat.reshape(-1, page_size, x)


def _tables(table: PageTable, dev):
    import torch  # noqa: PLC0415
    return [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in table[:4]]


def _planned(cls, ws, table: PageTable, heads: int, rank: int, rope: int, page_size: int,
             sm_scale: float, backend: str):
    import torch  # noqa: PLC0415
    w = cls(ws, backend=backend)
    qo, kv, idx, kv_len = _tables(table, ws.device)
    w.plan(qo, kv, idx, kv_len, num_heads=heads, head_dim_ckv=rank, head_dim_kpe=rope,
           page_size=page_size, causal=False, sm_scale=sm_scale, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    return w


def _sync():
    import torch  # noqa: PLC0415
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def _err(e: BaseException) -> dict:
    entry = {"error": f"{type(e).__name__}: {e}"[:400]}
    if is_oom(e):
        entry["oom"] = True
    return entry


def measure(cls, point, inputs, ours_out, ws, *, page_size: int, backend: str,
            sm_scale: float) -> tuple[dict, dict | None]:
    """FlashInfer's entry of ``point`` (``{"ms", "timing", "backend", "pages", "page_size"}`` or
    ``{"error"}``) and its check against ``ours_out [B, 1, H, R]`` (``{"rel_err", "max_abs"}``,
    None without ours).  ``inputs``: the point's arrays (``bench.mla_decode.Inputs``)."""
    import torch  # noqa: PLC0415
    b, h, r, dr = point.batch, point.heads, point.rank, point.rope
    try:
        table = page_table(b, point.prefix, point.suffix, page_size)
        ckv, kpe = (paged_cache(inputs.prefix_c, inputs.suffix_c, page_size),
                    paged_cache(inputs.prefix_k, inputs.suffix_k, page_size))
        ckv_t, kpe_t = to_torch(ckv), to_torch(kpe)
        qn, qp = to_torch(inputs.q_nope).reshape(b, h, r), to_torch(inputs.q_rope).reshape(b, h, dr)
        w = _planned(cls, ws, table, h, r, dr, page_size, sm_scale, backend)
        out = torch.empty_like(qn)
        w.run(qn, qp, ckv_t, kpe_t, out=out)
        _sync()
        check = None
        if ours_out is not None:
            ref = to_torch(ours_out).reshape(b, h, r).float()
            diff = out.float() - ref
            check = {"rel_err": float(torch.linalg.norm(diff) / torch.linalg.norm(ref)),
                     "max_abs": float(diff.abs().max())}
            del ref, diff
        t = graph_time(lambda: w.run(qn, qp, ckv_t, kpe_t, out=out))
        entry = {"ms": t["ms"], "timing": {k: v for k, v in t.items() if k != "ms"},
                 "backend": getattr(w, "_backend", None), "pages": table.num_pages, "page_size": page_size}
        return entry, check
    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
        return _err(e), None


def start(cls, fi, shapes, page_size: int, backend: str, run: dict, warm: dict):
    """``(workspace, thread)``: FlashInfer's float workspace, and :func:`warm_up` of ``shapes``
    started in a background thread (filling ``warm``).  With FlashInfer itself (``fi``), the
    torch harness's per-call cost goes to ``run["harness"]`` first, and the nvcc jobs leave two
    cores to the JAX host thread (``MAX_JOBS``, recorded in ``run["flashinfer"]``)."""
    ws = workspace()
    if fi is not None:
        run["harness"]["torch_graph_empty_kernel"] = empty_graph_ms()
        os.environ.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 4) - 2)))
        run["flashinfer"]["max_jobs"] = os.environ["MAX_JOBS"]
    thread = threading.Thread(target=warm_up, args=(cls, ws, shapes, page_size, backend, warm), daemon=True)
    thread.start()
    return ws, thread


def warm_up(cls, ws, shapes, page_size: int, backend: str, result: dict) -> None:
    """Plan and run the wrapper once per ``(heads, rank, rope)`` of ``shapes`` on two requests of
    two pages each (compiles FlashInfer's MLA module); fills ``result`` with the seconds taken
    and any errors."""
    import torch  # noqa: PLC0415
    t0 = time.perf_counter()
    errors = []
    for heads, rank, rope in sorted(shapes):
        try:
            table = page_table(2, page_size, page_size, page_size)
            gen = torch.Generator(device="cpu").manual_seed(0)
            rnd = lambda *s: torch.randn(s, generator=gen).to(torch.bfloat16).to(ws.device)  # noqa: E731
            ckv, kpe = rnd(table.num_pages, page_size, rank), rnd(table.num_pages, page_size, rope)
            w = _planned(cls, ws, table, heads, rank, rope, page_size, 1 / math.sqrt(rank + rope), backend)
            w.run(rnd(2, heads, rank), rnd(2, heads, rope), ckv, kpe)
            _sync()
        except Exception as e:  # noqa: BLE001
            errors.append(f"H={heads} R={rank} Dr={rope}: {type(e).__name__}: {e}"[:300])
    result.update(seconds=time.perf_counter() - t0, errors=errors)


def _int_table(name: str, t, n: int | None = None):
    import torch  # noqa: PLC0415
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got {t!r:.80}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    return t.cpu().long()


class ReferenceMLAWrapper:
    """A torch reference of ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (the API of the
    module doc): exact float32 attention of each request's rows over its pages, non-causal (the
    decode case).  It stands in for FlashInfer where FlashInfer cannot run (CPU smoke runs), and
    checks what FlashInfer requires: int32 tables, ``ceil(kv_len / page_size)`` pages per
    request, contiguous operands of the planned dtype and widths, ``qo_indptr[-1]`` rows."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.device = float_workspace_buffer.device
        self._backend = "torch-reference"

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        n = kv_len_arr.shape[0]
        qo, kv = _int_table("qo_indptr", qo_indptr, n + 1), _int_table("kv_indptr", kv_indptr, n + 1)
        idx, lens = _int_table("kv_indices", kv_indices), _int_table("kv_len_arr", kv_len_arr, n)
        if int(kv[-1]) > idx.shape[0]:
            raise ValueError(f"kv_indptr[-1] = {int(kv[-1])} but {idx.shape[0]} page indices")
        pages = kv[1:] - kv[:-1]
        if (pages != (lens + page_size - 1) // page_size).any():
            raise ValueError(f"every request needs ceil(kv_len / {page_size}) pages")
        if causal and ((qo[1:] - qo[:-1]) > 1).any():
            raise ValueError("this reference implements causal=False or one query row per request")
        self._plan = (qo, kv, idx, lens, num_heads, head_dim_ckv, head_dim_kpe, page_size, sm_scale,
                      q_data_type, kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        import torch  # noqa: PLC0415
        if not hasattr(self, "_plan"):
            raise RuntimeError("plan() must be called before run()")
        qo, kv, idx, lens, h, r, dr, ps, scale, q_dtype, kv_dtype = self._plan
        rows = int(qo[-1])
        for name, t, shape, dtype in (("q_nope", q_nope, (rows, h, r), q_dtype), ("q_pe", q_pe, (rows, h, dr), q_dtype),
                                      ("ckv_cache", ckv_cache, (None, ps, r), kv_dtype),
                                      ("kpe_cache", kpe_cache, (None, ps, dr), kv_dtype)):
            if (t.dim() != 3 or any(s is not None and s != x for s, x in zip(shape, t.shape))
                    or t.dtype != dtype or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} "
                                 f"(None: any), got {tuple(t.shape)} {t.dtype}")
        o = torch.zeros(rows, h, r, dtype=torch.float32)
        l_out = torch.full((rows, h), -math.inf, dtype=torch.float32)
        qn, qp = q_nope.float().cpu(), q_pe.float().cpu()
        for i in range(lens.shape[0]):
            pages = idx[kv[i]:kv[i + 1]]
            c = ckv_cache[pages.to(ckv_cache.device)].float().cpu().reshape(-1, r)[:int(lens[i])]
            k = kpe_cache[pages.to(kpe_cache.device)].float().cpu().reshape(-1, dr)[:int(lens[i])]
            sl = slice(int(qo[i]), int(qo[i + 1]))
            s = (qn[sl] @ c.T + qp[sl] @ k.T) * scale                    # [rows_i, H, len]
            l_out[sl] = torch.logsumexp(s, dim=-1)
            o[sl] = torch.softmax(s, dim=-1) @ c
        res = o.to(q_nope.dtype).to(q_nope.device)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, l_out.to(q_nope.device)) if return_lse else res
