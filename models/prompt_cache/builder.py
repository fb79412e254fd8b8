"""A Python builder for PML schemas: the same `Schema` object `parse_schema` returns.

    s = schema("trip",
               "You are a travel agent.",
               module("plan", "Plan a trip of ", param("duration", 4), " days."),
               union(module("miami", "Miami has beaches."), module("paris", "Paris has museums.")))

Strings become `Text`; adjacent strings are merged and whitespace-only ones dropped, exactly as
the parser does, so `parse_schema(schema_to_pml(s)) == s`.
"""
from __future__ import annotations

from models.prompt_cache.pml import (Module, Param, Schema, Text, Union, check_schema, normalize_children)

__all__ = ["schema", "module", "param", "union"]


def _children(items, context: str) -> tuple:
    out = []
    for i, c in enumerate(items):
        if isinstance(c, str):
            out.append(Text(c))
        elif isinstance(c, (Text, Param, Module, Union)):
            out.append(c)
        else:
            raise TypeError(f"{context} item {i}: received {type(c).__name__}, expected str, param(), module() "
                            f"or union()")
    return normalize_children(out)


def param(name: str, length: int) -> Param:
    """A parameter of `length` tokens (`<param name="..." len="..."/>`)."""
    return Param(name, length)


def module(name: str, *children) -> Module:
    """A module (`<module name="...">...</module>`) of text, params, modules and unions."""
    return Module(name, _children(children, f"module({name!r})"))


def union(*members: Module) -> Union:
    """Mutually exclusive modules sharing a start position (`<union>...</union>`)."""
    for i, m in enumerate(members):
        if not isinstance(m, Module):
            raise TypeError(f"union() member {i}: received {type(m).__name__}, expected module()")
    return Union(tuple(members))


def schema(name: str, *children) -> Schema:
    """A validated schema (`<schema name="...">...</schema>`)."""
    return check_schema(Schema(name, _children(children, f"schema({name!r})")))
