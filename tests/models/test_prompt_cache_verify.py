"""Prompt Cache storage that verifies itself: schema files whose K or V bytes changed, that are
truncated, empty, garbled or swapped, and manifests that are garbage, changed, empty or
swapped are each detected, reported in one log line, kept aside and encoded again, with the
answers of a fresh cache; a file replaced by a writer stopped before its manifest write is
adopted; an error of the system (no permission, I/O) is raised and keeps the file; a write that
fails part-way leaves the old file; two processes writing one directory lose no record and
corrupt no file."""
import builtins
import dataclasses
import errno
import json
import logging
import multiprocessing
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from helpers import PC_CONFIG, ModTokenizer, numbered_schema
from models import Llama, LlamaConfig, init_params
from models.prompt_cache import PromptCache, cached_generate, layout_prompt, parse_prompt
from models.prompt_cache import schema_file

CFG = LlamaConfig(**PC_CONFIG)
ARRAYS = ("k", "v", "positions", "token_ids", "keep", "offsets")


make_schema = numbered_schema


SCHEMAS = [make_schema(i) for i in range(5)]
PROMPTS = ('<a/><b p="xy"/> Where to?', '<b p="z"/> Why not?')


def new_params():
    return init_params(CFG, jax.random.PRNGKey(3), jnp.float32, std=0.3)


def open_cache(model, params, directory):
    return PromptCache(model, params, ModTokenizer(), directory=directory, tokenizer_id="mod")


@pytest.fixture(scope="module")
def setup():
    params = new_params()
    model = Llama(CFG, impl="reference")
    memory = PromptCache(model, params, ModTokenizer(), tokenizer_id="mod")
    fresh = {s.name: memory.encode_or_load(s, promote=False) for s in SCHEMAS}

    def answers(enc, s=SCHEMAS[0]):
        lay = memory.schema_layout(s)
        ps = [layout_prompt(parse_prompt(f'<prompt schema="{s.name}">{d}</prompt>', s), s, lay, ModTokenizer())
              for d in PROMPTS]
        return np.asarray(cached_generate(model, params, enc, ps, max_new_tokens=6, eos_token_ids=()).tokens)

    return model, params, fresh, answers, answers(fresh["s0"])


def stored(setup, directory, schemas=SCHEMAS[:2]):
    model, params, fresh, _, _ = setup
    cache = open_cache(model, params, directory)
    for s in schemas:
        cache.insert(s, fresh[s.name])
    return cache


def tensor_range(path, name):
    """Byte range of tensor `name` in a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def edit(path, fn):
    data = bytearray(open(path, "rb").read())
    data = fn(data)
    open(path, "wb").write(bytes(data))
    return bytes(data)


def zero_k(path):
    lo, hi = tensor_range(path, "k")
    return edit(path, lambda d: d[:lo + 64] + bytes(128) + d[lo + 192:])


def flip_k(path):
    lo, hi = tensor_range(path, "k")
    return edit(path, lambda d: d[:hi - 8] + bytes(b ^ 0xFF for b in d[hi - 8:hi]) + d[hi:])


def scale_v(path):
    lo, hi = tensor_range(path, "v")
    return edit(path, lambda d: d[:lo] + (np.frombuffer(bytes(d[lo:hi]), np.float32) * 3).tobytes() + d[hi:])


def garble_header(path):
    return edit(path, lambda d: d[:8] + b"#" * 24 + d[32:])


DAMAGE = {
    "zero a region of K": (zero_k, "tensor 'k' fails its SHA-256 digest"),
    "flip bytes of K": (flip_k, "tensor 'k' fails its SHA-256 digest"),
    "scale V by 3": (scale_v, "tensor 'v' fails its SHA-256 digest"),
    "truncate to half": (lambda p: edit(p, lambda d: d[:len(d) // 2]), "truncated"),
    "truncate to 5 bytes": (lambda p: edit(p, lambda d: d[:5]), "truncated: 5 bytes"),
    "empty": (lambda p: edit(p, lambda d: b""), "empty file (0 bytes)"),
    "garbled header": (garble_header, "garbled header"),
    "trailing bytes": (lambda p: edit(p, lambda d: d + b"\0" * 16), "trailing bytes"),
}


def warnings_of(caplog):
    msgs = [r.getMessage() for r in caplog.records if r.name == "models.prompt_cache"]
    assert all("\n" not in m for m in msgs), msgs          # each report is one line
    return msgs


def check_fresh(setup, enc, name="s0"):
    _, _, fresh, answers, want = setup
    for a in ARRAYS:
        assert np.asarray(getattr(enc, a)).tobytes() == np.asarray(getattr(fresh[name], a)).tobytes(), a
    if name == "s0":
        np.testing.assert_array_equal(answers(enc), want)


def check_verified_hit(setup, directory, name="s0"):
    """A new cache on the directory loads `name` from disk with no failure and fresh contents."""
    model, params, *_ = setup
    again = open_cache(model, params, directory)
    enc = again.lookup(SCHEMAS[int(name[1:])])
    st = again.stats()
    assert st.hits["disk"] == 1 and st.verification_failures == 0
    check_fresh(setup, enc, name)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_schema_file_is_reported_kept_aside_and_encoded_again(setup, tmp_path, caplog, case):
    model, params, *_ = setup
    stored(setup, tmp_path)
    damage, reason = DAMAGE[case]
    bad = damage(str(tmp_path / "s0.safetensors"))
    cache = open_cache(model, params, tmp_path)
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        enc = cache.encode_or_load(SCHEMAS[0])
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and str(tmp_path / "s0.safetensors") in msgs[0] and reason in msgs[0], msgs
    assert "kept as s0.safetensors.corrupt-" in msgs[0] and "encoding schema 's0' again" in msgs[0]
    st = cache.stats()
    assert st.verification_failures == 1 and st.misses["disk"] == 1 and st.hits["disk"] == 0
    aside = [f for f in os.listdir(tmp_path) if f.startswith("s0.safetensors.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == bad      # the bad file is kept as it was
    check_fresh(setup, enc)
    check_verified_hit(setup, tmp_path)
    assert cache.encode_or_load(SCHEMAS[1]) is not None and cache.stats().verification_failures == 1


def test_swapped_schema_files_are_detected(setup, tmp_path, caplog):
    model, params, *_ = setup
    stored(setup, tmp_path)
    a, b = tmp_path / "s0.safetensors", tmp_path / "s1.safetensors"
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    cache = open_cache(model, params, tmp_path)
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        encs = [cache.encode_or_load(s) for s in SCHEMAS[:2]]
    msgs = warnings_of(caplog)
    assert len(msgs) == 2 and all("header digest differs from the manifest's" in m for m in msgs), msgs
    assert cache.stats().verification_failures == 2
    for s, enc in zip(SCHEMAS[:2], encs):
        check_fresh(setup, enc, s.name)
        check_verified_hit(setup, tmp_path, s.name)


def test_file_replaced_before_its_manifest_was_written_is_adopted(setup, tmp_path, caplog):
    """A writer stopped between replacing a listed file and writing the manifest: the file's
    header digest differs from the manifest's, but the file verifies completely, so the next
    lookup adopts it (no warning, no failure, nothing kept aside) and records its digest."""
    model, params, fresh, _, _ = setup
    cache = stored(setup, tmp_path, SCHEMAS[:1])
    manifest = (tmp_path / "manifest.json").read_bytes()
    newer = dataclasses.replace(fresh["s0"], k=np.asarray(fresh["s0"].k) * 0.5)   # same schema, other bytes
    cache.insert(SCHEMAS[0], newer)
    (tmp_path / "manifest.json").write_bytes(manifest)          # the manifest of before the write
    again = open_cache(model, params, tmp_path)
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        enc = again.lookup(SCHEMAS[0])
    assert warnings_of(caplog) == []
    st = again.stats()
    assert st.verification_failures == 0 and st.hits["disk"] == 1
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "s0.safetensors"]
    for a in ARRAYS:
        assert np.asarray(getattr(enc, a)).tobytes() == np.asarray(getattr(newer, a)).tobytes(), a
    assert (tmp_path / "manifest.json").read_bytes() != manifest          # the adopted digest is recorded
    third = open_cache(model, params, tmp_path)
    np.testing.assert_array_equal(np.asarray(third.lookup(SCHEMAS[0]).k), np.asarray(newer.k))
    assert third.stats().verification_failures == 0


@pytest.mark.parametrize("error", ["EACCES on open", "EMFILE on open", "EIO on read", "ENOMEM on read"])
def test_transient_read_error_is_raised_and_keeps_the_file(setup, tmp_path, monkeypatch, caplog, error):
    """An error of the system, not of the file's bytes (no permission, too many open files, an
    I/O error, no memory): the lookup raises it in one line naming the file, and the file, its
    manifest record and the failure count stay as they were; the next lookup reads it."""
    model, params, *_ = setup
    stored(setup, tmp_path)
    path = str(tmp_path / "s0.safetensors")
    before = sorted(os.listdir(tmp_path)), (tmp_path / "manifest.json").read_bytes()
    code = getattr(errno, error.split()[0])
    real_open = builtins.open

    class FailingRead:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def readinto(self, buf):
            raise OSError(code, os.strerror(code))

    def failing_open(file, *args, **kwargs):
        if os.fspath(file) != path:
            return real_open(file, *args, **kwargs)
        if error.endswith("on open"):
            raise OSError(code, os.strerror(code))
        return FailingRead(real_open(file, *args, **kwargs))

    cache = open_cache(model, params, tmp_path)
    monkeypatch.setattr(schema_file, "open", failing_open, raising=False)
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        with pytest.raises(OSError) as info:
            cache.lookup(SCHEMAS[0])
    monkeypatch.undo()
    assert info.value.errno == code and path in str(info.value) and "\n" not in str(info.value)
    assert os.strerror(code) in str(info.value)
    assert warnings_of(caplog) == []
    assert (sorted(os.listdir(tmp_path)), (tmp_path / "manifest.json").read_bytes()) == before
    assert cache.stats().verification_failures == 0 and cache.names("disk") == ("s0", "s1")
    check_fresh(setup, cache.lookup(SCHEMAS[0]))
    assert cache.stats().hits["disk"] == 1


MANIFEST_DAMAGE = {
    "garbage": (lambda d: b"\x00\xffgarbage{", "not JSON"),
    "empty": (lambda d: b"", "empty file"),
    "truncated": (lambda d: d[:len(d) // 2], "not JSON"),
    "one changed value": (lambda d: d.replace(b'"tokens": ', b'"tokens": 1', 1), "fails its SHA-256 digest"),
    "a JSON list": (lambda d: b"[1, 2]", "not a prompt cache manifest"),
}


@pytest.mark.parametrize("case", list(MANIFEST_DAMAGE))
def test_damaged_manifest_is_kept_aside_and_rebuilt(setup, tmp_path, caplog, case):
    model, params, *_ = setup
    stored(setup, tmp_path)
    damage, reason = MANIFEST_DAMAGE[case]
    bad = edit(str(tmp_path / "manifest.json"), damage)
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        cache = open_cache(model, params, tmp_path)
        enc = cache.encode_or_load(SCHEMAS[0])
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and str(tmp_path / "manifest.json") in msgs[0] and reason in msgs[0], msgs
    assert "kept as manifest.json.corrupt-" in msgs[0] and "rebuilding it" in msgs[0]
    aside = [f for f in os.listdir(tmp_path) if f.startswith("manifest.json.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == bad
    st = cache.stats()
    assert st.verification_failures == 1 and set(cache.names("disk")) == {"s0", "s1"}
    assert st.hits["disk"] == 1                     # the schema files verified and were adopted
    check_fresh(setup, enc)
    check_verified_hit(setup, tmp_path)


def test_damaged_manifest_and_schema_file_together(setup, tmp_path, caplog):
    """The truncated file is not adopted into the rebuilt manifest; writing s0 again keeps it
    aside instead of replacing it."""
    model, params, *_ = setup
    stored(setup, tmp_path)
    edit(str(tmp_path / "manifest.json"), lambda d: b"{")
    bad = edit(str(tmp_path / "s0.safetensors"), lambda d: d[:100])
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        cache = open_cache(model, params, tmp_path)
        assert cache.names("disk") == ("s1",)
        enc = cache.encode_or_load(SCHEMAS[0])
    msgs = warnings_of(caplog)
    assert len(msgs) == 2 and "manifest.json" in msgs[0] and "s0.safetensors: not listed in the manifest" in msgs[1]
    aside = [f for f in os.listdir(tmp_path) if f.startswith("s0.safetensors.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == bad
    assert cache.stats().verification_failures == 2
    check_fresh(setup, enc)
    check_verified_hit(setup, tmp_path)


def test_swapped_manifest_is_detected(setup, tmp_path, caplog):
    """The manifest of another directory of the same model, whose s0 was encoded from other
    text: its record of s0 does not match the s0 file here."""
    model, params, fresh, _, _ = setup
    stored(setup, tmp_path / "a", SCHEMAS[:1])
    other = open_cache(model, params, tmp_path / "b")
    other.encode_or_load(make_schema(0, extra=" (edited)"))
    shutil.copy(tmp_path / "a" / "manifest.json", tmp_path / "b" / "manifest.json")
    cache = open_cache(model, params, tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="models.prompt_cache"):
        enc = cache.encode_or_load(SCHEMAS[0])
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and "s0.safetensors: header digest differs from the manifest's" in msgs[0], msgs
    assert cache.stats().verification_failures == 1
    check_fresh(setup, enc)
    check_verified_hit(setup, tmp_path / "b")


def test_failed_write_keeps_the_old_file_and_no_temporary(setup, tmp_path, monkeypatch):
    """A write that fails part-way (a full disk) leaves the stored file, its manifest record and
    no temporary file; a temporary file of a writer killed part-way is removed by the next cache."""
    model, params, fresh, _, _ = setup
    cache = stored(setup, tmp_path, SCHEMAS[:1])
    path = tmp_path / "s0.safetensors"
    before, manifest = path.read_bytes(), (tmp_path / "manifest.json").read_bytes()
    real_save = safetensors.numpy.save_file

    def half_then_fail(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(len(before) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        cache.insert(SCHEMAS[0], fresh["s0"])
    monkeypatch.undo()
    assert path.read_bytes() == before and (tmp_path / "manifest.json").read_bytes() == manifest
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "s0.safetensors"]
    (tmp_path / ".s0.safetensors.x1y2.tmp").write_bytes(before[:10])
    open_cache(model, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "s0.safetensors"]
    check_verified_hit(setup, tmp_path)


def _writer(directory, which, rounds, encoded, barrier):
    """A process that inserts schemas `which` into `directory` `rounds` times."""
    params = jax.tree_util.tree_map(jnp.asarray, encoded.pop("params"))
    cache = open_cache(Llama(CFG, impl="reference"), params, directory)
    barrier.wait()                                   # both caches opened the directory before writing
    for _ in range(rounds):
        for i in which:
            cache.insert(SCHEMAS[i], encoded[f"s{i}"])


def test_two_processes_writing_one_directory(setup, tmp_path):
    """Two processes open the same directory, then insert overlapping schema sets: the manifest
    holds every schema, every file verifies, no temporary file is left."""
    model, params, fresh, _, _ = setup
    host = {n: dataclasses.replace(e, k=np.asarray(e.k), v=np.asarray(e.v)) for n, e in fresh.items()}
    host["params"] = jax.tree_util.tree_map(np.asarray, params)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), which, 3, host, barrier))
             for which in ((0, 1, 2), (2, 3, 4))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    cache = open_cache(model, params, tmp_path)
    assert sorted(cache.names("disk")) == [s.name for s in SCHEMAS]
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"] + [f"s{i}.safetensors" for i in range(5)]
    for s in SCHEMAS:
        check_fresh(setup, cache.lookup(s), s.name)
    st = cache.stats()
    assert st.hits["disk"] == 5 and st.verification_failures == 0
