"""Help texts are true (issue 44.6): every `fleetd X [Y]` a help text names is a command
(and, where X has subcommands, Y is one of them), and a flag's stated default is not
contradicted by its command's description."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from fleetd.cli.main import build_parser

NAMED = re.compile(r"`?fleetd ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
# Prose that says "a fleetd database" or "three fleetd agents" names no command.
NOUNS = {"database", "databases", "agents"}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _texts(p: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, str]]:
    for text in (p.description, p.epilog, p.usage):
        if text:
            yield path, text
    for action in p._actions:
        if action.help and action.help != argparse.SUPPRESS:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.help:
                    yield f"{path} {choice.dest}", choice.help
            for name, sub in action.choices.items():
                yield from _texts(sub, f"{path} {name}")


def test_every_command_a_help_text_names_exists() -> None:
    top = build_parser()
    commands = _subparsers(top)
    wrong = []
    for where, text in _texts(top, "fleetd"):
        for cmd, sub in NAMED.findall(text):
            if cmd in NOUNS:
                continue
            if cmd not in commands:
                wrong.append(f"{where}: names `fleetd {cmd}`, which is no command")
                continue
            subs = _subparsers(commands[cmd])
            if subs and sub and not sub.startswith("-") and sub not in subs:
                wrong.append(f"{where}: names `fleetd {cmd} {sub}`, which is no subcommand")
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_wrong_name() -> None:
    """The pattern the test above relies on finds what it must."""
    assert NAMED.findall("for `fleetd fleet` and friends") == [("fleet", "")]
    assert NAMED.findall("run fleetd certs issue-node") == [("certs", "issue-node")]


def test_a_defaults_stated_twice_agree() -> None:
    """watch's --timeout: its description and the flag's help give the same default."""
    top = build_parser()
    watch = _subparsers(top)["watch"]
    [timeout] = [a for a in watch._actions if "--timeout" in a.option_strings]
    assert watch.description and timeout.help
    assert "3 s by default" in watch.description and "3s per poll" in timeout.help
    assert "10s" not in timeout.help
