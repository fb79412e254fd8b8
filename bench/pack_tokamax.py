"""Pack tokamax for the GPU machine, which has no network: ``python3 bench/pack_tokamax.py DIR``
downloads tokamax and the pure-Python dependencies that the GPU image lacks (CPython 3.12
wheels for Linux x86-64) into ``DIR`` and writes a stand-in ``xprof`` wheel: tokamax imports
``xprof.cli.tools`` at import time, only for its own profiler-based timing, which
``bench/flash_attention.py`` does not use; the real package is large and needs more
dependencies.  There: ``python3 -m pip install -q --no-index --no-deps --target /tmp/tk DIR/*.whl``
and ``/tmp/tk`` first on ``PYTHONPATH``.
"""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile

__all__ = ["TOKAMAX_VERSION", "TOKAMAX_WHEELS", "pack_tokamax", "write_xprof_stub"]

TOKAMAX_VERSION = "0.0.17"
# tokamax and what the GPU image lacks of its import-time dependencies (jax, jaxlib, numpy,
# absl-py, jaxtyping, tqdm and flax are there); typing-extensions is newer than pydantic needs.
TOKAMAX_WHEELS = (f"tokamax=={TOKAMAX_VERSION}", "immutabledict==4.3.1", "einshape==1.0", "qwix==0.1.8",
                  "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
                  "typing-inspection==0.4.5", "typing-extensions==4.16.0")
GPU_WHEEL_TAGS = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                  "--platform", "manylinux2014_x86_64")


def pack_tokamax(dest: str) -> list[str]:
    """Download :data:`TOKAMAX_WHEELS` for the GPU machine (CPython 3.12, Linux x86-64) into
    ``dest`` and write the stand-in ``xprof`` wheel; returns the files there."""
    os.makedirs(dest, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *GPU_WHEEL_TAGS, "-d", dest,
                    *TOKAMAX_WHEELS], check=True)
    write_xprof_stub(dest)
    return sorted(os.listdir(dest))


def write_xprof_stub(dest: str) -> str:
    """A wheel ``xprof 0.0.0`` holding the empty module ``xprof.cli.tools.get_kernel_stats_tool``."""
    doc = '"""Stand-in: tokamax imports this at import time; only its xprof timing calls it."""\n'
    files = {"xprof/__init__.py": doc, "xprof/cli/__init__.py": doc, "xprof/cli/tools/__init__.py": doc,
             "xprof/cli/tools/get_kernel_stats_tool.py": doc,
             "xprof-0.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: xprof\nVersion: 0.0.0\n"
                                               "Summary: stand-in for tokamax's import of xprof.cli.tools\n",
             "xprof-0.0.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: bench/flash_attention.py\n"
                                            "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{name},sha256={b64},{len(text.encode())}")
    record.append("xprof-0.0.0.dist-info/RECORD,,")
    path = os.path.join(dest, "xprof-0.0.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("xprof-0.0.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 bench/pack_tokamax.py DIR")
    print("\n".join(pack_tokamax(sys.argv[1])))
