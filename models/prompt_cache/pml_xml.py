"""Safe XML for PML (`models.prompt_cache.pml`): a document parsed by `xml.parsers.expat` into a
small tree of `XmlElement`s with line numbers.

A DOCTYPE, entity and notation declarations, external entities and processing instructions are
refused; `ParseLimits` caps the document's characters, element depth and element count (and the
`len` of a parameter, checked by `pml`). Every error is a `ValueError` naming the element or
line; a malformed document names its line and column, and where expat stopped at a `<` or `&`
that starts no markup, how to write it as text: a chat template's special token such as
`<|im_start|>` is written `&lt;|im_start|&gt;` (or inside `<![CDATA[...]]>`).
"""
from __future__ import annotations

import dataclasses
import re
from xml.parsers import expat
from xml.sax.saxutils import escape

__all__ = ["ParseLimits", "XmlElement", "parse_xml", "where"]


@dataclasses.dataclass(frozen=True)
class ParseLimits:
    """Size caps of one PML document: characters, element nesting depth, elements, `len` value."""
    max_chars: int = 4_000_000
    max_depth: int = 32
    max_elements: int = 100_000
    max_param_len: int = 1 << 20


def where(element: str, line: int | None) -> str:
    """`"<element> (line N)"`, or `"<element>"` for objects built in Python (no line)."""
    return f"<{element}>" if line is None else f"<{element}> (line {line})"


@dataclasses.dataclass
class XmlElement:
    """An element of a parsed PML document: `children` holds `XmlElement`s and `(text, line)` pairs."""
    tag: str
    attrs: dict
    line: int
    children: list = dataclasses.field(default_factory=list)   # XmlElement or (text, line)


def parse_xml(document: str, limits: ParseLimits = ParseLimits()) -> XmlElement:
    """Parse `document` into a tree of elements with line numbers; DTDs, entity declarations,
    external entities and processing instructions are refused; size and depth are capped."""
    if not isinstance(document, str):
        raise TypeError(f"document: received {type(document).__name__}, expected str")
    if len(document) > limits.max_chars:
        raise ValueError(f"document: {len(document)} characters, the limit is {limits.max_chars}")
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.buffer_text = True
    stack: list[XmlElement] = []
    root: list[XmlElement] = []
    count = [0]

    def start(tag, attrs):
        line = parser.CurrentLineNumber
        count[0] += 1
        if len(stack) >= limits.max_depth:
            raise ValueError(f"{where(tag, line)}: elements nested deeper than {limits.max_depth}")
        if count[0] > limits.max_elements:
            raise ValueError(f"{where(tag, line)}: more than {limits.max_elements} elements")
        el = XmlElement(tag, dict(attrs), line)
        (stack[-1].children if stack else root).append(el)
        stack.append(el)

    def end(_tag):
        stack.pop()

    def chars(data):
        if stack:
            stack[-1].children.append((data, parser.CurrentLineNumber))

    def refuse(what: str):
        def handler(*_args):
            raise ValueError(f"line {parser.CurrentLineNumber}: PML refuses {what}")
        return handler

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = chars
    parser.StartDoctypeDeclHandler = refuse("a DOCTYPE declaration")
    parser.EntityDeclHandler = refuse("entity declarations")
    parser.UnparsedEntityDeclHandler = refuse("entity declarations")
    parser.NotationDeclHandler = refuse("notation declarations")
    parser.ExternalEntityRefHandler = refuse("external entities")
    parser.ProcessingInstructionHandler = refuse("processing instructions")
    try:
        parser.Parse(document, True)
    except expat.ExpatError as e:
        raise ValueError(f"malformed PML at line {e.lineno}, column {e.offset}: "
                         f"{expat.ErrorString(e.code)}{_escape_hint(document, e)}") from None
    return root[0]


_SPECIAL = re.compile(r"<\|[^<>|\s]{1,64}\|>")       # a chat template's special token, e.g. <|im_start|>


def _escape_hint(document: str, error: expat.ExpatError) -> str:
    """How to write the character expat stopped at as text, when it is a `<` or `&` that
    starts no markup (expat reports the column after it, or at it)."""
    if error.code != expat.errors.codes[expat.errors.XML_ERROR_INVALID_TOKEN]:
        return ""
    lines = document.split("\n")
    text = lines[error.lineno - 1] if 1 <= error.lineno <= len(lines) else ""
    for i in (error.offset - 1, error.offset):
        if 0 <= i < len(text) and text[i] == "<":
            token = _SPECIAL.match(text, i)
            if token:
                t = token.group()
                return (f"; {t!r} is text, not markup: write it as {escape(t, {'>': '&gt;'})!r} (or inside "
                        f"<![CDATA[...]]>)")
            return "; a '<' in text is written '&lt;' (or the text goes inside <![CDATA[...]]>)"
        if 0 <= i < len(text) and text[i] == "&":
            return "; a '&' in text is written '&amp;'"
    return ""
