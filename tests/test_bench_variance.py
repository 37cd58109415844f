"""`deployrl bench variance`: its inner-product formula against autograd, its closed-form
variance against Monte Carlo draws, and an end-to-end run on the tiny model."""

import json

import pytest
import torch

from deployrl.algo.logprobs import RAW
from deployrl.algo.prefix import cutoff_law, sample_plan
from deployrl.commands.bench.variance import draw_errors, exact_variance, head_gradient_gram


def head_gradient(hidden, head, tokens, coef, c):
    """The slow reference: autograd of sum_t c_t a_t log p(o_t) with respect to the head."""
    w = head.clone().requires_grad_(True)
    logp = torch.log_softmax(hidden @ w.T, dim=-1).gather(1, tokens[:, None])[:, 0]
    (grad,) = torch.autograd.grad((c * coef * logp).sum(), w)
    return grad.double()


def test_gram_gives_the_autograd_error_and_cosine_of_any_weighting():
    g = torch.Generator().manual_seed(0)
    n, d, v = 11, 6, 9
    hidden, head = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    tokens, coef = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)
    gram = head_gradient_gram(hidden, head, tokens, coef, RAW, chunk=4)  # several blocks
    full = head_gradient(hidden, head, tokens, coef, torch.ones(n))
    assert float(gram.sum()) == pytest.approx(float((full ** 2).sum()), rel=1e-5)
    weights = torch.rand(3, n, generator=g) * 3 * (torch.rand(3, n, generator=g) > 0.4)
    sq_error, cosine = draw_errors(gram, weights)
    for r in range(3):
        hat = head_gradient(hidden, head, tokens, coef, weights[r])
        assert float(sq_error[r]) == pytest.approx(float(((hat - full) ** 2).sum()), rel=1e-5)
        reference = torch.nn.functional.cosine_similarity(hat.flatten(), full.flatten(), dim=0)
        assert float(cosine[r]) == pytest.approx(float(reference), abs=1e-6)


@pytest.mark.parametrize("strategy", ["uniform", "temporal", "sgrpo"])
def test_closed_form_variance_matches_monte_carlo(strategy):
    g = torch.Generator().manual_seed(1)
    k, t = 3, 7
    lengths = torch.tensor([7, 4, 6])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    real = mask.bool()
    n = int(real.sum())
    factor = torch.randn(n, 4, generator=g, dtype=torch.float64)
    gram = factor @ factor.T  # any positive semi-definite Gram matrix
    xi_groups = cutoff_law(strategy, mask, k, budget=3.0, xi_min=0.05)
    xi = xi_groups.repeat_interleave(k, dim=0)[real]
    row = torch.arange(k)[:, None].expand(k, t)[real]
    exact = exact_variance(gram, xi, row, independent=strategy == "sgrpo")
    draws = torch.stack([sample_plan(strategy, xi_groups, mask, g).weights[real] for _ in range(20000)])
    sq_error, _ = draw_errors(gram, draws)
    se = float(sq_error.std()) / 20000 ** 0.5
    assert exact > 0 and abs(float(sq_error.mean()) - exact) < 4 * se


def test_bench_variance_runs_and_prints_its_tables(tmp_path, tiny_dir, capsys):
    from tiny import toy_task_file

    from deployrl.commands.bench import main

    task_file = toy_task_file(tmp_path)
    out = tmp_path / "variance.json"
    code = main([
        "variance", f"model.name={tiny_dir}", "task.type=jsonl", f"task.path={task_file}",
        "task.reward=tiny:starts_with_digit", "task.instruction=", "rollout.engine=hf:fp32",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
        "rollout.context_length=64", "algo.ps.budget=3",
        "--budgets", "3", "6", "--groups", "2", "--draws", "64", "--json", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for strategy in ("full", "uniform", "temporal", "heuristic", "optimized", "sgrpo"):
        assert f"| {strategy} |" in printed
    numbers = json.loads(out.read_text())
    cells = {(r["budget"], r["strategy"]): r for r in numbers["results"]}
    engine_laws = ["heuristic:engine", "optimized:engine m=4", "optimized:engine m=16", "optimized:engine m=64"]
    assert len(cells) == 2 * (5 + len(engine_laws)) and all((3, law) in cells for law in engine_laws)
    # hf:fp32 reports the trainer's own entropy: the heuristic law is the same from either side
    assert cells[3, "heuristic:engine"]["rel_variance"] == pytest.approx(cells[3, "heuristic"]["rel_variance"], rel=1e-3)
    for r in cells.values():
        assert 0 < r["rel_variance"] and -1 <= r["cosine"] <= 1
        assert abs(r["rel_variance_mc"] - r["rel_variance"]) < 5 * r["rel_variance_mc_se"] + 1e-9
    for r in cells.values():  # the budget is met in expectation (completions here are longer than 3)
        assert r["kept_per_completion"] <= numbers["mean_length"] + 1e-6
    assert abs(cells[3, "uniform"]["kept_per_completion"] - 3) < 1.0
    # a larger budget keeps more tokens and lowers the variance of every law
    for strategy in ("uniform", "optimized"):
        assert cells[6, strategy]["kept_per_completion"] > cells[3, strategy]["kept_per_completion"]
        assert cells[6, strategy]["rel_variance"] < cells[3, strategy]["rel_variance"]
