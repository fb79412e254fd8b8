"""The inputs of ``jpa-sample``, checked before the model loads: the shared prompt and the
questions (files or standard input, the ``--demo`` example), the prompts ``LLM`` gets, the
flags that only go with ``--output``, and whether ``--output`` can be written.  Every problem is a
:class:`~models.cli.args.UsageError`."""
from __future__ import annotations

import argparse
import os
import sys

from models.cli.args import STDIN, UsageError

__all__ = ["DEMO_QUESTIONS", "DEMO_SYSTEM", "build_prompts", "check_output_flags", "check_writable", "output_mode",
           "read_inputs", "read_text"]

# SmolLM2-Instruct's own default system prompt: with other system prompts the 135M model answers
# oddly (transformers gives the same tokens), e.g. "Le Grand Paris, la femme de la France."
DEMO_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."
DEMO_QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Give me one tip for learning to cook.")


def read_text(path: str, what: str) -> str:
    """The text of `path`, or of standard input when `path` is `-`."""
    try:
        if path == STDIN:
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"{what} is a directory: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        source = "standard input" if path == STDIN else path
        raise UsageError(f"cannot read {what} {source}: {e}") from None


def check_output_flags(args: argparse.Namespace) -> None:
    """The flags that only go with an ``--output`` file: ``--overwrite`` and ``--append``, and
    ``--compare`` (its fields complete the records after they were written)."""
    for flag, given in (("--overwrite", args.overwrite), ("--append", args.append)):
        if given and not args.output:
            raise UsageError(f"{flag} needs --output FILE")
        if given and args.output == STDIN:
            raise UsageError(f"{flag} cannot be used with --output - (standard output has no file to replace)")
    if args.compare and args.output == STDIN:
        raise UsageError("--compare cannot be used with --output - (each record goes out when the cached path "
                         "ends, before the comparison); give --output FILE")


def output_mode(args: argparse.Namespace) -> str:
    """What ``--output`` does to an existing file: ``"overwrite"``, ``"append"`` or ``"new"`` (refuse it)."""
    return "overwrite" if args.overwrite else "append" if args.append else "new"


def check_writable(path: str) -> None:
    """UsageError unless `path` can be written: an existing file must be writable (opened for
    append, never truncated) and the parent directory must exist and be writable (the records
    go to a file next to `path` that is renamed onto it); `-` (standard output) always can.
    Creates nothing."""
    if path == STDIN:
        return
    if os.path.isdir(path):
        raise UsageError(f"cannot write --output {path}: is a directory")
    if os.path.exists(path):
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise UsageError(f"cannot write --output {path}: {e.strerror or e}") from None
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise UsageError(f"cannot write --output {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write --output {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --output {path}: directory {parent} is not writable")


def build_prompts(prompt: str | None, questions: list[str] | None, *, chat: bool, question_format: str) -> list:
    """The prompts `LLM.generate` gets (one per question, or one): chat message lists or texts."""
    if questions is None:
        if not prompt or not prompt.strip():
            raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
        return [prompt]
    out = []
    for q in questions:
        if chat:
            out.append(([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": q}])
        else:
            sep = "" if not prompt or prompt[-1].isspace() else "\n"
            out.append((prompt or "") + sep + question_format.format(question=q))
    return out


def read_inputs(args: argparse.Namespace) -> tuple[str | None, list[str] | None]:
    """`(prompt, questions)` of the flags (`--demo` also turns on `args.chat`)."""
    prompt = read_text(args.prompt_file, "prompt file") if args.prompt_file is not None else args.prompt
    questions = None
    if args.demo:
        args.chat = True
        prompt = DEMO_SYSTEM if prompt is None else prompt
        questions = list(DEMO_QUESTIONS) if args.questions_file is None else None
    if args.questions_file is not None:
        questions = [q.strip() for q in read_text(args.questions_file, "questions file").splitlines()]
        questions = [q for q in questions if q]
        if not questions:
            raise UsageError(f"questions file {args.questions_file} has no non-empty line")
    if questions is None and (prompt is None or not prompt.strip()):
        raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
    return prompt, questions
