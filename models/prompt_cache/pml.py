"""Prompt Markup Language (PML): schemas of reusable prompt modules and prompts that import them.

Schema::

    <schema name="trip">
      You are a travel agent.
      <module name="plan">Plan a trip of <param name="duration" len="4"/> days.</module>
      <union>
        <module name="miami">Miami has beaches.</module>
        <module name="paris">Paris has museums.</module>
      </union>
    </schema>

* Text outside any module is always part of a prompt (an anonymous module).
* `<module name>` may nest modules and unions; `<param name len/>` reserves `len` tokens for an
  argument inside a module; the members of a `<union>` share a start position and only one of
  them may be imported.

Prompt::

    <prompt schema="trip"><plan duration="3"/><miami/> Highlight the surf spots.</prompt>

* `<name/>` imports module `name`; a module with parameters needs an argument for each,
  `<name param="value"/>` (`param=""` for an empty one); a nested module is imported inside its
  parent's element (`<outer><inner/></outer>`).
* Imports follow the schema's order; free text anywhere between them is new (uncached) text.

Parsing (`models.prompt_cache.pml_xml`) uses `xml.parsers.expat` with everything that makes XML
unsafe refused: a DOCTYPE, any entity declaration, external entities and processing
instructions raise; documents are capped in size and element depth. Every error is a
`ValueError` naming the element and its line; a `<` or `&` that starts no markup (a chat
template's `<|im_start|>` written into text) says how to escape it (`&lt;|im_start|&gt;`, or a
CDATA section).
Argument lengths are counted in tokens, so they are checked by `models.prompt_cache.layout`
when a tokenizer is at hand.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping
from xml.sax.saxutils import escape, quoteattr

from models.prompt_cache.pml_xml import ParseLimits, XmlElement, parse_xml, where

__all__ = ["Text", "Param", "Module", "Union", "Schema", "Import", "Prompt", "ParseLimits", "XmlElement",
           "parse_schema", "parse_prompt", "parse_xml", "check_name", "check_schema", "check_prompt", "schema_to_pml",
           "where", "normalize_children", "NAME_PATTERN"]

NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")
_RESERVED = frozenset({"schema", "module", "param", "union", "prompt"})


# ------------------------------------------------------------------ the schema and prompt objects
@dataclasses.dataclass(frozen=True)
class Text:
    """Literal text of a schema (tokenized as one piece)."""
    text: str
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Param:
    """A placeholder of `length` tokens that an importing prompt fills with an argument."""
    name: str
    length: int
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Module:
    """A named module: a sequence of `Text`, `Param`, nested `Module` and `Union`."""
    name: str
    children: tuple
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Union:
    """Mutually exclusive modules that share a start position."""
    members: tuple
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Schema:
    """A schema: its `name` and top-level `Text`, `Module` and `Union` children in layout order."""
    name: str
    children: tuple
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Import:
    """One imported module of a prompt: its `args` (param name -> text) and nested `imports`."""
    module: str
    args: Mapping[str, str]
    imports: tuple = ()
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt: the schema it uses and its `Import` and `str` (new text) items in order."""
    schema: str
    items: tuple
    line: int | None = dataclasses.field(default=None, compare=False)




def normalize_children(children) -> tuple:
    """Merge adjacent text pieces and drop pieces that are only whitespace."""
    out: list = []
    for c in children:
        if isinstance(c, Text):
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + c.text, out[-1].line)
                continue
        out.append(c)
    return tuple(c for c in out if not (isinstance(c, Text) and not c.text.strip()))


# ------------------------------------------------------------------ checks shared by parser and builder
def check_name(name, element: str, line: int | None) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{where(element, line)}: name {name!r} is not a valid name (expected {NAME_PATTERN})")
    if name in _RESERVED:
        raise ValueError(f"{where(element, line)}: name {name!r} is reserved (reserved: {sorted(_RESERVED)})")
    return name


def check_schema(schema: Schema, limits: ParseLimits = ParseLimits()) -> Schema:
    """Validate a schema's structure and names; returns it. Raises ValueError naming the element."""
    if not isinstance(schema, Schema):
        raise TypeError(f"schema: received {type(schema).__name__}, expected Schema")
    check_name(schema.name, "schema", schema.line)
    seen: dict[str, int | None] = {}

    def visit(children, in_module: Module | None):
        params: dict[str, int | None] = {}
        for c in children:
            if isinstance(c, Text):
                if not isinstance(c.text, str):
                    raise TypeError(f"Text.text: received {type(c.text).__name__}, expected str")
            elif isinstance(c, Param):
                if in_module is None:
                    raise ValueError(f"{where('param', c.line)}: a parameter must be inside a module")
                check_name(c.name, "param", c.line)
                n = c.length
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_param_len:
                    raise ValueError(f"{where('param', c.line)} {c.name!r}: len={c.length!r}, expected an "
                                     f"integer in [1, {limits.max_param_len}]")
                if c.name in params:
                    raise ValueError(f"{where('param', c.line)}: duplicate parameter {c.name!r} in module "
                                     f"{in_module.name!r} (first at line {params[c.name]})")
                params[c.name] = c.line
            elif isinstance(c, Module):
                check_name(c.name, "module", c.line)
                if c.name in seen:
                    raise ValueError(f"{where('module', c.line)}: duplicate module name {c.name!r} (first at "
                                     f"line {seen[c.name]})")
                seen[c.name] = c.line
                visit(c.children, c)
            elif isinstance(c, Union):
                if not c.members:
                    raise ValueError(f"{where('union', c.line)}: a union needs at least one module")
                for m in c.members:
                    if not isinstance(m, Module):
                        raise ValueError(f"{where('union', c.line)}: a union holds only modules, got "
                                         f"{type(m).__name__}")
                visit(c.members, in_module)
            else:
                raise TypeError(f"schema child: received {type(c).__name__}, expected Text, Param, Module or Union")

    visit(schema.children, None)
    return schema


def _attrs(el: XmlElement, required: tuple, optional: tuple = ()) -> dict:
    for a in required:
        if a not in el.attrs:
            raise ValueError(f"{where(el.tag, el.line)}: missing attribute {a!r}")
    extra = set(el.attrs) - set(required) - set(optional)
    if extra:
        raise ValueError(f"{where(el.tag, el.line)}: unknown attribute(s) {sorted(extra)} (expected "
                         f"{list(required + optional)})")
    return el.attrs


# ------------------------------------------------------------------ schema
def _schema_children(el: XmlElement, limits: ParseLimits) -> tuple:
    out = []
    for c in el.children:
        if isinstance(c, tuple):
            out.append(Text(c[0], c[1]))
        elif c.tag == "module":
            a = _attrs(c, ("name",))
            out.append(Module(a["name"], _schema_children(c, limits), c.line))
        elif c.tag == "param":
            a = _attrs(c, ("name", "len"))
            if c.children:
                raise ValueError(f"{where('param', c.line)}: a parameter must be empty (<param name len/>)")
            try:
                n = int(a["len"])
            except ValueError:
                raise ValueError(f"{where('param', c.line)} {a['name']!r}: len={a['len']!r} is not an "
                                 f"integer") from None
            out.append(Param(a["name"], n, c.line))
        elif c.tag == "union":
            _attrs(c, ())
            members = _schema_children(c, limits)
            for m in members:
                if isinstance(m, Text):
                    raise ValueError(f"{where('union', c.line)}: text {m.text.strip()[:30]!r} at line {m.line}; "
                                     f"a union holds only modules")
            out.append(Union(members, c.line))
        else:
            raise ValueError(f"{where(c.tag, c.line)}: unknown schema element (expected module, param or union)")
    return normalize_children(out)


def parse_schema(document: str, limits: ParseLimits = ParseLimits()) -> Schema:
    """Parse and validate a PML schema document."""
    root = parse_xml(document, limits)
    if root.tag != "schema":
        raise ValueError(f"{where(root.tag, root.line)}: the root element of a schema must be <schema>")
    a = _attrs(root, ("name",))
    return check_schema(Schema(a["name"], _schema_children(root, limits), root.line), limits)


def schema_to_pml(schema: Schema) -> str:
    """The PML document of `schema` (parses back to an equal schema)."""
    def write(children) -> str:
        parts = []
        for c in children:
            if isinstance(c, Text):
                parts.append(escape(c.text))
            elif isinstance(c, Param):
                parts.append(f"<param name={quoteattr(c.name)} len=\"{c.length}\"/>")
            elif isinstance(c, Module):
                parts.append(f"<module name={quoteattr(c.name)}>{write(c.children)}</module>")
            else:
                parts.append(f"<union>{write(c.members)}</union>")
        return "".join(parts)
    return f"<schema name={quoteattr(check_schema(schema).name)}>{write(schema.children)}</schema>"


# ------------------------------------------------------------------ prompt
def _imports(el: XmlElement, top: bool) -> tuple:
    out = []
    for c in el.children:
        if isinstance(c, tuple):
            if top:
                out.append(c)
            elif c[0].strip():
                raise ValueError(f"{where(el.tag, el.line)}: text {c[0].strip()[:30]!r} inside an import; "
                                 f"only nested imports may go there")
        else:
            check_name(c.tag, c.tag, c.line)
            out.append(Import(c.tag, dict(c.attrs), _imports(c, False), c.line))
    if not top:
        return tuple(out)
    merged: list = []            # join adjacent text chunks into one new-text item
    for c in out:
        if isinstance(c, tuple) and merged and isinstance(merged[-1], str):
            merged[-1] += c[0]
        else:
            merged.append(c[0] if isinstance(c, tuple) else c)
    return tuple(m for m in merged if not (isinstance(m, str) and not m.strip()))


def parse_prompt(document: str, schema: Schema | None = None, limits: ParseLimits = ParseLimits()) -> Prompt:
    """Parse a PML prompt; with `schema`, also check it against the schema (`check_prompt`).

    New text is kept verbatim (a piece made only of whitespace is dropped)."""
    root = parse_xml(document, limits)
    if root.tag != "prompt":
        raise ValueError(f"{where(root.tag, root.line)}: the root element of a prompt must be <prompt>")
    a = _attrs(root, ("schema",))
    prompt = Prompt(a["schema"], _imports(root, True), root.line)
    return prompt if schema is None else check_prompt(prompt, schema)


def check_prompt(prompt: Prompt, schema: Schema) -> Prompt:
    """Check that `prompt` imports only modules of `schema`, each at most once, nested ones inside
    their parent, in schema order, at most one member per union, with an argument for every
    parameter of an imported module (an empty one is written `name=""`) and no other.
    Argument lengths are checked at layout time (they are counted in tokens). Returns `prompt`."""
    if prompt.schema != schema.name:
        raise ValueError(f"{where('prompt', prompt.line)}: schema={prompt.schema!r} but the schema is "
                         f"{schema.name!r}")

    def visit(imports, children, parent: str | None):
        order: dict[str, tuple[int, int | None, Module]] = {}   # name -> (index, union index, module)
        for i, c in enumerate(children):
            if isinstance(c, Module):
                order[c.name] = (i, None, c)
            elif isinstance(c, Union):
                for m in c.members:
                    order[m.name] = (i, i, m)
        last, chosen, done = -1, {}, set()
        for imp in imports:
            if not isinstance(imp, Import):
                continue
            el = where(imp.module, imp.line)
            if imp.module not in order:
                inside = f"module {parent!r}" if parent else f"schema {schema.name!r}"
                raise ValueError(f"{el}: unknown module {imp.module!r} at this level of {inside} (known here: "
                                 f"{sorted(order)}; a nested module is imported inside its parent's element)")
            idx, union, mod = order[imp.module]
            if imp.module in done:
                raise ValueError(f"{el}: module {imp.module!r} imported twice")
            done.add(imp.module)
            if union is not None and union in chosen:
                raise ValueError(f"{el}: modules {chosen[union]!r} and {imp.module!r} are members of one union; "
                                 f"import at most one")
            if idx <= last:
                raise ValueError(f"{el}: module {imp.module!r} imported out of schema order (imports follow "
                                 f"the order of the schema)")
            if union is not None:
                chosen[union] = imp.module
            last = idx
            params = [p.name for p in mod.children if isinstance(p, Param)]
            for arg, value in imp.args.items():
                if arg not in params:
                    raise ValueError(f"{el}: module {imp.module!r} has no parameter {arg!r} (parameters: "
                                     f"{sorted(params)})")
                if not isinstance(value, str):
                    raise TypeError(f"{el}: argument {arg!r}: received {type(value).__name__}, expected str")
            missing = [p for p in params if p not in imp.args]
            if missing:
                given = "".join(f' {p}="..."' for p in params)
                raise ValueError(f"{el}: module {imp.module!r} needs argument {missing[0]!r} (its parameters: "
                                 f"{params}); write <{imp.module}{given}/>")
            visit(imp.imports, mod.children, mod.name)

    visit(prompt.items, schema.children, None)
    return prompt
