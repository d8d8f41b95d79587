"""Issue 20, item 9: a policy none of whose rules matches a node of the model (the policy of another
model) is refused by ``train`` and ``apply`` unless forced (docs/architecture.md#runtime)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from autoprec import PolicyError, apply
from autoprec.cli import main
from autoprec.commands.train import train
from autoprec.policy import Policy
from tests.conftest import MODELS
from tests.nets import Block

MICRO = str(MODELS / "micro_lm.py")

#: What ``tune`` wrote for another model: module rules of a Qwen2 graph and its provenance.
_OTHER = {**Policy.fp32().to_dict(),
          "rules": [{"module": "model.layers.0.*", "op_class": "matmul", "dtype": "bf16"},
                    {"module": "model.layers.1.mlp", "dtype": "bf16"}],
          "provenance": {"model": "examples/qwen2_tiny.py", "graph_fingerprint": "0123456789abcdef"}}


def _policy_file(tmp_path: Path) -> Path:
    p = tmp_path / "qwen_policy.json"
    Policy.from_dict(_OTHER).save(p)
    return p


def test_train_refuses_a_policy_of_another_model(tmp_path):
    p = _policy_file(tmp_path)
    with pytest.raises(PolicyError) as e:
        train(MICRO, p, steps=1, compile=False, quiet=True)
    msg = str(e.value)
    assert str(p) in msg and "rules[0] model.layers.0.*:matmul->bf16" in msg and "rules[1]" in msg, msg
    assert "0123456789abcdef" in msg and "examples/qwen2_tiny.py" in msg and "--force" in msg, msg


def test_train_force_trains_with_it(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-rule "matches no node" warnings
        res = train(MICRO, _policy_file(tmp_path), steps=1, compile=False, quiet=True, force=True)
    assert len(res.losses) == 1


def test_cli_train_exits_2_unless_force(tmp_path, capsys):
    p = _policy_file(tmp_path)
    assert main(["train", MICRO, "--policy", str(p), "--steps", "1", "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert "none of its 2 module/node rules matches a node" in err and "--force" in err, err
    assert main(["train", MICRO, "--policy", str(p), "--steps", "1", "--no-compile", "--force"]) == 0


def test_apply_refuses_unless_force_and_a_matching_rule_passes():
    torch.manual_seed(0)
    model, batch = Block(), (torch.randint(0, 100, (2, 8)),)
    with pytest.raises(PolicyError, match="none of its 2 module/node rules matches a node"):
        apply(model, Policy.from_dict(_OTHER), batch, compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply(model, Policy.from_dict(_OTHER), batch, compile=False, force=True)
        # one rule that matches (fc1) is enough: the others only warn
        partly = {**_OTHER, "rules": [*_OTHER["rules"], {"module": "fc1", "dtype": "bf16"}]}
        apply(model, Policy.from_dict(partly), batch, compile=False)
    apply(model, Policy.fp32(), batch, compile=False)  # no rules: nothing to match


def test_op_class_rules_alone_never_make_a_policy_foreign():
    """``Policy.default("fp16")`` (``sensitive->fp32``) on a model with no sensitive node is a generic
    policy, not another model's (tests/cases C06 apply it to a bare Linear)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    apply(model, Policy.default("bf16"), torch.randn(2, 8), compile=False)


def test_a_policy_of_the_wrapped_model_names_the_wrapper_prefix():
    """A policy tuned on a model, applied to a wrapper around it (peft's ``PeftModel`` puts the
    model under ``base_model.model``): the refusal says under which prefix its rules match and to
    apply it to the wrapped model, which then passes."""

    class Holder(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids)

    class Wrapper(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.base_model = Holder(model)

        def forward(self, ids):
            return self.base_model(ids)

    torch.manual_seed(0)
    inner, batch = Block(), (torch.randint(0, 100, (2, 8)),)
    tuned = Policy.from_dict({**Policy.default("bf16").to_dict(),
                              "rules": [{"module": "fc1", "dtype": "fp32"},
                                        {"module": "head", "dtype": "fp32"},
                                        {"module": "nowhere.*", "dtype": "fp32"}]})
    with pytest.raises(PolicyError) as err:
        apply(Wrapper(inner), tuned, batch, compile=False)
    assert ("Under the module prefix 'base_model.model.', 2 of them match: this model wraps the one the "
            "policy was tuned on") in str(err.value), str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rule that matches nothing warns
        apply(inner, tuned, batch, compile=False)
    with pytest.raises(PolicyError) as err:  # no prefix helps a policy of another model
        apply(inner, Policy.from_dict(_OTHER), batch, compile=False)
    assert "Under the module prefix" not in str(err.value)


def test_a_mistyped_node_rule_of_this_models_policy_is_a_hand_edit_with_the_nearest_key(tmp_path):
    """A policy tuned on this very graph whose only node rule names a key the graph lacks
    (``lm_head/linear#7`` for ``#0``) is not "the policy of another model": the refusal says the
    rules were edited since, names the nearest node key, and --force; the warning of a policy that
    trains anyway names it too."""
    from autoprec.capture.trace import capture
    from autoprec.nodekeys import graph_fingerprint
    from autoprec.nodemeta import read_meta

    torch.manual_seed(0)
    model, batch = Block(), (torch.randint(0, 100, (2, 8)),)
    gm = capture(model, batch)
    key = next(k for n in gm.graph.nodes if (k := read_meta(n).key) and k.endswith("linear#0"))
    typo = key[:-1] + "7"
    edited = {**Policy.fp32().to_dict(), "rules": [{"node": typo, "dtype": "bf16"}],
              "provenance": {"model": "m.py", "graph_fingerprint": graph_fingerprint(gm)}}
    with pytest.raises(PolicyError) as e:
        apply(model, Policy.from_dict(edited), batch, compile=False, graph_module=gm)
    msg = str(e.value)
    assert f"did you mean {key!r}?" in msg and "changed by hand" in msg and "--force" in msg, msg
    assert "another model" not in msg, msg
    # apply's default capture is static for the example's shapes, as tune's: the same graph
    with pytest.raises(PolicyError, match=r"did you mean .*changed by hand since"):
        apply(model, Policy.from_dict(edited), batch, compile=False)
    # a dynamic capture (strict shapes) has another fingerprint (symbolic shapes): the near key still
    # makes it say the rules may have been edited
    with pytest.raises(PolicyError, match=r"did you mean .*or one whose rules were edited by hand"):
        apply(model, Policy.from_dict(edited), batch, compile=False, strict_shapes=True)
    partly = {**edited, "rules": [*edited["rules"], {"module": "fc1", "dtype": "bf16"}]}
    with pytest.warns(UserWarning, match=rf"names node '{typo}', which is not in the graph \(did you mean"):
        apply(model, Policy.from_dict(partly), batch, compile=False, graph_module=gm)


def test_show_names_the_nearest_key_of_a_node_rule_that_matches_nothing(tmp_path, capsys):
    p = tmp_path / "typo.json"
    typo = {**Policy.fp32().to_dict(), "rules": [{"node": "head/linear#7", "dtype": "bf16"}]}
    Policy.from_dict(typo).save(p)
    assert main(["show", str(p), "--model", MICRO]) == 0
    out = capsys.readouterr().out
    assert "rules[0] head/linear#7->bf16: 0 nodes  (matches no node; did you mean 'head/linear#0'?)" \
        in out, out


def test_a_batching_policy_is_compared_only_with_the_graph_at_its_micro_batch(tmp_path):
    """``bench`` without ``--global-batch`` runs the model file's batch, whose graph differs from the
    one ``tune --global-batch`` recorded at its micro-batch: it said "tuned on another model" for the
    file the policy was tuned on. A graph at the file's batch is not compared for such a policy (the
    CLI's note says bench runs the file's batch); a policy without batching still is."""
    import dataclasses

    from autoprec.applied.policy_match import check_policy_file
    from autoprec.capture import capture
    from autoprec.modelspec import load_model_spec
    from autoprec.policy import Batching
    from tests.conftest import EXAMPLES

    spec = load_model_spec(EXAMPLES / "tiny_mlp.py")
    gm = capture(spec.build_model(), spec.get_batch(0, "cpu"))
    src = tmp_path / "p.json"
    tuned = Policy.fp32().with_provenance(graph_fingerprint="0123456789abcdef", model="tiny_mlp.py")
    batching = dataclasses.replace(tuned, batching=Batching(micro_batch=4, accumulation=4))
    assert check_policy_file(batching, src, gm, "tiny_mlp.py", at_batching=False) is None
    warned = check_policy_file(batching, src, gm, "tiny_mlp.py")  # train, bench --global-batch: compared
    assert "was tuned on tiny_mlp.py (graph 0123456789abcdef)" in warned
    assert "was tuned on" in check_policy_file(tuned, src, gm, "tiny_mlp.py", at_batching=False)
