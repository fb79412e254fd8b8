import json
import os
import shutil
from importlib import metadata

_ON_CPU = shutil.which("nvidia-smi") is None


def _cpu_xla_flags() -> str:
    """XLA flags for a CPU run, each valid for the installed jaxlib: the suite is dominated by
    XLA:CPU compilation of many small programs, so compile them with cheap passes; 4 host
    devices for the mesh tests.  jaxlib < 0.11 also takes the classic (non-emitter) fusion
    code generator, which compiles these programs about 3x faster; jaxlib 0.11 removed that flag
    (and aborts on an unknown one)."""
    flags = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
             "--xla_force_host_platform_device_count=4"]
    major_minor = tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
    if major_minor < (0, 11):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)


if _ON_CPU and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _cpu_xla_flags()
if not _ON_CPU and os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share one GPU: each allocates what a test needs and frees it when
    # the test's arrays die, instead of reserving most of the GPU (the default) or keeping
    # every block it ever used in its own pool (``PREALLOCATE=false`` alone).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if not _ON_CPU and "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    # XLA's GEMM autotuner compiles and times candidate kernels for every dot fusion of every
    # program; the GPU tests compile hundreds of distinct programs (references are plain XLA
    # dots) and run each a few times, so they take XLA's default kernels.  Pallas kernels are
    # not autotuned either way.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
if not _ON_CPU:
    # On a host with NVLink multicast off in NCCL, jaxlib 0.12's own collective kernels fail;
    # the multi-GPU tests take NCCL's collectives there (models/collective_flags.py).
    from models.collective_flags import collective_xla_flags  # noqa: E402
    _flags = collective_xla_flags(os.environ)
    if _flags is not None:
        os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# On a GPU machine, JAX's persistent compilation cache, in one folder per jax version that every
# run and test process reuses: a kernel compiled once is read back instead of compiled again.
# The cache is unbounded (a few GB for the whole suite): a size bound makes jax hold one file
# lock across all test processes for every read and write, and list and stat the whole folder
# on every write, which serializes the processes' compilations.  Not on the CPU: there the
# suite's many small programs compile faster than the cache stores them (a cold run was 20%
# slower with it), and CI starts from a fresh clone.
if not _ON_CPU:
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache", jax.__version__))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Seconds each test spends tracing, lowering and compiling (jax's monitoring events), reported
# with its outcome in ``--results-log``: on the GPU compilation, not the kernels, is most of a
# test's time, and this tells which tests to make share their programs.
_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                   "/jax/core/compile/backend_compile_duration": "compile_s"}
_compile_seconds = dict.fromkeys(_COMPILE_EVENTS.values(), 0.0)


def _on_duration(event, duration, *args, **kwargs):
    name = _COMPILE_EVENTS.get(event)
    if name:
        _compile_seconds[name] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = dict(_compile_seconds)
    yield
    for name, total in _compile_seconds.items():
        item.user_properties.append((name, round(total - before[name], 3)))


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="cases of the differential fuzz tests (tests/fuzz; default 200 on the "
                          "CPU, 1000 on the GPU)")
    parser.addoption("--fuzz-summary", default=None,
                     help="write the fuzz run's summary (JSON) here")
    parser.addoption("--results-log", default=None,
                     help="append one JSON line per finished test (id, outcome, seconds) and the "
                          "records tests add through the results_log fixture to this file, as "
                          "they happen (a run cut short keeps what finished)")


def _append_record(path: str | None, record: dict) -> None:
    if path:
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(path, "a", encoding="utf-8") as f:   # one write per line: whole lines
            f.write(line)


class _ResultsLog:
    """Appends each test's outcome and duration to ``--results-log`` as the report arrives (in
    the controlling process, where pytest-xdist relays its workers' reports)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                      "seconds": round(report.duration, 3), **dict(report.user_properties)}
            if report.failed:
                record["error"] = report.longreprtext[-4000:]
            _append_record(self.path, record)


def pytest_configure(config):
    path = config.getoption("--results-log")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ResultsLog(path), "results_log")


@pytest.fixture
def results_log(request):
    """``results_log(**fields)`` appends a record for this test to ``--results-log``."""
    path = request.config.getoption("--results-log")
    return lambda **fields: _append_record(path, {"test": request.node.nodeid, **fields})


def pytest_collection_modifyitems(config, items):
    gpus = len(jax.devices()) if _has_gpu() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    one_gpu = pytest.mark.skip(reason=f"needs 2 GPUs, this machine has {gpus} (run on the "
                                      f"nvidia-h200-x2 kind)")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        elif "two_gpus" in item.keywords and gpus < 2:
            item.add_marker(one_gpu)
