"""Prompt Cache: schemas of reusable prompt modules (PML), their position layout and the
per-module K/V encoding at those positions.

* `pml`, `pml_xml`: parse and check schemas and prompts (safe XML).
* `builder`: build a schema in Python.
* `layout`: token ids and position ids of every module, argument and new-text segment.
* `encode`: K/V per layer of every module of a schema, each module attending only to itself.
* `identity`, `store`: `PromptCache`, encoded schemas in device, host and disk tiers (safetensors
  and a JSON manifest) with byte budgets and LRU eviction, bound to one model, dtype and tokenizer.
* `disk`, `schema_file`, `manifest`, `atomic`: the disk tier and its files, written
  atomically, carrying SHA-256 digests that are checked when they are read; damaged files are
  kept aside and encoded again.
* `levels`, `infer`: `cached_generate`, batched generation from the stored module K/V (modules
  stored once per batch as shared prefix levels), and `prefill_generate`, the same without the
  cache.

Example::

    cache = PromptCache(model, params, tokenizer, directory="prompt_cache")
    encoded = cache.encode_or_load(schema)
    prompts = [layout_prompt(parse_prompt(doc, schema), schema, cache.schema_layout(schema), tokenizer)
               for doc in prompt_documents]
    out = cached_generate(model, params, encoded, prompts, max_new_tokens=64)
    out.tokens, out.ttft_s, cache.stats()
"""
from models.prompt_cache.builder import module, param, schema, union
from models.prompt_cache.encode import EncodedSchema, encode_schema
from models.prompt_cache.identity import CacheIdentity, model_identity, schema_identity, tokenizer_identity
from models.prompt_cache.infer import PromptCacheOutput, assemble, cached_generate, prefill_generate
from models.prompt_cache.layout import PromptLayout, SchemaLayout, layout_prompt, layout_schema
from models.prompt_cache.levels import LevelPlan, plan_levels
from models.prompt_cache.pml import (Import, Module, Param, ParseLimits, Prompt, Schema, Text, Union, check_prompt,
                                     check_schema, parse_prompt, parse_schema, schema_to_pml)
from models.prompt_cache.store import CacheBudgets, CacheStats, PromptCache, kv_bytes_per_token

__all__ = ["module", "param", "schema", "union", "Import", "Module", "Param", "ParseLimits", "Prompt", "Schema",
           "Text", "Union", "check_prompt", "check_schema", "parse_prompt", "parse_schema", "schema_to_pml",
           "EncodedSchema", "encode_schema", "PromptLayout", "SchemaLayout", "layout_prompt", "layout_schema",
           "CacheIdentity", "model_identity", "schema_identity", "tokenizer_identity", "CacheBudgets", "CacheStats",
           "PromptCache", "kv_bytes_per_token", "LevelPlan", "plan_levels", "PromptCacheOutput", "assemble",
           "cached_generate", "prefill_generate"]
