"""The T5 seq2seq example (issue 20): pad-to-longest batches, attention masks, labels padded with
-100, through ``tune``, ``train``, ``bench`` and the Python API loop; ``bench`` measures every row
on batches of varying shape and exits non-zero when one fails; ``apply`` serves a batch outside the
example's ranges (``strict_shapes=True`` raises a clear error instead)."""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.capture import warmup_steps
from autoprec.cli import main
from autoprec.commands.bench import CONFIGS, run_bench
from autoprec.commands.bench_shapes import CompileWatch, drop_compiled_steps
from autoprec.measure import Timing
from autoprec.modelspec import load_model_spec
from tests.conftest import EXAMPLES

T5 = str(EXAMPLES / "t5_seq2seq.py")
EAGER = ["fp32_eager", "autocast_eager", "pure_low_eager", "policy_eager"]


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(T5)


@pytest.fixture()
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.json"
    autoprec.Policy.default("bf16").save(path)
    return path


def test_example_batches_pad_to_longest_with_masks_and_ignored_labels(spec):
    batches = [spec.get_batch(i, "cpu") for i in range(6)]
    assert len({(tuple(b["input_ids"].shape), tuple(b["labels"].shape)) for b in batches}) > 2  # shapes vary
    for b in batches:
        assert b["attention_mask"].shape == b["input_ids"].shape
        assert ((b["attention_mask"] == 0) == (b["input_ids"] == 0)).all()  # padding is masked
        assert (b["labels"] == -100).any()  # targets of their own lengths, padded with -100
    torch.testing.assert_close(spec.get_batch(3, "cpu")["labels"], batches[3]["labels"])  # deterministic
    model = spec.build_model()
    assert model.config.dropout_rate == 0.1 and not hasattr(model.config, "max_position_embeddings")


@pytest.mark.heavy
def test_tune_on_the_example(tmp_path: Path):
    out = tmp_path / "policy.json"
    code = main(["tune", T5, "--out", str(out), "--trials", "1", "--no-compile", "--traj-steps", "0",
                 "--device", "cpu"])
    assert code == 0
    assert autoprec.Policy.load(out).rules is not None


def test_train_on_the_example(tmp_path: Path, policy_file: Path):
    log = tmp_path / "train.jsonl"
    code = main(["train", T5, "--policy", str(policy_file), "--steps", "6", "--no-compile", "--device", "cpu",
                 "--log", str(log)])
    assert code == 0
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)


def _bench_rows(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.heavy
def test_bench_eager_rows_on_varying_shapes_exit_0(tmp_path: Path, policy_file: Path):
    out = tmp_path / "bench.json"
    code = main(["bench", T5, "--policy", str(policy_file), "--steps", "2", "--warmup", "1", "--device",
                 "cpu", "--configs", *EAGER, "--json", str(out)])
    assert code == 0
    res = _bench_rows(out)
    assert res["timing"]["warmup_steps"] >= 5  # every distinct shape of the 5 batches met before timing
    for name in EAGER:
        row = res["configs"][name]
        assert row["error"] is None and row["steps_timed"] > 0 and row["tokens_per_s"] > 0, name
        assert row["compiles_timed"] == 0


# A model whose forward refuses anything but fp32 weights: the pure-low rows fail, the others run.
FP32_ONLY = textwrap.dedent("""
    import torch
    from torch import nn

    class Fp32Only(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.out = nn.Linear(16, 32)

        def forward(self, input_ids):
            if self.out.weight.dtype != torch.float32:
                raise RuntimeError("this model runs in fp32 weights only")
            logits = self.out(self.emb(input_ids))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten())

    def build_model():
        torch.manual_seed(0)
        return Fp32Only()

    def get_batch(step, device):
        g = torch.Generator().manual_seed(step)
        return {"input_ids": torch.randint(0, 32, (4, 8), generator=g).to(device)}
""")


def test_bench_exits_1_when_a_row_fails(tmp_path: Path, capsys):
    path = tmp_path / "model.py"
    path.write_text(FP32_ONLY)
    pol = tmp_path / "p.json"
    autoprec.Policy.fp32().save(pol)
    code = main(["bench", str(path), "--policy", str(pol), "--steps", "1", "--warmup", "0", "--device", "cpu",
                 "--configs", "fp32_eager", "pure_low_eager", "policy_eager"])
    assert code == 1
    err = capsys.readouterr().err
    assert "pure_low_eager failed (RuntimeError: this model runs in fp32 weights only)" in err
    assert "policy_eager" not in err


# Token sequences of varying length, with dropout, a model torch.compile handles in seconds.
VARYING = textwrap.dedent("""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.mid = nn.Linear(16, 16)
            self.out = nn.Linear(16, 32)
            self.drop = nn.Dropout(0.1)

        def forward(self, input_ids, labels):
            logits = self.out(self.drop(torch.relu(self.mid(self.emb(input_ids)))))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def build_model():
        torch.manual_seed(0)
        return Tiny()

    def get_batch(step, device):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 32, (4, [6, 9, 6, 12, 7, 10, 6, 8][step % 8]), generator=gen).to(device)
        return {"input_ids": ids, "labels": ids.roll(1, 1)}
""")


@pytest.mark.slow  # compiles per shape (25 s)
def test_bench_compiled_rows_run_every_shape_untimed_compiles(tmp_path: Path):
    """pure_low_compiled was compiled for batch 0's shape only (Guard failed on the next) and
    autocast_compiled recompiled per shape; now every row is measured, none compiles in its timed
    steps, and the warm-up reaches batch 5's new shape (5 distinct shapes in 6 batches: a warm-up
    of one step per distinct shape stopped at batch 4)."""
    path = tmp_path / "model.py"
    path.write_text(VARYING)
    pol = autoprec.Policy.default("bf16")
    names = ["fp32_eager", "autocast_compiled", "pure_low_compiled"]
    res = run_bench(path, pol, steps=6, warmup=1, device="cpu", configs=names, quiet=True, time_cap_s=30)
    assert res["timing"]["warmup_steps"] == 6  # shapes of batches 0..5: the last new one at batch 5
    for name in names:
        row = res["configs"][name]
        assert row["error"] is None and row["steps_timed"] > 0, (name, row["error"])
        assert row["compiles_timed"] == 0, name
        # dropout: compiled rows are judged against the compiled FP32 graph on the fp32 weights
        # (pure_low_compiled's reference gradients were zeros on its bf16 copy: grad_rel_l2 ~1e300)
        assert row["grad_rel_l2"] < 0.1, (name, row["grad_rel_l2"])


def test_warmup_meets_every_shape_and_compiled_steps_are_dropped():
    b = lambda t: {"input_ids": torch.zeros(2, t, dtype=torch.long)}  # noqa: E731
    assert warmup_steps([b(4), b(4), b(5), b(4), b(6)], 2) == 5  # not 3 (the count of distinct shapes)
    assert warmup_steps([b(4), b(4)], 2) == 2
    watch = CompileWatch(lambda: None)
    watch.compiled = [0, 4, 6]  # a warm-up call and the 2nd and 4th timed calls compiled
    t = Timing.from_steps([0.1, 9.0, 0.1, 8.0, 0.1], 10.0, rounds=2)
    kept, n = drop_compiled_steps(t, watch, warm=3, tokens=10.0)
    assert n == 2 and kept.step_times == [0.1, 0.1, 0.1] and kept.rounds == 2


@pytest.mark.slow  # 32 s; tests/applied/test_dynamic_shapes.py trains on 20 shapes
def test_python_api_loop_over_batches_of_other_shapes(spec, caplog):
    """A plain loop after apply(model, policy, get_batch(0)): batch 0's shape is captured static, and
    the first batch of another shape captures once more with dynamic dimensions (logged), whose ranges
    (T5 has no max_position_embeddings: twice batch 0's lengths) every later batch fits, no error."""
    model = spec.build_model()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), spec.get_batch(0, "cpu"), compile=False)
    opt = torch.optim.AdamW(mp.parameters(), lr=1e-3)
    shapes = set()
    with caplog.at_level(logging.INFO, logger="autoprec"):
        for step in range(8):
            batch = spec.get_batch(step, "cpu")
            shapes.add((batch["input_ids"].shape[1], batch["labels"].shape[1]))
            loss = mp(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert math.isfinite(loss.item())
    assert len(shapes) > 4
    # torch.compile's rule: batch 0's shape static, dynamic dimensions at the first other shape
    assert "differ from the one shape captured; captured again with dynamic dimensions" in caplog.text
    assert mp.shape_stats["recaptures"] == 1  # ranges twice batch 0's: every later batch fits


@pytest.mark.heavy
def test_strict_shapes_raises_a_clear_error(spec):
    model = spec.build_model()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), spec.get_batch(0, "cpu"), compile=False,
                        strict_shapes=True)
    mp(**spec.get_batch(0, "cpu"))
    with pytest.raises(ValueError) as e:
        mp(**spec.get_batch(1, "cpu"))  # source length 32 > batch 0's 27
    msg = str(e.value)
    assert "dim 1 (seq) is 32, allowed 2..27" in msg and "target_seq" in msg
    assert "padded to one size" not in msg  # the old hint contradicted the separate target_seq
    assert "target lengths (target_seq) on their own" in msg and "strict_shapes=True" in msg


@pytest.mark.slow
def test_bench_every_row_on_the_example(tmp_path: Path, policy_file: Path):
    """All eight rows on T5 (compiles of several minutes on a 2-core CPU): each measured, exit 0."""
    out = tmp_path / "bench.json"
    code = main(["bench", T5, "--policy", str(policy_file), "--steps", "2", "--warmup", "1", "--device",
                 "cpu", "--json", str(out)])
    assert code == 0
    res = _bench_rows(out)
    for name in CONFIGS:
        row = res["configs"][name]
        assert row["error"] is None and row["steps_timed"] > 0, (name, row["error"])
        assert row["compiles_timed"] == 0, name


@pytest.mark.slow
def test_python_api_compiled_loop_over_batches_of_other_shapes(spec):
    model = spec.build_model()
    mp = autoprec.apply(model, autoprec.Policy.default("bf16"), spec.get_batch(0, "cpu"))
    opt = torch.optim.AdamW(mp.parameters(), lr=1e-3)
    for step in range(6):
        loss = mp(**spec.get_batch(step, "cpu")).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert math.isfinite(loss.item())
    assert mp.shape_stats["recaptures"] == 1


def test_shape_below_a_range_gets_its_own_graph(caplog):
    """A size under a range's lower bound (torch.export narrowed seq to 3..: logits[:, :-1]) cannot
    be served by a dynamic capture: that shape gets a graph of its own, logged; in-range batches run
    the dynamic graph."""
    from tests.nets import CausalLM, lm_batch

    torch.manual_seed(0)
    model = CausalLM()
    mp = autoprec.apply(model, autoprec.Policy.fp32(), lm_batch(4, 32, 0), compile=False)
    with caplog.at_level(logging.INFO, logger="autoprec"):
        for b, t in [(2, 2), (2, 20), (6, 40), (2, 2)]:
            batch = lm_batch(b, t, 1)
            torch.testing.assert_close(mp(**batch), model(**batch))
    # the example's shape static; (2, 2) captures with dynamic dimensions, whose seq range export
    # narrowed to 3..: that shape gets a graph of its own, and so does (6, 40), above the ranges
    assert "captured again with dynamic dimensions" in caplog.text
    assert "are below those ranges; such shapes get a graph each" in caplog.text
    stats = mp.shape_stats
    # the example's static graph, the dynamic one, and a graph each for (2, 2) and (6, 40)
    assert stats["mode"] == "dynamic+per_shape" and stats["captures"] == 4, stats
