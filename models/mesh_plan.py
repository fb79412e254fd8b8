"""Choosing the mesh: tensor parallel, data parallel or both, for a decode workload on N devices.

:func:`plan_mesh` models one greedy decode step of ``batch`` sequences that share one prefix of
``prefix_len`` tokens and grow suffixes of up to ``suffix_len`` tokens, on every
``(tensor_parallel, data_parallel)`` split of the devices (``tp * dp == devices``), and picks the
fastest split whose memory fits each device.  Per device, with ``W`` the weights' bytes, ``F``
the matmul flops of one step, ``KV`` the cache bytes one step reads and ``A`` the all-reduces:

    time   = max(W / tp / copy rate, F / dp / tp / (matmul rate * efficiency)) + KV / copy rate
             + tp > 1:  (2 * layers + 1) * allreduce(batch / dp * hidden * 2 bytes)
    memory = W / tp + (prefix + batch / dp * suffix_len) * kv bytes per token / tp + logits

``efficiency`` is the device profile's decode matmul efficiency on one device and its (lower)
sharded efficiency for ``tp > 1``: split matmuls are narrower.  The suffix read is charged at
its mean length (``suffix_len / 2``).  A data-parallel split needs ``batch >= dp`` (the caller
pads the batch to a multiple of ``dp``).  The rates come from
:func:`jax_prefix_attn.device_profile.device_profile`; the memory from the device when it
reports it.  ``docs/multi_gpu.md`` shows the model against the measured points.
"""
from __future__ import annotations

import dataclasses

import jax

from jax_prefix_attn.device import device_info
from jax_prefix_attn.device_profile import DeviceProfile, device_profile
from models.config import LlamaConfig

__all__ = ["DecodeWorkload", "MeshPlan", "device_memory", "plan_mesh", "plan_mesh_for_devices",
           "splits_of", "step_estimate"]

MEMORY_HEADROOM = 0.9     # share of a device's memory the plan may fill (workspace, fragmentation)


@dataclasses.dataclass(frozen=True)
class DecodeWorkload:
    """What the mesh is chosen for: ``batch`` sequences (prompts x samples) sharing a prefix of
    ``prefix_len`` tokens, each generating up to ``suffix_len`` tokens.  The defaults describe
    sampling many completions of long prompts, where several devices pay."""
    batch: int = 256
    prefix_len: int = 4096
    suffix_len: int = 256

    def __post_init__(self):
        for name in ("batch", "prefix_len", "suffix_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "prefix_len" else 1):
                raise ValueError(f"DecodeWorkload.{name} must be a "
                                 f"{'non-negative' if name == 'prefix_len' else 'positive'} int, "
                                 f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The chosen split: ``tensor_parallel x data_parallel`` devices, the modelled seconds of a
    step and bytes per device of every split considered (``estimates``: ``(tp, dp, seconds,
    bytes, fits)``), and ``reason``: one line saying what was chosen and why."""
    tensor_parallel: int
    data_parallel: int
    seconds: float
    bytes_per_device: float
    estimates: tuple
    reason: str


def splits_of(devices: int) -> list[tuple[int, int]]:
    """Every ``(tensor_parallel, data_parallel)`` with ``tp * dp == devices``, tp ascending."""
    return [(tp, devices // tp) for tp in range(1, devices + 1) if devices % tp == 0]


def step_estimate(config: LlamaConfig, profile: DeviceProfile, *, tensor_parallel: int,
                  data_parallel: int, batch: int, prefix_len: int, suffix_len: int,
                  weight_bytes: int = 2, cache_bytes: int = 2) -> tuple[float, float]:
    """``(seconds, bytes per device)`` of one decode step on this split (module docstring)."""
    tp, dp = tensor_parallel, data_parallel
    b_loc = -(-batch // dp)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    weights = config.num_params() * weight_bytes
    kv_token = 2 * config.num_key_value_heads * config.head_dim * cache_bytes * layers
    flops = 2.0 * b_loc * config.num_params()
    efficiency = (profile.decode_matmul_efficiency if tp == 1
                  else profile.sharded_matmul_efficiency)
    t_weights = weights / tp / profile.copy_bytes_per_s
    t_matmul = flops / tp / (profile.matmul_flops_per_s * efficiency)
    read = (prefix_len + b_loc * suffix_len / 2) * kv_token / tp
    seconds = max(t_weights, t_matmul) + read / profile.copy_bytes_per_s
    if tp > 1:
        seconds += (2 * layers + 1) * profile.allreduce_s(b_loc * hidden * 2)
    logits = b_loc * config.vocab_size * 4 / tp
    nbytes = weights / tp + (prefix_len + b_loc * suffix_len) * kv_token / tp + logits
    return seconds, nbytes


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def plan_mesh(config: LlamaConfig, *, devices: int, batch: int, prefix_len: int,
              suffix_len: int, profile: DeviceProfile, memory_bytes: float | None = None,
              profile_note: str = "") -> MeshPlan:
    """The fastest ``(tensor_parallel, data_parallel)`` split of ``devices`` devices that fits
    (module docstring).  ``memory_bytes``: per device (default the profile's);
    ``profile_note``: appended to the reason (e.g. which profile stands in for ``device``).
    Raises ``ValueError`` when no split fits, naming the model's size and the memory of all the
    devices together."""
    _positive("devices", devices)
    _positive("batch", batch)
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len must be a non-negative int, got {prefix_len!r}")
    _positive("suffix_len", suffix_len)
    memory = profile.memory_bytes if memory_bytes is None else float(memory_bytes)
    budget = MEMORY_HEADROOM * memory
    estimates = []
    for tp, dp in splits_of(devices):
        if dp > batch:
            continue
        seconds, nbytes = step_estimate(config, profile, tensor_parallel=tp, data_parallel=dp,
                                        batch=batch, prefix_len=prefix_len,
                                        suffix_len=suffix_len)
        estimates.append((tp, dp, seconds, nbytes, nbytes <= budget))
    fitting = [e for e in estimates if e[4]]
    if not fitting:
        need = min(e[3] for e in estimates) if estimates else float("nan")
        raise ValueError(
            f"the model ({config.num_params() / 1e9:.1f} B parameters) with batch={batch}, "
            f"prefix_len={prefix_len}, suffix_len={suffix_len} needs at least "
            f"{need / 1e9:.1f} GB per device on {devices} device(s), but a device has "
            f"{memory / 1e9:.1f} GB ({devices * memory / 1e9:.1f} GB on all of them together)")
    tp, dp, seconds, nbytes, _ = min(fitting, key=lambda e: (e[2], e[0]))
    alone = step_estimate(config, profile, tensor_parallel=1, data_parallel=1, batch=batch,
                          prefix_len=prefix_len, suffix_len=suffix_len)[0]
    others = ", ".join(f"tp {t} x dp {d} {s * 1e3:.2f} ms" + ("" if f else " (does not fit)")
                       for t, d, s, _, f in estimates if (t, d) != (tp, dp))
    reason = (f"tensor_parallel={tp} x data_parallel={dp}: modelled step {seconds * 1e3:.2f} ms, "
              f"{nbytes / 1e9:.1f} of {memory / 1e9:.1f} GB per device"
              + (f"; {others}" if others else "")
              + (f"; one device alone {alone * 1e3:.2f} ms" if devices > 1 else "")
              + (f" ({profile_note})" if profile_note else ""))
    return MeshPlan(tensor_parallel=tp, data_parallel=dp, seconds=seconds,
                    bytes_per_device=nbytes, estimates=tuple(estimates), reason=reason)


def device_memory(device) -> float | None:
    """Bytes a process may allocate on ``device`` as its runtime reports them (``None`` where it
    does not, e.g. on a CPU)."""
    stats = getattr(device, "memory_stats", lambda: None)()
    limit = (stats or {}).get("bytes_limit")
    return float(limit) if limit else None


def plan_mesh_for_devices(config: LlamaConfig, devices: int,
                          workload: DecodeWorkload | None = None) -> MeshPlan:
    """:func:`plan_mesh` on this machine: the first device's profile
    (:func:`jax_prefix_attn.device_profile.device_profile`, with its note when another part's
    profile stands in) and its memory as the runtime reports it (else the profile's).
    ``ValueError`` when fewer than ``devices`` devices exist."""
    _positive("devices", devices)
    have = jax.devices()
    if len(have) < devices:
        raise ValueError(f"devices={devices} needs {devices} devices, but only {len(have)} "
                         f"{have[0].platform} device(s) exist")
    w = DecodeWorkload() if workload is None else workload
    if not isinstance(w, DecodeWorkload):
        raise TypeError(f"workload must be a DecodeWorkload, got {type(w).__name__}")
    profile, note = device_profile(device_info(have[0]))
    return plan_mesh(config, devices=devices, batch=w.batch, prefix_len=w.prefix_len,
                     suffix_len=w.suffix_len, profile=profile, memory_bytes=device_memory(have[0]),
                     profile_note=note)
