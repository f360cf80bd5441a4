"""The argument parser of autopar's commands: a usage error is one line on stderr (`autopar plan: error: ...;
autopar plan --help lists the options`) and exit status 2, not argparse's usage block followed by the line."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn, Sequence

from ..errors import AutoparError


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose `error` prints one line that names the command, what is wrong and where
    the options are described, then exits 2 (argparse's status for a usage error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def at_least_1(hint: str = ""):
    """An argparse `type`: an integer of at least 1, else a refusal saying what to give (argparse puts the
    option's name before it: "argument --batch: must be at least 1, got 0")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {value}{hint}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def version() -> str:
    """autopar's version, from the installed distribution's metadata (pyproject.toml's `version`, the one
    place it is written). The distribution is found by the import package it provides, so its name
    (pyproject.toml's `name`) is written nowhere else either."""
    from importlib import metadata

    for name in metadata.packages_distributions().get(__name__.split(".")[0], []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    raise AutoparError("no package metadata for autopar: it is imported from a folder that was never installed; "
                       "run pip install -e . in the clone.")


def unknown_command(word: str, commands: Sequence[str]) -> str:
    """One line for a first word that is no command: what it is, the closest command, the list."""
    what = f"unknown option {word!r}" if word.startswith("-") else f"unknown command {word!r}"
    close = difflib.get_close_matches(word.lstrip("-"), commands, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"autopar: {what}{hint}; the commands are {', '.join(commands)} (autopar --help)."
