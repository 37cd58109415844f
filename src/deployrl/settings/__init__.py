"""Settings: one validated, frozen dataclass per component, documented field by field.

`config` holds the training run's schema (`TrainConfig` and its sections), `task` and `model`
the task-source and model vocabularies it validates against (precisions, `Device`, `Autocast`),
`parsing` maps YAML files and dotted overrides onto the dataclasses, `command_line` turns them
into a command's flags, and `docs` keeps each field's help (`setting`) and renders
docs/settings.md from it.
"""
