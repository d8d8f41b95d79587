"""Convergence check (``autoprec train --compare``): same weights, same batches, curves JSON + PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autoprec import Policy
from autoprec.cli import main
from autoprec.commands.compare import compare, median_step_seconds
from autoprec.errors import AutoprecError
from autoprec.metrics import traj_rel as max_rel_dev
from tests.conftest import DRIFT, EXAMPLES

TINY = str(EXAMPLES / "tiny_mlp.py")


def test_max_rel_dev():
    assert max_rel_dev([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert max_rel_dev([1.0, math.nan], [1.0, 2.0]) == math.inf


def test_median_step_seconds_leaves_out_warm_up_steps():
    """Step 0 and the first step after each resume compile again: they never set the median."""
    times = [9.0, 1.0, 9.0, 9.0, 2.0]  # steps 0, 2 and 3 started a process
    assert median_step_seconds(times, {0, 2, 3}) == 2.0
    assert median_step_seconds(times, {0}) == 9.0  # counting them would move the median
    assert median_step_seconds([5.0], {0}) == 5.0  # nothing else left: the one step there is


def test_fp32_policy_reproduces_fp32_exactly(tmp_path):
    """The fp32 policy graph runs the same kernels on the same weights and batches: zero deviation."""
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    res = compare(TINY, pol, steps=3, baselines=["fp32"], compile=False, quiet=True, heldout_batches=1)
    assert list(res.curves) == ["fp32", "policy"]
    assert res.curves["policy"] == res.curves["fp32"] and res.max_rel_dev == {"fp32": 0.0, "policy": 0.0}
    assert res.curves["fp32"][-1] < res.curves["fp32"][0]  # it trains
    assert res.heldout_loss["policy"] == res.heldout_loss["fp32"]


def test_every_configuration_trains_at_the_policys_batching(tmp_path, capsys):
    """A user's ``train --compare`` of a policy written by ``tune --global-batch`` ran every curve at
    the model file's batch: the convergence check tested another training than the policy's. Each
    configuration now trains at its micro-batch x accumulation on the same global batches as
    ``autoprec train`` (global batch 16: two of tiny_mlp's batches of 8 a step)."""
    import dataclasses

    from autoprec.commands.train import train
    from autoprec.policy import Batching

    pol = tmp_path / "p.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(4, 4)).save(pol)
    plain = tmp_path / "plain.json"
    Policy.fp32().save(plain)
    res = compare(TINY, pol, steps=3, baselines=["fp32"], compile=False, quiet=False, heldout_batches=1)
    assert "training every configuration at micro-batch 4 x 4 accumulated (global batch 16)" in (
        capsys.readouterr().out)
    assert res.meta["batching"] == "micro-batch 4 x 4 accumulated (global batch 16)"
    trained = train(TINY, pol, steps=3, compile=False, quiet=True).losses
    for name in ("fp32", "policy"):
        torch.testing.assert_close(res.curves[name], trained, rtol=1e-5, atol=1e-6)
    at_file_batch = compare(TINY, plain, steps=3, baselines=["fp32"], compile=False, quiet=True,
                            heldout_batches=1)
    assert at_file_batch.meta["batching"] is None
    assert abs(at_file_batch.curves["fp32"][1] - res.curves["fp32"][1]) > 1e-4  # other data at step 1


def test_cli_compare_bf16_writes_json_and_png(tmp_path, capsys):
    pol = tmp_path / "p.json"
    Policy.default("bf16").save(pol)
    out = tmp_path / "cmp"
    code = main(["train", TINY, "--policy", str(pol), "--steps", "2", "--compare", "fp32,autocast",
                 "--no-compile", "--out-dir", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "max rel dev vs fp32" in text and "autocast" in text
    d = json.loads((out / "convergence.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert set(d["curves"]) == {"fp32", "policy", "autocast"}
    assert all(len(c) == 2 for c in d["curves"].values())
    assert d["meta"]["autocast_dtype"] == "bfloat16" and d["meta"]["steps"] == 2
    assert d["curves"]["policy"][0] != d["curves"]["fp32"][0]  # bf16 compute really ran
    for name in ("policy", "autocast"):
        assert 0 < d["max_rel_dev_vs_fp32"][name] < DRIFT[torch.bfloat16]
        assert abs(d["heldout_loss"][name] - d["heldout_loss"]["fp32"]) < 1e-2
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_compare_rejects_unknown_baseline(tmp_path, capsys):
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    assert main(["train", TINY, "--policy", str(pol), "--compare", "fp32,apex"]) == 2
    assert "unknown baseline 'apex'" in capsys.readouterr().err


class _Crash(Exception):
    pass


def _crash_after(monkeypatch, n_steps):
    """Make the n-th training step of the whole compare run raise (a killed process)."""
    from autoprec.commands import compare as cmp

    real, calls = cmp.TrainStep.timed, []

    def timed(self, batch):
        calls.append(1)
        if len(calls) == n_steps:
            raise _Crash
        return real(self, batch)

    monkeypatch.setattr(cmp.TrainStep, "timed", timed)


def test_compare_resume_is_bit_identical(tmp_path, monkeypatch):
    """A run killed inside its third configuration resumes from the saved state (the finished
    configurations are not re-run; the running one continues from its checkpoint) and gives the
    same curves and held-out losses as an uninterrupted run."""
    pol = tmp_path / "p.json"
    Policy.default("bf16").save(pol)
    kw = dict(steps=6, baselines=["fp32", "autocast"], compile=False, quiet=True, heldout_batches=1)
    ref = compare(TINY, pol, out_dir=tmp_path / "ref", **kw)
    out = tmp_path / "cmp"
    with monkeypatch.context() as m:
        _crash_after(m, 6 + 6 + 4)  # fp32 and policy done; autocast dies in its 4th step (checkpoint at 2)
        with pytest.raises(_Crash):
            compare(TINY, pol, out_dir=out, checkpoint_every=2, **kw)
    state = out / "compare_state"
    assert set(json.loads((state / "results.json").read_text())["done"]) == {"fp32", "policy"}
    assert (state / "autocast.pt").exists() and not (out / "convergence.json").exists()

    with pytest.raises(AutoprecError, match="unfinished --compare run; pass --resume"):
        compare(TINY, pol, out_dir=out, **kw)  # without --resume nothing is overwritten
    with pytest.raises(AutoprecError, match=r"different run \(steps differ\)"):
        compare(TINY, pol, out_dir=out, resume=True, **{**kw, "steps": 7})
    with monkeypatch.context() as m:
        _crash_after(m, 5)  # the resumed run only trains autocast's steps 2..5 (4 steps)
        res = compare(TINY, pol, out_dir=out, checkpoint_every=2, resume=True, **kw)
    assert res.curves == ref.curves and res.heldout_loss == ref.heldout_loss
    assert res.max_rel_dev == ref.max_rel_dev and res.max_rel_dev["autocast"] > 0
    assert not state.exists() and (out / "convergence.json").exists()


def test_compare_checkpoint_of_another_run_is_refused(tmp_path, monkeypatch):
    """A run killed in its first configuration has only a checkpoint; its key is saved with it,
    so resuming with other settings is refused instead of continuing someone else's weights."""
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    kw = dict(baselines=["fp32"], compile=False, quiet=True, heldout_batches=1, out_dir=tmp_path / "o")
    with monkeypatch.context() as m:
        _crash_after(m, 4)
        with pytest.raises(_Crash):
            compare(TINY, pol, steps=6, checkpoint_every=2, **kw)
    assert (tmp_path / "o" / "compare_state" / "fp32.pt").exists()
    with pytest.raises(AutoprecError, match=r"different run \(steps differ\)"):
        compare(TINY, pol, steps=8, resume=True, **kw)
    res = compare(TINY, pol, steps=6, resume=True, **kw)
    assert len(res.curves["fp32"]) == 6 and res.curves["policy"] == res.curves["fp32"]


def test_every_configuration_clips_at_max_grad_norm(tmp_path, capsys):
    """``train --compare --max-grad-norm 0.01`` gave the same curves as without it (the option was
    not passed on): every configuration now clips, as plain ``train`` does, and ``--log`` (which
    wrote nothing) is refused."""
    from autoprec.commands.train import train

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    kw = {"steps": 3, "baselines": ["fp32"], "compile": False, "quiet": True, "heldout_batches": 1}
    free = compare(TINY, pol, **kw)
    clipped = compare(TINY, pol, max_grad_norm=0.01, **kw)
    assert clipped.curves["fp32"] != free.curves["fp32"]
    assert clipped.curves["policy"] == clipped.curves["fp32"]
    alone = train(TINY, pol, steps=3, compile=False, quiet=True, max_grad_norm=0.01)
    assert clipped.curves["policy"] == pytest.approx(alone.losses, rel=1e-6)
    assert clipped.meta["max_grad_norm"] == 0.01
    assert main(["train", TINY, "--policy", str(pol), "--compare", "fp32", "--log", str(tmp_path / "l.jsonl"),
                 "--out-dir", str(tmp_path / "o")]) == 2
    assert "--log does not apply to --compare" in capsys.readouterr().err


def test_cli_compare_checkpoint_flag_is_refused(tmp_path, capsys):
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    assert main(["train", TINY, "--policy", str(pol), "--compare", "fp32", "--checkpoint",
                 str(tmp_path / "c.pt"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "--checkpoint does not apply to --compare" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c.pt").exists()


@pytest.mark.slow
def test_qwen2_tiny_300_step_convergence(tmp_path):
    """The full issue-4 run: qwen2_tiny, 300 steps, policy vs fp32 vs autocast (hours on a CPU without
    AVX512-BF16; minutes on a GPU). Policy: $AUTOPREC_POLICY (the tuned policy) or the bf16 default.
    Writes convergence.{json,png} into $AUTOPREC_CONVERGENCE_DIR if set, else into the test's
    tmp_path (never into the repository); with $AUTOPREC_CONVERGENCE_DIR an interrupted run resumes
    from its saved state there when started again."""
    import os

    out = Path(os.environ.get("AUTOPREC_CONVERGENCE_DIR") or tmp_path / "convergence_qwen2_tiny_300")
    pol = os.environ.get("AUTOPREC_POLICY")
    if pol is None:
        out.mkdir(parents=True, exist_ok=True)
        pol = out / "policy.json"
        Policy.default("bf16").save(pol)
    res = compare(EXAMPLES / "qwen2_tiny.py", pol, steps=300, log_every=10,
                  out_dir=out, checkpoint_every=25, resume=True)
    assert all(math.isfinite(x) for c in res.curves.values() for x in c)
    assert res.max_rel_dev["policy"] <= 1.5 * res.max_rel_dev["autocast"] + 1e-3
    assert abs(res.heldout_loss["policy"] - res.heldout_loss["fp32"]) <= 0.01 * res.heldout_loss["fp32"]


def test_slow_autocast_steps_compute_gemms_in_fp32(tmp_path, monkeypatch):
    """Where torch.autocast's native step is EMULATE_AT x fp32's or slower (an AVX2-only CPU's bf16
    GEMMs: ~60x), its later steps compute the GEMMs as fp32 products: the curve keeps its numerics
    (against the native curve, bf16's tolerance), s/step comes from the native step, a note says so."""
    import autoprec.commands.compare as cmp
    from autoprec.kernels.fp32_gemms import Fp32ComputeGemms

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    counts = []

    class Counting(Fp32ComputeGemms):
        def __exit__(self, *exc):
            counts.append(self.count)
            return super().__exit__(*exc)

    monkeypatch.setattr(cmp, "Fp32ComputeGemms", Counting)
    monkeypatch.setattr(cmp, "EMULATE_AT", math.inf)  # never: torch.autocast runs natively
    native = compare(TINY, pol, steps=6, quiet=True, heldout_batches=1)
    assert counts == [] and native.notes == {}
    monkeypatch.setattr(cmp, "EMULATE_AT", 0.0)  # always: from step 2 on
    emulated = compare(TINY, pol, steps=6, quiet=True, heldout_batches=1, out_dir=tmp_path / "cmp")
    # steps 2-5 and the held-out batch: 5 Linear GEMMs forward each (more in each backward)
    assert len(counts) == 1 and counts[0] >= 4 * 5 + 5
    assert "steps 2+ compute torch.autocast's GEMMs as fp32 products" in emulated.notes["autocast"]
    assert set(emulated.notes) == {"autocast"}
    a, b = native.curves["autocast"], emulated.curves["autocast"]
    assert a[:2] == b[:2]  # steps 0 and 1 ran natively in both
    assert b != emulated.curves["fp32"]  # still bf16 numerics, not fp32's
    assert max(abs(x - y) / abs(y) for x, y in zip(b, a)) < 1e-2  # bf16 rounding of the same values
    assert math.isfinite(emulated.seconds_per_step["autocast"])
    saved = json.loads((tmp_path / "cmp" / "convergence.json").read_text())
    assert saved["notes"] == emulated.notes


def test_summary_table_marks_a_timing_with_a_note():
    """The CLI's table marks the s/step of a configuration with a note (torch.autocast timed on one
    native step) with `*` and prints the note under it."""
    from autoprec.commands.compare import CompareResult, summary_table

    res = CompareResult(curves={"fp32": [1.0], "autocast": [1.0]},
                        heldout_loss={"fp32": 1.0, "autocast": 1.0},
                        max_rel_dev={"fp32": 0.0, "autocast": 1e-3},
                        seconds_per_step={"fp32": 0.5, "autocast": 9.0},
                        skipped={"fp32": 0, "autocast": 0}, notes={"autocast": "steps 2+ compute ..."})
    lines = summary_table(res).splitlines()
    assert lines[1].split() == ["fp32", "0.000e+00", "1.0000", "0.500", "0"]
    assert lines[2].split() == ["autocast", "1.000e-03", "1.0000", "9.000*", "0"]
    assert lines[3] == "* autocast: steps 2+ compute ..."


def test_the_policy_curve_captures_from_the_first_batches_as_tune_and_train_do(tmp_path, caplog):
    """On a file whose batches vary in shape, ``train --compare`` captured its policy static on
    ``get_batch(0)`` and captured again at step 1 (a graph tune did not measure, and a second
    compile); it captures dynamic from the first batches at once, like ``train`` and ``tune``."""
    import logging

    from tests.conftest import MODELS

    pol = tmp_path / "p.json"
    Policy.default("bf16").save(pol)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        res = compare(str(MODELS / "varlen_lm.py"), pol, steps=4, baselines=["fp32"], compile=False,
                      quiet=True, heldout_batches=1)
    assert all(math.isfinite(x) for x in res.curves["policy"])
    assert "captured again" not in caplog.text and "differ from the one shape captured" not in caplog.text
