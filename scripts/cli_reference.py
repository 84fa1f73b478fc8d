"""Writes docs/cli.md, the reference of every command-line flag, from the argparse parsers
themselves (`expertstream` and `expertstream-gui`), so that the page says what --help says.

    python scripts/cli_reference.py            # rewrites docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 where docs/cli.md is stale

tests/test_docs.py checks that the page checked in is this text.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"

HEAD = """# Command-line reference

Every flag of `expertstream` and `expertstream-gui`, as `--help` gives it (this page is
generated from the parsers: `python scripts/cli_reference.py`). The README's
[first real run](../README.md#a-first-real-run) shows the few that matter; what the cache
flags mean together is in [docs/memory.md](memory.md), the HTTP server in
[docs/server.md](server.md).
"""


def _flag(action: argparse.Action) -> str:
    """How a flag is spelled: `--max-tokens N, -m N`, or a positional's name."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = action.metavar or (
        "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()
    )
    return ", ".join(f"`{o} {metavar}`" for o in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


def _listed(action: argparse.Action) -> bool:
    """Whether --help lists `action` as a flag of its own (not --help, --version, a
    hidden alias, or the list of subcommands)."""
    hidden = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return action.help != argparse.SUPPRESS and not isinstance(action, hidden)


def _parser_section(title: str, parser: argparse.ArgumentParser, seen: dict) -> list[str]:
    """The section of one (sub)command; a group of flags that an earlier section listed
    word for word (`seen`: rows -> that section's title) is named, not repeated."""
    lines = [f"## `{title}`", ""]
    if parser.description or getattr(parser, "_help_line", None):
        lines += [parser.description or parser._help_line, ""]
    groups: dict[str, tuple[str | None, list[argparse.Action]]] = {}
    for group in parser._action_groups:
        shown = [a for a in group._group_actions if _listed(a)]
        # the positionals and the plain options make one table, each other group its own
        name = "" if group.title in ("positional arguments", "options") else group.title
        if shown:
            groups.setdefault(name, (group.description, []))[1].extend(shown)
    for name, (description, shown) in groups.items():
        rows = tuple(f"| {_flag(a)} | {_help(parser, a)} |" for a in shown)
        if name:
            lines += [f"**{name[0].upper()}{name[1:]}**", ""]
            if description:
                lines += [description, ""]
        if rows in seen:
            lines += [f"As in `{seen[rows]}`.", ""]
            continue
        seen[rows] = title
        lines += ["| flag | what it does |", "|---|---|", *rows, ""]
    return lines


def _subcommands(parser: argparse.ArgumentParser, prefix: str):
    """(title, parser) of `parser` and of its subcommands, depth first."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                if not sub.add_help:  # `bench`: handed on unparsed, its own --help
                    continue
                sub._help_line = helps.get(name)
                yield from _subcommands(sub, f"{prefix} {name}")


def reference() -> str:
    """The text of docs/cli.md."""
    from app.main import build_parser as gui_parser
    from engine.cli import build_parser

    lines = [HEAD]
    seen: dict = {}
    for title, parser in [
        *_subcommands(build_parser(), "expertstream"),
        ("expertstream-gui", gui_parser()),
    ]:
        if title == "expertstream":
            continue  # only --version and the subcommands
        lines += _parser_section(title, parser, seen)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = reference()
    if argv == ["--check"]:
        if PAGE.read_text() != text:
            print("docs/cli.md is stale: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
