import json

import pytest

from deployrl.cli import main as cli
from deployrl.commands.mismatch import MismatchConfig, run
from deployrl.tasks import TaskDataError, load_prompt_file


def test_report_on_tiny_model(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is 1+2?"}\n\n{"messages": [{"role": "user", "content": "2*3="}]}\n')
    out = tmp_path / "report.json"
    code = cli(["mismatch", "--model", str(tiny_dir), "--engine", "hf:bf16", "--prompts", str(prompts),
                "-n", "2", "--max-new-tokens", "8", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "vs engine hf:bf16" in text and "diff" in text and "tokens/s" in text
    report = json.loads(out.read_text())
    assert report["completions"] == 4 and report["tokens"] > 0
    assert 0 < report["diff"]["mean"] <= report["diff"]["max"] <= 1
    assert set(report["delta_by_prob"]) == {"0-0.1", "0.1-0.5", "0.5-0.9", "0.9-0.99", "0.99-1"}


def test_fp32_engine_reports_no_discrepancy(tiny_dir):
    report = run(MismatchConfig(model=str(tiny_dir), engine="hf:fp32", num_prompts=2, n=2, max_new_tokens=6,
                                temperature=0.8, top_k=12))
    assert report["diff"]["max"] < 1e-5 and report["outside_support"] == 0


def test_bad_prompt_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "where is the prompt"}\n')
    with pytest.raises(TaskDataError, match=r"bad.jsonl:2: field 'prompt'"):
        load_prompt_file(bad)
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(TaskDataError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompt_file(bad)
    with pytest.raises(TaskDataError, match="none.jsonl: file not found"):
        load_prompt_file(tmp_path / "none.jsonl")
    with pytest.raises(TaskDataError, match="prompt files are .jsonl or .txt"):
        load_prompt_file(tmp_path / "prompts.csv")
    lines = tmp_path / "p.txt"
    lines.write_text("first\n\n second \n")
    assert load_prompt_file(lines) == ["first", "second"]
    with pytest.raises(ValueError, match="unknown engine 'vlm'"):
        MismatchConfig(engine="vlm")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        MismatchConfig(temperature=0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["llamacpp:q4_1", "hf:fp8"])
def test_real_model_report(engine):
    report = run(MismatchConfig(engine=engine, num_prompts=2, n=2, max_new_tokens=16))
    assert 1e-4 < report["diff"]["mean"] < 0.1
    assert report["engine_tokens_per_s"] > 0


def test_llamacpp_engine_needs_a_gguf_model_before_anything_loads(tiny_dir, capsys):
    from deployrl.commands.mismatch import main

    with pytest.raises(SystemExit) as stop:
        main(["--model", str(tiny_dir), "--engine", "llamacpp:q4_1"])
    assert stop.value.code == 2 and "must be a .gguf file" in capsys.readouterr().err
