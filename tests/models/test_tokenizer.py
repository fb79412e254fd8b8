"""Tokenizer: agreement with transformers' tokenizer built from the same GGUF, byte-exact
round trips, streaming decode, chat template (sandboxed), tokenizer.json directories."""
import numpy as np
import pytest

pytest.importorskip("tokenizers")

from models.gguf import default_gguf_path, open_gguf  # noqa: E402
from models.tokenizer import Tokenizer, TokenizerError, render_chat_template  # noqa: E402
from helpers import CHATML, tiny_tokenizer_meta  # noqa: E402

SAMPLES = [
    "Hello world!",
    "Größe, café, naïve — 日本語のテキスト、中文句子，русский текст, العربية, हिन्दी, 한국어",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 🦜🫠",
    "def f(x):\n    return x**2  # 12345 3.14159\n\tif a != b: pass\r\n",
    "  leading  spaces   and\n\n\nnewlines  \t",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "1234567890, year 2024, 3.5e-10, 1,000,000",
    "it's we'll they'RE I'd",
]

def tiny_tokenizer():
    m = tiny_tokenizer_meta()
    meta = {"tokenizer.ggml.model": m["model"], "tokenizer.ggml.pre": m["pre"],
            "tokenizer.ggml.tokens": m["tokens"], "tokenizer.ggml.token_type": m["token_types"],
            "tokenizer.ggml.merges": m["merges"], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": CHATML}
    return Tokenizer.from_gguf(meta)


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf(open_gguf(default_gguf_path()))


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    import os

    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _random_text(rng, n):
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF),
              (0x3040, 0x30FF), (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF), (0x0600, 0x06FF)]
    out = []
    for _ in range(n):
        lo, hi = ranges[rng.integers(len(ranges))]
        out.append(chr(int(rng.integers(lo, hi + 1))))
        if rng.random() < 0.2:
            out.append(" \n\t"[rng.integers(3)])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# SmolLM2 GGUF vs transformers
# ---------------------------------------------------------------------------------------------
def test_agrees_with_transformers_on_samples(smol, hf_smol):
    for text in SAMPLES:
        ours = smol.encode(text)
        theirs = hf_smol.encode(text, add_special_tokens=True)
        assert ours == theirs, text
        assert smol.decode(ours) == text
        assert smol.decode(ours) == hf_smol.decode(theirs)
        assert smol.decode(ours, skip_special_tokens=True) == hf_smol.decode(theirs, skip_special_tokens=True)
    assert smol.encode("<|im_start|>") == [1]
    assert smol.vocab_size == 49152 and smol.eos_token_id == 2 and smol.bos_token_id == 1
    assert 2 in smol.stop_token_ids and not smol.add_bos_token


def test_agrees_with_transformers_on_random_unicode(smol, hf_smol):
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(1, 60)))
        ids = smol.encode(text)
        assert ids == hf_smol.encode(text, add_special_tokens=True), text
        assert smol.decode(ids) == text


def test_digits_are_split_one_by_one(smol):
    ids = smol.encode("x 2024")
    assert [smol.decode([i]) for i in ids] == ["x", " ", "2", "0", "2", "4"]


def test_chat_template_matches_transformers(smol, hf_smol):
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2? 😀"}],
    ]
    for conv in convs:
        for gen in (True, False):
            want = hf_smol.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            got = smol.apply_chat_template(conv, add_generation_prompt=gen)
            assert got == want
            assert smol.encode(got, add_special_tokens=False) == \
                hf_smol.encode(want, add_special_tokens=False)
    text = smol.apply_chat_template(convs[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_hf_directory_tokenizer_matches_gguf_one(smol, hf_smol, tmp_path):
    hf_smol.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in SAMPLES:
        assert tok.encode(text) == smol.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    conv = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(conv) == smol.apply_chat_template(conv)
    assert tok.eos_token_id == 2 and 2 in tok.stop_token_ids
    assert Tokenizer.from_path(tmp_path).encode("abc") == smol.encode("abc")


# ---------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------
def test_multibyte_characters_split_over_tokens_decode_whole(smol):
    text = "🫠🦜 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = smol.encode(text)
    pieces = [smol.token_bytes(i) for i in ids]
    assert any(len(p) and not _is_complete_utf8(p) for p in pieces), "sample must split a character"
    assert smol.decode(ids) == text
    stream = smol.stream_decoder()
    parts = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    # token-by-token naive decoding would have produced replacement characters
    assert "\ufffd" in "".join(smol.decode([i]) for i in ids)


def _is_complete_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_invalid_utf8_becomes_replacement_character(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1
    assert smol.decode(ids[:-1]).endswith("\ufffd")
    stream = smol.stream_decoder()
    assert stream.push(ids[0]) == ""
    assert stream.flush() == "\ufffd"


def test_decode_rejects_out_of_range_ids(smol):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.decode([49152])


# ---------------------------------------------------------------------------------------------
# tiny tokenizer built from metadata
# ---------------------------------------------------------------------------------------------
def test_tiny_tokenizer_merges_specials_and_round_trip():
    tok = tiny_tokenizer()
    ids = tok.encode(" the")
    assert [tok.decode([i]) for i in ids] == [" the"]
    assert tok.encode("<|im_start|>user") == [1] + tok.encode("user")
    rng = np.random.default_rng(1)
    for _ in range(10):
        text = _random_text(rng, 30)
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 2, 0], skip_special_tokens=True) == ""
    assert tok.vocab_size == 3 + 256 + 6


def test_non_byte_level_gguf_tokenizer_is_refused():
    with pytest.raises(TokenizerError, match="'llama' is not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


# ---------------------------------------------------------------------------------------------
# chat template sandbox
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
])
def test_chat_template_is_sandboxed(template):
    with pytest.raises(TokenizerError):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_chat_template_raise_exception_and_missing_template():
    t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat_template(t, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="first must be user"):
        render_chat_template(t, [{"role": "assistant", "content": "x"}])
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
