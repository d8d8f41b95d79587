"""``tune --global-batch`` (issue 51, :mod:`autoprec.search.micro_batch`): the fit rule on scripted
peaks, the global-step formula against a timed global step, a real tune writing ``batching`` (and
none without the flag), and the errors that name the numbers."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from autoprec.errors import SearchError
from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.modelspec.micro_batches import MicroBatches
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Role
from autoprec.search.micro_batch import BatchConfig, BatchPoint, BatchSearch, global_step_seconds
from autoprec.search.study import tune
from autoprec.training.train import TrainStep
from tests.conftest import EXAMPLES

CPU = torch.device("cpu")
TINY = EXAMPLES / "tiny_mlp.py"  # file batch 8


class _Scripted(BatchSearch):
    """A search whose peaks are an affine function of the micro-batch (no model runs)."""

    def __init__(self, n: int, budget: float, file_batch: int, base: float, per_example: float) -> None:
        self.n, self.memory_budget, self.file_batch, self.quiet = n, budget, file_batch, True
        self.base_bytes, self.per, self.points, self.measured = base, per_example, [], []

    def point(self, cfg, m):
        for p in self.points:  # measured once, as BatchSearch.point
            if p.micro_batch == m:
                return p
        self.measured.append(m)
        peak = int(self.base_bytes + self.per * m)
        pt = BatchPoint(cfg, m, self.n // m, peak_bytes=peak, fits=peak <= self.memory_budget)
        self.points.append(pt)
        return pt


@pytest.mark.parametrize("budget, want, measured", [
    (1000 + 100 * 16, 16, [4, 8, 16]),      # the line predicts 16: measured, it fits
    (1000 + 100 * 9, 8, [4, 8, 16]),        # 8 fits; the line says 16 does not: measured, it does not
    (1000 + 100 * 5, 4, [4, 8]),            # the file's 4 fits, 8 does not
    (1000 + 100 * 2, 2, [4, 2]),            # even the file's batch is over: smaller until one fits
    (500, None, [4, 2, 1]),                 # nothing fits
])
def test_each_configuration_runs_at_its_largest_fitting_micro_batch_and_predictions_are_measured(
        budget, want, measured):
    """The micro-batch chosen fits, measured, and the next divisor of N does not, measured (or it is
    N): the line through two measured peaks only says which to measure first."""
    s = _Scripted(16, budget, file_batch=4, base=1000, per_example=100)
    pt = s.fit(BatchConfig("policy", Role.POLICY, Policy.fp32()))
    assert (pt.micro_batch if pt is not None else None) == want
    assert s.measured == measured
    if pt is not None:
        assert pt.fits and pt.accumulation == 16 // want


@pytest.mark.serial  # times steps: run alone, after the parallel rest (make test)
def test_global_step_formula_matches_a_timed_global_step():
    """``A * t_step - (A - 1) * t_update`` against accumulated global steps timed directly, both
    medians of steps interleaved in one process (tiny_mlp, micro-batch 2 x 8)."""
    spec = load_model_spec(TINY)
    mb = MicroBatches(spec, global_batch=16, micro_batch=2, device=CPU)
    h = Harness(mb.micro_spec(), CPU, drift_batches=1)
    step = TrainStep(h.model, h.params, spec.make_optimizer(h.params), spec.loss_fn, stats=False)
    micro, whole = [], []
    for k in range(12):  # interleaved: load that comes and goes hits both
        micro.append(step.timed(mb.micro(k, CPU))[1])
        t0 = time.perf_counter()
        step(mb.step(k, CPU))
        whole.append(time.perf_counter() - t0)
    update = h.update_seconds(scaled=False)
    predicted = global_step_seconds(statistics.median(micro[2:]), update, 8)
    measured = statistics.median(whole[2:])
    # the noise of ms steps on a shared 2-core machine is wide; a formula off by the accumulation
    # (8) or without the update's correction (8 updates instead of 1) falls far outside
    assert 0.5 < predicted / measured < 2.0, (predicted, measured, update)
    wrong = statistics.median(micro[2:])  # one micro-step: 1/8 of the work
    assert wrong / measured < 0.5
    assert global_step_seconds(0.3, 0.1, 1) == 0.3 and global_step_seconds(0.3, 0.1, 4) == pytest.approx(0.9)


def test_tune_with_global_batch_writes_batching_and_without_it_nothing_changes(tmp_path, capsys):
    """Eager (``compile=False``) to keep it short: the flag's path end to end on tiny_mlp, whose file
    batch is 8; the same tune without it writes no ``batching`` and no micro-batch numbers."""
    kw = dict(trials=1, compile=False, progress=False, traj_steps=0, quiet=True)
    res = tune(TINY, out=tmp_path / "g.json", global_batch=16, max_memory="3MiB", **kw)
    d = json.loads((tmp_path / "g.json").read_text())
    b = res.policy.batching
    assert d["schema_version"] == 4 and d["batching"] == {"micro_batch": b.micro_batch,
                                                          "accumulation": b.accumulation}
    assert b.global_batch == 16 and d["measured"]["micro_batch_peak_bytes"] <= 3 * 2**20
    assert d["measured"]["micro_batch_tokens_per_s"] > 0
    report = (tmp_path / "g.report.md").read_text()
    assert "## Micro-batch and memory lever" in report and (tmp_path / "g.micro_batch.png").is_file()
    # train captures at the policy's micro-batch: the provenance names that graph, so no warning
    from autoprec.commands.train import train

    capsys.readouterr()
    assert len(train(TINY, tmp_path / "g.json", steps=2, compile=False, quiet=True).losses) == 2
    assert "was tuned on" not in capsys.readouterr().err
    plain = tune(TINY, out=tmp_path / "p.json", **kw)
    d0 = json.loads((tmp_path / "p.json").read_text())
    assert plain.policy.batching is None and "batching" not in d0 and d0["schema_version"] < 4
    assert not any("micro_batch" in k or "global_batch" in k for k in d0["measured"])


def test_a_global_batch_the_file_cannot_give_is_refused_before_any_capture(tmp_path):
    with pytest.raises(SearchError, match=r"--global-batch 12: .*global batch 12 is not a multiple of the "
                                          r"file's batch 8 .*add one: def get_batch\(step, device, "):
        tune(TINY, out=tmp_path / "p.json", global_batch=12, trials=1, compile=False, progress=False,
             quiet=True)
    assert not (tmp_path / "p.json").exists()


SHORT_LAST = """
import torch
from torch import nn

N, B = 18, 4  # a DataLoader over 18 examples in batches of 4: the fifth has 2
_rows = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))
_batches = list(torch.utils.data.DataLoader(_rows, batch_size=B, shuffle=False))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def get_batch(step, device):
    return _batches[step % len(_batches)].to(device)


def loss_fn(output, batch):
    return output.pow(2).mean()
"""


def _refused_before_capture(tmp_path, name: str, source: str):
    """``tune --global-batch 8`` on the model file ``source``: its path and the ``SearchError``'s
    message, once the test has checked that no policy file was written."""
    model = tmp_path / name
    model.write_text(source)
    with pytest.raises(SearchError) as err:
        tune(model, out=tmp_path / "p.json", global_batch=8, trials=1, compile=False, progress=False,
             quiet=True)
    assert not (tmp_path / "p.json").exists()
    return model, str(err.value)


def test_a_short_batch_is_refused_before_any_capture_naming_the_step_and_the_calls(tmp_path):
    """A user's DataLoader whose last batch is short: ``tune --global-batch 8`` ran the whole search
    and then failed with "the concatenated batches gave 6 examples, not 8" (logged as "peak 0 bytes
    -> over the budget" with no budget). It is refused before any capture, naming the step, each
    ``get_batch`` call and its rows, and what to do; ``train`` says the same where it meets it."""
    model, message = _refused_before_capture(tmp_path, "short_last.py", SHORT_LAST)
    assert (f"--global-batch 8: {model}: the global batch of optimizer step 2 (8 examples) needs 4 "
            "examples each (get_batch(0)'s); got get_batch(4) 2, get_batch(5) 4. What to do: give every "
            "batch the same size (a DataLoader's last batch is shorter unless drop_last=True)") in message
    from autoprec.errors import ModelSpecError
    from autoprec.modelspec.micro_batches import MicroBatches

    spec = load_model_spec(model)
    with pytest.raises(ModelSpecError, match=r"optimizer step 2 \(8 examples\).*got get_batch\(4\) 2"):
        MicroBatches(spec, 8, 4, CPU).step(2, CPU)


PAD_TO_LONGEST = """
import torch
from torch import nn

LENGTHS = [9, 7, 12, 5, 8, 11, 6, 10]  # each batch padded to its own longest sequence


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 1))


def get_batch(step, device{sized}):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, ({rows}, LENGTHS[step % len(LENGTHS)]), generator=g).to(device)


def loss_fn(output, batch):
    return output.pow(2).mean()
"""


def test_batches_padded_to_their_own_length_are_refused_before_any_capture_saying_to_add_batch_size(tmp_path):
    """A pad-to-longest loader (the sequence length differs per batch): ``tune --global-batch 8`` over
    batches of 4 ran the whole search, then ended in torch.cat's "Sizes of tensors must match"
    traceback (exit 1; ``train`` the same). It is refused before any capture, naming the calls, the
    shapes and the fix; with a ``batch_size=`` argument the same file gives its global batches."""
    padded = PAD_TO_LONGEST.format(sized="", rows=4)
    model, message = _refused_before_capture(tmp_path, "pad_longest.py", padded)
    assert (f"--global-batch 8: {model}: the global batch concatenates get_batch(0), get_batch(1), but batch "
            "is (4, 9) in get_batch(0) and (4, 7) in get_batch(1): batches concatenate along dimension 0 "
            "only") in message
    assert "def get_batch(step, device, batch_size=...)" in message
    sized = tmp_path / "pad_longest_sized.py"
    sized.write_text(PAD_TO_LONGEST.format(sized=", batch_size=4", rows="batch_size"))
    batches = MicroBatches(load_model_spec(sized), 8, 4, CPU)
    assert [tuple(b.shape) for b in batches.step(1, CPU).parts] == [(4, 7), (4, 7)]


def test_no_configuration_fitting_names_the_budget_and_the_smallest_peak():
    spec = load_model_spec(TINY)
    search = BatchSearch(spec, CPU, 16, memory_budget=1000.0, compile=False,
                         autocast=AutocastBaseline(torch.bfloat16), budget=DriftBudget.fixed(1.0))
    with pytest.raises(SearchError, match=r"--global-batch 16: no policy configuration fits the memory "
                                          r"budget \(1000 bytes; the smallest peak measured was [0-9.]+ "):
        search.run(Policy.fp32())


def test_eager_saved_activations_are_honoured_when_measured():
    """Without compile the bf16 saved-activation lever runs as ``train --no-compile`` runs it
    (``saved_eager``): its measured peak is below the plain policy's at the same micro-batch."""
    from autoprec.search.space import with_saved

    search = BatchSearch(load_model_spec(TINY), CPU, 16, memory_budget=None, compile=False,
                         autocast=AutocastBaseline(torch.bfloat16), budget=DriftBudget.fixed(1.0), quiet=True)
    plain = search.point(BatchConfig("policy", Role.POLICY, Policy.fp32()), 16)
    lever = with_saved(Policy.fp32(), "bf16")
    saved = search.point(BatchConfig("policy + saved bf16", Role.POLICY, lever), 16)
    assert plain.error is None and saved.error is None
    assert saved.peak_bytes < plain.peak_bytes


def test_a_tie_is_a_tie_and_budget_shares_are_checked():
    from autoprec.search.budgets import parse_max_memory
    from autoprec.search.micro_batch import faster

    cfg = BatchConfig("x", Role.POLICY)
    a = BatchPoint(cfg, 8, 2, tokens_per_s=1000.0, tokens_per_s_band=(950.0, 1050.0))
    b = BatchPoint(cfg, 4, 4, tokens_per_s=980.0, tokens_per_s_band=(940.0, 1010.0))
    c = BatchPoint(cfg, 4, 4, tokens_per_s=800.0, tokens_per_s_band=(780.0, 820.0))
    assert not faster(a, b) and not faster(b, a) and faster(a, c) and not faster(c, a)
    assert parse_max_memory("90%") == ("device", 0.9)
    with pytest.raises(SearchError, match=r"above 0% and at most 100%; got '150%'"):
        parse_max_memory("150%")


def test_without_saved_undoes_the_saved_lever_only():
    from autoprec.policy import Rule
    from autoprec.search.space import with_saved, without_saved

    pol = Policy(default_dtype="fp32", rules=(Rule(op_class="matmul", dtype="bf16"),
                                              Rule(node="lm_head/linear#0", saved="bf16")))
    assert without_saved(with_saved(pol, "bf16")) == pol


def test_a_tie_goes_to_the_lower_drift_simpler_configuration():
    """A user's ``tune --global-batch 16 --max-memory``: saved bf16 activations at 4 x 4 (drift
    1.15e-3) measured 1.01x fp32 at 2 x 8 (drift 0), band 0.91-1.15, and were written. A tie goes
    to the lower-drift, simpler configuration (the contest's rule); beyond the noise the faster."""
    from autoprec.search.micro_batch import pick

    def pt(name, m, tps, band, drift, role=Role.POLICY):
        return BatchPoint(BatchConfig(name, role), m, 16 // m, tokens_per_s=tps, tokens_per_s_band=band,
                          drift=[drift] * 2)

    saved = pt("policy + saved bf16", 4, 10192.0, (9700.0, 10700.0), 1.15e-3)
    plain = pt("policy", 2, 10110.0, (9600.0, 10600.0), 0.0)
    assert pick([saved, plain]) is plain
    fp32 = pt("fp32 + torch.compile", 2, 10100.0, (9600.0, 10600.0), 3e-7, Role.BASELINE)
    bf16 = pt("policy", 4, 10150.0, (9650.0, 10650.0), 4e-3)
    assert pick([bf16, fp32]) is fp32  # a tie: all-fp32 is the lower-drift, simpler
    fast = pt("policy + saved bf16", 8, 13000.0, (12500.0, 13500.0), 1.15e-3)
    assert pick([fast, plain, fp32]) is fast  # faster beyond the noise: the faster
    same = pt("policy + recompute 0", 2, 10120.0, (9600.0, 10600.0), 0.0)
    assert pick([same, plain]) is plain  # the same drift: no lever before recomputation
    with pytest.raises(ValueError):
        pick([])
