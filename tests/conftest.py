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

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# JAX's persistent compilation cache, in one folder per jax version that every run reuses: a
# program compiled once (a GPU kernel, or one of the many identical per-thread programs of Mosaic
# GPU's CPU interpreter) is read back instead of compiled again.
_CACHE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache", jax.__version__)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
