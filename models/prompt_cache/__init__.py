"""Prompt Cache: schemas of reusable prompt modules (PML), their position layout and the
per-module K/V encoding at those positions.

* `pml`: parse and check schemas and prompts (safe XML).
* `builder`: build a schema in Python.
* `layout`: token ids and position ids of every module, argument and new-text segment.
* `encode`: K/V per layer of every module of a schema, each module attending only to itself.
"""
from models.prompt_cache.builder import module, param, schema, union
from models.prompt_cache.pml import (Import, Module, Param, ParseLimits, Prompt, Schema, Text, Union, check_prompt,
                                     check_schema, parse_prompt, parse_schema, schema_to_pml)

__all__ = ["module", "param", "schema", "union", "Import", "Module", "Param", "ParseLimits", "Prompt", "Schema",
           "Text", "Union", "check_prompt", "check_schema", "parse_prompt", "parse_schema", "schema_to_pml"]
