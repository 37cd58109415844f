"""Settings document themselves: docs/settings.md, flags' help and --print-config come from the
help written once on each config field, and every engine option shows in every engine flag's help."""

from pathlib import Path

import pytest

from deployrl import cli
from deployrl.commands.bench import COMMANDS as BENCH_COMMANDS
from deployrl.engines import ENGINES
from deployrl.settings.command_line import NO_VALUE, CommandLine
from deployrl.settings.docs import COMMAND_CONFIGS, command_config, commented_yaml, key_help, settings_markdown
from deployrl.settings.parsing import ConfigError, build, load, parse_yaml

DOCS = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
ALL_COMMANDS = [[name] for name in cli.COMMANDS if name != "bench"] + [["bench", name] for name in BENCH_COMMANDS]


def test_settings_docs_are_in_step_with_the_code():
    assert DOCS.read_text() == settings_markdown(), "regenerate: python -m deployrl.settings.docs > docs/settings.md"


@pytest.fixture(scope="module")
def command_lines():
    """(command, its CommandLine, its --help text) of every command, each asked for --help."""
    built: list[CommandLine] = []
    original = CommandLine.parse

    def recording(self, argv):
        built.append(self)
        return original(self, argv)

    found = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CommandLine, "parse", recording)
        for command in ALL_COMMANDS:
            built.clear()
            with pytest.raises(SystemExit) as stop:
                cli.main([*command, "--help"])
            assert stop.value.code == 0
            assert len(built) == 1, f"{command} parses {len(built)} command lines"
            found.append((" ".join(command), built[0], built[0].parser.format_help()))
    return found


def takes_engine_spec(config_class: type, flag) -> bool:
    """Whether `flag`'s key takes an engine spec: an unknown engine kind is refused as one."""
    value = ["nosuch:x"] if flag.many else "nosuch:x"
    try:
        load(config_class, None, [(flag.key, value), *flag.also])
    except ConfigError as err:
        return "unknown engine 'nosuch'" in str(err)
    return False


def test_every_engine_flag_lists_every_registered_engine_option(command_lines):
    specs = [f"{kind}:{{{','.join(ENGINES.get(kind).options)}}}" for kind in ENGINES]
    checked = []
    for command, command_line, text in command_lines:
        for flag in command_line.flags:
            if flag.const is NO_VALUE and takes_engine_spec(command_line.config_class, flag):
                action = next(a for a in command_line.parser._actions if flag.name in a.option_strings)
                flat = "".join(text.split())  # argparse wraps lines anywhere
                assert all(spec in action.help for spec in specs), (command, flag.name, action.help)
                assert all(spec in flat for spec in specs), (command, flag.name)
                checked.append(f"{command} {flag.name}")
    # the commands that take engine specs today (the check above finds any new one by itself)
    assert {"eval --engine", "mismatch --engine", "bench engines --engine", "bench engines --compare"} <= set(checked)


def test_a_flag_that_only_sets_a_key_shows_the_key_s_own_help(command_lines):
    for command, command_line, _ in command_lines:
        for flag in command_line.flags:
            written = key_help(command_line.config_class, flag.key)
            if flag.const is NO_VALUE and not flag.also:
                assert not flag.help, f"{command} {flag.name} retypes its help: document {flag.key} on its field"
                assert written, f"{command}: {flag.key} has no help on its field"
            assert flag.help != written, f"{command} {flag.name} repeats the help of {flag.key}"


@pytest.mark.parametrize("command", list(COMMAND_CONFIGS))
def test_every_setting_of_a_command_is_documented(command):
    """Each field of the command's own sections has help (the task's variants document themselves in tasks.md)."""
    config_class = command_config(command)
    text = settings_markdown()
    section = text.split(f"## `{command}`")[1].split("\n## ")[0]
    blank = [line for line in section.splitlines() if line.endswith("|  |")]
    task_rows = section.split("### `task`")[1].split("###")[0] if "### `task`" in section else ""
    assert [line for line in blank if line not in task_rows] == [], (command, config_class.__name__)


def test_print_config_comments_each_key_with_its_help_and_reads_back(capsys):
    from deployrl.settings.config import TrainConfig

    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "rollout.engine=hf:fp16", "--print-config"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert f"  engine: hf:fp16  # {key_help(TrainConfig, 'rollout.engine')}" in text
    assert "  max_refill_rounds: 2  # refill: extra sampling rounds per step at most" in text
    config = build(TrainConfig, parse_yaml(text))
    assert config.rollout.engine == "hf:fp16" and commented_yaml(config) == text


def test_engine_help_comes_from_the_registry():
    from deployrl.settings.config import TrainConfig

    text = key_help(TrainConfig, "rollout.engine")
    for kind in ENGINES:
        assert f"{kind}:{{{','.join(ENGINES.get(kind).options)}}} ({ENGINES.get(kind).help})" in text
    assert "adapter (" in key_help(TrainConfig, "rollout.lora_serving")


def test_vocabularies_are_asked_not_compared():
    from deployrl.settings.config import AlgoConfig, OptimConfig, RolloutConfig

    assert AlgoConfig(dynamic_sampling="off").refill_rounds is None
    assert AlgoConfig(dynamic_sampling="drop").refill_rounds == 0
    assert AlgoConfig(dynamic_sampling="refill", max_refill_rounds=3).refill_rounds == 3
    assert AlgoConfig(dynamic_sampling="refill", kl_coef=0.1).refill_rounds is None  # with KL every group teaches
    assert RolloutConfig().every_rank_samples and not RolloutConfig(engine_ranks="main").every_rank_samples
    assert OptimConfig(schedule="cosine").decays and not OptimConfig().decays
    with pytest.raises(ValueError, match="unknown lr schedule 'cosin'. Did you mean 'cosine'"):
        OptimConfig(schedule="cosin")


def test_one_wording_for_an_engine_that_needs_a_gguf(tmp_path):
    """The config, the engines and the mismatch command refuse a non-GGUF model for llamacpp alike."""
    from deployrl.engines import check_model_file
    from deployrl.settings.config import load_config

    with pytest.raises(ConfigError) as from_config:
        load_config(None, ["model.name=some/dir", "rollout.engine=llamacpp:q4_1"])
    with pytest.raises(ValueError) as direct:
        check_model_file("llamacpp:q4_1", "some/dir", False, "rollout.engine", "model.name")
    assert str(direct.value) in str(from_config.value)
    assert "needs a GGUF model" in str(direct.value) and "rollout.engine=hf:bf16" in str(direct.value)
    check_model_file("hf:bf16", "some/dir", False)  # an engine that needs no GGUF takes any model
