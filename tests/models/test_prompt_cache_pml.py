"""PML: schemas and prompts parsed into the same objects the builder makes, every error case
(with element and line), and refusal of DTDs, entities, processing instructions and size limits."""
import pytest

from models.prompt_cache import (Import, Module, Param, ParseLimits, Schema, Text, Union, module, param,
                                 parse_prompt, parse_schema, schema, schema_to_pml, union)

SCHEMA = """<schema name="trip">
  You are a travel agent.
  <module name="plan">Plan a trip of <param name="duration" len="4"/> days.
    <module name="budget">Keep it under <param name="amount" len="3"/>.</module>
  </module>
  <union>
    <module name="miami">Miami &amp; its beaches.</module>
    <module name="paris">Paris has museums.</module>
  </union>
  Answer briefly.
</schema>"""


def built():
    return schema("trip",
                  "\n  You are a travel agent.\n  ",
                  module("plan", "Plan a trip of ", param("duration", 4), " days.\n    ",
                         module("budget", "Keep it under ", param("amount", 3), "."), "\n  "),
                  union(module("miami", "Miami & its beaches."), module("paris", "Paris has museums.")),
                  "\n  Answer briefly.\n")


def test_schema_parses_to_the_built_schema():
    s = parse_schema(SCHEMA)
    assert s == built()
    plan = s.children[1]
    assert isinstance(plan, Module) and plan.line == 3
    assert plan.children[1] == Param("duration", 4)
    assert isinstance(s.children[2], Union) and s.children[2].line == 6
    assert s.children[2].members[1].line == 8
    assert s.children[0] == Text("\n  You are a travel agent.\n  ")


def test_round_trip_through_pml():
    s = built()
    assert parse_schema(schema_to_pml(s)) == s


def test_builder_drops_whitespace_and_merges_text():
    m = module("m", "a", "b", "  ", param("p", 2), "\n", module("n", " \t"))
    assert m.children == (Text("ab  "), Param("p", 2), Module("n", ()))


def test_prompt_parses_imports_arguments_and_text():
    s = parse_schema(SCHEMA)
    p = parse_prompt('<prompt schema="trip">\n<plan duration="3"><budget amount="$50"/></plan>\n'
                     '<miami/>Surf spots?</prompt>', s)
    assert p.items == (Import("plan", {"duration": "3"}, (Import("budget", {"amount": "$50"}),)),
                       Import("miami", {}), "Surf spots?")
    assert p.items[0].line == 2 and p.items[1].line == 3


@pytest.mark.parametrize("doc, words", [
    ('<schema name="s"><module name="a">x</schema>', ["malformed", "line 1"]),
    ('<schema name="s"><module name="sys">\n<|im_start|>system\nBe brief.<|im_end|></module></schema>',
     ["malformed PML at line 2, column 1", "'<|im_start|>' is text, not markup", "'&lt;|im_start|&gt;'"]),
    ('<schema name="s">\n<module>x</module></schema>', ["<module> (line 2)", "missing attribute 'name'"]),
    ('<schema name="s"><module name="a" x="1">t</module></schema>', ["unknown attribute", "'x'"]),
    ('<schema name="s">\n\n<modul name="a">t</modul></schema>', ["<modul> (line 3)", "unknown schema element"]),
    ('<schema name="s"><module name="a">x</module>\n<module name="a">y</module></schema>',
     ["<module> (line 2)", "duplicate module name 'a'", "line 1"]),
    ('<schema name="s"><module name="a"><param name="p" len="2"/>\n<param name="p" len="3"/></module></schema>',
     ["<param> (line 2)", "duplicate parameter 'p'"]),
    ('<schema name="s"><module name="a"><param name="p" len="zero"/></module></schema>', ["<param>", "not an integer"]),
    ('<schema name="s"><module name="a"><param name="p" len="0"/></module></schema>', ["<param>", "len=0"]),
    ('<schema name="s"><param name="p" len="2"/></schema>', ["<param>", "inside a module"]),
    ('<schema name="s"><union>text<module name="a">x</module></union></schema>', ["<union>", "only modules"]),
    ('<schema name="s"><union></union></schema>', ["<union>", "at least one module"]),
    ('<schema name="s"><union><union><module name="a">x</module></union></union></schema>', ["<union>"]),
    ('<schema name="s"><module name="1a">x</module></schema>', ["<module>", "not a valid name"]),
    ('<schema name="s"><module name="union">x</module></schema>', ["<module>", "reserved"]),
    ('<prompt schema="s"/>', ["<prompt>", "root element of a schema"]),
])
def test_schema_errors(doc, words):
    with pytest.raises(ValueError) as e:
        parse_schema(doc)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("doc, words", [
    ('<prompt schema="other"><plan/></prompt>', ["<prompt> (line 1)", "'other'"]),
    ('<prompt schema="trip">\n<rome/></prompt>', ["<rome> (line 2)", "unknown module 'rome'"]),
    ('<prompt schema="trip">\n<budget/></prompt>', ["<budget> (line 2)", "unknown module", "inside its parent"]),
    ('<prompt schema="trip"><plan days="3"/></prompt>', ["<plan>", "no parameter 'days'"]),
    ('<prompt schema="trip"><miami/>\n<paris/></prompt>', ["<paris> (line 2)", "'miami' and 'paris'", "one union"]),
    ('<prompt schema="trip"><plan duration="3"/><plan duration="3"/></prompt>', ["<plan>", "imported twice"]),
    ('<prompt schema="trip"><miami/><plan/></prompt>', ["<plan>", "out of schema order"]),
    ('<prompt schema="trip"><plan>text</plan></prompt>', ["<plan>", "inside an import"]),
    ('<prompt schema="trip"><plan></prompt>', ["malformed", "line 1"]),
    ('<prompt><plan/></prompt>', ["<prompt>", "missing attribute 'schema'"]),
    ('<prompt schema="trip">\n<plan/> Go</prompt>',
     ["<plan> (line 2)", "module 'plan' needs argument 'duration'", '<plan duration="..."/>']),
    ('<prompt schema="trip"><plan duration="3">\n<budget/></plan> Go</prompt>',
     ["<budget> (line 2)", "module 'budget' needs argument 'amount'", '<budget amount="..."/>']),
    ('<prompt schema="trip"><plan duration="3"/>\n<|im_start|>user Go</prompt>',
     ["malformed PML at line 2", "'<|im_start|>' is text", "'&lt;|im_start|&gt;'", "CDATA"]),
    ('<prompt schema="trip"><plan duration="3"/> Sun & sand?</prompt>', ["malformed", "written '&amp;'"]),
    ('<prompt schema="trip"><plan duration="3"/> 3 < 4?</prompt>', ["malformed", "written '&lt;'"]),
])
def test_prompt_errors(doc, words):
    with pytest.raises(ValueError) as e:
        parse_prompt(doc, parse_schema(SCHEMA))
    for w in words:
        assert w in str(e.value)


def test_left_out_argument_is_refused_an_empty_one_is_accepted():
    s = parse_schema(SCHEMA)
    with pytest.raises(ValueError, match="module 'plan' needs argument 'duration'"):
        parse_prompt('<prompt schema="trip"><plan/> Go</prompt>', s)
    p = parse_prompt('<prompt schema="trip"><plan duration=""/> Go</prompt>', s)
    assert p.items == (Import("plan", {"duration": ""}), " Go")


@pytest.mark.parametrize("template", [
    '<schema name="s"><module name="sys">{}system</module></schema>',
    '<prompt schema="trip"><plan duration="3"/>{}user Go</prompt>',
])
def test_raw_special_token_error_says_how_to_escape_it(template):
    """The escape the message suggests, put in place of the raw token, parses to the token as text."""
    parse = parse_schema if template.startswith("<schema") else lambda d: parse_prompt(d, parse_schema(SCHEMA))
    with pytest.raises(ValueError, match="is text, not markup") as e:
        parse(template.format("<|im_start|>"))
    escaped = str(e.value).split("write it as '")[1].split("'")[0]
    assert escaped == "&lt;|im_start|&gt;"
    got = parse(template.format(escaped))
    text = got.children[0].children[0].text if template.startswith("<schema") else got.items[1]
    assert text.startswith("<|im_start|>")


@pytest.mark.parametrize("doc, words", [
    ('<?xml version="1.0"?>\n<!DOCTYPE s [<!ENTITY a "aaaa">]><schema name="s">&a;</schema>', ["DOCTYPE", "line 2"]),
    ('<!DOCTYPE schema SYSTEM "file:///etc/passwd"><schema name="s"/>', ["DOCTYPE"]),
    ('<schema name="s">&ext;</schema>', ["malformed", "undefined entity"]),
    ('<schema name="s"><?php evil()?></schema>', ["processing instructions"]),
])
def test_unsafe_xml_is_refused(doc, words):
    with pytest.raises(ValueError) as e:
        parse_schema(doc)
    for w in words:
        assert w in str(e.value)


def test_size_depth_and_element_limits():
    doc = '<schema name="s"><module name="a">' + "x" * 200 + "</module></schema>"
    assert parse_schema(doc, ParseLimits(max_chars=len(doc))).name == "s"
    with pytest.raises(ValueError, match="characters, the limit is"):
        parse_schema(doc, ParseLimits(max_chars=len(doc) - 1))
    deep = '<schema name="s">' + "".join(f'<module name="m{i}">' for i in range(5)) + "x" + \
        "</module>" * 5 + "</schema>"
    assert parse_schema(deep, ParseLimits(max_depth=6)).name == "s"
    with pytest.raises(ValueError, match="nested deeper than 5"):
        parse_schema(deep, ParseLimits(max_depth=5))
    with pytest.raises(ValueError, match="more than 3 elements"):
        parse_schema(deep, ParseLimits(max_elements=3))


def test_builder_errors():
    with pytest.raises(ValueError, match="duplicate module name 'a'"):
        schema("s", module("a", "x"), union(module("a", "y")))
    with pytest.raises(TypeError, match="expected module"):
        union("text")
    with pytest.raises(TypeError, match=r"module\('a'\) item 0"):
        module("a", 3)
    with pytest.raises(ValueError, match="len=-1"):
        schema("s", module("a", param("p", -1)))
    with pytest.raises(TypeError, match="expected Schema"):
        schema_to_pml("not a schema")


def test_text_is_kept_verbatim_with_character_references():
    s = parse_schema('<schema name="s"><module name="a">a&lt;b&#65; <![CDATA[<raw>]]></module></schema>')
    assert s.children[0].children == (Text("a<bA <raw>"),)
    assert isinstance(s, Schema)
