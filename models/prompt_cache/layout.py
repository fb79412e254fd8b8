"""Token ids and position ids of a schema's modules and of a prompt built from it.

Schema layout (`layout_schema`): one position counter runs over the schema in document order.

* Text takes the next positions. Text outside any module forms an anonymous module (named `#0`,
  `#1`, ...) that every prompt includes.
* `<param len=N>` takes N positions filled with `placeholder_id` (a single space token by
  default: whitespace leaves a module's meaning unchanged); their positions are recorded.
* A nested module lies inside its parent's span. Each token belongs to its innermost module, so a
  parent's own tokens skip the positions its nested modules reserve, and a parent's K/V does not
  depend on which of its nested modules a prompt imports.
* The members of a union start at the same position; the union reserves its longest member.
* With `bos_id`, an anonymous module `#bos` holding that one token comes first, at position 0.

Prompt layout (`layout_prompt`):

* `modules`: the imported modules plus all anonymous ones, in schema order.
* `arguments`: each argument's tokens at the first positions of its parameter's placeholders
  (an argument longer than its `len` in tokens is a ValueError; `check_prompt` requires one per
  parameter, an empty one is written `name=""`).
* `texts`: each new-text segment continues the position counter after every included module
  that lies before the next import of the prompt (after all of them for trailing text), and
  after the previous new text. Text placed after module A and before B starts where A ends,
  as in the Prompt Cache paper; positions never go backwards.
* `new_token_ids`/`new_positions`: the uncached tokens (arguments at their import, new text
  where it is written) in prompt order, the order in which they attend causally to each other.

Cached inference keeps each included module's tokens except its placeholders (`keep_mask`),
replacing them by the arguments.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from models.prompt_cache.pml import Import, Module, Param, Prompt, Schema, Text, check_prompt, check_schema, where

__all__ = ["TokenEncoder", "ParamSlot", "ModuleLayout", "SchemaLayout", "Argument", "NewText", "PromptLayout",
           "layout_schema", "layout_prompt", "default_placeholder_id"]


class TokenEncoder(Protocol):
    """What the layout needs of a tokenizer (`models.tokenizer.Tokenizer` fits)."""
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """A parameter's placeholders: `length` tokens at index `offset` of its module's tokens,
    positions `start .. start + length - 1`."""
    name: str
    offset: int
    length: int
    start: int
    line: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ModuleLayout:
    """One module's own tokens: `token_ids`/`positions` int32 `[n]`; its span `[start, end)`
    covers its nested modules and reserved parameter positions."""
    name: str
    token_ids: np.ndarray
    positions: np.ndarray
    start: int
    end: int
    params: tuple = ()
    parent: str | None = None
    union: int | None = None
    anonymous: bool = False

    @property
    def keep_mask(self) -> np.ndarray:
        """bool `[n]`: True for tokens a prompt reuses, False for parameter placeholders."""
        mask = np.ones(len(self.token_ids), bool)
        for p in self.params:
            mask[p.offset:p.offset + p.length] = False
        return mask


@dataclasses.dataclass(frozen=True, eq=False)
class SchemaLayout:
    """Every module of a schema in schema order (a parent before its nested modules); `length`
    is the number of positions the schema uses."""
    name: str
    modules: tuple
    length: int
    placeholder_id: int

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.name == name:
                return m
        raise ValueError(f"name: no module {name!r} in schema {self.name!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Argument:
    """An argument's `token_ids`/`positions` int32 `[n]` for `param` of `module`."""
    module: str
    param: str
    token_ids: np.ndarray
    positions: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class NewText:
    """A new-text segment's `token_ids`/`positions` int32 `[n]`; `after` is the name of the last
    import before it (None at the start of the prompt)."""
    text: str
    after: str | None
    token_ids: np.ndarray
    positions: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class PromptLayout:
    """A prompt's included `modules` (names, schema order), `arguments`, `texts` and the uncached
    tokens in prompt order (`new_token_ids`, `new_positions`: int32 `[N]`)."""
    schema: str
    modules: tuple
    arguments: tuple
    texts: tuple
    new_token_ids: np.ndarray
    new_positions: np.ndarray

    def assembled(self, schema_layout: SchemaLayout) -> tuple[np.ndarray, np.ndarray]:
        """`(token_ids, positions)` int32 of the whole prompt, sorted by position (stable: module
        tokens, then uncached tokens in prompt order); placeholders are left out."""
        ids, pos = [], []
        for name in self.modules:
            m = schema_layout.module(name)
            keep = m.keep_mask
            ids.append(m.token_ids[keep])
            pos.append(m.positions[keep])
        ids.append(self.new_token_ids)
        pos.append(self.new_positions)
        ids, pos = np.concatenate(ids).astype(np.int32), np.concatenate(pos).astype(np.int32)
        order = np.argsort(pos, kind="stable")
        return ids[order], pos[order]


def _encode(tokenizer: TokenEncoder, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in ids]


def default_placeholder_id(tokenizer: TokenEncoder) -> int:
    """The id of a single space, when the tokenizer encodes `" "` as one token."""
    ids = _encode(tokenizer, " ")
    if len(ids) != 1:
        raise ValueError(f"placeholder_id: the tokenizer encodes ' ' as {ids}, not one token; pass placeholder_id")
    return ids[0]


def layout_schema(schema: Schema, tokenizer: TokenEncoder, *, placeholder_id: int | None = None,
                  bos_id: int | None = None) -> SchemaLayout:
    """Token ids and positions of every module of `schema` (see the module docstring)."""
    check_schema(schema)
    if placeholder_id is None:
        placeholder_id = default_placeholder_id(tokenizer)
    for arg, v in (("placeholder_id", placeholder_id), ("bos_id", bos_id)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ValueError(f"{arg}: received {v!r}, expected a non-negative int")
    modules: list[ModuleLayout] = []
    n_unions = [0]

    def finish(index, name, ids, pos, start, end, params, parent, union, anonymous):
        modules.insert(index, ModuleLayout(name, np.asarray(ids, np.int32), np.asarray(pos, np.int32), start, end,
                                           tuple(params), parent, union, anonymous))

    def module(m: Module, cursor: int, parent: str | None, union: int | None) -> int:
        index = len(modules)              # a parent comes before its nested modules
        ids, pos, params = [], [], []
        start = cursor
        for c in m.children:
            if isinstance(c, Text):
                t = _encode(tokenizer, c.text)
                ids += t
                pos += range(cursor, cursor + len(t))
                cursor += len(t)
            elif isinstance(c, Param):
                params.append(ParamSlot(c.name, len(ids), c.length, cursor, c.line))
                ids += [int(placeholder_id)] * c.length
                pos += range(cursor, cursor + c.length)
                cursor += c.length
            else:
                cursor = nested(c, cursor, m.name)
        finish(index, m.name, ids, pos, start, cursor, params, parent, union, False)
        return cursor

    def nested(c, cursor: int, parent: str | None) -> int:
        if isinstance(c, Module):
            return module(c, cursor, parent, None)
        uid = n_unions[0]
        n_unions[0] += 1
        return max(module(member, cursor, parent, uid) for member in c.members)

    cursor, n_anon = 0, 0
    if bos_id is not None:
        finish(0, "#bos", [bos_id], [0], 0, 1, (), None, None, True)
        cursor = 1
    for c in schema.children:
        if isinstance(c, Text):
            t = _encode(tokenizer, c.text)
            finish(len(modules), f"#{n_anon}", t, range(cursor, cursor + len(t)), cursor, cursor + len(t), (),
                   None, None, True)
            n_anon += 1
            cursor += len(t)
        else:
            cursor = nested(c, cursor, None)
    return SchemaLayout(schema.name, tuple(modules), cursor, int(placeholder_id))


def layout_prompt(prompt: Prompt, schema: Schema, schema_layout: SchemaLayout,
                  tokenizer: TokenEncoder) -> PromptLayout:
    """Positions of `prompt`'s modules, arguments and new text (see the module docstring).
    Raises ValueError naming the element and line for an argument longer than its `len`."""
    check_prompt(prompt, schema)
    if schema_layout.name != schema.name:
        raise ValueError(f"schema_layout: laid out for schema {schema_layout.name!r}, expected {schema.name!r}")
    by_name = {m.name: m for m in schema_layout.modules}
    imports = [i for i in prompt.items if isinstance(i, Import)]
    included = {m.name for m in schema_layout.modules if m.anonymous}
    stack = list(imports)
    while stack:
        imp = stack.pop()
        included.add(imp.module)
        stack += imp.imports
    ends = sorted(by_name[n].end for n in included)

    def end_before(imp: Import | None) -> int:
        """Largest end of an included module lying before `imp` (of all of them for None)."""
        limit = by_name[imp.module].start if imp is not None else ends[-1] if ends else 0
        return max([e for e in ends if e <= limit], default=0)

    arguments: list[Argument] = []
    texts: list[NewText] = []
    new_ids: list[np.ndarray] = []
    new_pos: list[np.ndarray] = []

    def take(imp: Import):
        m = by_name[imp.module]
        slots = {p.name: p for p in m.params}
        for name, value in imp.args.items():
            ids = _encode(tokenizer, value)
            slot = slots[name]
            if len(ids) > slot.length:
                raise ValueError(f"{where(imp.module, imp.line)}: argument {name}={value[:40]!r} is {len(ids)} tokens, "
                                 f"longer than len={slot.length} of its parameter (line {slot.line})")
            a = Argument(m.name, name, np.asarray(ids, np.int32),
                         np.arange(slot.start, slot.start + len(ids), dtype=np.int32))
            arguments.append(a)
            new_ids.append(a.token_ids)
            new_pos.append(a.positions)
        for sub in imp.imports:
            take(sub)

    cursor, after = 0, None
    for i, item in enumerate(prompt.items):
        if isinstance(item, Import):
            take(item)
            cursor, after = max(cursor, by_name[item.module].end), item.module
            continue
        nxt = next((it for it in prompt.items[i + 1:] if isinstance(it, Import)), None)
        start = max(cursor, end_before(nxt))
        ids = np.asarray(_encode(tokenizer, item), np.int32)
        pos = np.arange(start, start + len(ids), dtype=np.int32)
        texts.append(NewText(item, after, ids, pos))
        new_ids.append(ids)
        new_pos.append(pos)
        cursor = start + len(ids)
    order = {m.name: i for i, m in enumerate(schema_layout.modules)}
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros((0,), np.int32)
    return PromptLayout(schema.name, tuple(sorted(included, key=order.__getitem__)), tuple(arguments),
                        tuple(texts), cat(new_ids), cat(new_pos))

