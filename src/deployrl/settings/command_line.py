"""The command line of every deployrl command: one config dataclass from a file, flags and overrides.

A command's settings are one validated, frozen dataclass. `CommandLine.parse` builds it through
`settings.parsing.load` from, in order (later ones win):

* an optional YAML file, the first positional argument;
* flags, each an alias of one key (`--num-prompts 5` is `num_prompts=5`, values in YAML syntax);
* dotted `key=value` overrides, the other positional arguments.

So every command reports an unknown key (with the nearest valid one), a value of the wrong type
or out of range, and a bad file (with its line) the same way, before anything loads, and
`--print-config` shows the resolved settings. A flag's help is its key's help, written once on
the config field (`settings.docs.setting`), unless the flag does more than set the key.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, Sequence

from deployrl.settings.docs import commented_yaml, key_help
from deployrl.settings.parsing import ConfigError, load, parse_value, split_config_items

NO_VALUE = object()  # a flag whose `const` is this takes an argument


@dataclass(frozen=True)
class Flag:
    """`name` sets config key `key`: to its argument, to a list of several (`many`), or
    to `const` without one (a switch); `also` sets further keys with it (e.g. a task's type)."""

    name: str  # "--num-prompts", "-n"
    key: str  # dotted config key
    help: str = ""  # only where the flag does more than set the key; "": the key's own help
    many: bool = False
    const: Any = NO_VALUE
    also: tuple[tuple[str, Any], ...] = ()

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def overrides(self, given: Any) -> list[tuple[str, Any]]:
        """The (key, value) pairs the flag sets, given argparse's value for it."""
        if self.const is not NO_VALUE:
            value = self.const
        elif self.many:  # separated by spaces or commas
            value = [parse_value(part, f"{self.name} {text!r}") for text in given for part in text.split(",")]
        else:
            value = parse_value(given, f"{self.name} {given!r}")
        return [*self.also, (self.key, value)]


class CommandLine:
    """argparse for a command whose settings are dataclass `config_class` (every field defaulted).

    A benchmark that runs training passes `train_items` (metavar, help): its positional
    arguments are then a `deployrl train` config and overrides, left to it in `args.items`, and
    its own settings are set by flags only."""

    def __init__(self, prog: str, config_class: type, description: str, flags: Sequence[Flag] = (),
                 epilog: Optional[str] = None, train_items: Optional[tuple[str, str]] = None) -> None:
        self.config_class = config_class
        self.flags = tuple(flags)
        self.own_items = train_items is None
        self.parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
        metavar, help_text = train_items or (
            "[config.yaml] [key=value ...]",
            "an optional YAML file of settings, then dotted overrides; `--print-config` lists every key",
        )
        self.parser.add_argument("items", nargs="*", metavar=metavar, help=help_text)
        defaults = config_class()
        for flag in self.flags:
            text = _escaped(flag.help or key_help(config_class, flag.key))
            if flag.const is not NO_VALUE:
                self.parser.add_argument(flag.name, dest=flag.dest, action="store_const", const=True,
                                         default=argparse.SUPPRESS, help=f"{text} ({flag.key}={flag.const})")
                continue
            shown = "" if flag.also else f", default {_value_of(defaults, flag.key)}"
            self.parser.add_argument(flag.name, dest=flag.dest, nargs="+" if flag.many else None,
                                     default=argparse.SUPPRESS, help=f"{text} ({flag.key}{shown})".lstrip())
        self.parser.add_argument("--print-config", action="store_true",
                                 help="print the resolved settings as YAML, each key with its help, and exit")

    def parse(self, argv: Optional[Sequence[str]]) -> tuple[Any, argparse.Namespace]:
        """(the validated config, argparse's namespace for the command's own extra arguments);
        a bad setting exits with status 2 and a one-line error."""
        args = self.parser.parse_args(argv)
        try:
            path, overrides = split_config_items(args.items) if self.own_items else (None, [])
            flagged = [pair for flag in self.flags if hasattr(args, flag.dest)
                       for pair in flag.overrides(getattr(args, flag.dest))]
            config = load(self.config_class, path, [*flagged, *overrides])
        except ConfigError as err:
            self.fail(err)
        if args.print_config:
            print(commented_yaml(config), end="")
            self.parser.exit(0)
        return config, args

    def fail(self, error: Exception) -> NoReturn:
        """Exit with status 2 and `error` on one line: bad input, not a traceback."""
        self.parser.exit(2, f"{self.parser.prog}: error: {error}\n")


def _escaped(text: str) -> str:
    """Help text as argparse shows it verbatim (it formats `%`)."""
    return text.replace("%", "%%")


def _value_of(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return list(config) if isinstance(config, tuple) else config

