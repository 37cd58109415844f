"""`deployrl bench engines` runs both paths on the real model and writes its numbers."""

import json

import pytest

from deployrl.commands.bench.engines import main


def test_bad_arguments_are_refused_before_any_model_loads(capsys):
    for argv, message in [
        (["--engine", "hf:bf16"], "must be a llamacpp engine"),
        (["-k", "0,4"], "positive integers"),
        (["--parallel", "0"], "parallel must be > 0"),
        (["--compare", "llamacpp:q4_1,vllm:int3"], "unknown vllm engine option"),
        (["--lora-rank", "4"], "lora_rank applies to --compare"),
        (["--compare", "hf:bf16", "--lora-rank", "4", "--lora-serving", "merge"], "unknown lora serving 'merge'"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_both_paths_run_and_the_json_is_written(tmp_path, capsys):
    out = tmp_path / "engines.json"
    main(["--prompts", "2", "-k", "1,3", "--tokens", "6", "--repeats", "1", "--parallel", "4", "--threads", "1",
          "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["threads"] == 1 and [r["k"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert 0 < row["tokens"] <= 2 * row["k"] * 6
        assert row["sequential_tokens_per_s"] > 0 and row["batched_tokens_per_s"] > 0
        assert 0 <= row["identical"] <= 1
    assert "sequential tok/s" in capsys.readouterr().out


@pytest.mark.slow
def test_engines_compared_side_by_side(tmp_path, capsys):
    out = tmp_path / "compare.json"
    main(["--compare", "llamacpp:q4_1,hf:bf16", "--prompts", "2", "-k", "2", "--tokens", "6", "--repeats", "1",
          "--threads", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["engines"] == ["llamacpp:q4_1", "hf:bf16"] and set(result["start_s"]) == set(result["engines"])
    (row,) = result["rows"]
    for spec in result["engines"]:
        assert 0 < row["tokens"][spec] <= 2 * 2 * 6 and row["tokens_per_s"][spec] > 0
    assert "hf:bf16 / llamacpp:q4_1" in capsys.readouterr().out


@pytest.mark.slow
def test_engines_with_lora_adapters_report_their_sync(tmp_path, capsys):
    out = tmp_path / "lora.json"
    main(["--compare", "llamacpp:q4_1,hf:bf16", "--lora-rank", "4", "--prompts", "1", "-k", "2", "--tokens", "4",
          "--repeats", "1", "--threads", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    # merged is a vllm way: the other engines run once, with their adapters beside the base
    assert result["engines"] == ["llamacpp:q4_1/adapter", "hf:bf16/adapter"] and result["lora_rank"] == 4
    assert set(result["sync_s"]) == set(result["engines"]) and min(result["sync_s"].values()) > 0
    assert "weight sync (s, median of 3)" in capsys.readouterr().out
