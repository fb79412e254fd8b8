"""Every code snippet of README.md and docs/*.md runs.

Convention (for whoever writes the docs):

* Every ```python block is executed, in document order, in one namespace per markdown file,
  with the current directory set to a fresh temporary directory per file: a block may use the
  names and files an earlier block of the same file made. Snippets run on the CPU with tiny
  shapes or the built-in SmolLM2-135M model (``LLM.load()`` with no path).
* An HTML comment on the line right before a fence changes that:

  - ``<!-- snippet: skip (why) -->``: not run; the test reports it as skipped with the reason.
  - ``<!-- snippet: gpu -->``: run only where a CUDA GPU is present (skipped elsewhere).
  - ``<!-- snippet: devices N -->``: run only where jax has at least N devices (the CPU run
    has 4: tests/conftest.py sets ``--xla_force_host_platform_device_count=4``).
  - ``<!-- snippet: file NAME -->``: the block's text is written to ``NAME`` in the file's
    directory (e.g. a PML schema that a later block or command reads).
  - ``<!-- snippet: run -->`` (```bash blocks): the commands run in the file's directory, each
    ``jpa-sample`` command through its entry point ``models.cli.main`` in the test's process
    (exit status 0 required), any other block with ``bash -e``; keep them cheap (small ``-m``,
    ``-n``).

  Other ```bash blocks are not run, but every ``jpa-sample`` / ``python -m models.cli`` command
  in any block must pass the CLI's argument checks (``models.cli.args.parse_args``), one that
  writes ``--output FILE`` must say ``--overwrite`` or ``--append`` (so that it runs twice), and
  a command said to be "what `make run` runs" must be the Makefile's.
* Other fences (```xml, ```text, unlabelled) are not run.

The markers are kept to snippets that need a GPU, several hosts or a checkpoint that is not
installed; the README must also stay under 200 lines and its relative links must resolve.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w.+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
_KINDS = {"skip", "gpu", "devices", "file", "run"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # "skip", "gpu", "devices", "file", "run" or None
    arg: str           # the marker's argument (reason, file name)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, dedented to their fence, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: fence never closed")
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[start + 1:j]]
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        if marker and marker["kind"] not in _KINDS:
            raise AssertionError(f"{path.name}:{start}: unknown snippet marker {marker['kind']!r}")
        blocks.append(Block(path, start + 1, m["lang"], "\n".join(body) + "\n",
                            marker["kind"] if marker else None, marker["arg"].strip("() ") if marker else ""))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for p in DOCS for b in parse_blocks(p)]
RUNNABLE = [b for b in ALL_BLOCKS
            if b.lang == "python" or b.marker == "file" or (b.lang == "bash" and b.marker == "run")]


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def _unmet(block: Block) -> str | None:
    """Why ``block`` cannot run here (its marker's condition), or ``None``."""
    if block.marker == "skip":
        return f"{block.id}: marked skip: {block.arg or 'no reason given'}"
    if block.marker == "gpu" and not _has_gpu():
        return f"{block.id}: marked gpu: needs a CUDA GPU"
    if block.marker == "devices" and len(jax.devices()) < int(block.arg):
        return f"{block.id}: needs {block.arg} devices, jax has {len(jax.devices())}"
    return None


def _run_bash(block: Block, cwd: Path) -> None:
    """A block of `jpa-sample` commands runs them in this process through the entry point,
    `models.cli.main` (the compiled functions are shared with the Python snippets: much cheaper
    than a process each); any other block runs in `bash -e`."""
    commands = _commands(block.text)
    if commands and all(_cli_argv(argv) is not None for argv in commands):
        from models.cli import main
        for argv in commands:
            rc = main(_cli_argv(argv))
            assert rc == 0, f"{block.id}: `{shlex.join(argv)}` exits with status {rc}"
        return
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(["bash", "-e", "-c", block.text], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{block.id}: exit status {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


FILES = sorted({b.path for b in RUNNABLE})
UNMET = [(b, why) for b in RUNNABLE if (why := _unmet(b)) is not None]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(path: Path, tmp_path, monkeypatch):
    """The runnable blocks of one markdown file, in order, in one namespace and directory (one
    test per file: its blocks build on each other, so they run in one process); blocks whose
    marker's condition does not hold here are left out and reported by
    :func:`test_marked_block_not_run_here`."""
    namespace: dict = {"__name__": "__docs_snippet__"}
    monkeypatch.chdir(tmp_path)
    ran = 0
    for block in (b for b in RUNNABLE if b.path == path):
        if _unmet(block) is not None:
            continue
        if block.marker == "file":
            assert block.arg and "/" not in block.arg, f"{block.id}: `file` needs a plain file name"
            (tmp_path / block.arg).write_text(block.text, encoding="utf-8")
        elif block.lang == "bash":
            _run_bash(block, tmp_path)
        else:
            exec(compile(block.text, block.id, "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran, f"{path.name}: no block could run here"


@pytest.mark.parametrize("block,why", UNMET, ids=[b.id for b, _ in UNMET])
def test_marked_block_not_run_here(block: Block, why: str):
    pytest.skip(why)


# --- commands in ```bash blocks --------------------------------------------------------------

def _commands(text: str) -> list[list[str]]:
    """The commands of a bash block (continuation lines joined, comments dropped), split."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:
            continue
        if argv:
            out.append(argv)
    return out


def _cli_argv(argv: list[str]) -> list[str] | None:
    """The arguments after `jpa-sample` / `python -m models.cli`, or None for another command."""
    if argv[0] == "jpa-sample":
        return argv[1:]
    if len(argv) >= 3 and re.fullmatch(r"(\S*/)?python3?|\$\(PY\)", argv[0]) and argv[1:3] == ["-m", "models.cli"]:
        return argv[3:]
    return None


CLI_COMMANDS = [(b, line) for b in ALL_BLOCKS if b.lang == "bash"
                for line in b.text.replace("\\\n", " ").splitlines()
                if _commands(line) and _cli_argv(_commands(line)[0]) is not None]


def test_docs_have_cli_commands():
    assert len(CLI_COMMANDS) >= 5, [b.id for b, _ in CLI_COMMANDS]


@pytest.mark.parametrize("block,line", CLI_COMMANDS, ids=[f"{b.id}:{line.split('#')[0].strip()[:40]}"
                                                          for b, line in CLI_COMMANDS])
def test_cli_command_parses(block: Block, line: str):
    from models.cli.args import UsageError, build_parser, parse_args
    argv = _cli_argv(_commands(line)[0])
    try:
        args = parse_args(build_parser(), argv)
    except UsageError as e:
        pytest.fail(f"{block.id}: `{line.strip()}`: {e}")
    except SystemExit as e:  # --help / --version
        assert e.code in (0, None), f"{block.id}: `{line.strip()}` exits {e.code}"
        return
    if args.output not in (None, "-"):
        assert args.overwrite or args.append, (f"{block.id}: `{line.strip()}` fails when run a second time "
                                               f"(the --output file exists): add --overwrite or --append")


def test_make_run_command_is_the_makefiles():
    """A documented command said to be what `make run` runs is the Makefile's recipe."""
    recipe = re.search(r"^run:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    make_argv = _cli_argv(shlex.split(recipe))
    assert make_argv is not None, recipe
    claims = [(b, line) for b, line in CLI_COMMANDS if re.search(r"#.*make run", line)]
    assert claims, "no documented command says it is what `make run` runs"
    for b, line in claims:
        assert _cli_argv(_commands(line)[0]) == make_argv, f"{b.id}: `{line.strip()}` != Makefile `{recipe}`"


# --- the README's shape and every relative link ---------------------------------------------

def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n < 200, f"README.md has {n} lines"


_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    bad = []
    for m in _LINK.finditer(text):
        target = m["target"].split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            bad.append(m["target"])
    assert not bad, f"{path.name}: links to missing files: {bad}"
