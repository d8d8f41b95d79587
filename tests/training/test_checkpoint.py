"""Checkpoints: atomic, weights_only-loadable, and a resumed run is bit-identical on the CPU."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn

from autoprec import AutoprecError, Policy
from autoprec.applied.apply import apply
from autoprec.commands.train import train
from autoprec.training.checkpoint import load_checkpoint, save_checkpoint
from autoprec.training.train import TrainStep, make_scaler
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny_mlp.py"


class Net(nn.Module):
    """Tiny (≈300 params) net with dropout, so the RNG state matters for bit-identity."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.25), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def _loss(out, batch):
    return out.float().pow(2).mean()


def _setup(policy: Policy):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Net()
    mp = apply(model, policy, (_batch(0),), compile=False)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    return model, mp, opt, TrainStep(mp, params, opt, _loss, scaler=make_scaler(policy))


def _run(step, start, stop):
    return [step((_batch(i),)).loss for i in range(start, stop)]


@pytest.mark.parametrize("low", ["fp32", "bf16", "fp16"])
def test_resumed_run_is_bit_identical(tmp_path, low):
    policy = Policy.fp32() if low == "fp32" else Policy.default(low)
    n, k = 6, 3
    torch.manual_seed(123)
    model, _, _, step = _setup(policy)
    full = _run(step, 0, n)
    ref_params = [p.detach().clone() for p in model.parameters()]
    ref_scale = step.scaler.state_dict() if step.scaler else None

    torch.manual_seed(123)
    model, _, opt, step = _setup(policy)
    first = _run(step, 0, k)
    save_checkpoint(tmp_path / "ck.pt", model, opt, step.scaler, policy, step=k, extra={"tokens": 96})
    torch.manual_seed(999)  # perturb everything a fresh process would have differently
    random.seed(5)
    model2, _, opt2, step2 = _setup(policy)
    ck = load_checkpoint(tmp_path / "ck.pt", model2, opt2, step2.scaler)
    assert ck.step == k and ck.extra == {"tokens": 96} and ck.policy.to_dict() == policy.to_dict()
    rest = _run(step2, ck.step, n)
    assert first + rest == full  # exact float equality, step by step
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), ref_params))
    if ref_scale is not None:
        assert step2.scaler.state_dict() == ref_scale


def test_checkpoint_is_weights_only_and_fp32(tmp_path):
    model, _, opt, step = _setup(Policy.default("fp16"))
    _run(step, 0, 2)
    save_checkpoint(tmp_path / "sub" / "ck.pt", model, opt, step.scaler, Policy.default("fp16"), step=2)
    payload = torch.load(tmp_path / "sub" / "ck.pt", weights_only=True)
    assert payload["autoprec_checkpoint"] == 1 and payload["step"] == 2
    assert all(t.dtype == torch.float32 for t in payload["model"].values())
    assert payload["scaler"]["scale"] == step.scaler.get_scale()
    for st in payload["optimizer"]["state"].values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["ck.pt"]  # no temp file left behind


def test_save_failure_keeps_old_checkpoint(tmp_path, monkeypatch):
    model, _, opt, _ = _setup(Policy.fp32())
    path = tmp_path / "ck.pt"
    save_checkpoint(path, model, opt, step=1)
    old = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model, opt, step=2)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    monkeypatch.undo()
    # an extra value weights_only loading would refuse: refused at save, naming the key, the old file kept
    import numpy as np

    with pytest.raises(TypeError, match=r"ck\.pt\): extra\['best'\] is not JSON-able .*nothing was written"):
        save_checkpoint(path, model, opt, step=2, extra={"epoch": 1, "best": np.float32(0.5)})
    assert path.read_bytes() == old
    save_checkpoint(path, model, opt, step=2, extra={"epoch": 1, "best": [0.5, "x", {"k": None}]})
    assert load_checkpoint(path, model).extra["best"] == [0.5, "x", {"k": None}]


def test_load_errors_name_the_file(tmp_path):
    model, _, opt, _ = _setup(Policy.fp32())
    with pytest.raises(AutoprecError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", model, opt)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(AutoprecError, match="junk.pt"):
        load_checkpoint(tmp_path / "junk.pt", model, opt)
    torch.save({"a": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(AutoprecError, match="not an autoprec checkpoint"):
        load_checkpoint(tmp_path / "other.pt", model, opt)
    save_checkpoint(tmp_path / "ck.pt", nn.Linear(2, 2), opt)
    with pytest.raises(AutoprecError, match="do not match this model"):
        load_checkpoint(tmp_path / "ck.pt", model, opt)


def test_loop_resume_matches_uninterrupted(tmp_path):
    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    kw = {"compile": False, "quiet": True}
    full = train(TINY, pol, steps=4, **kw)
    ck = tmp_path / "ck.pt"
    part = train(TINY, pol, steps=2, checkpoint=ck, **kw)
    rest = train(TINY, pol, steps=4, checkpoint=ck, resume=True, log_path=tmp_path / "log.jsonl", **kw)
    assert rest.start_step == 2 and part.losses + rest.losses == full.losses
    assert (tmp_path / "log.jsonl").read_text().count("\n") == 2
    other = tmp_path / "q.json"
    Policy.default("bf16").save(other)
    with pytest.raises(AutoprecError, match="different policy"):
        train(TINY, other, steps=5, checkpoint=ck, resume=True, **kw)
    # a policy that differs in one setting only: the message names it (it showed two equal summaries)
    scaled = Policy.default("fp16")
    (tmp_path / "a.json").write_text(scaled.to_json())
    ck16 = tmp_path / "ck16.pt"
    train(TINY, tmp_path / "a.json", steps=1, checkpoint=ck16, **kw)
    every2 = dataclasses.replace(scaled.loss_scaling, growth_interval=2)
    slower = dataclasses.replace(scaled, loss_scaling=every2)
    slower.save(tmp_path / "b.json")
    with pytest.raises(AutoprecError, match=r"different policy than .*b.json \(loss_scaling.growth_interval: "
                                            r"2000 vs 2: the checkpoint's first\)"):
        train(TINY, tmp_path / "b.json", steps=2, checkpoint=ck16, resume=True, **kw)


def test_resumed_run_drops_the_log_lines_it_redoes(tmp_path):
    """An interrupted run's log holds the steps after its last checkpoint; the resumed run redoes
    them. A user's ``--log`` held steps 300-318 twice (a loss curve from it doubled back): the resume
    drops them first, keeps what came before and any other line, and a cut-off last line."""
    import json

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    kw = {"compile": False, "quiet": True}
    ck, log = tmp_path / "ck.pt", tmp_path / "log.jsonl"
    full = train(TINY, pol, steps=5, **kw)
    train(TINY, pol, steps=2, checkpoint=ck, log_path=log, **kw)
    with open(log, "a") as f:  # the interrupted run went on past its checkpoint at step 2
        f.write('{"step": 2, "loss": 9.0}\n{"note": "kept"}\n{"step": 3, "loss": 9.0}\n{"step": 4, "lo')
    rest = train(TINY, pol, steps=5, checkpoint=ck, resume=True, log_path=log, **kw)
    rows = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [r.get("step") for r in rows] == [0, 1, None, 2, 3, 4]
    assert [r["loss"] for r in rows if "step" in r] == pytest.approx(full.losses, rel=0, abs=0)
    assert rest.start_step == 2
    train(TINY, pol, steps=5, checkpoint=tmp_path / "none.pt", resume=True, log_path=log, **kw)
    assert len(log.read_text().splitlines()) == 11  # no checkpoint to resume from: appended, nothing dropped


def test_cli_checkpoint_resume(tmp_path, capsys):
    from autoprec.cli import main

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    ck = tmp_path / "ck.pt"
    base = ["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(ck)]
    assert main(base + ["--steps", "2"]) == 0
    capsys.readouterr()
    assert main(base + ["--steps", "3", "--resume", "--log", str(tmp_path / "l.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and "step    2" in out and "step    1 " not in out
    assert "skipped steps 0 (of steps 2-2, run after the resume)" in out  # its own steps, named
    assert main(["train", str(TINY), "--policy", str(pol), "--resume"]) == 2


def test_resume_of_finished_run_is_a_no_op(tmp_path, capsys):
    """Issue 20, item 5: ``--resume`` on a checkpoint at step ≥ --steps exits 0 with one line."""
    from autoprec.cli import main

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    ck = tmp_path / "ck.pt"
    base = ["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(ck)]
    assert main(base + ["--steps", "2"]) == 0
    stamp = ck.stat().st_mtime_ns
    capsys.readouterr()
    for steps in ("2", "1"):
        assert main(base + ["--steps", steps, "--resume"]) == 0
        cap = capsys.readouterr()
        line = f"checkpoint {ck} is at step 2 of --steps {steps}: the run is complete, nothing to do"
        assert cap.out.splitlines() == [line], cap
        assert ck.stat().st_mtime_ns == stamp
    res = train(TINY, pol, steps=2, checkpoint=ck, resume=True, compile=False, quiet=True)
    assert res.complete and res.start_step == 2 and res.losses == []
    other = tmp_path / "q.json"
    Policy.default("bf16").save(other)
    with pytest.raises(AutoprecError, match="different policy"):  # a finished run still checks the policy
        train(TINY, other, steps=2, checkpoint=ck, resume=True, compile=False, quiet=True)


def test_a_run_without_resume_never_overwrites_an_existing_checkpoint(tmp_path, capsys):
    """A 3-step run's checkpoint was replaced, rc 0 and no word, by a 1-step run that forgot
    --resume: refused before anything is built (exit 2, no log written), naming the file, the step it
    holds and the choices; a file there that is no checkpoint is refused too, and kept as it was."""
    from autoprec.cli import main
    from autoprec.training.checkpoint import peek_checkpoint

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    ck, log = tmp_path / "ck.pt", tmp_path / "log.jsonl"
    base = ["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(ck)]
    assert main(base + ["--steps", "3"]) == 0
    stamp = ck.stat().st_mtime_ns
    capsys.readouterr()
    assert main(base + ["--steps", "1", "--log", str(log)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and not log.exists()  # refused before the model was built
    assert (f"checkpoint {ck} holds a run at step 3; without --resume this run would start at step 0 and "
            "overwrite it. To keep it, pass --resume to continue it (with --steps above that step to train "
            "further), or give another --checkpoint path; to start over, remove it first") in cap.err
    assert peek_checkpoint(ck).step == 3 and ck.stat().st_mtime_ns == stamp
    with pytest.raises(AutoprecError, match="holds a run at step 3"):  # the API's rule too
        train(TINY, pol, steps=5, checkpoint=ck, compile=False, quiet=True)
    assert main(base + ["--steps", "4", "--resume"]) == 0  # the way on it names
    assert peek_checkpoint(ck).step == 4
    junk = tmp_path / "notes.pt"
    junk.write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(junk)]) == 2
    err = capsys.readouterr().err
    assert (f"checkpoint {junk} already exists (not an autoprec checkpoint (not a torch.save file: it begins "
            "b'not a ch')); without --resume") in err and "To keep it, give another --checkpoint path" in err
    assert junk.read_bytes() == b"not a checkpoint"
    old = tmp_path / "old.pt"  # torch.save's pre-zip format, which mmap (peek_checkpoint) cannot read
    torch.save(torch.load(ck, weights_only=True), old, _use_new_zipfile_serialization=False)
    assert main(["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(old)]) == 2
    assert f"checkpoint {old} holds a run at step 4; without --resume" in capsys.readouterr().err


def test_resume_under_another_number_of_processes_is_refused(tmp_path, capsys):
    """A checkpoint records how many processes wrote it: rank r of N trains on get_batch(k*N + r),
    so resuming a --nproc 2 run in one process trained on other batches, silently."""
    from autoprec.cli import main
    from autoprec.training.checkpoint import peek_checkpoint

    pol = tmp_path / "p.json"
    Policy.fp32().save(pol)
    ck = tmp_path / "ck.pt"
    base = ["train", str(TINY), "--policy", str(pol), "--no-compile", "--checkpoint", str(ck)]
    assert main(base + ["--steps", "2"]) == 0
    assert peek_checkpoint(ck).extra == {"world_size": 1}
    payload = torch.load(ck, weights_only=False)
    payload["extra"]["world_size"] = 2  # as `train --nproc 2` writes it
    torch.save(payload, ck)
    stamp = ck.stat().st_mtime_ns
    capsys.readouterr()
    assert main(base + ["--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {ck} was saved by a run of 2 processes (train --nproc 2) and this one has 1" in err
    assert ck.stat().st_mtime_ns == stamp  # nothing written
    # the no-op on a finished run checks the count too (it answered "the run is complete" for any --nproc)
    assert main(base + ["--steps", "2", "--resume"]) == 2
    assert "was saved by a run of 2 processes (train --nproc 2) and this one has 1" in capsys.readouterr().err
    assert ck.stat().st_mtime_ns == stamp
