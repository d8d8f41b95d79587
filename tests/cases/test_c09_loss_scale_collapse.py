"""C09: the loss scale collapses forever (inf from the forward pass) or grows to inf (tiny loss)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx

from autoprec.errors import LossScaleError
from autoprec.training.scaler import DynamicLossScaler


class InfForward(torch.nn.Module):
    """``(p * tensor([1, inf])).sum()``: the forward pass itself produces the inf."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("w", torch.tensor([1.0, math.inf]))

    def forward(self) -> torch.Tensor:
        return (self.p * self.w).sum()


def first_nonfinite_node(module: torch.nn.Module) -> str | None:
    """A minimal Monitor.first_nonfinite_node: the first fx op whose output is inf/NaN."""
    found: list[str] = []

    class Probe(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            out = super().run_node(n)
            computed = n.op in ("call_function", "call_method", "call_module")  # not constants/inputs
            if computed and not found and isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
                found.append(n.name)
            return out

    with torch.no_grad():
        Probe(torch.fx.symbolic_trace(module)).run()
    return found[0] if found else None


def test_c09_gradscaler_collapses_without_a_word():
    """The fault, for reference: 65 skipped steps take GradScaler's scale from 65536 to ~1e-15."""
    model = InfForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu")
    for _ in range(65):
        opt.zero_grad()
        ref.scale(model()).backward()
        ref.step(opt)
        ref.update()
    assert ref.get_scale() == 2.0**-49


def test_c09_skips_keep_params_floor_the_scale_and_name_the_forward_node():
    model = InfForward()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**16, min_scale=1.0, max_skips_at_floor=8,
                               diagnose=lambda: first_nonfinite_node(model))
    before = model.p.detach().clone()
    updates = 0
    with pytest.raises(LossScaleError) as excinfo:
        for _ in range(65):
            opt.zero_grad()
            scaler.scale(model()).backward()
            assert scaler.step(opt) is False
            assert torch.equal(model.p.detach(), before) and not opt.state  # bitwise unchanged, no state
            updates += 1
            scaler.update()
            assert scaler.get_scale() >= 1.0
    assert updates == 16 + 8  # 16 halvings reach the floor, then 8 skips at the floor
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 24 and scaler.skips_at_floor == 8
    msg = str(excinfo.value)
    assert "forward" in msg
    assert first_nonfinite_node(model) == "mul"
    assert "'mul'" in msg


def test_c09_without_a_scaler_skips_are_given_up_too_naming_the_forward_node():
    """A bf16 or fp32 policy trains without a loss scaler: its steps with inf/NaN gradients are
    skipped (weights bitwise unchanged), and after MAX_SKIPS_AT_FLOOR in a row the same
    LossScaleError says the forward pass makes them and names the node (``autoprec train`` ran 100
    skipped steps and exited 1 without a word); a finite step in between resets the count.
    Measurements (``max_skips`` None, the default) never give up."""
    from autoprec.training.scaler import MAX_SKIPS_AT_FLOOR
    from autoprec.training.train import TrainStep

    model = InfForward()
    step = TrainStep(lambda: model(), list(model.parameters()), torch.optim.AdamW(model.parameters()),
                     lambda out, _batch: out, max_skips=MAX_SKIPS_AT_FLOOR,
                     diagnose=lambda: first_nonfinite_node(model))
    before = model.p.detach().clone()
    for _ in range(MAX_SKIPS_AT_FLOOR - 1):
        assert step(()).skipped and torch.equal(model.p.detach(), before)
    model.w.fill_(1.0)
    assert not step(()).skipped  # finite: the count starts again
    model.w[1] = math.inf
    after = model.p.detach().clone()
    with pytest.raises(LossScaleError, match=r"^8 consecutive optimizer steps were skipped with inf/NaN "
                       r"gradients and no loss scaler .* forward pass\. First node .*'mul'\.$"):
        for _ in range(MAX_SKIPS_AT_FLOOR):
            step(())
    assert torch.equal(model.p.detach(), after)  # no NaN written into the weights
    patient = TrainStep(lambda: model(), list(model.parameters()), torch.optim.AdamW(model.parameters()),
                        lambda out, _batch: out)
    assert all(patient(()).skipped for _ in range(2 * MAX_SKIPS_AT_FLOOR))


def test_c09_tiny_loss_growth_is_capped_not_inf():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1e-3)
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=1, max_scale=2.0**24)
    for _ in range(200):
        opt.zero_grad()
        scaler.scale((p * 1e-30).sum()).backward()
        assert scaler.step(opt) is True
        scaler.update()
        assert scaler.get_scale() <= 2.0**24
    assert scaler.get_scale() == 2.0**24 and math.isfinite(scaler.get_scale())
    assert scaler.skipped_steps == 0


C09_MODEL = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("w", torch.tensor([1.0, float("inf")]))

    def forward(self, x):
        return (self.lin(x) * self.w).sum()


def build_model():
    torch.manual_seed(0)
    return M()


def get_batch(step, device):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
"""


def test_c09_tune_of_a_model_whose_fp32_step_is_not_finite_says_so(tmp_path, capsys):
    """tune used to say "drift budget is not finite ...; pass --max-drift X", and with it "no trial
    met the drift budget, not even all-fp32": the fp32 step itself is not finite, and the error
    says that first, naming the model file and the node (the inf buffer ``w``); nothing written."""
    from autoprec.cli import main

    model = tmp_path / "c09_inf.py"
    model.write_text(C09_MODEL)
    out = tmp_path / "p.json"
    assert main(["tune", str(model), "--out", str(out), "--trials", "2", "--no-compile", "--traj-steps", "0",
                 "--dtypes", "bf16"]) == 2
    err = capsys.readouterr().err
    assert (f"{model}: the model's own fp32 training step fails (non-finite loss (drift batch "
            "0); first non-finite output: node w); autoprec tunes a model that trains in fp32") in err, err
    assert not out.exists()


def test_tune_of_a_model_whose_loss_fn_is_not_finite_blames_the_loss_not_the_backward(tmp_path, capsys):
    """The forward is finite and the model file's loss_fn makes the loss inf: the error said
    "forward finite (backward overflows)"; it names the loss now."""
    from autoprec.cli import main

    model = tmp_path / "inf_loss.py"
    model.write_text(C09_MODEL.replace('float("inf")', "1.0") + (
        "\n\ndef loss_fn(output, batch):\n    return output * float('inf')\n"))
    out = tmp_path / "p.json"
    assert main(["tune", str(model), "--out", str(out), "--trials", "2", "--no-compile", "--traj-steps", "0",
                 "--dtypes", "bf16"]) == 2
    err = capsys.readouterr().err
    assert ("the model's own fp32 training step fails (non-finite loss (drift batch 0); the forward's "
            "outputs are finite: the loss computed from them (loss_fn) is not)") in err, err
    assert not out.exists()


def test_train_whose_loss_is_not_finite_says_so_and_exits_1(tmp_path, capsys):
    """It printed "final loss ... inf" and exited 1 without an error line."""
    from autoprec.cli import main
    from autoprec.policy import Policy

    model = tmp_path / "inf_loss.py"
    model.write_text(C09_MODEL.replace('float("inf")', "1.0") + (
        "\n\ndef loss_fn(output, batch):\n    return output * float('inf')\n"))
    Policy.fp32().save(tmp_path / "p.json")
    assert main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "2",
                 "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert "autoprec train: error: each of the last 2 steps was skipped for non-finite gradients" in err, err
    assert "the forward's outputs on the last batch are finite: the loss computed from them (loss_fn)" in err


def test_train_whose_forward_is_not_finite_names_the_node_and_line(tmp_path, capsys):
    """It said "autoprec tune names the first non-finite node" though its own monitor had found it
    (in the --log file): now the error names the node and the model's line."""
    from autoprec.cli import main
    from autoprec.policy import Policy

    model = tmp_path / "nan_forward.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        h = self.fc(x)\n        h = h / (h - h)\n        return h\n\n\n"
        "def build_model():\n    torch.manual_seed(0)\n    return M()\n\n\n"
        "def get_batch(step, device):\n"
        "    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)\n\n\n"
        "def loss_fn(out, batch):\n    return out.float().pow(2).mean()\n")
    Policy.fp32().save(tmp_path / "p.json")
    assert main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "2",
                 "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert "first non-finite output on the last batch: node div#0 (from " in err, err
    assert "nan_forward.py:12 (forward): h = h / (h - h)" in err, err
    # a longer run stops after 8 skipped steps in a row (case C09); that error names the line too
    assert main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "20",
                 "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert "consecutive optimizer steps were skipped" in err, err
    assert "First node that produced a non-finite value: 'div#0' (from " in err, err
    assert "nan_forward.py:12 (forward): h = h / (h - h))." in err, err


FP16_SPIKE_MODEL = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def get_batch(step, device):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    return (x * 1e6 if step == {spike} else x).to(device)  # fp16 overflows at the spike (max 65504)


def loss_fn(output, batch):
    return output.float().pow(2).mean()
"""


@pytest.mark.parametrize("spike", [3, None])
def test_train_fp16_one_overflow_among_the_last_steps_is_skipped_not_an_error(tmp_path, capsys, spike):
    """An fp16 run whose one overflowing step (skipped by the loss scaler, weights unchanged) was
    among the last 5 exited 1: that step's non-finite loss entered the final mean. The final loss
    is now the mean of the steps not skipped among the last 5; a run without the spike gives the
    mean of all 5."""
    from autoprec.cli import main
    from autoprec.policy import Policy

    model = tmp_path / "spike.py"
    model.write_text(FP16_SPIKE_MODEL.replace("{spike}", str(spike if spike is not None else -1)))
    Policy.default("fp16").save(tmp_path / "p.json")
    code = main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "6", "--no-compile",
                 "--device", "cpu"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    losses = [float(line.split()[3]) for line in cap.out.splitlines() if line.startswith("step ")]
    skipped = [line.startswith("step ") and "SKIPPED" in line for line in cap.out.splitlines()
               if line.startswith("step ")]
    assert len(losses) == 6 and sum(skipped) == (1 if spike is not None else 0), cap.out
    kept = [x for x, s in zip(losses[1:], skipped[1:]) if not s]
    line = f"final loss (mean of the last {len(kept)} steps not skipped) {sum(kept) / len(kept):.4f}"
    assert line in cap.out, cap.out


def test_train_whose_fp16_backward_overflows_at_the_floor_says_so_and_the_advice_trains(tmp_path, capsys):
    """A summed squared error of ~6e7 in fp32 whose fp16 weight gradients overflow even at scale 1: the
    error said the values "come from the forward pass", then that the forward pass was finite, and told
    a CLI user to build the Monitor ``autoprec train`` had attached (a user test). Now it says the
    backward overflows and what to do; lowering ``loss_scaling.min_scale`` as it says trains."""
    import json

    from autoprec.cli import main
    from autoprec.policy import Policy

    model = tmp_path / "big_loss.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\ndef build_model():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))\n\n\n"
        "def get_batch(step, device):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return (10 * torch.randn(64, 32, generator=g)).to(device)\n\n\n"
        "def loss_fn(output, batch):\n    return ((output.float() - 1000.0) ** 2).sum()\n")
    Policy.default("fp16").save(tmp_path / "p.json")
    assert main(["train", str(model), "--policy", str(tmp_path / "p.json"), "--steps", "40",
                 "--no-compile"]) == 1
    err = capsys.readouterr().err
    assert "skipped with the loss scale at its floor (min_scale=1.0)" in err, err
    assert "has no non-finite output, so they arise in the backward pass" in err, err
    assert "come from the forward pass" not in err and "autoprec.Monitor(" not in err, err
    d = json.loads((tmp_path / "p.json").read_text())
    d["loss_scaling"]["min_scale"] = 2.0 ** -10
    (tmp_path / "low.json").write_text(json.dumps(d))
    log = tmp_path / "log.jsonl"
    assert main(["train", str(model), "--policy", str(tmp_path / "low.json"), "--steps", "40",
                 "--no-compile", "--log", str(log)]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["loss_scale"] < 1.0 and not records[-1]["skipped"], records[-1]
