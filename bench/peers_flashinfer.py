"""FlashInfer's columns of ``bench/peers.py`` and the torch timing harness.

* :func:`load` -- import FlashInfer (or a module with its wrapper API, e.g.
  ``bench.flashinfer_reference``); ``None`` and a one-line reason where it is absent.
* :func:`to_torch` -- a JAX array as a torch tensor on the torch device (DLPack, no copy on
  the GPU; a host copy through numpy where DLPack fails), so both libraries read the same data.
* :func:`graph_time` -- milliseconds per call of ``fn`` captured ``calls`` times in one
  ``torch.cuda.CUDAGraph`` (median of replays timed with CUDA events); on a machine without CUDA
  the eager wall time (smoke runs only).  :func:`empty_graph_ms`: the same harness around a
  one-element ``add_`` (its per-call cost with an empty body).
* :func:`columns` -- FlashInfer's columns over one paged layout: the multi-level cascade over
  the layout's levels and paged decode over shared pages (tensor cores off and on), each
  planned outside the timed region, its output compared with ours, each in its own ``try`` (an
  error is recorded and the next column runs).
* :func:`warm_up` -- plan and run every column once on tiny shapes (FlashInfer compiles its
  kernels with nvcc on first use), meant for a background thread.
"""
from __future__ import annotations

import importlib
import statistics
import time
import traceback

import numpy as np

from bench.peers_paged import PagedLayout, paged_layout, single_prefix_tree

__all__ = ["load", "to_torch", "graph_time", "empty_graph_ms", "columns", "warm_up", "versions",
           "WORKSPACE_BYTES", "specs_for"]

WORKSPACE_BYTES = 256 << 20   # FlashInfer's float workspace (its docs recommend 128 MB)


def load(module: str = "flashinfer"):
    """``(module, None)``, or ``(None, reason)`` when torch, CUDA or the module is missing."""
    try:
        import torch  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        return None, f"torch not importable ({type(e).__name__}: {e})"[:200]
    try:
        fi = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return None, f"{module} not importable ({type(e).__name__}: {e})"[:200]
    if module == "flashinfer" and not torch.cuda.is_available():
        return None, "flashinfer needs a CUDA device, torch sees none"
    return fi, None


def versions(fi) -> dict:
    out = {}
    try:
        import torch  # noqa: PLC0415
        out.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    if fi is not None:
        out["flashinfer"] = getattr(fi, "__version__", "unknown")
        out["flashinfer_module"] = fi.__name__
    return out


def device():
    import torch  # noqa: PLC0415
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_torch(x, dev=None):
    """``x`` (a JAX array, ready) as a torch tensor on ``dev`` (default :func:`device`)."""
    import torch  # noqa: PLC0415
    import jax  # noqa: PLC0415
    dev = dev or device()
    x = jax.block_until_ready(x)
    try:
        t = torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - host copy
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            t = torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(dev)


def _sync():
    """Wait for the current torch stream (not the device: JAX may be running on it)."""
    import torch  # noqa: PLC0415
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def graph_time(fn, *, target_s: float = 0.03, reps: int = 7, min_calls: int = 10,
               max_calls: int = 200) -> dict:
    """Per-call time of ``fn()`` (see the module doc): ``{"ms", "calls", "method"}``."""
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():   # smoke runs: one warm-up call, one timed call
        fn()
        t0 = time.perf_counter()
        fn()
        return {"ms": (time.perf_counter() - t0) * 1e3, "calls": 1, "method": "eager wall time (no CUDA device)"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    eager_ms = start.elapsed_time(end) / 5
    calls = int(min(max_calls, max(min_calls, target_s * 1e3 / max(eager_ms, 1e-4))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # JAX's threads stay legal
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return {"ms": statistics.median(times), "calls": calls, "eager_ms": eager_ms,
            "method": "cuda_graph"}


def empty_graph_ms() -> dict:
    """:func:`graph_time` of a one-element ``add_`` (one trivial kernel per call)."""
    import torch  # noqa: PLC0415
    x = torch.zeros(1, device=device())
    return graph_time(lambda: x.add_(1.0), max_calls=200)


def _table(level, dev):
    import torch  # noqa: PLC0415
    return [torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(dev)
            for a in (level.qo_indptr, level.kv_indptr, level.kv_indices, level.last_page_len)]


def _backend_of(w):
    """The kernel family FlashInfer resolved ``backend="auto"`` to (per level for the cascade)."""
    def one(x):
        try:
            return getattr(x, "resolved_backend", None) or getattr(x, "_backend", None)
        except Exception:  # noqa: BLE001 - informative only
            return getattr(x, "_backend", None)
    inner = getattr(w, "_batch_prefill_wrappers", None)
    return [one(x) for x in inner] if inner is not None else one(w)


def planned(fi, kind: str, layout: PagedLayout, heads: tuple, ws, *, tensor_cores: bool = False):
    """A planned wrapper of ``kind`` (``"cascade"`` or ``"decode"``) over ``layout``."""
    import torch  # noqa: PLC0415
    hq, hkv, d = heads
    dt = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    dev = ws.device
    if kind == "cascade":
        if layout.cascade is None:
            raise ValueError(f"no cascade for this forest: {layout.cascade_why_not}")
        tabs = [_table(lv, dev) for lv in layout.cascade]
        w = fi.MultiLevelCascadeAttentionWrapper(len(tabs), ws, "NHD")
        w.plan([t[0] for t in tabs], [t[1] for t in tabs], [t[2] for t in tabs], [t[3] for t in tabs],
               hq, hkv, d, layout.page_size, causal=False, **dt)
        return w
    _, indptr, indices, last = _table(layout.decode, dev)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, hq, hkv, d, layout.page_size, **dt)
    return w


def _err(e) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def specs_for(page_size: int, decode: bool) -> list[tuple]:
    """``(column, kind, tensor_cores)`` of one page size: the cascade, and with ``decode`` paged
    decode with tensor cores off and on."""
    out = [(f"fi_cascade_p{page_size}", "cascade", False)]
    if decode:
        out += [(f"fi_decode_p{page_size}", "decode", False), (f"fi_decode_tc_p{page_size}", "decode", True)]
    return out


def columns(fi, layout: PagedLayout, cache, q_t, heads: tuple, ours_out: np.ndarray | None, ws,
            specs: list[tuple], *, log=print) -> dict:
    """FlashInfer's columns ``specs`` (:func:`specs_for`) over one layout and its torch cache.
    Returns ``{"<col>_ms", "<col>_timing", "<col>_maxabs_vs_ours", "<col>_maxrel_vs_ours",
    "<col>_backend", "<col>_error"}``."""
    rec = {}
    for name, kind, tc in specs:
        try:
            w = planned(fi, kind, layout, heads, ws, tensor_cores=tc)
            out = w.run(q_t, cache)
            _sync()
            if ours_out is not None:
                o = out.float().cpu().numpy()
                diff = float(np.max(np.abs(o - ours_out)))
                rec[f"{name}_maxabs_vs_ours"] = diff
                rec[f"{name}_maxrel_vs_ours"] = diff / max(float(np.max(np.abs(ours_out))), 1e-30)
            del out
            rec[f"{name}_backend"] = _backend_of(w)
            t = graph_time(lambda w=w: w.run(q_t, cache))
            rec[f"{name}_ms"] = t["ms"]
            rec[f"{name}_timing"] = {k: v for k, v in t.items() if k != "ms"}
            if kind == "cascade":
                rec["fi_cascade_levels"] = len(layout.cascade)
        except Exception as e:  # noqa: BLE001 - recorded, the next column runs
            rec[f"{name}_ms"] = "error"
            rec[f"{name}_error"] = _err(e)
            log(f"{name}: {_err(e)}")
            traceback.print_exc(limit=3)
    return rec


def warm_up(fi, heads_set, ws, result: dict) -> None:
    """Plan and run every column kind once per head shape on tiny random shapes (compiles
    FlashInfer's kernels); fills ``result`` with the seconds taken and any errors."""
    import torch  # noqa: PLC0415
    t0 = time.perf_counter()
    errors = []
    for hq, hkv, d in sorted(heads_set):
        for ps in (16, 1):
            try:
                layout = paged_layout(single_prefix_tree(32, 2), [16, 16], 16, ps)
                gen = torch.Generator(device="cpu").manual_seed(0)
                cache = torch.randn((layout.num_pages, 2, ps, hkv, d), generator=gen).to(
                    torch.bfloat16).to(ws.device)
                q = torch.randn((2, hq, d), generator=gen).to(torch.bfloat16).to(ws.device)
                for _, kind, tc in specs_for(ps, decode=ps == 16):
                    planned(fi, kind, layout, (hq, hkv, d), ws, tensor_cores=tc).run(q, cache)
                _sync()
            except Exception as e:  # noqa: BLE001
                errors.append(f"Hq={hq} Hkv={hkv} D={d} page {ps}: {_err(e)}")
    result.update(seconds=time.perf_counter() - t0, errors=errors)
