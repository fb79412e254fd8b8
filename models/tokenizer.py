"""Tokenizer and chat template for Llama checkpoints: from a GGUF file's metadata or a Hugging
Face directory (`tokenizer.json` + `tokenizer_config.json`).

* `Tokenizer.from_gguf(path)` builds a byte-level BPE tokenizer (`tokenizer.ggml.model ==
  "gpt2"`) with the `tokenizers` library from the file's vocabulary, merges and control tokens,
  and the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre` type.
* `Tokenizer.from_hf_dir(path)` loads `tokenizer.json` (any model the `tokenizers` library
  knows) and the chat template / special tokens of `tokenizer_config.json`.
* `encode(text, add_special_tokens=True) -> list[int]`; special tokens written in the text
  (`<|im_start|>`) map to their ids.
* `decode(ids) -> str` joins the tokens' raw bytes, then decodes UTF-8 once (a character split
  over several byte tokens comes out whole; invalid bytes become U+FFFD).
  `StreamDecoder` does the same incrementally, holding back an incomplete UTF-8 tail.
* `apply_chat_template(messages, add_generation_prompt=True) -> str` renders the model's
  Jinja chat template in jinja2's `ImmutableSandboxedEnvironment`: a template shipped inside a
  downloaded model file is untrusted code.

Nothing here unpickles anything.
"""
from __future__ import annotations

import codecs
import datetime
import json
import os
import types
import warnings
from typing import Any, Iterable, Sequence

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "bytes_to_unicode"]


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be built or applied."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_OF_CHAR = types.MappingProxyType({c: b for b, c in bytes_to_unicode().items()})

# llama.cpp pre-tokenizer regexes by `tokenizer.ggml.pre` (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre type -> (split digits one by one first, main regex)
_PRE_TYPES = types.MappingProxyType({
    "default": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT), "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT), "starcoder": (True, _GPT2_SPLIT), "refact": (True, _GPT2_SPLIT),
    "command-r": (True, _GPT2_SPLIT), "codeshell": (True, _GPT2_SPLIT), "exaone": (True, _GPT2_SPLIT),
    "minerva-7b": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT), "llama-v3": (False, _LLAMA3_SPLIT), "llama-bpe": (False, _LLAMA3_SPLIT),
    "falcon3": (False, _LLAMA3_SPLIT), "smaug-bpe": (False, _LLAMA3_SPLIT), "dbrx": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT), "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
})
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre is None:
        pre = "default"
    if pre not in _PRE_TYPES:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split (known: {sorted(_PRE_TYPES)})")
        pre = "default"
    digits, split = _PRE_TYPES[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with byte-exact decoding, special ids and a chat template.

    Attributes: `vocab_size`, `bos_token_id`, `eos_token_id`, `stop_token_ids` (ids that end a
    completion: eos plus end-of-turn ids), `special_ids`, `add_bos_token`, `chat_template`.
    """

    def __init__(self, backend, *, token_bytes: Sequence[bytes], special_ids: Iterable[int],
                 bos_token_id: int | None, eos_token_id: int | None, stop_token_ids: Iterable[int] = (),
                 add_bos_token: bool = False, chat_template: str | None = None,
                 special_tokens_map: dict[str, str | None] | None = None,
                 uses_post_processor: bool = False):
        self.backend = backend
        self._token_bytes = list(token_bytes)
        self.special_ids = frozenset(int(i) for i in special_ids)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        stops = {int(i) for i in stop_token_ids}
        if eos_token_id is not None:
            stops.add(int(eos_token_id))
        self.stop_token_ids = frozenset(stops)
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens_map or {})
        self._uses_post_processor = uses_post_processor

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path_or_meta) -> "Tokenizer":
        """From a GGUF file (path) or its metadata dict (`models.gguf.read_gguf_metadata`)."""
        if isinstance(path_or_meta, dict):
            meta = path_or_meta
        else:
            from models.gguf import read_gguf_metadata
            meta = read_gguf_metadata(path_or_meta)
        return cls._from_gguf_meta(meta)

    @classmethod
    def _from_gguf_meta(cls, meta: dict[str, Any]) -> "Tokenizer":
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE); "
                "load a Hugging Face directory with a tokenizer.json instead")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("GGUF byte-level tokenizer has no 'tokenizer.ggml.merges'")
        alphabet = set(_BYTE_OF_CHAR)

        def spelled(tok: str) -> str:  # a token spelled in the byte alphabet
            return tok if set(tok) <= alphabet else "".join(bytes_to_unicode()[b] for b in tok.encode("utf-8"))

        vocab = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(spelled(tok), i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed GGUF merge {m!r}")
            pairs.append((a, b))
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        control = [i for i, t in enumerate(types) if t == _CONTROL]
        user = [i for i, t in enumerate(types) if t == _USER_DEFINED]
        if control:
            backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        if user:
            backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        tb = []
        for i, tok in enumerate(tokens):
            if types[i] in (_CONTROL, _USER_DEFINED) or not set(tok) <= alphabet:
                tb.append(tok.encode("utf-8"))
            else:
                tb.append(bytes(_BYTE_OF_CHAR[c] for c in tok))

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        stops = [t for t in (tid("eot_token_id"), tid("eom_token_id")) if t is not None]
        return cls(backend, token_bytes=tb, special_ids=control, bos_token_id=bos, eos_token_id=eos,
                   stop_token_ids=stops, add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens_map={"bos_token": tokens[bos] if bos is not None else None,
                                       "eos_token": tokens[eos] if eos is not None else None})

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face checkpoint directory (`tokenizer.json`, `tokenizer_config.json`,
        optionally `chat_template.jinja` / `chat_template.json`, `generation_config.json`)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = HFTokenizer.from_file(tj)
            with open(tj, encoding="utf-8") as f:
                spec = json.load(f)
        except Exception as e:
            raise TokenizerError(f"cannot read {tj}: {e}") from None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        template = cfg.get("chat_template")
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(os.path.join(path, "chat_template.json")):
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template", template)
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def tok_text(v):
            return v.get("content") if isinstance(v, dict) else v

        names = {k: tok_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

        def tid(text):
            return backend.token_to_id(text) if text is not None else None

        bos, eos = tid(names["bos_token"]), tid(names["eos_token"])
        stops = gen.get("eos_token_id", [])
        stops = [stops] if isinstance(stops, int) else list(stops)

        size = backend.get_vocab_size(with_added_tokens=True)
        specials = [a["id"] for a in spec.get("added_tokens", []) if a.get("special")]
        dec = spec.get("decoder") or {}
        byte_level = dec.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in dec.get("decoders", []) if isinstance(d, dict))
        added = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
        tb = []
        for i in range(size):
            tok = backend.id_to_token(i)
            if tok is None:
                tb.append(b"")
            elif i in added:
                tb.append(added[i].encode("utf-8"))
            elif byte_level and set(tok) <= set(_BYTE_OF_CHAR):
                tb.append(bytes(_BYTE_OF_CHAR[c] for c in tok))
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                tb.append(bytes([int(tok[3:5], 16)]))  # sentencepiece byte fallback
            else:
                tb.append(tok.replace("\u2581", " ").encode("utf-8"))
        add_bos = cfg.get("add_bos_token")
        uses_pp = backend.post_processor is not None and add_bos is None
        return cls(backend, token_bytes=tb, special_ids=specials, bos_token_id=bos, eos_token_id=eos,
                   stop_token_ids=stops, add_bos_token=bool(add_bos), chat_template=template,
                   special_tokens_map=names, uses_post_processor=uses_pp)

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "Tokenizer":
        """A `.gguf` file or a Hugging Face directory."""
        path = os.fspath(path)
        return cls.from_hf_dir(path) if os.path.isdir(path) else cls.from_gguf(path)

    # -- encoding / decoding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, a BOS is prepended when the model
        wants one (`add_bos_token`, or the tokenizer.json post-processor)."""
        if not isinstance(text, str):
            raise TypeError(f"text: received {type(text).__name__}, expected str")
        if self._uses_post_processor:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (a special token: its text)."""
        return self._token_bytes[int(token_id)]

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._token_bytes):
                raise ValueError(f"ids: token id {i} outside the vocabulary [0, {len(self._token_bytes)})")
            if skip_special_tokens and i in self.special_ids:
                continue
            out.append(self._token_bytes[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`: the tokens' bytes joined, decoded as UTF-8 (invalid -> U+FFFD)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the model's chat template (sandboxed). `messages`: `[{"role", "content"}]`."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (use a plain prompt, without --chat)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages: received {m!r}, expected dicts with 'role' and 'content'")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **{k: v for k, v in self.special_tokens_map.items() if v is not None}, **extra)


class StreamDecoder:
    """Incremental decoding: `push(token_id) -> str` returns the text completed so far by that
    token (an incomplete UTF-8 sequence is held back until its last byte arrives)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.decode_bytes([token_id], self._skip))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render a Hugging Face-style chat template in jinja2's `ImmutableSandboxedEnvironment`
    (trim_blocks, lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`,
    as transformers renders them). Template errors raise `TokenizerError`."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=list(messages),
                                                add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.SecurityError as e:
        raise TokenizerError(f"chat template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerError(f"chat template failed: {e}") from None
