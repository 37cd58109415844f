"""Settings that document themselves: each config field's help is written once, on the field.

`setting(default, help)` is a dataclass field whose ``metadata["help"]`` documents it, as TRL's
``field(metadata={"help": ...})`` does; the help may be a function (the engine fields' lists every
engine the registry holds when it is read). Everything else is generated from it:

* the help of a command-line flag that aliases a field (`settings.command_line.Flag` without its own help);
* `--print-config`: the resolved settings as YAML, each key with its help as a comment
  (`commented_yaml`, which reads back as the same settings);
* docs/settings.md, the settings of every command (`settings_markdown`;
  ``python -m deployrl.settings.docs > docs/settings.md`` rewrites it, tests/test_settings_docs.py
  checks that it is in step with the code).

A field redeclared by a subclass with a new default and no help keeps its parent's help.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import types
import typing
from typing import Any, Callable, Iterator, Union

import yaml

from deployrl.settings.parsing import to_dict

Help = Union[str, Callable[[], str]]

# The settings of each command, in the order docs/settings.md lists them: "module:class".
COMMAND_CONFIGS = {
    "deployrl train": "deployrl.settings.config:TrainConfig",
    "deployrl eval": "deployrl.commands.evaluate:EvalCommandConfig",
    "deployrl mismatch": "deployrl.commands.mismatch:MismatchConfig",
    "deployrl selfcheck": "deployrl.commands.selfcheck:SelfCheckConfig",
    "deployrl engines": "deployrl.commands.engines:EnginesCommandConfig",
    "deployrl bench update": "deployrl.commands.bench.update:UpdateBenchConfig",
    "deployrl bench variance": "deployrl.commands.bench.variance:VarianceBenchConfig",
    "deployrl bench step": "deployrl.commands.bench.step:StepBenchConfig",
    "deployrl bench engines": "deployrl.commands.bench.engines:EnginesBenchConfig",
    "deployrl bench vs-trl": "deployrl.commands.bench.vs_trl:VsTrlConfig",
}


def setting(default: Any = dataclasses.MISSING, help: Help = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with `default` (or `factory`) documented by `help`."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


def field_help(cls: type, name: str) -> str:
    """The help of field `name` of dataclass `cls` (or of the parent class that documents it); '' if none."""
    for klass in cls.__mro__:
        found = getattr(klass, "__dataclass_fields__", {}).get(name)
        text = found.metadata.get("help") if found is not None else None
        if text:
            return text() if callable(text) else text
    return ""


def key_help(cls: type, key: str) -> str:
    """The help of dotted config key `key` (``algo.dc.tolerance``) of dataclass `cls`; for a
    section that is a union of dataclasses, the first variant that has the key answers."""
    *sections, name = key.split(".")
    classes = [cls]
    for part in sections:
        classes = [sub for klass in classes for sub in _dataclasses_of(_hints(klass).get(part))]
    return next((text for klass in classes if (text := field_help(klass, name))), "")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


def _dataclasses_of(hint: Any) -> list[type]:
    """The dataclasses a field's type names: itself, or the members of a union (Optional included)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [option for option in typing.get_args(hint) if dataclasses.is_dataclass(option)]
    return [hint] if dataclasses.is_dataclass(hint) else []


def _sections(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted prefix, dataclass instance) of `config` and of each nested section as its field
    declares it (before the parent's `__post_init__` derives anything from it), depth first."""
    yield prefix, config
    for f in dataclasses.fields(config):
        if dataclasses.is_dataclass(getattr(config, f.name)):
            declared = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield from _sections(declared, f"{prefix}{f.name}.")


def _shown(value: Any) -> str:
    """A value as one line of YAML (flow style; JSON, which YAML reads, for text with line breaks)."""
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=10**6, sort_keys=False,
                          allow_unicode=True).strip()
    text = text.removesuffix("...").strip()
    return json.dumps(to_dict(value), ensure_ascii=False) if "\n" in text else text


def commented_yaml(config: Any) -> str:
    """`config` (a dataclass instance) as block YAML, each key followed by its help as a comment."""
    return "\n".join(_yaml_lines(config, "")) + "\n"


def _yaml_lines(config: Any, indent: str) -> Iterator[str]:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        comment = field_help(type(config), f.name)
        comment = f"  # {comment}" if comment else ""
        if dataclasses.is_dataclass(value):
            yield f"{indent}{f.name}:{comment}"
            yield from _yaml_lines(value, indent + "  ")
        else:
            yield f"{indent}{f.name}: {_shown(value)}{comment}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(config: Any) -> str:
    """Markdown: each section of dataclass instance `config`, a table of its keys, defaults and help."""
    parts = []
    for prefix, section in _sections(config):
        title = f"`{prefix.rstrip('.')}`" if prefix else "top level"
        doc = inspect.getdoc(type(section)) or ""
        rows = [
            f"| `{f.name}` | `{_cell(_shown(getattr(section, f.name)))}` | {_cell(field_help(type(section), f.name))} |"
            for f in dataclasses.fields(section) if not dataclasses.is_dataclass(getattr(section, f.name))
        ]
        lead = f"### {title} (`{type(section).__name__}`)\n\n{doc.splitlines()[0] if doc else ''}".rstrip()
        parts.append("\n".join([lead, "", "| key | default | meaning |", "| --- | --- | --- |", *rows]))
    return "\n\n".join(parts)


def command_config(command: str) -> type:
    """The settings class of `command` (a key of COMMAND_CONFIGS)."""
    module, _, name = COMMAND_CONFIGS[command].partition(":")
    return getattr(importlib.import_module(module), name)


def settings_markdown() -> str:
    """docs/settings.md: the settings of every command, generated from their fields' help."""
    head = [
        "# Settings",
        "",
        "Every setting of every command, its default and its meaning, generated from the help written on",
        "each config field (`settings.docs.setting`); do not edit by hand: `python -m deployrl.settings.docs >",
        "docs/settings.md` rewrites it and tests/test_settings_docs.py checks it is in step with the code.",
        "Sections are YAML mappings (`rollout: {engine: hf:bf16}`) or dotted overrides",
        "(`rollout.engine=hf:bf16`); `--print-config` prints the resolved settings with these comments.",
        "The `task` section's keys depend on its `type`: see [tasks.md](tasks.md).",
    ]
    body = [f"## `{command}`\n\n{settings_table(command_config(command)())}" for command in COMMAND_CONFIGS]
    return "\n\n".join(["\n".join(head), *body]) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")
