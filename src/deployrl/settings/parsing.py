"""YAML files and dotted command-line overrides mapped onto nested, validated dataclasses.

`load(cls, path, overrides)` reads an optional YAML file, applies ``a.b.c=value`` overrides and
builds `cls`; `build(cls, data, origin)` turns a plain dict into `cls` (a dataclass whose fields
may be dataclasses themselves), checking every key and type before any component is
constructed: an unknown key is an error naming it, where it was written (``file:line`` for a
YAML file, ``command line`` for an override) and the nearest valid key; a value of the wrong
type names the key and the expected type. Each dataclass validates its own bounds in
`__post_init__`; those errors are re-raised with the key path.

A field typed as a union of dataclasses that each fix a `type` field (``init=False``) is a
tagged union: the mapping's `type` picks the class, e.g. ``task: {type: jsonl, path: ...}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import yaml

from deployrl.registry import unknown_name_error

COMMAND_LINE = "command line"
Override = Union[str, tuple[str, Any]]  # "a.b=value" (the value in YAML syntax), or (dotted key, value)


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and where."""


class Located(dict):
    """A mapping that remembers where each key was written: `where[key]` is "file:line" or "command line"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.where: dict[Any, str] = {}


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans (`off`, `no` stay strings) and
    exponent floats need no dot (`2e-5` is a number, not a string). A key given twice in one
    mapping is an error (YAML forbids it; PyYAML would keep the last one silently). Mappings
    are `Located`, with the line of each key when `source` names a file."""

    source: Optional[str] = None

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

    def construct_located_mapping(self, node):
        data = Located()
        yield data
        data.update(self.construct_mapping(node))
        if self.source is not None:
            for key_node, _ in node.value:  # merged (`<<`) keys included, at the line of their anchor
                if isinstance(key_node, yaml.ScalarNode):
                    data.where[self.construct_object(key_node)] = f"{self.source}:{key_node.start_mark.line + 1}"


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_located_mapping)
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


def parse_yaml(text: str, source: Optional[str] = None):
    """Parse YAML safely (a SafeLoader: no arbitrary objects) with YAML 1.2 booleans; mappings
    record the line of each key in file `source`."""
    loader = _Loader(text)
    loader.source = source
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
        data = parse_yaml(text, str(path))
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


def split_config_items(items: Sequence[str]) -> tuple[Optional[Path], list[str]]:
    """Command-line `[config.yaml] [key=value ...]` -> (the file or None, the overrides)."""
    path, overrides = None, list(items)
    if overrides and "=" not in overrides[0]:
        path = Path(overrides.pop(0))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r} is neither the first argument (a config file) nor a key=value override")
    return path, overrides


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", the value parsed as YAML; empty: None)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    return key, parse_value(raw, f"override {item!r}")


def parse_value(raw: str, what: str) -> Any:
    """A command-line value in YAML syntax (`1e-5`, `true`, `[1, 2]`, `{}`); empty text is None."""
    try:
        return parse_yaml(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError) as err:
        problem = getattr(err, "problem", None) or "nested too deeply"
        hint = "" if isinstance(err, yaml.constructor.ConstructorError) else "; quote a string that holds YAML punctuation"
        raise ConfigError(f"{what}: the value is not valid YAML ({problem}){hint}") from None


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[Override], origin: Optional[str] = COMMAND_LINE
) -> dict[str, Any]:
    """A copy of nested dict `data` with each override's dotted key set; each key set records
    `origin` as where it was written (None: nowhere, errors then name the whole config's origin)."""
    merged = _deep_copy(data)
    for override in overrides:
        key, value = parse_override(override) if isinstance(override, str) else override
        node = merged
        *sections, name = key.split(".")
        for part in sections:
            if part not in node:
                node[part] = Located()
                _record(node, part, origin)
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is a value, not a section")
        node[name] = value
        _record(node, name, origin)
    return merged


def _record(node: Located, key: str, origin: Optional[str]) -> None:
    if origin is not None:
        node.where[key] = origin


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}, for configs written in code."""
    return apply_overrides({}, flat.items(), origin=None)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        copy = Located({k: _deep_copy(v) for k, v in data.items()})
        copy.where.update(getattr(data, "where", {}))
        return copy
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load(cls: type, path: Optional[Path] = None, overrides: Iterable[Override] = ()) -> Any:
    """`cls` from an optional YAML file plus overrides (applied in order), fully validated."""
    data = load_yaml(path) if path is not None else {}
    overrides = list(overrides)
    origin = str(path) if path is not None else COMMAND_LINE
    if overrides:
        data = apply_overrides(data, overrides)
        origin = f"{origin} (with overrides)" if path is not None else origin
    return build(cls, data, origin)


def build(cls: type, data: dict[str, Any], origin: str = "config", prefix: str = "", base: Any = None) -> Any:
    """Construct dataclass `cls` from `data`, validating keys and types recursively.

    Keys absent from `data` take their values from `base` (an instance of `cls`) when given,
    else the field defaults; nested sections merge into their defaults the same way, so an
    override changes one key and keeps its neighbours. Mappings (dict fields) are replaced whole.
    A key naming a field that the class fixes (``init=False``, a tagged union's `type`) is
    skipped, so that `to_dict`'s output builds again. `origin` says where the whole of `data`
    came from; a `Located` mapping says where each of its keys was written.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = getattr(data, "where", {})
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else "."
            tag = _tag(cls)
            here = f"of a {tag} {prefix.rstrip('.').rpartition('.')[2]}" if tag else "here"
            raise ConfigError(
                f"{where.get(key, origin)}: unknown key '{prefix}{key}'{hint} Valid keys {here}: {', '.join(fields)}"
            )
    settable = {name: f for name, f in fields.items() if f.init}
    kwargs = {name: getattr(base, name) for name in settable} if base is not None else {}
    for name, value in data.items():
        if name in settable:
            default = getattr(base, name) if base is not None else _field_default(settable[name])
            kwargs[name] = _convert(hints[name], value, origin, where.get(name, origin), f"{prefix}{name}", default)
    missing = [name for name, f in settable.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{origin}: {prefix}{missing[0]} is required (it has no default)")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        section = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{origin}: {section}: {err}") from None


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _tag(cls: Any) -> Optional[str]:
    """The `type` a dataclass fixes (a field `type` with init=False), else None."""
    if not dataclasses.is_dataclass(cls):
        return None
    field = {f.name: f for f in dataclasses.fields(cls)}.get("type")
    return field.default if field is not None and not field.init else None


def _build_tagged(options: list[type], value: Any, origin: str, location: str, key: str, default: Any) -> Any:
    """One of dataclasses `options`, picked by the mapping's `type`; without one, the default's class.
    A mapping of the default's class updates the default, as a section does; another starts afresh."""
    if not isinstance(value, dict):
        raise ConfigError(f"{location}: {key} must be a mapping with a type, got {value!r}")
    variants = {_tag(cls): cls for cls in options}
    tag = value.get("type", _tag(type(default)))
    if tag is None:
        raise ConfigError(f"{location}: {key}.type is required: one of {', '.join(variants)}")
    if not isinstance(tag, str) or tag not in variants:
        kind = f"{key.rpartition('.')[2]} type"
        raise ConfigError(f"{getattr(value, 'where', {}).get('type', location)}: {key}.type: "
                          f"{unknown_name_error(kind, str(tag), list(variants))}")
    cls = variants[tag]
    return build(cls, value, origin, f"{key}.", default if type(default) is cls else None)


def _convert(hint: Any, value: Any, origin: str, location: str, key: str, default: Any = None) -> Any:
    """`value` of field `key` checked against type `hint`; `location` is where the value was written."""
    origin_type = typing.get_origin(hint)
    if origin_type in (Union, types.UnionType):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) > 1 and all(_tag(option) for option in options):
            return _build_tagged(options, value, origin, location, key, default)
        errors = []
        for option in options:
            try:
                return _convert(option, value, origin, location, key, default)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if dataclasses.is_dataclass(hint):
        base = default if isinstance(default, hint) else None
        return build(hint, value if value is not None else {}, origin, f"{key}.", base)
    if dict in (hint, origin_type):
        if not isinstance(value, dict):
            raise ConfigError(f"{location}: {key} must be a mapping, got {value!r}")
        return to_dict(value)  # plain dicts, whatever the loader made
    if origin_type in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{location}: {key} must be a list, got {value!r}")
        (item_type, *_) = typing.get_args(hint) or (Any,)
        items = [_convert(item_type, v, origin, location, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin_type is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{location}: {key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{location}: {key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{location}: {key} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the range of floats
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{location}: {key} must be a finite number, got {number}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{location}: {key} must be a string, got {value!r}")
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
