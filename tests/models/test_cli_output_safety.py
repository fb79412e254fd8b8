"""`jpa-sample --output` loses nothing and overwrites nothing by accident: records are written to
`FILE.partial-PID` as each sequence finishes (whole lines) and `FILE` appears by a rename when the
run ends; an interrupted (SIGINT), killed (SIGKILL) or failing (a file size limit, as on a full
disk) run leaves the previous `FILE` as it was and its finished records in the partial file; a
second run on a path another run is writing fails at once; an existing `FILE` needs `--overwrite`
or `--append`; `--output -` writes the records to standard output; Ctrl-C in `--schema` mode
keeps the completions of the running call. Also the `--question-format` escapes and checks, and
the flags that only go with `--output` or are easily mistaken (`-m model.gguf`).

The runs that are killed or limited are subprocesses of a small driver that runs `models.cli`
with the token stream wrapped: at step 1 the first sequence gets the end-of-sequence token (so
one record is finished early) and at a given step the stream sleeps, so the test can signal a
run that is certainly mid-generation."""
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import assert_one_error_line, run_cli, write_tiny_gguf
from models import cli
from models.cli import command, jsonl as cli_jsonl
from models.cli.args import UsageError
from models.cli.jsonl import FileRecords, open_records, record_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = r"""
import resource, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C raises, even if started ignored
cache_dir, pause_step, size_limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if size_limit >= 0:  # writes past it fail with EFBIG, as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size_limit, size_limit))
import jax
import numpy as np
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
import models.llm
from models import cli
real = models.llm.generate_stream

def driven(*a, **k):
    for step, out in enumerate(real(*a, **k)):
        if step == 1:  # sequence 0 ends at this step (end-of-sequence id 2): its record is written
            tok = np.array(out[0] if isinstance(out, tuple) else out)
            tok[0] = 2
            out = (tok, *out[1:]) if isinstance(out, tuple) else tok
        if step == pause_step:
            print("paused", file=sys.stderr, flush=True)
            time.sleep(600)
        yield out

models.llm.generate_stream = driven
sys.exit(cli.main(sys.argv[4:]))
"""

PREVIOUS = '{"previous": "run"}\n'


@pytest.fixture(autouse=True)
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this process during each test, also where the suite was
    started with SIGINT ignored (a background job of a non-interactive shell)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=7, lm_head_scale=30,
                           tensor_type=lambda n: "Q8_0" if "mlp" in n else "F32")


def _argv(model, *extra):
    """Three samples of one prompt, six tokens at most, greedy (sample 0 ends early in the driver)."""
    return [str(a) for a in ("--model", model, "-p", "the cat sat on", "-n", 3, "-m", 6, "-t", 0, *extra)]


_run = run_cli
_one_error_line = assert_one_error_line


def _whole_records(path):
    """The records of a JSONL file that must hold only whole lines."""
    data = open(path, encoding="utf-8").read()
    assert data.endswith("\n"), repr(data[-80:])
    return [json.loads(line) for line in data.splitlines()]


def _driver(model, output, pause_step, *extra, size_limit=-1):
    """The driver (module docstring) on `output`, pausing at `pause_step` (-1: never), with a
    file size limit of `size_limit` bytes (-1: none) set before anything else runs. (The limit
    is set by the child itself: a `preexec_fn` would run Python between fork and exec of a
    process whose JAX threads may hold locks.)"""
    env = dict(os.environ, PYTHONPATH=REPO)
    argv = [jax.config.jax_compilation_cache_dir or "", str(pause_step), str(size_limit),
            *_argv(model, "-o", output, *extra)]
    return subprocess.Popen([sys.executable, "-c", DRIVER, *argv], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_records(proc, partial, count, timeout=180):
    """Waits until `partial` holds `count` lines while `proc` still runs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()}")
        if os.path.exists(partial) and open(partial, encoding="utf-8").read().count("\n") >= count:
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no record in {partial} after {timeout} s")


@pytest.fixture
def no_loading(monkeypatch):
    def loader(*a, **k):
        raise AssertionError("the model loader was called")

    monkeypatch.setattr(command, "load_model", loader)


# ---------------------------------------------------------------------------------------------
# records as each sequence finishes, the file at the end
# ---------------------------------------------------------------------------------------------
def _drive(monkeypatch, at_step3):
    """In-process, the driver's wrap of the token stream: sample 0 ends at step 1 (its record is
    written), and ``at_step3()`` runs before step 3 is delivered."""
    import models.llm  # noqa: PLC0415

    real = models.llm.generate_stream

    def driven(*a, **k):
        for step, out in enumerate(real(*a, **k)):
            if step == 1:  # sample 0 ends (end-of-sequence id 2)
                tok = np.array(out[0])
                tok[0] = 2
                out = (tok, *out[1:])
            if step == 3:
                at_step3()
            yield out

    monkeypatch.setattr(models.llm, "generate_stream", driven)


def test_each_record_is_in_the_partial_file_when_its_sequence_ends(tiny_model, tmp_path, capsys, monkeypatch):
    """After sample 0 ended and before the run ends, the partial file holds its record and
    `FILE` does not exist; at the end `FILE` holds the three records in order, with the layout,
    and nothing else is left in the directory."""
    o, partial, seen = tmp_path / "o.jsonl", tmp_path / f"o.jsonl.partial-{os.getpid()}", []
    _drive(monkeypatch, lambda: seen.append((sorted(os.listdir(tmp_path)), _whole_records(partial))))
    rc, out, err = _run(_argv(tiny_model, "-o", o), capsys)
    assert rc == 0, err
    ((names, early),) = seen
    assert names == ["o.jsonl.lock", partial.name]
    assert [(r["sample"], r["finish_reason"], r["attention"]) for r in early] == [(0, "stop", None)]
    assert early[0]["timings"]["total_s"] >= early[0]["timings"]["first_token_s"] > 0
    recs = _whole_records(o)
    assert [(r["sample"], r["finish_reason"]) for r in recs] == [(0, "stop"), (1, "length"), (2, "length")]
    assert {r["attention"] for r in recs} == {"shared"} and recs[0]["token_ids"] == early[0]["token_ids"]
    assert os.listdir(tmp_path) == ["o.jsonl"] and out == ""


def test_a_file_created_meanwhile_is_not_replaced(tiny_model, tmp_path, capsys, monkeypatch):
    """Without --overwrite, a FILE that something else creates during the run is kept: status 2,
    the records in the partial file."""
    o, partial = tmp_path / "o.jsonl", tmp_path / f"o.jsonl.partial-{os.getpid()}"
    _drive(monkeypatch, lambda: o.write_text(PREVIOUS))
    rc, out, err = _run(_argv(tiny_model, "-o", o), capsys)
    _one_error_line(rc, out, err, f"cannot write --output {o}: {o} was created by something else during the run; "
                                  f"3 records kept in {partial} (whole lines)")
    assert o.read_text() == PREVIOUS and [r["sample"] for r in _whole_records(partial)] == [0, 1, 2]


class _ClosedPipe:
    """A standard output whose reader has exited, text and bytes alike."""

    @property
    def buffer(self):
        return self

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_output_dash_to_a_closed_pipe_is_one_line(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc = cli.main(_argv(tiny_model, "-o", "-"))
    err = capsys.readouterr().err
    assert rc == 2 and err == "jpa-sample: error: cannot write --output - (standard output): Broken pipe; 0 records " \
                              "written to standard output\n"


def test_existing_output_needs_overwrite_or_append(tiny_model, tmp_path, capsys):
    o = tmp_path / "o.jsonl"
    o.write_text(PREVIOUS)
    _one_error_line(*_run(_argv(tiny_model, "-o", o), capsys),
                    f"--output {o} exists; give --overwrite to replace it or --append to add this run's records")
    assert o.read_text() == PREVIOUS and os.listdir(tmp_path) == ["o.jsonl"]
    rc, _, err = _run(_argv(tiny_model, "-o", o, "--append"), capsys)
    assert rc == 0, err
    lines = o.read_text().splitlines(keepends=True)
    assert lines[0] == PREVIOUS and [json.loads(x)["sample"] for x in lines[1:]] == [0, 1, 2]
    rc, _, err = _run(_argv(tiny_model, "-o", o, "--overwrite"), capsys)
    assert rc == 0, err
    assert [r["sample"] for r in _whole_records(o)] == [0, 1, 2] and os.listdir(tmp_path) == ["o.jsonl"]


def test_output_dash_writes_utf8_whatever_the_stdout_encoding(monkeypatch):
    """On a standard output whose encoding cannot write the text (ASCII here), the record goes
    out as its UTF-8 bytes, after the text written before it."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    sys.stdout.write("before\n")
    records = open_records("-", "new")
    records.write({"completion": "caf\u00e9 \u2014 \U0001f600"})
    assert raw.getvalue() == b"before\n" + record_line({"completion": "caf\u00e9 \u2014 \U0001f600"})
    assert records.count == 1


def test_output_dash_writes_the_records_to_stdout(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(_argv(tiny_model, "-o", "-", "--logprobs"), capsys)
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert sorted(r["sample"] for r in recs) == [0, 1, 2] and all(len(r["logprobs"]) == len(r["token_ids"])
                                                                    for r in recs)
    assert os.listdir(tmp_path) == [] and "3 sequences (1 prompt x 3 samples)" in err


# ---------------------------------------------------------------------------------------------
# interrupted, killed, concurrent, out of space
# ---------------------------------------------------------------------------------------------
def test_sigint_keeps_the_records_and_a_second_run_on_the_path_fails(tiny_model, tmp_path, capsys):
    """A run paused mid-generation holds the path: a second run on it (even with --overwrite)
    fails at once with one line. SIGINT then ends the first with status 130: the previous file
    is unchanged and the partial file holds the finished record and the two interrupted ones,
    each with the log-probabilities and top-2 alternatives of its tokens (`--logprobs 2`)."""
    o = tmp_path / "o.jsonl"
    o.write_text(PREVIOUS)
    proc = _driver(tiny_model, o, 3, "--overwrite", "--logprobs", 2)
    partial = tmp_path / f"o.jsonl.partial-{proc.pid}"
    try:
        _wait_for_records(proc, partial, 1)
        _one_error_line(*_run(_argv(tiny_model, "-o", o, "--overwrite"), capsys),
                        f"cannot write --output {o}: another run is writing it")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"3 records kept in {partial} (whole lines); {o} is unchanged" in err
    assert o.read_text() == PREVIOUS and sorted(os.listdir(tmp_path)) == ["o.jsonl", partial.name]
    recs = _whole_records(partial)
    assert [(r["sample"], r["finish_reason"]) for r in recs] == [(0, "stop"), (1, "interrupted"),
                                                                 (2, "interrupted")]
    assert all(len(r["token_ids"]) >= 2 for r in recs[1:])
    for r in recs:
        assert len(r["logprobs"]) == len(r["top_logprobs"]) == len(r["token_ids"]), r
        assert all(lp <= 0 for lp in r["logprobs"]) and all(len(alts) == 2 for alts in r["top_logprobs"])
        assert all(alts[0][1] >= lp - 1e-4 for alts, lp in zip(r["top_logprobs"], r["logprobs"]))


def test_sigkill_keeps_the_previous_file_and_whole_records(tiny_model, tmp_path, capsys):
    """SIGKILL mid-generation: the previous file is unchanged, the partial file holds the one
    finished record; the lock it left does not stop the next run."""
    o = tmp_path / "o.jsonl"
    o.write_text(PREVIOUS)
    proc = _driver(tiny_model, o, 3, "--overwrite")
    partial = tmp_path / f"o.jsonl.partial-{proc.pid}"
    try:
        _wait_for_records(proc, partial, 1)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert o.read_text() == PREVIOUS
    assert [(r["sample"], r["finish_reason"]) for r in _whole_records(partial)] == [(0, "stop")]
    rc, _, err = _run(_argv(tiny_model, "-o", o, "--overwrite"), capsys)
    assert rc == 0, err
    assert [r["sample"] for r in _whole_records(o)] == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", partial.name]


def test_full_disk_keeps_the_previous_file(tiny_model, tmp_path, capsys):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail as on a full disk)
    that fits one record but not two: status 2 and one line naming the partial file, which holds
    the one whole record; the previous file is unchanged."""
    sizes = tmp_path / "sizes.jsonl"
    rc, _, err = _run(_argv(tiny_model, "-o", sizes), capsys)   # the sizes of the records
    assert rc == 0, err
    lines = sorted(len(line) for line in sizes.read_bytes().splitlines(keepends=True))
    limit = lines[0] + lines[1] // 2
    sizes.unlink()
    o = tmp_path / "o.jsonl"
    o.write_text(PREVIOUS * 3)
    proc = _driver(tiny_model, o, -1, "--overwrite", size_limit=limit)
    _, err = proc.communicate(timeout=300)
    partial = tmp_path / f"o.jsonl.partial-{proc.pid}"
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith(f"jpa-sample: error: cannot write --output {o}: "), err
    assert f"1 record kept in {partial} (whole lines); {o} is unchanged" in err
    assert o.read_text() == PREVIOUS * 3
    assert [r["sample"] for r in _whole_records(partial)] == [0]
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", partial.name]


# ---------------------------------------------------------------------------------------------
# Ctrl-C inside a write: no record lost, none twice, no file left behind
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before the write", "after the write"])
def test_ctrl_c_during_a_records_write_keeps_it_once(when, tiny_model, tmp_path, capsys, monkeypatch):
    """Ctrl-C lands in the write of sample 0's finished record, before its line reaches the file
    or after: the partial file holds it once (finished), and the two interrupted ones."""
    real, calls = FileRecords.write, []

    def write(self, record):
        calls.append(record["sample"])
        if len(calls) == 1 and when == "before the write":
            raise KeyboardInterrupt
        real(self, record)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(FileRecords, "write", write)
    o = tmp_path / "o.jsonl"
    _drive(monkeypatch, lambda: None)
    rc, out, err = _run(_argv(tiny_model, "-o", o), capsys)
    partial = tmp_path / f"o.jsonl.partial-{os.getpid()}"
    assert rc == 130, err
    assert f"3 records kept in {partial} (whole lines); {o} is unchanged" in err
    recs = _whole_records(partial)
    assert [(r["sample"], r["finish_reason"]) for r in recs] == [(0, "stop"), (1, "interrupted"), (2, "interrupted")]


class _OsWith:
    """The ``os`` module as ``models.cli.jsonl`` sees it, with the given functions replaced."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def _partial_records(tmp_path):
    """FileRecords on ``tmp_path/o.jsonl`` and its partial file's name."""
    records = FileRecords.open(str(tmp_path / "o.jsonl"), "new")
    return records, records.partial


def test_ctrl_c_after_the_bytes_are_written_counts_the_record(tmp_path, monkeypatch):
    """Ctrl-C right after `os.write` wrote a whole line: the record is counted, `abandon` keeps
    the partial file, and a later failed write cuts back to that line, not before it."""
    records, partial = _partial_records(tmp_path)
    real_write = os.write

    def write_then_interrupt(fd, data):
        real_write(fd, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_jsonl, "os", _OsWith(write=write_then_interrupt))
    with pytest.raises(KeyboardInterrupt):
        records.write({"sample": 0})
    assert records.count == 1

    def half_write(fd, data):
        return real_write(fd, data[:len(data) // 2])

    monkeypatch.setattr(cli_jsonl, "os", _OsWith(write=half_write))
    with pytest.raises(UsageError, match="1 record kept in .* \\(whole lines\\)"):
        records.write({"sample": 1, "completion": "x" * 100})
    assert open(partial, "rb").read() == record_line({"sample": 0})


def test_abandon_keeps_a_partial_file_with_a_line_it_did_not_count(tmp_path):
    """`abandon` decides by the file's content: a line in the file keeps it, an empty file is removed."""
    records, partial = _partial_records(tmp_path)
    os.write(records._fd, record_line({"sample": 0}))     # as a write whose bookkeeping was cut short
    records.abandon()
    assert open(partial, "rb").read() == record_line({"sample": 0})
    os.unlink(partial)
    records, partial = _partial_records(tmp_path)
    assert records.abandon() == f"no record was written; {tmp_path / 'o.jsonl'} is unchanged"
    assert os.listdir(tmp_path) == []


def test_ctrl_c_during_commit_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Ctrl-C while the final file is flushed: the temporary file is removed, `FILE` is not
    created, the partial file keeps the record."""
    records, partial = _partial_records(tmp_path)
    records.write({"sample": 0})

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_jsonl, "os", _OsWith(fsync=interrupted))
    with pytest.raises(KeyboardInterrupt):
        records.commit([{"sample": 0}])
    assert records.abandon().startswith("1 record kept in ")
    assert os.listdir(tmp_path) == [os.path.basename(partial)]


def test_commit_succeeds_when_only_the_temporary_name_cannot_be_removed(tmp_path, monkeypatch):
    """Without --overwrite `FILE` is made by a hard link: when the link is made and removing the
    temporary name fails, `FILE` holds the records and the commit is a success."""
    records, partial = _partial_records(tmp_path)
    records.write({"sample": 0})
    real_unlink = os.unlink

    def unlink(path, *a, **k):
        if ".tmp-" in os.fspath(path):
            raise PermissionError(1, "Operation not permitted")
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(cli_jsonl, "os", _OsWith(unlink=unlink))
    records.commit([{"sample": 0}])
    assert open(tmp_path / "o.jsonl", "rb").read() == record_line({"sample": 0})
    assert records.abandon() == f"1 record written to {tmp_path / 'o.jsonl'}"
    assert not os.path.exists(partial) and not os.path.exists(tmp_path / "o.jsonl.lock")


# ---------------------------------------------------------------------------------------------
# Ctrl-C in --schema mode
# ---------------------------------------------------------------------------------------------
SCHEMA = ('<schema name="pets"><module name="intro">the cat sat on the mat. </module>'
          '<module name="doc">a dog ran home then slept. </module></schema>')
PROMPTS = ('<prompt schema="pets"><intro/>so then</prompt>', '<prompt schema="pets"><intro/><doc/> and at last</prompt>')


def test_ctrl_c_in_schema_mode_keeps_the_completions(tiny_model, tmp_path, capsys, monkeypatch):
    """SIGINT while the cached path's call runs: the call finishes, its two records go to the
    partial file, the comparison does not run; status 130 and the previous file unchanged."""
    import models.cli.prompt_cache as pc  # noqa: PLC0415

    (tmp_path / "s.pml").write_text(SCHEMA)
    argv = ["--model", tiny_model, "--schema", tmp_path / "s.pml", "-t", 0, "-m", 4]
    for k, text in enumerate(PROMPTS):
        (tmp_path / f"p{k}.pml").write_text(text)
        argv += ["--prompt-pml", tmp_path / f"p{k}.pml"]
    real, calls = pc.cached_generate, []

    def interrupted(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while the call runs
        return out

    monkeypatch.setattr(pc, "cached_generate", interrupted)
    o = tmp_path / "o.jsonl"
    o.write_text(PREVIOUS)
    rc, out, err = _run(argv + ["--compare", "-o", o, "--overwrite"], capsys)
    partial = tmp_path / f"o.jsonl.partial-{os.getpid()}"
    assert rc == 130, err
    assert calls == [1] and "without cache" not in err
    assert f"2 records kept in {partial} (whole lines); {o} is unchanged" in err
    recs = _whole_records(partial)
    assert [r["prompt_index"] for r in recs] == [0, 1] and all("compare" not in r and r["token_ids"] for r in recs)
    assert o.read_text() == PREVIOUS and out == ""
    calls.clear()                                       # without --output the completions are printed
    rc, out, err = _run(argv, capsys)
    assert rc == 130 and calls == [1] and out.count("--- prompt ") == 2, err


# ---------------------------------------------------------------------------------------------
# --question-format, flags that go with --output, -m
# ---------------------------------------------------------------------------------------------
def test_question_format_unescapes_like_stop(tiny_model, tmp_path, capsys):
    """The default as --help prints it, typed on a command line (backslash-n), is the default."""
    shown = re.search(r"\(default: '([^']*)'\)", " ".join(cli.build_parser().format_help().split()))[1]
    assert shown == "Q: {question}\\nA:"
    parser = cli.build_parser()
    assert cli.parse_args(parser, ["--question-format", shown]).question_format == "Q: {question}\nA:"
    assert cli.parse_args(parser, ["--question-format", r"{question}\t\\"]).question_format == "{question}\t\\"
    q = tmp_path / "q.txt"
    q.write_text("why is the sky blue\n")
    rc, out, err = _run(["--model", tiny_model, "-p", "Answer:", "--questions-file", q, "-m", 1, "-t", 0,
                         "--question-format", shown, "-o", "-"], capsys)
    assert rc == 0, err
    assert json.loads(out)["prompt"] == "Answer:\nQ: why is the sky blue\nA:"


@pytest.mark.parametrize("argv,msg", [
    (["--questions-file", os.devnull, "--question-format", "Q: A:"],
     "argument --question-format: template 'Q: A:' has no {question} field"),
    (["--questions-file", os.devnull, "--question-format", "{}"], "argument --question-format: bad template"),
    (["--logprobs"], "--logprobs needs --output FILE or --output - (the log-probabilities are written in the "
                     "JSONL records)"),
    (["--prompt-logprobs", "3"], "--prompt-logprobs needs --output FILE or --output - (the log-probabilities are "
                                 "written in the JSONL records)"),
    (["--overwrite"], "--overwrite needs --output FILE"),
    (["--append"], "--append needs --output FILE"),
    (["-o", "-", "--append"], "--append cannot be used with --output -"),
    (["-o", "o.jsonl", "--append", "--overwrite"], "argument --overwrite: not allowed with argument --append"),
    (["--schema", "s.pml", "--prompt-pml", "p.pml", "-o", "-", "--compare"],
     "--compare cannot be used with --output -"),
    (["-m", "model.gguf", "-n", "64"], "-m is --max-new-tokens (an integer), got 'model.gguf'; to load a model "
                                       "file use --model model.gguf"),
    (["-mmodels/x y.gguf"], "got 'models/x y.gguf'; to load a model file use --model 'models/x y.gguf'"),
])
def test_output_and_model_flag_errors_exit_2_before_loading(argv, msg, no_loading, capsys):
    _one_error_line(*_run(([] if "--schema" in argv else ["-p", "x"]) + argv, capsys), msg)


def test_logprobs_flags_say_both_output_forms_in_their_help():
    parser = cli.build_parser()
    for action in parser._actions:
        if action.dest in ("logprobs", "prompt_logprobs"):
            assert "needs --output FILE or - (default" in " ".join(action.help.split()), action.help


def test_deferred_interrupt_raises_after_the_block_or_at_a_second_sigint(capsys):
    from models.cli.interrupt import deferred_interrupt  # noqa: PLC0415

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block went on")
    assert done == ["the block went on"] and "Ctrl-C again to stop now" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            done.append("not reached")
    assert done == ["the block went on"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
