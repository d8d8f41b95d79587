"""A graph that draws random numbers is never compiled under an activation memory budget below 1.0
(``autoprec.applied.compile.check_recompute``): torch's partitioner then recomputes the random ops in
backward with fresh randomness, so the gradients belong to other dropout masks than the forward's
(pytorch/pytorch#190758). ``tune --max-memory`` fits such a graph with saved activations only."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import autoprec
from autoprec.errors import PolicyError, SearchError
from autoprec.policy import Policy
from tests.measure.test_measure_rng import DROPOUT_MODEL


class Drop(nn.Module):
    """x -> Linear(16, 64) -> 3·tanh + 0.1 (never 0) -> Dropout(0.5) -> (h, Σh²)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 64), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(torch.tanh(self.lin(x)) * 3 + 0.1)
        return (h * h).sum(), h


def _mask_error(model: Drop, x: torch.Tensor, h: torch.Tensor) -> float:
    """Relative L2 error of ``model.lin.weight.grad`` against the gradient of Σh² through the
    dropout mask the forward applied (read off ``h``: 0 where dropped, as the pre-dropout value is
    never 0)."""
    keep = (h != 0).float()
    with torch.no_grad():
        t = torch.tanh(model.lin(x))
        dz = 2 * h * keep * 2 * 3 * (1 - t * t)  # d(Σh²)/dh · dh/dz, h = keep·2·(3t + 0.1)
        expected = dz.t() @ x
    g = model.lin.weight.grad
    return float((g - expected).norm() / expected.norm())


@pytest.mark.heavy
def test_torch_still_recomputes_dropout_with_fresh_masks():
    """Why the rule exists, on the installed torch: compiled under activation_memory_budget 0.0,
    the gradients do not match the forward's own mask (budget 1.0: they do, exactly). When the
    first assertion fails, torch keeps the masks: drop ``check_recompute`` and ``RECOMPUTE_REDRAWS``."""
    errors = {}
    for budget in (0.0, 1.0):
        torch.manual_seed(0)
        model, x = Drop().train(), torch.randn(32, 16)
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            loss, h = torch.compile(model)(x)
            loss.backward()
        errors[budget] = _mask_error(model, x, h)
    assert errors[0.0] > 0.1, f"torch now keeps dropout masks under a memory budget: {errors}"
    assert errors[1.0] < 1e-5, errors


def test_apply_refuses_a_memory_budget_on_a_graph_with_dropout_and_names_the_node():
    """The error names the policy's field, the random node (name, op, node key) and the cause,
    also for a model in eval mode (the capture traces the training graph, dropout on); the same
    policy on a model without dropout, or with budget 1.0, is applied."""
    x = torch.randn(32, 16)
    policy = dataclasses.replace(Policy.fp32(), activation_memory_budget=0.5)
    with pytest.raises(PolicyError, match=r"activation_memory_budget 0\.5: the model's graph draws random "
                                          r"numbers \(node dropout \(aten\.dropout\.default, "
                                          r"drop/dropout#0\)\).*pytorch/pytorch#190758"):
        autoprec.apply(Drop().train(), policy, x, compile=True, dynamic=False)
    with pytest.raises(PolicyError, match=r"activation_memory_budget 0\.5: the model's graph draws random"):
        autoprec.apply(Drop().eval(), policy, x, compile=True, dynamic=False)
    no_dropout = Drop()
    no_dropout.drop = nn.Identity()
    autoprec.apply(no_dropout, policy, x, compile=True, dynamic=False)  # compiles lazily: no cost here
    autoprec.apply(Drop().train(), Policy.fp32(), x, compile=True, dynamic=False)


@pytest.mark.heavy
def test_tune_max_memory_does_not_recompute_a_graph_with_dropout(tmp_path, capsys):
    """A memory budget that only recomputation could meet: with dropout the fit tries the saved
    levers, says why recomputation is not tried, and no finalist is left (the error says why)
    instead of a policy whose gradients use other masks."""
    from autoprec.measure import Harness
    from autoprec.modelspec import load_model_spec
    from autoprec.search.study import tune

    model = tmp_path / "drop.py"
    model.write_text(DROPOUT_MODEL)
    state = Harness(load_model_spec(model), torch.device("cpu"), warmup=1, steps=1).state_bytes
    with pytest.raises(SearchError, match=r"recomputation is not used on a graph that draws random") as err:
        tune(model, trials=1, out=tmp_path / "p.json", max_memory=str(state + 64), finalists=1, traj_steps=0,
             dtypes="bf16", max_drift=1.0, progress=False, report=False)
    log = capsys.readouterr().out
    assert "memory lever saved bf16" in log and "memory lever recompute: not tried" in log
    # the error quotes the lowest peak a saved lever reached, not the finalist's own
    peaks = [int(ln.split(" bytes, grad_rel_l2")[0].rsplit(" ", 1)[1]) for ln in log.splitlines()
             if "memory lever saved" in ln]
    assert f"the smallest peak was {min(peaks)} bytes with saved activations" in str(err.value)
    assert "activation memory budget 0" not in log  # no recompute lever compiled
    assert not (tmp_path / "p.json").exists()


def test_train_and_bench_refuse_it_before_a_step_and_name_the_policy_file(tmp_path, capsys):
    """``autoprec train`` and ``bench`` (before any row runs) name the policy file and exit 2;
    ``show --model`` says they will."""
    from autoprec.cli import main

    model, pol = tmp_path / "drop.py", tmp_path / "amb.json"
    model.write_text(DROPOUT_MODEL)
    pol.write_text(json.dumps({"schema_version": 1, "default_dtype": "fp32", "rules": [],
                               "activation_memory_budget": 0.5}))
    assert main(["train", str(model), "--policy", str(pol), "--steps", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"autoprec train: error: {pol}: activation_memory_budget 0.5: the model's graph draws" in err
    out = tmp_path / "bench.json"
    assert main(["bench", str(model), "--policy", str(pol), "--steps", "1", "--json", str(out)]) == 2
    assert f"autoprec bench: error: {pol}: activation_memory_budget 0.5" in capsys.readouterr().err
    assert not out.exists()
    assert main(["show", str(pol), "--model", str(model)]) == 0  # show explains, and does not refuse
    shown = capsys.readouterr().out
    assert "this policy is refused on this model: activation_memory_budget 0.5" in shown
