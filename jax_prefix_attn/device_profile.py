"""Measured rates and tuned regions of a GPU part, for the cost models and regions that choose
how work is laid out.

A :class:`DeviceProfile` holds what the runtime does not report: the rate a kernel copies
memory at, the bf16 matmul rate, the cost model's launch and latency terms, the rates of the
role-split and tree cost models, for a model's decode step the share of the matmul rate its
matmuls reach whole and split over a tensor-parallel mesh and the all-reduce time, and the
planner's tuned regions and tilings (:class:`Tuning`).  Each measured part is one JSON file of
``jax_prefix_attn/device_data/`` (its ``source`` names the measurements behind its values),
read and validated once (:func:`profiles`) when a plan first needs it.

:func:`device_profile` gives the profile of a :class:`~jax_prefix_attn.device.DeviceInfo`:
the part's own profile when one was measured, else the nearest (same compute capability first)
and a one-line note saying which profile stands in for the part.  :func:`planning_profile` is
that profile with the SM count and shared memory the device itself reports, which is what the
cost functions take.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import types

from jax_prefix_attn.device import DeviceInfo, planning_device_info

__all__ = ["DeviceProfile", "Tuning", "device_profile", "planning_profile", "default_profile",
           "reference_profile", "profiles", "load_part", "data_files"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The planner's tuned regions and tilings on one part (hashable; the measurements:
    ``docs/performance.md``, "Planner regions and tilings").  A tiling is ``(block_k,
    num_warps, num_stages)``; a region bounds are ``(low, high)`` inclusive.

    ``decode_suffix_tiling``, ``row_suffix_tiling``: the own-layout and row-layout suffix
    passes; ``overlap_below_programs``: below this many (sequence, kv head) programs the Triton
    family overlaps its launches; ``prefix_tiling``, ``large_m_tiling``: the Triton prefix
    kernel, split / unsplit with the two-phase key loop; ``flat_tiles``: ``((max_programs or
    None, tiling), ...)`` of the own-layout flat decode; ``flat_rows_tiling``: the row-layout
    flat decode; ``flat_own_min_split_keys``, ``flat_own_max_splits`` (``None``: no cap),
    ``flat_own_max_chunk``: the own layout's key splits and region; ``mgpu_min_ctas``,
    ``mgpu_min_real_rows``: the Mosaic GPU region; ``few_ctas``, ``long_tiles``,
    ``split_waste``: its prefix split rule; ``mgpu_suffix_split_below``: suffix split beside it;
    ``one_launch_regions`` ``((prefix, suffix, min_group), ...)``, ``one_launch_min_ctas``,
    ``one_launch_min_group``; ``joint_regions`` ``((prefix, suffix, min_group, min_ctas),
    ...)``, ``joint_stages``, ``joint_schedule_barrier``; ``split_regions`` ``((prefix,
    suffix), ...)``, ``split_group``, ``split_min_rows``: the one-launch, one-pass and
    role-split Mosaic GPU leaves; ``mgpu_backward_min_tq``: from this many query rows per
    sequence the shared-prefix plans' ``backward="auto"`` runs the Mosaic GPU flash backward;
    ``stream_two_launch_regions`` ``((prefix, suffix), ...)``: where the planner takes the
    all-Mosaic two-launch leaf (``mgpu_stream_two_launch``; empty: only when forced);
    ``flat_stream_regions``: the same for the Mosaic GPU flat decode (``flat_mgpu_stream``)."""
    decode_suffix_tiling: tuple
    row_suffix_tiling: tuple
    overlap_below_programs: int
    prefix_tiling: tuple
    large_m_tiling: tuple
    flat_tiles: tuple
    flat_rows_tiling: tuple
    flat_own_min_split_keys: int
    flat_own_max_splits: int | None
    flat_own_max_chunk: int
    mgpu_min_ctas: int
    mgpu_min_real_rows: float
    few_ctas: int
    long_tiles: int
    split_waste: int
    mgpu_suffix_split_below: int
    one_launch_regions: tuple
    one_launch_min_ctas: int
    one_launch_min_group: int
    joint_regions: tuple
    joint_stages: int
    joint_schedule_barrier: bool
    split_regions: tuple
    split_group: int
    split_min_rows: int
    mgpu_backward_min_tq: int
    stream_two_launch_regions: tuple
    flat_stream_regions: tuple


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one GPU part (hashable).

    ``name``: the part (a substring of the device kind it matches, e.g. ``"H200"``);
    ``compute_capability``: ``"9.0"`` style; ``memory_bytes``: device memory a process may use
    (used when the device does not report it); ``copy_bytes_per_s``: bytes a copy kernel moves
    per second; ``matmul_flops_per_s``: dense bf16 matmul rate (large square products);
    ``sm_count``, ``smem_per_block``: SMs and shared memory of one CTA (the part's; the
    :func:`planning_profile` of a device takes the device's own);
    ``decode_matmul_efficiency``: the share of that rate a decode step's matmuls reach on one
    device (weight-by-batch products, the layer's other kernels between them);
    ``sharded_matmul_efficiency``: the same with the matmuls split over a tensor-parallel mesh
    (narrower products); ``allreduce_latency_s`` and ``allreduce_bytes_per_s``: an all-reduce of
    ``n`` bytes over the GPUs of one host takes ``latency + n / rate``.

    The planner's cost model (:mod:`jax_prefix_attn.cost_model`): ``copy_share``, ``mma_share``,
    ``mma_mgpu_share``: the shares of the copy rate the decode kernels stream at and of the
    matmul rate the Triton and the Mosaic GPU prefix kernels reach; ``l2_bytes_per_s``: prefix
    re-reads served by L2 in the flat kernel; ``launch_s``: one kernel launch or dependent stage
    (launch, ramp, tail); ``key_latency_s``, ``flat_key_latency_s``: one key on a program's
    critical path (shared and flat kernels); ``slots_per_sm``: programs per SM that reach full
    bandwidth; ``overlap_serial_share``: the share of the shorter of the overlapped prefix and
    suffix programs that stays serial (imperfect overlap).  The role split
    (``leaves.mgpu_split.plan_roles``):
    ``role_prefix_flops_per_cta``, ``role_task_s`` (fixed cost of a prefix task),
    ``role_stream_bytes_per_s`` (per stream CTA).  The tree cost model
    (:mod:`jax_prefix_attn.tree_cost`): ``tree_copy_bytes_per_s``, ``tree_program_bytes_per_s``
    (one program streaming alone), ``tree_flops_per_s`` (tree kernels' matmuls),
    ``tree_prefix_flops_per_s`` (the shared-prefix kernel), ``tree_launch_s``,
    ``tree_program_s`` (fixed cost of one program).  ``tuning``: the :class:`Tuning`.
    """
    name: str
    compute_capability: str
    memory_bytes: float
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    decode_matmul_efficiency: float
    sharded_matmul_efficiency: float
    allreduce_latency_s: float
    allreduce_bytes_per_s: float
    sm_count: int
    smem_per_block: int
    copy_share: float
    mma_share: float
    mma_mgpu_share: float
    l2_bytes_per_s: float
    launch_s: float
    key_latency_s: float
    flat_key_latency_s: float
    slots_per_sm: float
    overlap_serial_share: float
    role_prefix_flops_per_cta: float
    role_task_s: float
    role_stream_bytes_per_s: float
    tree_copy_bytes_per_s: float
    tree_program_bytes_per_s: float
    tree_flops_per_s: float
    tree_prefix_flops_per_s: float
    tree_launch_s: float
    tree_program_s: float
    tuning: Tuning

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if field.type in ("float", "int") and not (number and value > 0):
                raise ValueError(f"DeviceProfile.{field.name} must be a positive number, got "
                                 f"{value!r}")

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds of one all-reduce of ``nbytes`` bytes over the GPUs of one host."""
        return self.allreduce_latency_s + nbytes / self.allreduce_bytes_per_s


# --- the data files ---------------------------------------------------------------------------

def _fail(path, key: str, why: str):
    raise ValueError(f"device data file {path}: {key}: {why}")


def _keys(obj, want, path, where: str) -> None:
    if not isinstance(obj, dict):
        _fail(path, where, f"must be an object, got {type(obj).__name__}")
    for key in obj:
        if key not in want:
            _fail(path, f"{where}.{key}" if where else key, "unknown key")
    for key in want:
        if key not in obj:
            _fail(path, f"{where}.{key}" if where else key, "missing key")


def _number(v, path, key):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        _fail(path, key, f"must be a positive number, got {v!r}")
    return v


def _count(v, path, key):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        _fail(path, key, f"must be a positive integer, got {v!r}")
    return v


def _optional_count(v, path, key):
    return None if v is None else _count(v, path, key)


def _flag(v, path, key):
    if not isinstance(v, bool):
        _fail(path, key, f"must be true or false, got {v!r}")
    return v


def _text(v, path, key):
    if not isinstance(v, str) or not v.strip():
        _fail(path, key, f"must be a non-empty string, got {v!r}")
    return v


_TILE = ("block_k", "num_warps", "num_stages")


def _tiling(v, path, key, extra=()):
    _keys(v, extra + _TILE, path, key)
    return tuple(_count(v[k], path, f"{key}.{k}") for k in _TILE)


def _flat_tiles(v, path, key):
    if not isinstance(v, list) or not v:
        _fail(path, key, "must be a non-empty list")
    out = []
    for i, t in enumerate(v):
        where = f"{key}[{i}]"
        tiling = _tiling(t, path, where, extra=("max_programs",))
        bound = _optional_count(t["max_programs"], path, f"{where}.max_programs")
        if (bound is None) != (i == len(v) - 1):
            _fail(path, f"{where}.max_programs", "null exactly on the last tiling")
        out.append((bound, tiling))
    return tuple(out)


def _bounds(v, path, key):
    if not (isinstance(v, list) and len(v) == 2):
        _fail(path, key, f"must be [low, high], got {v!r}")
    lo, hi = (_count(x, path, key) for x in v)
    if lo > hi:
        _fail(path, key, f"low {lo} above high {hi}")
    return lo, hi


def _regions(*counts, allow_empty: bool = False):
    def parse(v, path, key):
        if not isinstance(v, list) or not (v or allow_empty):
            _fail(path, key, "must be a " + ("list" if allow_empty else "non-empty list"))
        out = []
        for i, r in enumerate(v):
            where = f"{key}[{i}]"
            _keys(r, ("prefix", "suffix") + counts, path, where)
            out.append((_bounds(r["prefix"], path, f"{where}.prefix"),
                        _bounds(r["suffix"], path, f"{where}.suffix"))
                       + tuple(_count(r[c], path, f"{where}.{c}") for c in counts))
        return tuple(out)
    return parse


def _share(v, path, key):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        _fail(path, key, f"must be a number in (0, 1], got {v!r}")
    return v


# the data file's keys: its ``profile`` (every rate of DeviceProfile, by type) and its
# ``tuning`` (every field of Tuning, by parser)
_PROFILE_FIELDS = types.MappingProxyType({
    f.name: f.type for f in dataclasses.fields(DeviceProfile)
    if f.name not in ("name", "compute_capability", "tuning")})
_TUNING = types.MappingProxyType({
    "decode_suffix_tiling": _tiling, "row_suffix_tiling": _tiling,
    "overlap_below_programs": _count, "prefix_tiling": _tiling, "large_m_tiling": _tiling,
    "flat_tiles": _flat_tiles, "flat_rows_tiling": _tiling, "flat_own_min_split_keys": _count,
    "flat_own_max_splits": _optional_count, "flat_own_max_chunk": _count,
    "mgpu_min_ctas": _count, "mgpu_min_real_rows": _share, "few_ctas": _count,
    "long_tiles": _count, "split_waste": _count, "mgpu_suffix_split_below": _count,
    "one_launch_regions": _regions("min_group"), "one_launch_min_ctas": _count,
    "one_launch_min_group": _count, "joint_regions": _regions("min_group", "min_ctas"),
    "joint_stages": _count, "joint_schedule_barrier": _flag,
    "split_regions": _regions(), "split_group": _count, "split_min_rows": _count,
    "mgpu_backward_min_tq": _count, "stream_two_launch_regions": _regions(allow_empty=True),
    "flat_stream_regions": _regions(allow_empty=True),
})


def load_part(path) -> DeviceProfile:
    """The :class:`DeviceProfile` of one data file (``name``, ``compute_capability``,
    ``source``, ``profile`` and ``tuning``); raises ``ValueError`` naming the file and the key
    that is unknown, missing or of the wrong type."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            _fail(path, "(file)", f"not JSON: {e}")
    _keys(doc, ("name", "compute_capability", "source", "profile", "tuning"), path, "")
    for key in ("name", "compute_capability", "source"):
        _text(doc[key], path, key)
    _keys(doc["profile"], tuple(_PROFILE_FIELDS), path, "profile")
    rates = {k: (_count if t == "int" else _number)(doc["profile"][k], path, f"profile.{k}")
             for k, t in _PROFILE_FIELDS.items()}
    _keys(doc["tuning"], tuple(_TUNING), path, "tuning")
    tuning = Tuning(**{k: parse(doc["tuning"][k], path, f"tuning.{k}")
                       for k, parse in _TUNING.items()})
    return DeviceProfile(name=doc["name"], compute_capability=doc["compute_capability"],
                         tuning=tuning, **rates)


def data_files() -> tuple:
    """The data files of the measured parts (``jax_prefix_attn/device_data/*.json``)."""
    folder = importlib.resources.files("jax_prefix_attn").joinpath("device_data")
    return tuple(sorted((f for f in folder.iterdir() if f.name.endswith(".json")),
                        key=lambda f: f.name))


@functools.cache
def profiles() -> types.MappingProxyType:
    """``{name: DeviceProfile}`` of every data file, read and validated once."""
    found = {}
    for f in data_files():
        with importlib.resources.as_file(f) as path:
            profile = load_part(path)
        if profile.name in found:
            _fail(f, "name", f"{profile.name!r} is also the name of another data file")
        found[profile.name] = profile
    return types.MappingProxyType(found)


def reference_profile() -> DeviceProfile:
    """The H200's profile: the part whose values the documentation quotes, and what benchmarks
    and tests that report a setting with no device at hand read; the planner reads each
    device's own (:func:`device_profile`)."""
    return profiles()["H200"]


def _cc(cc: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(cc).split("."))
    except ValueError:
        return ()


@functools.cache
def device_profile(dev: DeviceInfo) -> tuple[DeviceProfile, str]:
    """``(profile, note)`` for ``dev``: the profile whose ``name`` occurs in the device kind
    (``note == ""``), else the measured part nearest by compute capability with a note naming
    both (e.g. for a CPU, or a GPU no profile was measured on)."""
    known = profiles()
    for profile in known.values():
        if profile.name.lower() in dev.name.lower():
            return profile, ""
    want = _cc(dev.compute_capability)
    nearest = min(known.values(),
                  key=lambda p: (_cc(p.compute_capability) != want,
                                 abs(_cc(p.compute_capability)[0] - (want or (0,))[0])))
    return nearest, (f"no measured profile for {dev.name!r} (compute capability "
                     f"{dev.compute_capability or 'none'}); planned with the {nearest.name} "
                     f"profile")


@functools.cache
def planning_profile(dev: DeviceInfo) -> DeviceProfile:
    """:func:`device_profile` of ``dev`` with the SM count and shared memory ``dev`` reports
    (the profile's own where it reports none): what the cost functions take."""
    profile, _ = device_profile(dev)
    facts = {k: getattr(dev, k) for k in ("sm_count", "smem_per_block") if getattr(dev, k) > 0}
    if all(getattr(profile, k) == v for k, v in facts.items()):
        return profile
    return dataclasses.replace(profile, **facts)


def default_profile() -> DeviceProfile:
    """:func:`planning_profile` of the part host-side planning targets
    (:func:`jax_prefix_attn.device.planning_device_info`): for the helpers whose callers pass
    no profile."""
    return planning_profile(planning_device_info())
