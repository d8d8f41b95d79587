"""Drift under dropout at its default (issue 19.2, Done when 3): tiny GPT-2 and T5, dropout 0.1.

Compiled graphs draw their own random numbers (Inductor), and Inductor's dropout rounds
``rand_like(x)`` to x's dtype before comparing it with p, so a compiled bf16 graph drew other masks
than the compiled FP32 reference: torch.autocast + torch.compile measured ``grad_rel_l2`` 1.09e-2
against eager torch.autocast's 5.41e-3 on the GPT-2 below (ratio 1.95, 95% lower bound 1.46), and
the budget no longer meant "as accurate as torch.autocast". The Harness now runs compiled drift
passes on graphs with random ops under ``torch._inductor.config.fallback_random`` (eager's random
ops, eager's masks for every dtype; ``autoprec/measure/harness.py``, ``Harness._grads``).

Checked with the project's own rule (:class:`autoprec.search.drift_budget.DriftBudget`, the paired
one-sided t-test over the K = 4 drift batches, 2% margin) and the selector's own path for compiled
finalists (``AutocastBaseline.compiled_budget``, the contest's drift gate):

* (a) compiled and eager torch.autocast agree: neither is worse than the other beyond the noise
  (T5). On GPT-2 compiled torch.autocast is the more accurate one by ~5% on every batch, so only
  that direction is the rule's; eager's excess is its own arithmetic, not masks: eager bf16
  dropout scales the kept values by 1/0.9 rounded to bf16 (1.109375, -0.16%), Inductor by the
  fp32 constant, and with dropout 0 the two agree to 0.1% (4.80e-3 both).
* (b) the autocast twin (``Policy.autocast("bf16")``), compiled, is feasible under ``auto`` as the
  selector judges compiled finalists on graphs with random ops.

Each model compiles three graphs (torch.autocast's module, the FP32 reference, the twin): GPT-2
runs in the default suite, T5 (encoder and decoder: ~3x the compile time) is ``slow``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from autoprec.measure import Harness
from autoprec.modelspec import load_model_spec
from autoprec.passes import run_pipeline
from autoprec.policy import Policy
from autoprec.search.autocast_baseline import AutocastBaseline
from autoprec.search.contest import Contest
from autoprec.search.drift_budget import DriftBudget
from autoprec.search.gates import Candidate, Entry, Role, first_failure
from autoprec.search.progress import Clock
from autoprec.training.train import make_scaler
from tests.conftest import DRIFT

pytest.importorskip("transformers")

GPT2_MODEL = '''
import torch
import transformers

def build_model():
    """Tiny GPT-2, dropouts at their defaults (resid, embd, attn 0.1), default attention (sdpa)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  use_cache=False)
    return transformers.GPT2LMHeadModel(cfg).train()

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 128, (2, 32), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}
'''

T5_MODEL = '''
import torch
import transformers

def build_model():
    """Tiny T5, dropout_rate at its default (0.1); decoder_start_token_id 0 (T5's pad), which
    shifting the labels needs and T5Config leaves unset."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=128,
                                decoder_start_token_id=0, use_cache=False)
    return transformers.T5ForConditionalGeneration(cfg).train()

def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 128, (2, 24), generator=g).to(device),
            "labels": torch.randint(0, 128, (2, 12), generator=g).to(device)}
'''

MODELS = {"gpt2": GPT2_MODEL, "t5": T5_MODEL}
BF16 = torch.bfloat16
_cache: dict[str, dict] = {}


# both slow (gpt2: 80 s of compiles); tests/measure/test_measure_rng.py checks a compiled dropout finalist
@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) for name in ("gpt2", "t5")])
def measured(request, tmp_path_factory):
    """Per model (measured once per session): the harness, eager torch.autocast's drift, the
    contest after its compiled torch.autocast baseline (budget re-based by
    ``AutocastBaseline.compiled_budget``), and the compiled twin's function and drift."""
    name = request.param
    if name not in _cache:
        path = tmp_path_factory.mktemp(name) / f"{name}_model.py"
        path.write_text(MODELS[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = Harness(load_model_spec(path), torch.device("cpu"), warmup=1, steps=1)
        eager = h.drift(h.model, None, BF16)
        sel = Contest(h, DriftBudget.auto(eager.grad_rel_l2_batches), True, AutocastBaseline(BF16), None, 0,
                      Clock(), True)
        sel.measure_autocast()  # compiled as the contest compiles its baseline; the budget re-based
        twin = Policy.autocast("bf16")
        twin_fn = sel.build(run_pipeline(h.graph_module, twin).graph_module)
        twin_m = h.measure(twin_fn, lambda: make_scaler(twin), timing=False)
        print(f"{name}: grad_rel_l2 per batch: eager autocast {eager.grad_rel_l2_batches}, compiled autocast "
              f"{sel.autocast_compiled.grad_rel_l2_batches}, compiled twin {twin_m.grad_rel_l2_batches}")
        _cache[name] = dict(name=name, h=h, eager=eager, sel=sel, twin=twin, twin_fn=twin_fn, twin_m=twin_m)
    return _cache[name]


def test_compiled_and_eager_autocast_drift_agree_within_the_noise(measured):
    """(a) Compiled torch.autocast is not worse than eager torch.autocast beyond the noise
    (``DriftBudget.auto(eager).feasible(compiled)``; before the fix: ratio 1.95 on GPT-2), and eager
    not worse than compiled: within the rule's 2% on T5, within 10% on GPT-2 (eager's bf16-rounded
    dropout scale, module docstring; measured 1.06). The graphs draw random numbers, and the
    compiled FP32 graph draws eager's masks: its drift against the eager reference is fp32-sized."""
    h, eager, ac = measured["h"], measured["eager"], measured["sel"].autocast_compiled
    assert h.random
    assert eager.error is None and ac.error is None
    assert len(eager.grad_rel_l2_batches) == len(ac.grad_rel_l2_batches) == h.drift_batches
    assert all(math.isfinite(g) and g > 0 for g in eager.grad_rel_l2_batches + ac.grad_rel_l2_batches)
    by_eager = DriftBudget.auto(eager.grad_rel_l2_batches)
    assert by_eager.feasible(ac), by_eager.explain(ac)
    reverse = DriftBudget.auto(ac.grad_rel_l2_batches, margin=0.10 if measured["name"] == "gpt2" else 0.02)
    assert reverse.feasible(eager), reverse.explain(eager)
    # the masks themselves: the compiled FP32 reference against the eager one, batch 0
    from autoprec.metrics import grad_rel_l2

    _loss, g = h._reference(measured["twin_fn"], 0)  # the compiled FP32 reference
    # measured 2.3e-7 (GPT-2); different masks: ~0.5
    assert grad_rel_l2(g, h.ref_grads) < DRIFT[torch.float32]


def test_compiled_twin_is_feasible_under_auto_as_the_selector_judges_it(measured):
    """(b) The selector re-based ``auto`` on torch.autocast + torch.compile (same masks, same
    per-batch rule), and the compiled autocast twin passes its gates."""
    sel, twin_m = measured["sel"], measured["twin_m"]
    assert sel.budget.rule == "auto"
    assert sel.budget.reference == tuple(sel.autocast_compiled.grad_rel_l2_batches)
    assert twin_m.error is None
    entry = Entry(Candidate("autocast twin", Role.POLICY, measured["twin"]), measured["twin_fn"], twin_m)
    assert first_failure(entry, sel.gates).going_on, sel.budget.explain(twin_m)
    # and it is bf16-sized against eager torch.autocast too (not mask-sized: ~0.5)
    assert DriftBudget.auto(measured["eager"].grad_rel_l2_batches, margin=0.10).feasible(twin_m)
