"""The import-time check of the installed jax against the supported range."""
import subprocess
import sys
import warnings

import jax
import pytest

from pallas_kernels.jax_support import (GPU_TESTED, MIN_JAX, UNTESTED_FROM, UntestedJaxWarning,
                                        check_jax_version, parse_version, supported_range)


@pytest.mark.parametrize("text,want", [("0.12.0.1", (0, 12, 0, 1)), ("0.10.2", (0, 10, 2)),
                                       ("0.13.0.dev20261101", (0, 13, 0)), (" 1.0rc1", (1, 0))])
def test_parse_version(text, want):
    assert parse_version(text) == want


def test_parse_version_rejects_non_versions():
    with pytest.raises(ValueError, match="version must start with a release number"):
        parse_version("jax")
    with pytest.raises(TypeError, match="version must be a string"):
        parse_version((0, 12))


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2", "0.12.0.1", "0.12.9"])
def test_supported_versions_pass_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_jax_version(version)


@pytest.mark.parametrize("version", ["0.10.1", "0.9.0", "0.4.38"])
def test_older_jax_fails_naming_the_range(version):
    with pytest.raises(ImportError) as e:
        check_jax_version(version)
    assert f"jax {version} is installed" in str(e.value)
    assert "jax>=0.10.2,<0.13" in str(e.value) and "0.11.2 and 0.12.0.1" in str(e.value)


@pytest.mark.parametrize("version", ["0.13.0", "0.13.0.dev20261101", "1.0.0"])
def test_newer_jax_warns_naming_the_range(version):
    with pytest.warns(UntestedJaxWarning, match=r"jax>=0\.10\.2,<0\.13") as record:
        check_jax_version(version)
    assert f"jax {version} is newer" in str(record[0].message)


def test_range_constants_agree_with_pyproject():
    import pathlib
    text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"jax>={".".join(map(str, MIN_JAX))},<{".".join(map(str, UNTESTED_FROM))}"' in text
    assert parse_version(GPU_TESTED[-1]) < UNTESTED_FROM and MIN_JAX <= parse_version(GPU_TESTED[0])
    assert supported_range().startswith("jax>=0.10.2,<0.13")


def test_installed_jax_imports_without_a_warning():
    assert MIN_JAX <= parse_version(jax.__version__) < UNTESTED_FROM
    code = "import jax_prefix_attn, pallas_kernels"
    subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], check=True,
                   cwd=__file__.rsplit("/tests/", 1)[0])
