import os
import shutil

# On machines without a GPU (CI), kernels run in Pallas interpret mode and the suite is
# dominated by XLA:CPU compilation of many small programs: compile them with cheap passes.
if shutil.which("nvidia-smi") is None and "XLA_FLAGS" not in os.environ:
    # (the classic fusion emitters compile these programs ~3x faster; 4 devices: the mesh tests)
    os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                               "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _compile_interpreter_threads_once() -> None:
    """Mosaic GPU's CPU interpreter runs each CTA as threads (one per warpgroup) that each trace
    and compile the kernel's per-thread program anew: ``CTAs x warpgroups`` identical XLA
    compilations of seconds each per launch, most of an interpreter test's time.  Keyed by the
    program (the same jaxpr object for every thread and CTA of a launch) and its argument types,
    one compiled executable serves them all; the computation is unchanged.  A no-op where the
    interpreter's internals differ (other jax versions)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return
    if not callable(getattr(thread_map, "_run_jaxpr", None)):
        return
    import collections
    import threading

    import numpy as np

    cache: collections.OrderedDict = collections.OrderedDict()
    lock = threading.Lock()

    def run(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        key = (id(jaxpr), tuple((np.shape(x), np.asarray(x).dtype.str)
                                for x in jax.tree.leaves((consts, args))))
        with lock:
            hit = cache.get(key)
            if hit is None or hit[0] is not jaxpr:
                compiled = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
                hit = cache[key] = (jaxpr, compiled)
                while len(cache) > 32:
                    cache.popitem(last=False)
            cache.move_to_end(key)
        hit[1](consts, *args)

    thread_map._run_jaxpr = run_jaxpr


if shutil.which("nvidia-smi") is None:
    _compile_interpreter_threads_once()


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
