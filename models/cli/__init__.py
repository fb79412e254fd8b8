"""`jpa-sample`, the command line: completions of prompts that share a prefix, with shared-prefix
attention (the flags, outputs and errors: :mod:`models.cli.command`).

* `command`: :func:`main` (the console entry point) and :func:`run`, flags to completions;
* `args`: the flags and their checks (:class:`UsageError`);
* `inputs`: the prompt, the questions and the files they come from;
* `progress`: the live line on standard error;
* `output`: completion blocks, the summary line and the JSONL records;
* `jsonl`: where the records are written (partial file, lock, `--overwrite` / `--append`);
* `interrupt`: Ctrl-C during one compiled call;
* `prompt_cache`: the PML path (`--schema`, `--prompt-pml`).

Also runnable as `python -m models.cli`.
"""
from models.cli.command import (DEMO_QUESTIONS, DEMO_SYSTEM, PROG, STDIN, Progress, UsageError, build_parser,
                                build_prompts, check_writable, error_line, join_processes, load_model, main,
                                make_devices, parse_args, planned_devices, printable, read_text, run, unescape,
                                version)

__all__ = ["DEMO_QUESTIONS", "DEMO_SYSTEM", "PROG", "STDIN", "Progress", "UsageError", "build_parser",
           "build_prompts", "check_writable", "error_line", "join_processes", "load_model", "main", "make_devices",
           "parse_args", "planned_devices", "printable", "read_text", "run", "unescape", "version"]
