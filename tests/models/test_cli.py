"""`jpa-sample` end to end on a tiny generated GGUF (random weights, tiny byte-level BPE): JSONL
records, samples independent of -n, --stop, --logprobs, streaming of one sequence (also in a
pseudo-terminal, with the live progress line), plain text when piped, --version and --help;
error paths exit with status 2 and a one-line message.  Prompt Cache (`--schema`, `--prompt-pml`):
records with the assembled prompt's token ids, the exact case equal to greedy decoding by full
recomputation, `--compare`, a second run that loads the modules from `--cache-dir` and gives the
same tokens, and its errors.  The built-in SmolLM2 model is exercised through `models.LLM` in
test_llm.py."""
import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (assert_one_error_line, run_cli, tiny_config, tiny_state_dict, tiny_tokenizer_meta,
                     write_tiny_gguf)
from models import cli
from models.cli import command
from models.cli.prompt_cache import CompileTimeline, bos_token_id
from models.config import LlamaConfig
from models.gguf import load_gguf, write_llama_gguf
from models.llama import Llama
from models.prompt_cache import PromptCache, cached_generate, layout_prompt, parse_prompt, parse_schema
from models.sampling import DEFAULT_SAMPLING, SamplingConfig
from models.tokenizer import Tokenizer
from models.weights import params_from_hf_state_dict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=7, lm_head_scale=30,
                           tensor_type=lambda n: "Q8_0" if "mlp" in n else "F32")


def SAMPLE_ARGV(model):
    return ["--model", model, "-p", "the cat sat on", "-n", 3, "-m", 6, "-t", 1.0, "--top-k", 0, "--top-p", 1.0]


_run = run_cli
_one_error_line = assert_one_error_line


@pytest.fixture
def no_loading(monkeypatch):
    """Replaces the model loader with one that records its calls and fails the test if reached."""
    calls = []

    def loader(*a, **k):
        calls.append(a)
        raise AssertionError("the model loader was called")

    monkeypatch.setattr(command, "load_model", loader)
    return calls


def _hf_dir(tiny_model, d):
    """A Hugging Face directory (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json) of the tiny GGUF's weights and tokenizer."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    hf_cfg, state = load_gguf(tiny_model)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(d / "model.safetensors"))
    tok = Tokenizer.from_gguf(tiny_model)
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
         "chat_template": tok.chat_template}))
    return d


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _naive_greedy(model_path, prompt_ids, steps):
    """Greedy continuation by full recomputation (no cache), through the model's forward."""
    hf, sd = load_gguf(model_path)
    config = LlamaConfig.from_hf_config(hf)
    params = params_from_hf_state_dict(config, sd, jnp.float32)
    model = Llama(config, impl="reference")
    forward = jax.jit(model.forward)
    ids = list(prompt_ids)
    out = []
    for _ in range(steps):  # right-padded to a fixed length (causal: padding after is not seen)
        padded = np.zeros((1, config.max_position_embeddings), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(forward(params, jnp.asarray(padded)))[0, len(ids) - 1]
        t = int(np.argmax(logits))
        out.append(t)
        if t == 2:
            break
        ids.append(t)
    return out


RECORD_KEYS = {"model", "prompt_index", "sample", "question", "prompt", "completion", "token_ids", "finish_reason",
               "stop_reason",
               "seed", "sampling", "attention", "device", "mesh", "timings"}


def _texts(recs):
    return [(r["completion"], r["token_ids"], r["finish_reason"]) for r in recs]


def test_tiny_model_sampling_jsonl_and_seed(tiny_model, tmp_path, capsys):
    out1, out2, out3, out4 = (tmp_path / f"o{i}.jsonl" for i in range(4))
    base = SAMPLE_ARGV(tiny_model)
    rc, stdout, err = _run(base + ["--seed", 1, "-o", out1], capsys)
    assert rc == 0, err
    recs = _records(out1)
    assert len(recs) == 3 and [r["sample"] for r in recs] == [0, 1, 2] and stdout == ""
    tok = Tokenizer.from_gguf(tiny_model)
    for r in recs:
        assert set(r) == RECORD_KEYS
        assert r["prompt"] == "the cat sat on" and r["question"] is None and r["prompt_index"] == 0
        assert 1 <= len(r["token_ids"]) <= 6
        body = r["token_ids"][:-1] if r["finish_reason"] == "stop" else r["token_ids"]
        assert r["finish_reason"] in ("stop", "length")
        assert r["completion"] == tok.decode(body, skip_special_tokens=True)
        assert r["seed"] == 1 and r["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                   "min_p": 0.0, "repetition_penalty": 1.0,
                                                   "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                                   "max_new_tokens": 6, "stop": [], "stop_token_ids": [],
                                                   "ignore_eos": False, "include_stop_str": False}
        assert r["model"]["path"] == os.path.abspath(tiny_model) and r["model"]["format"] == "gguf"
        assert r["model"]["bytes"] == os.path.getsize(tiny_model) and len(r["model"]["config_sha256"]) == 64
        assert r["attention"] == "shared" and r["device"] == jax.default_backend()
        assert r["mesh"] == {"tensor_parallel": 1, "data_parallel": 1}
        assert set(r["timings"]) == {"load_s", "compile_s", "prefill_s", "first_token_s", "decode_s", "total_s"}
    assert "3 sequences (1 prompt x 3 samples)" in err and "tok/s" in err and "KV cache" in err
    assert "first token" in err and "stored once" in err and "seed=" not in err
    assert len({tuple(r["token_ids"]) for r in recs}) > 1, "samples of one prompt should differ"
    assert _run(base + ["--seed", 1, "-o", out2], capsys)[0] == 0
    assert _texts(_records(out2)) == _texts(recs), "same seed, same completions"
    assert _run(base + ["--seed", 2, "-o", out3], capsys)[0] == 0
    assert [r["token_ids"] for r in _records(out3)] != [r["token_ids"] for r in recs]
    assert _run(base + ["--seed", 1, "-n", 2, "-o", out4], capsys)[0] == 0
    assert _texts(_records(out4)) == _texts(recs)[:2], "sample i does not depend on -n"


def test_tiny_model_greedy_questions_shared_equals_flat_equals_naive(tiny_model, tmp_path, capsys):
    qfile = tmp_path / "q.txt"
    qfile.write_text("why is the sky blue\n\n  what is a cat  \n")
    outs = {}
    for attention in ("shared", "flat"):
        o = tmp_path / f"{attention}.jsonl"
        rc, _, err = _run(["--model", tiny_model, "-p", "Answer:", "--questions-file", qfile, "-n", 2, "-m", 5,
                           "-t", 0, "--attention", attention, "-o", o], capsys)
        assert rc == 0, err
        outs[attention] = _records(o)
        assert {r["attention"] for r in outs[attention]} == {attention}
    assert _texts(outs["shared"]) == _texts(outs["flat"])
    recs = outs["shared"]
    assert [r["question"] for r in recs] == ["why is the sky blue"] * 2 + ["what is a cat"] * 2
    assert [r["prompt_index"] for r in recs] == [0, 0, 1, 1]
    assert recs[0]["prompt"] == "Answer:\nQ: why is the sky blue\nA:"
    tok = Tokenizer.from_gguf(tiny_model)
    for r in recs[::2]:
        want = _naive_greedy(tiny_model, tok.encode(r["prompt"]), 5)
        assert r["token_ids"] == want
    assert recs[0]["token_ids"] == recs[1]["token_ids"]  # greedy: samples agree


def test_tiny_model_chat_and_printed_output(tiny_model, tmp_path, capsys):
    qfile = tmp_path / "q.txt"
    qfile.write_text("hello there\nthe end\n")
    rc, stdout, err = _run(["--model", tiny_model, "--chat", "-p", "Be brief.", "--questions-file", qfile,
                            "-n", 2, "-m", 3, "-t", 0.7, "--progress", "on"], capsys)
    assert rc == 0, err
    heads = re.findall(r"^--- question (\d): ([a-z ]+), sample (\d)/2 \((stop|length), (\d) tokens\) ---$", stdout,
                       re.MULTILINE)
    assert sorted((q, s) for q, _, s, _, _ in heads) == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    assert {(q, text) for q, text, *_ in heads} == {("1", "hello there"), ("2", "the end")}
    assert "[prefill" in err and "[decode" in err and "\r\x1b[K" in err  # the live line (forced on)
    assert "4 sequences (2 prompts x 2 samples)" in err and "stored once" in err


def test_random_seed_is_in_the_summary_and_reproduces_the_run(tiny_model, capsys):
    """`--seed random` without `--output`: the summary names the drawn seed, and `--seed` with it
    prints the same completions."""
    rc, out, err = _run(SAMPLE_ARGV(tiny_model) + ["--seed", "random"], capsys)
    assert rc == 0, err
    (seed,) = re.findall(r" \| seed=(\d+) \| ", err)
    rc, again, err = _run(SAMPLE_ARGV(tiny_model) + ["--seed", seed], capsys)
    assert rc == 0 and again == out and "seed=" not in err, err


def test_stop_and_logprobs_flags(tiny_model, tmp_path, capsys):
    """--stop (repeatable) ends a completion before the string; --logprobs adds one float per token."""
    o1, o2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = ["--model", tiny_model, "-p", "the cat sat on", "-m", 6, "-t", 0]
    assert _run(base + ["--logprobs", "-o", o1], capsys)[0] == 0
    (free,) = _records(o1)
    assert len(free["logprobs"]) == len(free["token_ids"]) and all(lp <= 0 for lp in free["logprobs"])
    text = free["completion"]
    stop = text[1:3]
    assert len(stop) == 2
    rc, _, err = _run(base + ["--stop", "never-there", "--stop", stop.replace("\\", "\\\\"), "-o", o2], capsys)
    assert rc == 0, err
    (cut,) = _records(o2)
    assert cut["finish_reason"] == "stop" and cut["completion"] == text[:text.find(stop)]
    assert cut["sampling"]["stop"] == ["never-there", stop] and "logprobs" not in cut
    assert free["token_ids"][:len(cut["token_ids"])] == cut["token_ids"]


class _Recorder(io.StringIO):
    """A stdout that records each write."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_one_sequence_is_streamed(tiny_model, tmp_path, capsys, monkeypatch):
    o = tmp_path / "o.jsonl"
    argv = ["--model", tiny_model, "-p", "the cat sat on", "-m", 6, "-t", 0]
    assert _run(argv + ["-o", o], capsys)[0] == 0
    (rec,) = _records(o)
    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main([str(a) for a in argv]) == 0
    assert out.getvalue() == cli.printable(rec["completion"]) + "\n"
    assert len([w for w in out.writes if w]) >= 3, "written as it was generated, not at the end"
    err = capsys.readouterr().err
    assert "1 sequence (1 prompt x 1 sample)" in err and not CONTROL.search(err + out.getvalue())  # piped


def _pty_run(argv):
    """Run the CLI with stdout and stderr on a pseudo-terminal; everything it wrote."""
    import pty  # noqa: PLC0415

    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=REPO, TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "models.cli", *argv], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, cwd=REPO, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    return b"".join(chunks).decode("utf-8", errors="replace")


CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")   # control characters but tab and newline


def test_terminal_gets_a_live_line_and_the_stream_pipes_get_plain_text(tiny_model, tmp_path, capsys):
    argv = ["--model", tiny_model, "-p", "the cat sat on", "-m", 6, "-t", 0]
    rc, piped, err = _run(argv, capsys)
    assert rc == 0 and not CONTROL.search(piped + err)
    tty = _pty_run([str(a) for a in argv])
    assert "\r\x1b[K[load" in tty and "\r\x1b[K[prefill" in tty      # the live progress line
    plain = re.sub(r"\r\x1b\[K(\[[a-z, ]+\] [^\r\n\x1b]*)?", "", tty).replace("\r\n", "\n")
    assert plain.startswith(piped), (plain, piped)                   # then the same streamed text
    assert "1 sequence (1 prompt x 1 sample)" in plain and "first token" in plain


def test_version_and_each_default_shown_once(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and re.fullmatch(r"jpa-sample \S+ \(jax \S+\)\n", out)
    help_text = " ".join(cli.build_parser().format_help().split())
    for action in cli.build_parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert (action.help or "").count("(default:") == 1, action.dest
    for shown in ("(default: 0.8)", "(default: 0.95)", "(default: 50)", "(default: 64)", "(default: 1)",
                  "(default: 0)", "(default: auto)"):
        assert shown in help_text, shown


def test_ctrl_c_keeps_finished_tokens(tiny_model, tmp_path, capsys, monkeypatch):
    """A KeyboardInterrupt raised by the token stream (as Ctrl-C would) after two steps: every
    sequence's tokens so far are records in the partial file, the output file is not written."""
    import models.llm  # noqa: PLC0415

    real = models.llm.generate_stream

    def interrupted(*a, **k):
        for i, toks in enumerate(real(*a, **k)):
            if i == 2:
                raise KeyboardInterrupt
            yield toks

    monkeypatch.setattr(models.llm, "generate_stream", interrupted)
    o = tmp_path / "o.jsonl"
    rc, _, err = _run(SAMPLE_ARGV(tiny_model) + ["-o", o], capsys)  # shapes compiled by the first test
    assert rc == 130 and "interrupted" in err
    partial = tmp_path / f"o.jsonl.partial-{os.getpid()}"
    assert f"3 records kept in {partial} (whole lines); {o} is unchanged" in err
    assert sorted(os.listdir(tmp_path)) == [partial.name]
    recs = _records(partial)
    assert len(recs) == 3
    for r in recs:
        assert len(r["token_ids"]) <= 2
        assert r["finish_reason"] in ("interrupted", "stop")


@pytest.mark.parametrize("argv,msg", [
    (["-p", "x", "--num-samples", "0"], "argument --num-samples/-n: must be >= 1, got 0"),
    (["-p", "x", "--max-new-tokens", "abc"], "expected an integer, got 'abc'"),
    (["-p", "x", "--temperature", "-1"], "argument --temperature/-t: must be a number in [0, 100]"),
    (["-p", "x", "--temperature", "nan"], "must be a number in [0, 100], got nan"),
    (["-p", "x", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["-p", "x", "--top-p", "1.5"], "must be in (0, 1], got 1.5"),
    (["-p", "x", "--top-k", "-3"], "must be >= 0, got -3"),
    (["-p", "x", "--repetition-penalty", "0"], "argument --repetition-penalty: must be in (0, 1000000], got 0"),
    (["-p", "x", "--repetition-penalty", "2e6"], "argument --repetition-penalty: must be in (0, 1000000], got 2e6"),
    (["-p", "x", "--attention", "fast"], "invalid choice: 'fast'"),
    (["-p", "x", "--stop", ""], "argument --stop: expected a non-empty string"),
    (["-p", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["-p", "x", "--prompt-file", "f"], "not allowed with argument"),
    (["-p", "   "], "empty prompt"),
    ([], "empty prompt"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found: /nonexistent/prompt.txt"),
    (["-p", "x", "--model", "/nonexistent/m.gguf"], "model file not found: /nonexistent/m.gguf"),
    (["-p", "x", "--questions-file", os.devnull, "--question-format", "{question.x}"],
     "argument --question-format: bad template '{question.x}'"),
    (["-p", "x", "--questions-file", os.devnull, "--question-format", "{question[i]}"],
     "argument --question-format: bad template '{question[i]}'"),
])
def test_usage_errors_exit_2_with_one_line(argv, msg, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert err.startswith("jpa-sample: error: ") and msg in err, err
    assert err.count("\n") == 1 and out == ""


def test_file_errors_exit_2(tiny_model, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    rc, _, err = _run(["-p", "x", "--model", junk], capsys)
    assert rc == 2 and "is not a readable GGUF file" in err and err.count("\n") == 1

    rc, _, err = _run(["-p", "x", "--model", tmp_path], capsys)  # a directory without a config.json
    assert rc == 2 and "has no config.json" in err

    empty_q = tmp_path / "q.txt"
    empty_q.write_text("\n  \n")
    rc, _, err = _run(["-p", "x", "--model", tiny_model, "--questions-file", empty_q], capsys)
    assert rc == 2 and "has no non-empty line" in err

    rc, _, err = _run(["-p", "x", "--model", tiny_model, "-m", 1000], capsys)
    assert rc == 2 and "exceeds the model's context of 128 tokens" in err

    # a llama GGUF whose tokenizer has no chat template
    meta = tiny_tokenizer_meta()
    del meta["chat_template"]
    cfg = tiny_config(vocab_size=len(meta["tokens"]))
    nochat = tmp_path / "nochat.gguf"
    write_llama_gguf(nochat, cfg, tiny_state_dict(cfg), tokenizer=meta)
    rc, _, err = _run(["-p", "x", "--model", nochat, "--chat"], capsys)
    assert rc == 2 and "no chat template" in err

    # a GGUF of another architecture
    import gguf

    other = tmp_path / "qwen.gguf"
    w = gguf.GGUFWriter(str(other), "qwen2")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, _, err = _run(["-p", "x", "--model", other], capsys)
    assert rc == 2 and "unsupported GGUF architecture 'qwen2'; supported: llama" in err


def test_subprocess_error_has_no_traceback_and_help_works():
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "models.cli", "-p", "hi", "--model", "/nonexistent.gguf"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "jpa-sample: error: model file not found: /nonexistent.gguf\n"
    r = subprocess.run([sys.executable, "-m", "models.cli", "--help"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0 and "--questions-file" in r.stdout and "--num-samples" in r.stdout


def test_hf_directory_model_gives_the_same_completions(tiny_model, tmp_path, capsys):
    """`--model DIR` (config.json + model.safetensors + tokenizer.json) of the same weights and
    tokenizer as the tiny GGUF: identical greedy completions."""
    d = _hf_dir(tiny_model, tmp_path / "hfdir")
    outs = []
    for model in (tiny_model, d):
        o = tmp_path / f"{len(outs)}.jsonl"
        rc, _, err = _run(SAMPLE_ARGV(model) + ["-t", 0, "-o", o], capsys)
        assert rc == 0, err
        outs.append(_records(o))
    assert _texts(outs[0]) == _texts(outs[1])
    assert len(outs[0]) == 3 and [r["model"]["format"] for r in (outs[0][0], outs[1][0])] == ["gguf", "hf"]


# ---------------------------------------------------------------------------------------------
# user errors: checked before the model loads, one line on stderr, status 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", ["99999999999999999999", str(2**32), str(2**63), "-1"])
def test_seed_out_of_range_rejected_at_parse_time(seed, no_loading, capsys):
    rc, out, err = _run(["-p", "x", "--seed", seed], capsys)
    _one_error_line(rc, out, err, f"argument --seed: must be an integer in [0, 4294967295], got {seed}")
    assert no_loading == []


def test_seed_range_is_accepted_and_documented():
    parser = cli.build_parser()
    assert parser.parse_args(["--seed", "4294967295"]).seed == 2**32 - 1
    assert parser.parse_args(["--seed", "0"]).seed == 0
    assert "[0, 4294967295]" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("where,msg", [
    ("missing_dir/o.jsonl", "does not exist"),
    ("a_file/o.jsonl", "is not a directory"),
    ("a_dir", "is a directory"),
])
def test_unwritable_output_detected_before_loading(where, msg, tmp_path, no_loading, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    target = tmp_path / where
    rc, out, err = _run(["-p", "x", "-o", target], capsys)
    _one_error_line(rc, out, err, f"cannot write --output {target}")
    assert msg in err
    assert no_loading == [], "the model loaded before the --output check"


def test_output_check_keeps_an_existing_file(tmp_path, capsys):
    o = tmp_path / "o.jsonl"
    o.write_text("kept\n")
    rc, out, err = _run(["-p", "x", "-o", o, "--overwrite", "--model", tmp_path / "missing.gguf"], capsys)
    _one_error_line(rc, out, err, "model file not found")
    assert o.read_text() == "kept\n" and os.listdir(tmp_path) == ["o.jsonl"]


@pytest.mark.parametrize("present,missing", [
    ((), "has no config.json"),
    (("tokenizer.json", "model.safetensors"), "has no config.json"),
    (("config.json",), "has no safetensors weights"),
    (("config.json", "tokenizer.json"), "has no safetensors weights"),
    (("config.json", "model.safetensors"), "has no tokenizer.json"),
])
def test_model_directory_names_the_first_missing_file(present, missing, tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    for name in present:
        (d / name).write_text("{}")
    rc, out, err = _run(["-p", "x", "--model", d], capsys)
    _one_error_line(rc, out, err, f"model directory {d} {missing}")


@pytest.mark.parametrize("damage,msg", [
    ("safetensors", "cannot load"),
    ("index", "cannot load"),
    ("config_list", "cannot load"),
])
def test_bad_checkpoint_directory_is_one_line(damage, msg, tiny_model, tmp_path, capsys):
    d = _hf_dir(tiny_model, tmp_path / "hf")
    if damage == "safetensors":
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    elif damage == "index":
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text("{}")
    else:
        (d / "config.json").write_text("[]")
    rc, out, err = _run(["-p", "x", "--model", d], capsys)
    _one_error_line(rc, out, err, msg)


def test_prompt_file_dash_reads_stdin(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat sat on"))
    o = tmp_path / "o.jsonl"
    rc, _, err = _run(["--model", tiny_model, "--prompt-file", "-"] + SAMPLE_ARGV(tiny_model)[4:] + ["-o", o], capsys)
    assert rc == 0, err
    assert [r["prompt"] for r in _records(o)] == ["the cat sat on"] * 3


def test_questions_file_dash_reads_stdin(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("why is the sky blue\n\n  what is a cat  \n"))
    o = tmp_path / "o.jsonl"
    rc, _, err = _run(["--model", tiny_model, "-p", "Answer:", "--questions-file", "-", "-n", 2, "-m", 5,
                       "-t", 0, "-o", o], capsys)
    assert rc == 0, err
    assert [r["question"] for r in _records(o)] == ["why is the sky blue"] * 2 + ["what is a cat"] * 2


def test_prompt_and_questions_both_from_stdin_is_an_error(no_loading, capsys):
    rc, out, err = _run(["--prompt-file", "-", "--questions-file", "-"], capsys)
    _one_error_line(rc, out, err, "--prompt-file and --questions-file cannot both be '-'")
    assert no_loading == []


def test_unescape():
    assert cli.unescape(r"a\n\tb\\n\x") == "a\n\tb\\n\\x"


def test_error_line_joins_lines():
    assert cli.error_line("cannot read x:\n  bad value\n\n at line 2") == "cannot read x: bad value at line 2"


def _cli_subprocess(argv, stdin=""):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "models.cli", *argv], input=stdin, capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)


def test_subprocess_huge_seed_exits_2_with_one_line():
    r = _cli_subprocess(["-p", "hi", "--seed", "99999999999999999999"])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("jpa-sample: error: argument --seed: must be an integer in [0, 4294967295], "
                        "got 99999999999999999999\n")


def test_subprocess_prompt_file_dash_reads_stdin():
    """A blank standard input is read as the prompt: the empty-prompt error, before any loading."""
    r = _cli_subprocess(["--prompt-file", "-", "--model", "/nonexistent.gguf"], stdin="  \n")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "jpa-sample: error: empty prompt: give --prompt TEXT or --prompt-file FILE\n"


# ---------------------------------------------------------------------------------------------
# several devices (the 4 CPU devices of tests/conftest.py)
# ---------------------------------------------------------------------------------------------
def test_tensor_and_data_parallel_flags_give_one_devices_completions(tiny_model, tmp_path, capsys):
    """--tensor-parallel 2 --data-parallel 2: three samples at temperature 1 (padded to four rows
    over the two data shards), decoded step by step, equal one device's; the summary names the
    mesh."""
    argv = SAMPLE_ARGV(tiny_model)
    one, mesh = tmp_path / "one.jsonl", tmp_path / "mesh.jsonl"
    assert _run(argv + ["-o", one], capsys)[0] == 0
    rc, _, err = _run(argv + ["--tensor-parallel", 2, "--data-parallel", 2, "-o", mesh], capsys)
    assert rc == 0, err
    assert "tensor_parallel=2 data_parallel=2" in err and "3 sequences (1 prompt x 3 samples)" in err
    assert _texts(_records(mesh)) == _texts(_records(one)) and len(_records(one)) == 3
    assert all(r["mesh"] == {"tensor_parallel": 2, "data_parallel": 2} for r in _records(mesh))
    assert len({tuple(r["token_ids"]) for r in _records(one)}) > 1, "samples of one prompt should differ"


@pytest.mark.parametrize("argv,msg", [
    (["--tensor-parallel", "8"], "--tensor-parallel 8 x --data-parallel 1: tensor_parallel=8 x data_parallel=1 "
                                 "needs 8 devices, but only 4"),
    (["--tensor-parallel", "2", "--data-parallel", "3"], "needs 6 devices, but only 4"),
    (["--tensor-parallel", "0"], "argument --tensor-parallel: must be >= 1, got 0"),
    (["--data-parallel", "two"], "argument --data-parallel: expected an integer, got 'two'"),
])
def test_impossible_device_counts_exit_2_before_loading(argv, msg, no_loading, capsys):
    assert len(jax.devices()) == 4
    rc, out, err = _run(["-p", "x"] + argv, capsys)
    _one_error_line(rc, out, err, msg)
    assert no_loading == []


# ---------------------------------------------------------------------------------------------
# Prompt Cache: --schema / --prompt-pml
# ---------------------------------------------------------------------------------------------
INTRO, DOC_HEAD, DOC_TAIL, FR = "the cat sat on the mat. ", "a dog ran to ", " then slept. ", "and the bird sang"
PML_SCHEMA = (f'<schema name="pets"><module name="intro">{INTRO}</module>'
          f'<module name="doc">{DOC_HEAD}<param name="where" len="4"/>{DOC_TAIL}</module>'
          f'<union><module name="en">in the park</module><module name="fr">{FR}</module></union></schema>')
PML_PROMPTS = {"exact": '<prompt schema="pets"><intro/>so then</prompt>',
           "mixed": '<prompt schema="pets"><intro/><doc where="home"/><fr/> and at last</prompt>'}


@pytest.fixture(scope="module")
def pml_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pml")
    (d / "schema.pml").write_text(PML_SCHEMA)
    for name, text in PML_PROMPTS.items():
        (d / f"{name}.pml").write_text(text)
    return d


PML_RECORD_KEYS = {"model", "schema", "schema_file", "prompt_file", "prompt_index", "sample", "prompt",
                   "prompt_token_ids", "cached_tokens", "new_tokens", "completion", "token_ids", "finish_reason",
                   "stop_reason", "logprobs", "seed", "sampling", "attention", "device", "mesh", "cache", "timings",
                   "compare"}


def test_pml_records_exact_case_compare_and_disk_cache(tiny_model, pml_files, tmp_path, capsys):
    cache_dir, o1, o2 = tmp_path / "cache", tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"
    base = ["--model", tiny_model, "--schema", pml_files / "schema.pml", "--prompt-pml", pml_files / "exact.pml",
            "--prompt-pml", pml_files / "mixed.pml", "--cache-dir", cache_dir, "-t", 0, "-m", 6]
    rc, stdout, err = _run(base + ["--compare", "--logprobs", "-o", o1], capsys)
    assert rc == 0, err
    assert stdout == "" and sorted(os.listdir(cache_dir)) == ["manifest.json", "pets.safetensors"]
    recs = _records(o1)
    assert [(r["prompt_index"], r["sample"]) for r in recs] == [(0, 0), (1, 0)]
    tok = Tokenizer.from_gguf(tiny_model)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    want_prompts = [enc(INTRO) + enc("so then"),
                    enc(INTRO) + enc(DOC_HEAD) + enc("home") + enc(DOC_TAIL) + enc(FR) + enc(" and at last")]
    new = {"exact": enc("so then"), "mixed": enc("home") + enc(" and at last")}   # argument and new text
    for r, name, want in zip(recs, PML_PROMPTS, want_prompts):
        assert set(r) == PML_RECORD_KEYS
        assert r["schema"] == "pets" and r["prompt_file"] == str(pml_files / f"{name}.pml")
        assert r["schema_file"] == str(pml_files / "schema.pml") and r["attention"] == "prompt_cache"
        assert r["prompt_token_ids"] == want and r["prompt"] == tok.decode(want)
        assert r["new_tokens"] == len(new[name])
        assert r["cached_tokens"] == len(want) - r["new_tokens"]
        assert 1 <= len(r["token_ids"]) <= 6 and len(r["logprobs"]) == len(r["token_ids"])
        body = r["token_ids"][:-1] if r["finish_reason"] == "stop" else r["token_ids"]
        assert r["completion"] == tok.decode(body, skip_special_tokens=True)
        assert r["seed"] == 0 and r["sampling"]["temperature"] == 0.0 and r["sampling"]["max_new_tokens"] == 6
        assert r["model"]["path"] == os.path.abspath(tiny_model) and r["device"] == jax.default_backend()
        assert r["cache"]["modules"] == "encoded" and r["cache"]["hits"] == {"device": 0, "host": 0, "disk": 0}
        assert r["cache"]["bytes"]["disk"] == os.path.getsize(cache_dir / "pets.safetensors")
        for t in (r["timings"], r["compare"]["timings"]):
            assert t["total_s"] >= t["ttft_s"] >= t["ttft_compile_s"] >= 0 and t["warm_ttft_s"] > 0
    exact, mixed = recs
    assert len(exact["token_ids"]) == 6 and len(set(exact["token_ids"])) > 1, exact["token_ids"]
    assert exact["token_ids"] == _naive_greedy(tiny_model, want_prompts[0], 6)      # the exact case
    assert exact["compare"]["same_tokens"] and exact["compare"]["token_ids"] == exact["token_ids"]
    # contiguous positions (the argument fills its parameter, the union member is its longest)
    assert mixed["compare"]["token_ids"] == _naive_greedy(tiny_model, want_prompts[1], 6)
    assert "TTFT with cache" in err and "without cache" in err and "(second calls; " in err
    assert f"same tokens {sum(r['compare']['same_tokens'] for r in recs)}/2" in err
    assert "modules encoded" in err
    assert "2 sequences (2 prompts x 1 sample) of schema 'pets'" in err
    assert "cache hits device 0, host 0, disk 0" in err

    rc, _, err = _run(base + ["-o", o2, "--progress", "on"], capsys)     # modules from the directory
    assert rc == 0, err
    assert "\r\x1b[K[load" in err and "[modules" in err and "[generate with cache" in err   # the live line
    again = _records(o2)
    assert "modules disk" in err and "cache hits device 0, host 0, disk 1" in err and "without cache" not in err
    assert [r["cache"]["modules"] for r in again] == ["disk", "disk"] and "compare" not in again[0]
    assert "warm_ttft_s" not in again[0]["timings"] and "s of it compiling)" in err
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in recs]
    assert [r["prompt_token_ids"] for r in again] == want_prompts

    stop = mixed["completion"][1:3]                # printed blocks, two greedy samples, cut at a stop string
    rc, stdout, err = _run(base + ["-n", 2, "--stop", stop.replace("\\", "\\\\")], capsys)
    assert rc == 0, err
    cut = cli.printable(mixed["completion"][:mixed["completion"].find(stop)])
    blocks = re.split(r"^--- prompt (\d): (\S+), sample (\d)/2 \((\w+), \d+ tokens\) ---\n", stdout, flags=re.M)
    assert blocks[0] == "" and "4 sequences (2 prompts x 2 samples)" in err
    got = [tuple(blocks[i:i + 5]) for i in range(1, len(blocks), 5)]
    assert [g[:3] for g in got] == [("1", str(pml_files / "exact.pml"), "1"), ("1", str(pml_files / "exact.pml"), "2"),
                                    ("2", str(pml_files / "mixed.pml"), "1"), ("2", str(pml_files / "mixed.pml"), "2")]
    assert [g[3:] for g in got[2:]] == [("stop", cut + "\n")] * 2

    manifest = json.loads((cache_dir / "manifest.json").read_text())   # a directory of another model
    manifest["identity"]["model"] = "0" * 64
    (cache_dir / "manifest.json").write_text(json.dumps(manifest))
    _one_error_line(*_run(base, capsys), "made for another model")


def test_pml_repetition_penalty_gives_the_tokens_of_cached_generate(tiny_model, pml_files, tmp_path, capsys):
    """`--schema` with `--repetition-penalty 1.3`: the records' `sampling` shows it and their
    tokens are those of `cached_generate` with the same SamplingConfig, which differ from the
    unpenalised ones."""
    out = tmp_path / "o.jsonl"
    rc, _, err = _run(["--model", tiny_model, "--schema", pml_files / "schema.pml", "--prompt-pml",
                       pml_files / "exact.pml", "--prompt-pml", pml_files / "mixed.pml", "-t", 0, "-m", 6,
                       "--repetition-penalty", 1.3, "-o", out], capsys)
    assert rc == 0, err
    recs = _records(out)
    assert [r["sampling"]["repetition_penalty"] for r in recs] == [1.3, 1.3]
    llm = cli.load_model(tiny_model, None)
    schema = parse_schema(PML_SCHEMA)
    cache = PromptCache(llm.model, llm.params, llm.tokenizer, bos_id=bos_token_id(llm.tokenizer))
    encoded, lay = cache.encode_or_load(schema), cache.schema_layout(schema)
    prompts = [layout_prompt(parse_prompt(PML_PROMPTS[k], schema), schema, lay, llm.tokenizer) for k in PML_PROMPTS]

    def tokens(**penalty):
        sampling = SamplingConfig(temperature=0.0, top_k=DEFAULT_SAMPLING.top_k, top_p=DEFAULT_SAMPLING.top_p,
                                  **penalty)
        o = cached_generate(llm.model, llm.params, encoded, prompts, max_new_tokens=6, sampling=sampling, seed=0,
                            eos_token_ids=llm.eos_token_ids)
        return [[int(t) for t in o.tokens[b, :o.lengths[b]]] for b in range(len(prompts))]

    penalised = tokens(repetition_penalty=1.3)
    assert [r["token_ids"] for r in recs] == penalised
    assert penalised != tokens()


def test_pml_random_seed_is_in_the_summary_and_reproduces_the_run(tiny_model, pml_files, capsys):
    """`--schema` with `--seed random`: the summary names the drawn seed, and `--seed` with it
    prints the same completions."""
    base = ["--model", tiny_model, "--schema", pml_files / "schema.pml", "--prompt-pml", pml_files / "mixed.pml",
            "-n", 2, "-m", 6, "-t", 1.0, "--top-k", 0, "--top-p", 1.0]
    rc, out, err = _run(base + ["--seed", "random"], capsys)
    assert rc == 0, err
    (seed,) = re.findall(r" \| seed=(\d+) \| ", err)
    rc, again, err = _run(base + ["--seed", seed], capsys)
    assert rc == 0 and again == out and "seed=" not in err, err


def test_pml_argument_longer_than_its_param_exits_2(tiny_model, pml_files, tmp_path, capsys):
    p = tmp_path / "long.pml"
    p.write_text('<prompt schema="pets"><doc where="a very long place indeed"/> ok</prompt>')
    rc, out, err = _run(["--model", tiny_model, "--schema", pml_files / "schema.pml", "--prompt-pml", p], capsys)
    _one_error_line(rc, out, err, f"prompt file {p}: <doc> (line 1): argument where=")


@pytest.mark.parametrize("schema,prompt,extra,msg", [
    (None, PML_PROMPTS["exact"], [], "--prompt-pml needs --schema FILE"),
    (PML_SCHEMA, None, [], "--schema needs at least one --prompt-pml FILE"),
    (None, None, ["--compare"], "--compare needs --schema FILE"),
    (None, None, ["--cache-dir", "d"], "--cache-dir needs --schema FILE"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["-p", "x"], "--prompt cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--chat"], "--chat cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--attention", "flat"], "--attention flat cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--tensor-parallel", "2"], "--tensor-parallel / --data-parallel cannot be used"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--stop-token-ids", "5"], "--stop-token-ids cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--ignore-eos"], "--ignore-eos cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--include-stop-str"], "--include-stop-str cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--logprobs", "3", "-o", "-"], "--logprobs K cannot be used with --schema"),
    (PML_SCHEMA, PML_PROMPTS["exact"], ["--prompt-logprobs", "-o", "-"],
     "--prompt-logprobs cannot be used with --schema"),
    ('<schema name="pets"><module name="a">x</schema>', PML_PROMPTS["exact"], [], "malformed PML at line 1"),
    (PML_SCHEMA, '<prompt schema="pets"><outro/> x</prompt>', [], "<outro> (line 1): unknown module 'outro'"),
    (PML_SCHEMA, '<prompt schema="pets"><en/><fr/> x</prompt>', [], "are members of one union"),
    (PML_SCHEMA, '<prompt schema="pets"><doc size="2"/> x</prompt>', [], "module 'doc' has no parameter 'size'"),
    (PML_SCHEMA, '<prompt schema="pets">hi <intro/></prompt>', [], "it must end with new text"),
    (PML_SCHEMA, '<prompt schema="other"><intro/> x</prompt>', [], "schema='other' but the schema is 'pets'"),
])
def test_pml_usage_errors_exit_2_before_loading(schema, prompt, extra, msg, tmp_path, no_loading, capsys):
    argv = []
    if schema is not None:
        (tmp_path / "s.pml").write_text(schema)
        argv += ["--schema", tmp_path / "s.pml"]
    if prompt is not None:
        (tmp_path / "p.pml").write_text(prompt)
        argv += ["--prompt-pml", tmp_path / "p.pml"]
    _one_error_line(*_run(argv + extra, capsys), msg)
    assert no_loading == []


def test_pml_file_errors_exit_2_before_loading(tmp_path, no_loading, capsys):
    (tmp_path / "s.pml").write_text(PML_SCHEMA)
    (tmp_path / "p.pml").write_text(PML_PROMPTS["exact"])
    (tmp_path / "afile").write_text("")
    ok = ["--schema", tmp_path / "s.pml", "--prompt-pml", tmp_path / "p.pml"]
    _one_error_line(*_run(["--schema", tmp_path / "none.pml", "--prompt-pml", tmp_path / "p.pml"], capsys),
                    f"schema file not found: {tmp_path / 'none.pml'}")
    _one_error_line(*_run(ok + ["--prompt-pml", tmp_path / "none.pml"], capsys),
                    f"prompt file not found: {tmp_path / 'none.pml'}")
    _one_error_line(*_run(ok + ["--cache-dir", tmp_path / "afile"], capsys), "is not a directory")
    _one_error_line(*_run(ok + ["-o", tmp_path / "no" / "o.jsonl"], capsys), "does not exist")
    _one_error_line(*_run(["--schema", "-", "--prompt-pml", "-"], capsys), "only one of --schema and --prompt-pml")
    assert no_loading == []


class _Tok:
    def __init__(self, bos, add):
        self.bos, self.add = bos, add

    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return ([self.bos] if add_special_tokens and self.add else []) + ids


def test_pml_bos_token_id_follows_the_tokenizer():
    assert bos_token_id(_Tok(7, True)) == 7
    assert bos_token_id(_Tok(7, False)) is None


def test_compile_timeline_counts_nested_events_once():
    clock = CompileTimeline()
    clock.events = [(2.0, 1.0), (1.8, 0.3), (5.0, 0.5), (9.0, 1.0)]   # (end, duration): the 2nd inside the 1st
    assert clock.seconds(0.0, 10.0) == pytest.approx(2.5)
    assert clock.seconds(1.5, 4.8) == pytest.approx(0.5 + 0.3)      # clipped to the window
    assert clock.seconds(2.5, 4.0) == 0.0 and clock.seconds(5.5, 7.0) == 0.0


BUILTIN_SCHEMA = ('<schema name="guide">&lt;|im_start|&gt;system\nYou are a helpful travel guide. Answer in one '
                  'sentence.&lt;|im_end|&gt;\n&lt;|im_start|&gt;user\n'
                  '<module name="city">Lisbon is the capital of Portugal. It lies on the river Tagus and is '
                  'known for its trams, its hills and its custard tarts. </module>'
                  '<module name="tip">Visitors should wear good shoes because the streets are steep. </module>'
                  '</schema>')
BUILTIN_PROMPT = ('<prompt schema="guide"><city/>What river is Lisbon on?&lt;|im_end|&gt;\n'
                  '&lt;|im_start|&gt;assistant\n</prompt>')


@pytest.mark.slow
def test_pml_on_the_builtin_model_equals_ordinary_generation(tmp_path, capsys):
    """The built-in SmolLM2 end to end through --schema/--prompt-pml: the exact case (the
    schema's leading text and first module, then new text) gives the greedy tokens of ordinary
    generation on the same prompt ids; a second run loads the modules from --cache-dir."""
    from models import LLM, PromptBatch, generate  # noqa: PLC0415
    (tmp_path / "s.pml").write_text(BUILTIN_SCHEMA)
    (tmp_path / "p.pml").write_text(BUILTIN_PROMPT)
    base = ["--schema", tmp_path / "s.pml", "--prompt-pml", tmp_path / "p.pml", "--cache-dir", tmp_path / "c",
            "-t", 0, "-m", 8, "--dtype", "float32"]
    rc, _, err = _run(base + ["-o", tmp_path / "o1.jsonl"], capsys)
    assert rc == 0, err
    (rec,) = _records(tmp_path / "o1.jsonl")
    assert rec["model"]["format"] == "gguf" and rec["cached_tokens"] > 30 and rec["cache"]["modules"] == "encoded"
    llm = LLM.load(dtype="float32")
    want = generate(llm.model, llm.params, PromptBatch.plain([rec["prompt_token_ids"]]), max_new_tokens=8,
                    eos_token_ids=llm.eos_token_ids)
    n = int(want.lengths[0])
    assert rec["token_ids"] == want.tokens[0, :n].tolist() and len(set(rec["token_ids"])) > 2
    assert "Tagus" in rec["completion"], rec["completion"]
    rc, _, err = _run(base + ["-o", tmp_path / "o2.jsonl"], capsys)
    assert rc == 0, err
    (again,) = _records(tmp_path / "o2.jsonl")
    assert again["cache"]["modules"] == "disk" and again["token_ids"] == rec["token_ids"]
