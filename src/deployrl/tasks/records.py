"""Tasks whose examples are records with a question field and a reference field: JSON Lines and
Parquet files, and Hugging Face datasets. Every record is validated as it is read; an error names
the file, the line (or row) and the field.
"""

from __future__ import annotations

import codecs
import json
import math
from pathlib import Path
from typing import Any, Iterator, Optional

from deployrl.settings.task import HFTask, JsonlTask, ParquetTask, RecordSource
from deployrl.tasks.base import LOADERS, BadExamples, Example, TaskDataError, make_prompt
from deployrl.tasks.prompts import Prompt


def _check_encodable(text: str, where: str, field_name: str) -> None:
    """Refuse text that UTF-8 cannot encode: a lone surrogate (the JSON escape "\\ud800"), which
    no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TaskDataError(
            f"{where}: field {field_name!r} holds a lone UTF-16 surrogate ({text[err.start]!r} at character"
            f" {err.start}), which is not text a tokenizer accepts; fix the escape in the file"
        ) from None


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
        and any(m["role"] == "user" for m in value)
    )


def _check_prompt(value: Any, where: str, field_name: str) -> Prompt:
    if isinstance(value, str) and value.strip():
        _check_encodable(value, where, field_name)
        return value
    if _is_messages(value):
        for message in value:
            _check_encodable(message["content"], where, field_name)
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise TaskDataError(
        f"{where}: field {field_name!r} must be a non-empty string or a list of chat messages"
        f" ({{role, content}} with a user message), got {_short(value)}"
    )


def _check_answer(value: Any, where: str, field_name: str) -> Any:
    if value is None or isinstance(value, bool):
        raise TaskDataError(f"{where}: field {field_name!r} is empty (null)")
    if isinstance(value, str):
        if not value.strip():
            raise TaskDataError(f"{where}: field {field_name!r} is an empty string")
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise TaskDataError(f"{where}: field {field_name!r} is {value} (not a finite number)")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise TaskDataError(f"{where}: field {field_name!r} is an empty list")
        return [_check_answer(v, where, field_name) for v in value]
    if isinstance(value, dict) and value:
        return value
    raise TaskDataError(f"{where}: field {field_name!r} must be a string, a number or a list, got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _record_example(record: Any, where: str, config: RecordSource, instruction: Optional[str]) -> Example:
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in (config.prompt_field, config.answer_field):
        if name not in record:
            present = ", ".join(sorted(map(str, record))) or "none"
            raise TaskDataError(f"{where}: field {name!r} is missing (fields present: {present})")
    prompt = _check_prompt(record[config.prompt_field], where, config.prompt_field)
    answer = _check_answer(record[config.answer_field], where, config.answer_field)
    return Example(prompt=make_prompt(prompt, instruction, config.system_prompt), reference=answer, source=where)


def _json_line(raw: bytes, where: str) -> Optional[dict]:
    """The JSON object on one line of a JSONL file (None for a blank line); errors name `where`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TaskDataError(
            f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); save the file as UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskDataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # an integer too long to convert, arrays nested too deep
        raise TaskDataError(f"{where}: JSON that cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def json_lines(path: Path, bad: Optional[BadExamples] = None) -> Iterator[tuple[str, dict]]:
    """("file:line", object) for each non-empty line of a JSONL file; errors name file and line.

    A malformed line goes to `bad` (default: stop at it); a missing file always stops."""
    bad = bad or BadExamples()
    if path.is_dir():
        raise TaskDataError(f"{path}: a directory, not a JSONL file")
    if not path.is_file():
        raise TaskDataError(f"{path}: file not found")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # editors on Windows start UTF-8 files with one
            try:
                record = _json_line(raw, where)
            except TaskDataError as err:
                bad.handle(err)
                continue
            if record is not None:
                yield where, record


@LOADERS.register(JsonlTask.type)
def _load_jsonl(config: JsonlTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    return _valid_examples(json_lines(Path(config.path), bad), config, instruction, bad)


def _valid_examples(
    records: Iterator[tuple[str, dict]], config: RecordSource, instruction: Optional[str], bad: BadExamples
) -> list[Example]:
    """The examples of (where, record) pairs, the first `config.max_examples`; a malformed record goes to `bad`."""
    examples = []
    for where, record in records:
        try:
            examples.append(_record_example(record, where, config, instruction))
        except TaskDataError as err:
            bad.handle(err)
        if config.max_examples is not None and len(examples) >= config.max_examples:
            break
    return examples


def load_prompt_file(path: Path) -> list[Prompt]:
    """Prompts without references (for sampling only): ``.jsonl`` with a ``prompt`` string or a
    ``messages`` chat list per line, or ``.txt`` with one prompt per non-empty line."""
    path = Path(path)
    if path.suffix == ".txt":
        if not path.is_file():
            raise TaskDataError(f"{path}: file not found")
        prompts: list[Prompt] = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        prompts = []
        for where, record in json_lines(path):
            key = "prompt" if "prompt" in record else "messages"
            if key not in record:
                raise TaskDataError(f"{where}: field 'prompt' (a string) or 'messages' (a chat list) is required")
            prompts.append(_check_prompt(record[key], where, key))
    else:
        raise TaskDataError(f"{path}: prompt files are .jsonl or .txt, got {path.suffix or 'no suffix'}")
    if not prompts:
        raise TaskDataError(f"{path}: no prompts")
    return prompts


@LOADERS.register(ParquetTask.type)
def _load_parquet(config: ParquetTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    import pyarrow.parquet as pq

    path = Path(config.path)
    if not path.is_file():
        raise TaskDataError(f"{path}: file not found (task.path)")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types
        raise TaskDataError(f"{path}: cannot read as Parquet ({type(err).__name__}: {err})") from None
    for name in (config.prompt_field, config.answer_field):
        if name not in table.column_names:
            raise TaskDataError(
                f"{path}: field {name!r} is missing (columns: {', '.join(table.column_names) or 'none'})"
            )
    if config.max_examples is not None:
        table = table.slice(0, config.max_examples)
    records = table.select([config.prompt_field, config.answer_field]).to_pylist()
    return _valid_examples(
        ((f"{path}:row {number}", record) for number, record in enumerate(records, start=1)), config, instruction, bad
    )


@LOADERS.register(HFTask.type)
def _load_hf(config: HFTask, instruction: Optional[str], bad: BadExamples) -> list[Example]:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is a dependency
        raise TaskDataError("hf tasks need the 'datasets' package (pip install datasets)") from err
    local = Path(config.name)
    try:
        if local.is_dir() and (
            (local / "dataset_info.json").is_file()
            or (local / "state.json").is_file()
            or (local / "dataset_dict.json").is_file()
        ):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                if config.split not in data:
                    raise TaskDataError(
                        f"{local}: no split {config.split!r} (task.split); splits: {', '.join(data)}"
                    )
                data = data[config.split]
        else:
            data = datasets.load_dataset(config.name, split=config.split)
    except TaskDataError:
        raise
    except Exception as err:
        raise TaskDataError(
            f"hf dataset {config.name!r} (split {config.split!r}): cannot load ({type(err).__name__}: {err})"
        ) from None
    for name in (config.prompt_field, config.answer_field):
        if name not in data.column_names:
            raise TaskDataError(
                f"hf dataset {config.name!r}: field {name!r} is missing (columns: {', '.join(data.column_names)})"
            )
    if config.max_examples is not None:
        data = data.select(range(min(config.max_examples, len(data))))
    data = data.select_columns([config.prompt_field, config.answer_field])
    return _valid_examples(
        ((f"hf:{config.name}[{config.split}]#{index}", record) for index, record in enumerate(data)),
        config, instruction, bad,
    )
