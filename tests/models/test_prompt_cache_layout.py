"""Layout of Prompt Cache schemas and prompts: module, union, nested-module and parameter
positions; argument and new-text positions; errors; the contiguous case equals plain tokenization."""
import numpy as np
import pytest

from models.prompt_cache import module, param, parse_prompt, parse_schema, schema, schema_to_pml, union
from models.prompt_cache.layout import default_placeholder_id, layout_prompt, layout_schema


class CharTokenizer:
    """One token per character: its code point (so lengths are visible in the text)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class NibbleTokenizer:
    """Two tokens per character (its code point's high and low nibble pairs): ' ' is not one token."""

    def encode(self, text, add_special_tokens=True):
        return [t for c in text for t in divmod(ord(c), 16)]


TOK = CharTokenizer()
SCHEMA = schema("s", "AB",
                module("m", "xy", param("p", 3), "z", module("n", "qq"), "w"),
                union(module("u1", "abc"), module("u2", "defgh")),
                "T")


def ords(text):
    return [ord(c) for c in text]


def test_schema_positions():
    lay = layout_schema(SCHEMA, TOK)
    assert lay.placeholder_id == ord(" ") and lay.length == 17
    got = {m.name: (m.token_ids.tolist(), m.positions.tolist(), m.start, m.end) for m in lay.modules}
    assert [m.name for m in lay.modules] == ["#0", "m", "n", "u1", "u2", "#1"]
    assert got["#0"] == (ords("AB"), [0, 1], 0, 2)
    assert got["m"] == (ords("xy   zw"), [2, 3, 4, 5, 6, 7, 10], 2, 11)   # n's positions 8, 9 are skipped
    assert got["n"] == (ords("qq"), [8, 9], 8, 10)
    assert got["u1"] == (ords("abc"), [11, 12, 13], 11, 14)
    assert got["u2"] == (ords("defgh"), [11, 12, 13, 14, 15], 11, 16)
    assert got["#1"] == (ords("T"), [16], 16, 17)                         # after the longest union member
    m = lay.module("m")
    assert [(p.name, p.offset, p.length, p.start) for p in m.params] == [("p", 2, 3, 4)]
    assert m.keep_mask.tolist() == [True, True, False, False, False, True, True]
    assert lay.module("n").parent == "m" and m.parent is None
    assert lay.module("u1").union == lay.module("u2").union is not None and m.union is None
    assert lay.module("#0").anonymous and not m.anonymous
    with pytest.raises(ValueError, match="no module 'zz'"):
        lay.module("zz")


def test_parsed_schema_has_the_same_layout():
    a, b = layout_schema(SCHEMA, TOK), layout_schema(parse_schema(schema_to_pml(SCHEMA)), TOK)
    for x, y in zip(a.modules, b.modules, strict=True):
        assert x.name == y.name and (x.start, x.end) == (y.start, y.end)
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.positions, y.positions)


def test_bos_and_placeholder_options():
    lay = layout_schema(SCHEMA, TOK, placeholder_id=0, bos_id=7)
    assert lay.modules[0].name == "#bos" and lay.modules[0].token_ids.tolist() == [7]
    assert lay.modules[0].positions.tolist() == [0] and lay.length == 18
    assert lay.module("m").positions.tolist() == [3, 4, 5, 6, 7, 8, 11]
    assert lay.module("m").token_ids.tolist() == ords("xy") + [0, 0, 0] + ords("zw")
    with pytest.raises(ValueError, match="not one token; pass placeholder_id"):
        default_placeholder_id(NibbleTokenizer())
    with pytest.raises(ValueError, match="placeholder_id: received -1"):
        layout_schema(SCHEMA, TOK, placeholder_id=-1)


def prompt(body):
    return parse_prompt(f'<prompt schema="s">{body}</prompt>', SCHEMA)


def test_prompt_positions():
    lay = layout_schema(SCHEMA, TOK)
    out = layout_prompt(prompt('hi<m p="12"><n/></m>mid<u2/>end'), SCHEMA, lay, TOK)
    assert out.modules == ("#0", "m", "n", "u2", "#1")
    (arg,) = out.arguments
    assert (arg.module, arg.param, arg.token_ids.tolist(), arg.positions.tolist()) == ("m", "p", ords("12"), [4, 5])
    texts = [(t.text, t.after, t.token_ids.tolist(), t.positions.tolist()) for t in out.texts]
    assert texts == [("hi", None, ords("hi"), [2, 3]),          # after #0, before m
                     ("mid", "m", ords("mid"), [11, 12, 13]),   # where m ends
                     ("end", "u2", ords("end"), [17, 18, 19])]  # after everything included
    assert out.new_token_ids.tolist() == ords("hi12midend")
    assert out.new_positions.tolist() == [2, 3, 4, 5, 11, 12, 13, 17, 18, 19]


def test_prompt_without_optional_parts():
    lay = layout_schema(SCHEMA, TOK)
    out = layout_prompt(prompt('<m p=""/><u1/>q'), SCHEMA, lay, TOK)
    assert out.modules == ("#0", "m", "u1", "#1") and [a.token_ids.size for a in out.arguments] == [0]
    assert out.texts[0].positions.tolist() == [17]      # the union still reserves u2's length
    out = layout_prompt(prompt("<u1/>q"), SCHEMA, lay, TOK)
    assert out.texts[0].positions.tolist() == [17]
    out = layout_prompt(prompt("only text"), SCHEMA, lay, TOK)
    assert out.modules == ("#0", "#1") and out.new_positions.tolist() == list(range(17, 26))


def test_text_positions_never_go_backwards():
    lay = layout_schema(SCHEMA, TOK)
    out = layout_prompt(prompt('<m p=""/>a long new text<u1/>x'), SCHEMA, lay, TOK)
    first, second = out.texts
    assert first.positions.tolist() == list(range(11, 11 + len("a long new text")))
    assert second.positions[0] == max(first.positions[-1] + 1, 17)


def test_argument_longer_than_len():
    lay = layout_schema(SCHEMA, TOK)
    doc = '<prompt schema="s">\n<m p="1234"/></prompt>'
    with pytest.raises(ValueError) as e:
        layout_prompt(parse_prompt(doc), SCHEMA, lay, TOK)
    assert all(w in str(e.value) for w in ("<m> (line 2)", "argument p='1234' is 4 tokens", "len=3"))
    out = layout_prompt(parse_prompt(doc.replace("1234", "123")), SCHEMA, lay, TOK)
    assert out.arguments[0].positions.tolist() == [4, 5, 6]


def test_prompt_checked_against_its_schema():
    lay = layout_schema(SCHEMA, TOK)
    with pytest.raises(ValueError, match="'u1' and 'u2'"):
        layout_prompt(parse_prompt('<prompt schema="s"><u1/><u2/></prompt>'), SCHEMA, lay, TOK)
    other = schema("t", module("m", "x"))
    with pytest.raises(ValueError, match="schema_layout: laid out for schema 's'"):
        layout_prompt(parse_prompt('<prompt schema="t"><m/></prompt>'), other, lay, TOK)


def test_leading_modules_assemble_like_plain_tokenization():
    """Modules at the start of the schema, no parameters, then new text: the assembled prompt is
    the plain token sequence of the same text at positions 0..n-1."""
    s = schema("c", "sys ", module("a", "doc one. "), module("b", "doc two. "), module("z", "unused"))
    lay = layout_schema(s, TOK)
    out = layout_prompt(parse_prompt('<prompt schema="c"><a/><b/>question?</prompt>', s), s, lay, TOK)
    ids, pos = out.assembled(lay)
    text = "sys doc one. doc two. question?"
    assert ids.tolist() == ords(text) and pos.tolist() == list(range(len(text)))


def test_assembled_leaves_placeholders_out():
    lay = layout_schema(SCHEMA, TOK)
    ids, pos = layout_prompt(prompt('<m p="1"/>'), SCHEMA, lay, TOK).assembled(lay)
    assert ord(" ") not in ids.tolist() and 4 in pos.tolist() and 5 not in pos.tolist()
    assert np.all(np.diff(pos) >= 0)


def test_random_nested_schemas_keep_layout_invariants():
    rng = np.random.default_rng(0)
    for trial in range(20):
        names = iter(f"m{i}" for i in range(1000))

        def children(depth):
            out = []
            for _ in range(rng.integers(1, 4)):
                kind = rng.integers(0, 4 if depth < 3 else 2)
                if kind == 0:
                    out.append("t" * int(rng.integers(1, 5)))
                elif kind == 1 and depth > 0:
                    out.append(param(f"p{len(out)}", int(rng.integers(1, 4))))
                elif kind == 2:
                    out.append(module(next(names), *children(depth + 1)))
                elif kind == 3:
                    out.append(union(*(module(next(names), *children(depth + 1)) for _ in range(rng.integers(1, 3)))))
            return out

        s = schema("r", *children(0))
        lay = layout_schema(s, TOK)
        by = {m.name: m for m in lay.modules}
        owner = {}
        for m in lay.modules:
            assert len(m.token_ids) == len(m.positions)
            assert np.all((m.positions >= m.start) & (m.positions < m.end))
            assert np.all(np.diff(m.positions) > 0)
            if m.parent is not None:
                p = by[m.parent]
                assert p.start <= m.start and m.end <= p.end
                assert not set(p.positions.tolist()) & set(m.positions.tolist())
            for q in m.positions.tolist():      # outside unions, no two modules share a position
                if m.union is None and all(by[a].union is None for a in ancestors(by, m)):
                    assert q not in owner, (trial, q)
                    owner[q] = m.name
        members = {}
        for m in lay.modules:
            if m.union is not None:
                members.setdefault(m.union, []).append(m)
        for ms in members.values():
            assert len({m.start for m in ms}) == 1
        assert lay.length == max([m.end for m in lay.modules], default=0)


def ancestors(by, m):
    while m.parent is not None:
        m = by[m.parent]
        yield m.name


def test_with_the_project_tokenizer():
    from test_tokenizer import tiny_tokenizer
    tok = tiny_tokenizer()
    s = schema("k", "the ", module("a", "in the on ", param("x", 2)))
    lay = layout_schema(s, tok, placeholder_id=0, bos_id=tok.bos_token_id)
    a = lay.module("a")
    want = tok.encode("in the on ", add_special_tokens=False)
    assert a.token_ids.tolist() == want + [0, 0]
    start = 1 + len(tok.encode("the ", add_special_tokens=False))
    assert a.positions.tolist() == list(range(start, start + len(want) + 2))
    out = layout_prompt(parse_prompt('<prompt schema="k"><a x="on"/> the</prompt>', s), s, lay, tok)
    assert out.arguments[0].token_ids.tolist() == tok.encode("on", add_special_tokens=False)


def test_union_nested_in_a_module():
    s = schema("n", module("outer", "ab", union(module("x", "c"), module("y", "def")), "g", param("q", 2)))
    lay = layout_schema(s, TOK)
    outer = lay.module("outer")
    assert outer.positions.tolist() == [0, 1, 5, 6, 7] and (outer.start, outer.end) == (0, 8)
    assert lay.module("x").positions.tolist() == [2] and lay.module("y").positions.tolist() == [2, 3, 4]
    assert lay.module("x").parent == lay.module("y").parent == "outer"
    out = layout_prompt(parse_prompt('<prompt schema="n"><outer q="z"><y/></outer>!</prompt>', s), s, lay, TOK)
    assert out.modules == ("outer", "y")
    assert out.new_positions.tolist() == [6, 8] and out.new_token_ids.tolist() == ords("z!")
    ids, pos = out.assembled(lay)
    assert ids.tolist() == ords("abdefgz!") and pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
    with pytest.raises(ValueError, match="'x' and 'y'"):
        parse_prompt('<prompt schema="n"><outer q="z"><x/><y/></outer></prompt>', s)
