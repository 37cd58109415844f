"""YAML files and dotted command-line overrides mapped onto nested, validated dataclasses.

`build(cls, data, origin)` turns a plain dict into `cls` (a dataclass whose fields may be
dataclasses themselves), checking every key and type before any component is constructed:
an unknown key is an error naming it, where it came from, and the nearest valid key; a value
of the wrong type names the key and the expected type. Each dataclass validates its own
bounds in `__post_init__`; those errors are re-raised with the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and where."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans (`off`, `no` stay strings) and
    exponent floats need no dot (`2e-5` is a number, not a string). A key given twice in one
    mapping is an error (YAML forbids it; PyYAML would keep the last one silently)."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue  # `<<: *defaults` merges may repeat keys; unhashable keys fail in SafeLoader
            key = self.construct_object(key_node)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {key!r} is given twice (first on line {first_line[key] + 1}); keep one", key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str):
    """Parse YAML safely (a SafeLoader: no arbitrary objects) with YAML 1.2 booleans."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_yaml(path: Path) -> dict[str, Any]:
    """The mapping of sections in YAML file `path`; every failure is a ConfigError naming the file (and line)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give a YAML config file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save it as UTF-8"
        ) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML (nested too deeply)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to a nested dict copy."""
    merged = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except (yaml.YAMLError, RecursionError) as err:
            problem = getattr(err, "problem", None) or "nested too deeply"
            hint = "" if isinstance(err, yaml.constructor.ConstructorError) else "; quote a string that holds YAML punctuation"
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}){hint}") from None
        node = merged
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return merged


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def build(cls: type, data: dict[str, Any], origin: str = "config", prefix: str = "", base: Any = None) -> Any:
    """Construct dataclass `cls` from `data`, validating keys and types recursively.

    Keys absent from `data` take their values from `base` (an instance of `cls`) when given,
    else the field defaults; nested sections merge into their defaults the same way, so an
    override changes one key and keeps its neighbours. Mappings (dict fields) are replaced whole.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else "."
            raise ConfigError(
                f"{origin}: unknown key '{prefix}{key}'{hint} Valid keys here: {', '.join(fields)}"
            )
    kwargs = {name: getattr(base, name) for name in fields} if base is not None else {}
    for name, value in data.items():
        default = getattr(base, name) if base is not None else _field_default(fields[name])
        kwargs[name] = _convert(hints[name], value, origin, f"{prefix}{name}", default)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{origin}: {where}: {err}") from None


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _convert(hint: Any, value: Any, origin: str, key: str, default: Any = None) -> Any:
    origin_type = typing.get_origin(hint)
    if origin_type in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, origin, key, default)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if dataclasses.is_dataclass(hint):
        base = default if isinstance(default, hint) else None
        return build(hint, value if value is not None else {}, origin, f"{key}.", base)
    if origin_type in (dict,):
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: {key} must be a mapping, got {value!r}")
        return dict(value)
    if origin_type in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{origin}: {key} must be a list, got {value!r}")
        (item_type, *_) = typing.get_args(hint) or (Any,)
        items = [_convert(item_type, v, origin, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin_type is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{origin}: {key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{origin}: {key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{origin}: {key} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the range of floats
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{origin}: {key} must be a finite number, got {number}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{origin}: {key} must be a string, got {value!r}")
        return value
    return value


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain dicts, for writing the resolved config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
