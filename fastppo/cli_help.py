"""``--help`` without torch: the command line's help, kept as data beside the package.

The parser (``cli.build_parser``) is made from ``PPOConfig``, a ``transformers.TrainingArguments``, so building it
imports transformers and torch: seconds of imports (13.7 s on a loaded machine, issue 63) to print a page of
text. ``cli_help.json`` holds what its help shows: the program, usage and description, and each section's flags
with their metavar, nargs and help text (the default already filled in, as transformers' formatter fills it).
``print_saved_help`` rebuilds a plain ``argparse`` parser from it, so argparse lays the same text out at the
terminal's width as it lays out the real one's.

The file is written from the real parser (``python -m fastppo.cli_help``) and is used only under the transformers
version it was written with (``TrainingArguments``' fields change between versions); under another, the command
line builds the real parser. tests/test_cli_entry.py checks that the file prints what the real parser prints.
"""
from __future__ import annotations

import argparse
import json
import os
from importlib import metadata
from typing import Any

HELP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_help.json")
HELP_FLAGS = ("-h", "--help")


def asks_for_help(argv: list[str]) -> bool:
    """Whether argparse would print the help for these arguments (a help flag before any ``--``)."""
    flags = argv[:argv.index("--")] if "--" in argv else argv
    return any(token in HELP_FLAGS for token in flags)


def describe(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """What ``parser``'s help shows, as JSON-able data: each flag's help text as its formatter expands it
    (``ArgumentDefaultsHelpFormatter``'s "(default: ...)" included) and its metavar as the formatter resolves it
    (the choices, or the flag's name in capitals)."""
    formatter = parser._get_formatter()
    groups = []
    for group in parser._action_groups:
        flags = []
        for action in group._group_actions:
            metavar = formatter._metavar_formatter(action, formatter._get_default_metavar_for_optional(action))(1)
            flags.append({
                "option_strings": list(action.option_strings),
                "nargs": action.nargs,
                "metavar": list(metavar) if isinstance(action.metavar, tuple) else metavar[0],
                "help": None if action.help is None else
                        action.help if action.help == argparse.SUPPRESS else formatter._expand_help(action),
            })
        groups.append({"title": group.title, "description": group.description, "flags": flags})
    return {"prog": parser.prog, "usage": parser.usage, "description": parser.description,
            "epilog": parser.epilog, "groups": groups}


def parser_from(described: dict[str, Any]) -> argparse.ArgumentParser:
    """A plain argparse parser whose help is ``described``'s (for printing only: it parses nothing)."""
    parser = argparse.ArgumentParser(prog=described["prog"], usage=described["usage"],
                                     description=described["description"], epilog=described["epilog"],
                                     add_help=False, allow_abbrev=False)  # -h is among the described flags
    made = {parser._positionals.title: parser._positionals, parser._optionals.title: parser._optionals}
    for group in described["groups"]:
        target = made.get(group["title"]) or parser.add_argument_group(group["title"], group["description"])
        for flag in group["flags"]:
            text = flag["help"] if flag["help"] in (None, argparse.SUPPRESS) else flag["help"].replace("%", "%%")
            metavar = tuple(flag["metavar"]) if isinstance(flag["metavar"], list) else flag["metavar"]
            if flag["nargs"] == 0:  # a switch (-h, --no_x): its option strings alone
                target.add_argument(*flag["option_strings"], action="store_const", const=None, help=text)
            else:
                target.add_argument(*flag["option_strings"], nargs=flag["nargs"], metavar=metavar, help=text)
    return parser


def transformers_version() -> str | None:
    try:
        return metadata.version("transformers")  # the installed distribution's, read without importing it
    except metadata.PackageNotFoundError:
        return None


def print_saved_help(path: str = HELP_FILE) -> bool:
    """Print the saved help and say so; False (nothing printed) without the file or when it was written under
    another transformers version than the installed one."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    if saved.get("transformers") != transformers_version():
        return False
    parser_from(saved["parser"]).print_help()
    return True


def saved_help(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's content for ``parser`` under the installed transformers."""
    return {"transformers": transformers_version(), "parser": describe(parser)}


def main(path: str = HELP_FILE) -> None:
    """``python -m fastppo.cli_help``: (re)write the file from the real parser, after a change to a flag or to
    transformers' version."""
    from fastppo.cli import build_parser  # the command line, which imports this module to print its help

    with open(path, "w") as f:
        json.dump(saved_help(build_parser()), f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
