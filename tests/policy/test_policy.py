"""Tests for autoprec.policy: JSON round-trips, validation messages, atomic save, rule resolution."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest

from autoprec.errors import AutoprecError, PolicyError
from autoprec.policy import OP_CLASSES, SCHEMA_VERSION, LossScalingConfig, Policy, Rule
from tests.conftest import ROOT


def complex_policy() -> Policy:
    return Policy(
        default_dtype="bf16",
        rules=(
            Rule(op_class="sensitive", dtype="fp32"),
            Rule(module="model.layers.0.*", op_class="matmul", dtype="fp32"),
            Rule(module="model.layers.1.*", op_class="matmul", dtype="bf16"),
            Rule(node="model.layers.3.mlp.down_proj/linear#0", dtype="fp16"),
        ),
        accumulate="none",
        loss_scaling=LossScalingConfig(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25,
                                       growth_interval=3, min_scale=2.0, max_scale=2.0**20),
        provenance={"model": "examples/qwen2_tiny.py", "torch": "2.13", "nested": {"k": [1, 2.5, None]}},
        measured={"tokens_per_s": 1234.5, "grad_rel_l2": 1e-2, "peak_bytes": 123456789},
    )


POLICIES = {"default": Policy.default(), "default_fp16": Policy.default(low="fp16"),
            "fp32": Policy.fp32(), "complex": complex_policy()}


def write(tmp_path: Path, data, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def base(**kw) -> dict:
    d = Policy.default().to_dict()
    d.update(kw)
    return d


# ------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_dict_round_trip(name):
    p = POLICIES[name]
    d = p.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d  # JSON-ready
    assert Policy.from_dict(d) == p
    assert Policy.from_dict(json.loads(p.to_json())) == p


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_save_load_round_trip(tmp_path, name):
    p = POLICIES[name]
    path = tmp_path / "sub" / "dir" / "p.json"  # parents are created
    p.save(path)
    assert Policy.load(path) == p
    assert Policy.load(str(path)) == p
    assert path.read_text().endswith("\n")


def test_to_dict_layout_matches_design():
    d = complex_policy().to_dict()
    assert list(d) == ["schema_version", "default_dtype", "rules", "accumulate", "loss_scaling",
                       "master_weights", "optimizer_state", "provenance", "measured"]
    # the field is written only when set, so files without it stay readable by older versions
    d2 = dataclasses.replace(complex_policy(), activation_memory_budget=0.5).to_dict()
    assert list(d2)[7:] == ["activation_memory_budget", "provenance", "measured"]
    # no schema-2 field is used, so the file is written as schema 1 (older readers take it)
    assert d["schema_version"] == 1 and SCHEMA_VERSION == 4
    assert d["rules"][0] == {"op_class": "sensitive", "dtype": "fp32"}
    assert d["rules"][1] == {"module": "model.layers.0.*", "op_class": "matmul", "dtype": "fp32"}
    assert d["rules"][3] == {"node": "model.layers.3.mlp.down_proj/linear#0", "dtype": "fp16"}
    assert list(d["loss_scaling"]) == ["mode", "init_scale", "growth_factor", "backoff_factor",
                                       "growth_interval", "min_scale", "max_scale"]
    assert complex_policy().to_json() == json.dumps(d, indent=2)


def test_design_example_loads(tmp_path):
    """The docs/architecture.md#policy-file example (no max_scale) loads; missing fields other than
    default_dtype take defaults."""
    text = """{
      "schema_version": 1, "default_dtype": "bf16",
      "rules": [{"op_class": "sensitive", "dtype": "fp32"},
                {"module": "model.layers.0.*", "op_class": "matmul", "dtype": "fp32"},
                {"node": "model.layers.3.mlp.down_proj/linear#0", "dtype": "fp16"}],
      "accumulate": "fp32",
      "loss_scaling": {"mode": "dynamic", "init_scale": 65536.0, "growth_factor": 2.0,
                       "backoff_factor": 0.5, "growth_interval": 2000, "min_scale": 1.0},
      "master_weights": "fp32", "optimizer_state": "fp32",
      "provenance": {"model": "examples/qwen2_tiny.py"},
      "measured": {"tokens_per_s": 0, "grad_rel_l2": 0}
    }"""
    p = Policy.load(write(tmp_path, text))
    assert len(p.rules) == 3 and p.loss_scaling.max_scale == 2.0**24
    assert p.needs_loss_scaling
    assert Policy.from_dict({"schema_version": 1, "default_dtype": "bf16"}) == Policy()
    # the one field besides the version a file must name: its default would lower every other node
    # to bf16 without a word (a user test deleted it from an fp32 policy, which then trained bf16)
    with pytest.raises(PolicyError, match=r"^p.json: default_dtype: missing; a policy file names the dtype"):
        Policy.from_dict({"schema_version": 1, "rules": [{"op_class": "matmul", "dtype": "fp32"}]}, "p.json")


def test_defaults_and_constructors():
    assert Policy.default().rules == (Rule(op_class="sensitive", dtype="fp32"),)
    assert Policy.default().default_dtype == "bf16"
    assert Policy.default("fp16").default_dtype == "fp16"
    assert Policy.fp32().default_dtype == "fp32" and Policy.fp32().rules == ()
    ls = LossScalingConfig()  # torch.amp.GradScaler defaults
    got = (ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval)
    assert got == (2.0**16, 2.0, 0.5, 2000)
    assert OP_CLASSES == ("matmul", "sensitive", "follow", "nonfloat")


def test_dtypes_used_and_loss_scaling():
    assert Policy.default().dtypes_used() == {"bf16", "fp32"}
    assert not Policy.default().needs_loss_scaling
    assert Policy.default("fp16").needs_loss_scaling
    assert complex_policy().dtypes_used() == {"bf16", "fp32", "fp16"}
    assert complex_policy().needs_loss_scaling
    # bf16-only policies may skip scaling (cases C07)
    Policy(loss_scaling=LossScalingConfig(mode="none"))


def test_with_measured_and_provenance_are_copies():
    p = Policy.default().with_provenance(model="m.py", torch="2.13")
    q = p.with_provenance(torch="2.14", device="cpu")
    assert dict(p.provenance) == {"model": "m.py", "torch": "2.13"}
    assert dict(q.provenance) == {"model": "m.py", "torch": "2.14", "device": "cpu"}
    r = q.with_measured({"tokens_per_s": 10.0})
    assert dict(r.measured) == {"tokens_per_s": 10.0} and dict(q.measured) == {}
    with pytest.raises(TypeError):
        r.measured["x"] = 1.0  # read-only
    src = {"a": 1}
    s = Policy(provenance={"nested": src})
    src["a"] = 2
    assert s.provenance["nested"] == {"a": 1}  # deep-copied
    with pytest.raises(PolicyError, match=r"measured\.x"):
        p.with_measured({"x": math.inf})


def test_pickle_and_deepcopy():
    """Policies cross process boundaries (search workers) and get deep-copied."""
    import copy
    import pickle

    p = complex_policy()
    assert pickle.loads(pickle.dumps(p)) == p
    q = copy.deepcopy(p)
    assert q == p and q.provenance is not p.provenance


def test_summary():
    p = Policy(rules=(Rule(op_class="sensitive", dtype="fp32"), Rule(node="a/linear#0", dtype="fp32"),
                      Rule(node="b/linear#0", dtype="fp32")))
    assert p.summary() == "default bf16; sensitive->fp32; 2 node rules"
    s = complex_policy().summary()
    assert "\n" not in s and "model.layers.0.*:matmul->fp32" in s and "loss scaling dynamic" in s


# ------------------------------------------------------------------------------------- validation

REJECTIONS = [
    # (mutation of the default policy dict, field named in the message, extra text expected)
    ({"schema_version": 5}, "schema_version", "versions 1, 2, 3 and 4"),
    ({"schema_version": "1"}, "schema_version", "not supported"),
    ({"schema_version": True}, "schema_version", "not supported"),
    ({"extra": 1}, "extra", "unknown top-level key"),
    ({"default_dtype": "fp64"}, "default_dtype", "valid: bf16, fp16, fp32"),
    ({"default_dtype": "fp8_e4m3"}, "default_dtype", "valid: bf16, fp16, fp32"),
    ({"default_dtype": 16}, "default_dtype", "expected a string"),
    ({"rules": {"op_class": "matmul"}}, "rules", "expected a list"),
    ({"rules": ["sensitive"]}, "rules[0]", "expected a JSON object"),
    ({"rules": [{"op_class": "sensitive", "dtype": "fp32"}, {"dtype": "fp32"}]}, "rules[1]",
     "at least one of op_class, module, node"),
    ({"rules": [{"op_class": "softmax", "dtype": "fp32"}]}, "rules[0].op_class",
     "valid: matmul, sensitive, follow"),
    ({"rules": [{"op_class": "nonfloat", "dtype": "fp32"}]}, "rules[0].op_class", "never cast"),
    ({"rules": [{"op_class": "matmul", "dtype": "fp32"}] * 2 + [{"op_class": "follow", "dtype": "fp64"}]},
     "rules[2].dtype", "'fp64' is not a valid dtype; valid: bf16, fp16, fp32"),
    ({"schema_version": 2, "rules": [{"op_class": "sensitive", "dtype": "fp8_e4m3"}]}, "rules[0].dtype",
     "matmul compute dtype"),
    ({"rules": [{"op_class": "matmul", "dtype": "fp8_e4m3"}]}, "rules[0].dtype", "needs schema_version 2"),
    ({"rules": [{"op_class": "matmul", "dtype": "bf16", "compute": "fp32"}]}, "rules[0].compute",
     "needs schema_version 2"),
    ({"schema_version": 2, "rules": [{"op_class": "matmul", "compute": "fp32"}]}, "rules[0].compute",
     "needs a dtype"),
    ({"fp8_scaling": "rowwise"}, "fp8_scaling", "needs schema_version 2"),
    ({"schema_version": 2, "loss_scaling": {"mode": "none"},
      "rules": [{"op_class": "matmul", "dtype": "bf16", "compute": "fp16"}]}, "loss_scaling.mode",
     "rules[0].compute is fp16"),
    ({"schema_version": 2, "rules": [{"op_class": "matmul", "saved": "fp32", "compute": "fp32"}]},
     "rules[0].compute", "needs a dtype"),
    ({"schema_version": 2, "rules": [{"op_class": "matmul", "dtype": "bf16", "compute": "fp64"}]},
     "rules[0].compute", "valid: fp32, bf16, fp16, fp8_e4m3"),
    ({"schema_version": 2, "rules": [{"op_class": "follow", "saved": "fp8_e4m3"}]}, "rules[0].saved",
     "valid: fp32, bf16, fp16, fp8_e5m2"),
    ({"schema_version": 2, "rules": [{"module": "x.*", "dtype": "bf16", "compute": "fp8_e4m3"}]},
     "rules[0].compute", "matmul compute dtype"),
    ({"schema_version": 2, "rules": [{"op_class": "matmul", "dtype": "fp8_e4m3", "compute": "fp32"}]},
     "rules[0].compute", "already is the compute dtype"),
    ({"rules": [{"op_class": "matmul"}]}, "rules[0]", "a rule needs at least one of dtype, saved"),
    ({"rules": [{"op_class": "matmul", "dtype": "fp32", "dtpye": "x"}]}, "rules[0].dtpye",
     "unknown rule key"),
    ({"rules": [{"module": 3, "dtype": "fp32"}]}, "rules[0].module", "non-empty string"),
    ({"rules": [{"node": "", "dtype": "fp32"}]}, "rules[0].node", "non-empty string"),
    ({"accumulate": "fp16"}, "accumulate", "valid: fp32, none"),
    ({"loss_scaling": [1]}, "loss_scaling", "expected a JSON object"),
    ({"loss_scaling": {"mode": "static"}}, "loss_scaling.mode", "valid: dynamic, none"),
    ({"loss_scaling": {"init_scale": 0}}, "loss_scaling.init_scale", "> 0"),
    ({"loss_scaling": {"init_scale": -1.0}}, "loss_scaling.init_scale", "> 0"),
    ({"loss_scaling": {"init_scale": True}}, "loss_scaling.init_scale", "expected a number"),
    ({"loss_scaling": {"init_scale": "65536"}}, "loss_scaling.init_scale", "expected a number"),
    ({"loss_scaling": {"growth_factor": 1.0}}, "loss_scaling.growth_factor", "> 1"),
    ({"loss_scaling": {"backoff_factor": 1.0}}, "loss_scaling.backoff_factor", "(0, 1)"),
    ({"loss_scaling": {"backoff_factor": 0}}, "loss_scaling.backoff_factor", "(0, 1)"),
    ({"loss_scaling": {"growth_interval": 0}}, "loss_scaling.growth_interval", ">= 1"),
    ({"loss_scaling": {"growth_interval": 2000.0}}, "loss_scaling.growth_interval", "integer"),
    ({"loss_scaling": {"growth_interval": True}}, "loss_scaling.growth_interval", "integer"),
    ({"loss_scaling": {"min_scale": 1e6}}, "loss_scaling.min_scale", "above init_scale"),
    ({"loss_scaling": {"min_scale": 0.0}}, "loss_scaling.min_scale", "> 0"),
    ({"loss_scaling": {"max_scale": 1.0}}, "loss_scaling.max_scale", "below init_scale"),
    ({"loss_scaling": {"grow": 2}}, "loss_scaling.grow", "unknown loss_scaling key"),
    ({"master_weights": "bf16"}, "master_weights", "fp32"),
    ({"optimizer_state": "fp16"}, "optimizer_state", "fp32"),
    ({"provenance": "x"}, "provenance", "expected a JSON object"),
    ({"measured": []}, "measured", "expected a JSON object"),
    ({"measured": {"tokens_per_s": "fast"}}, "measured.tokens_per_s", "expected a number"),
    ({"measured": {"ok": True}}, "measured.ok", "expected a number, got bool True"),
    ({"default_dtype": None}, "default_dtype", "expected a string, got null"),  # not "null None"
    ({"default_dtype": "fp16", "loss_scaling": {"mode": "none"}}, "loss_scaling.mode",
     "fp16 without a loss scaler"),
    ({"rules": [{"node": "m/linear#0", "dtype": "fp16"}], "loss_scaling": {"mode": "none"}},
     "loss_scaling.mode", "fp16 without a loss scaler"),
]


@pytest.mark.parametrize("mutation,field,text", REJECTIONS, ids=[r[1] + ":" + r[2] for r in REJECTIONS])
def test_rejections_name_file_and_field(tmp_path, mutation, field, text):
    path = write(tmp_path, base(**mutation))
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {field}: ") and text in msg and "null None" not in msg, msg
    with pytest.raises(PolicyError, match=r"^p\.json: " + field.replace("[", r"\[").replace(".", r"\.")):
        Policy.from_dict(base(**mutation), source="p.json")


NO_SELECTOR = "a rule needs at least one of op_class, module, node"
NO_SETTING = "a rule needs at least one of dtype, saved (it selects nodes but sets nothing for them)"


@pytest.mark.parametrize("rule,expected", [
    ({}, f"rules[1]: {NO_SELECTOR}"),  # selectors are checked before the settings
    ({"dtype": "bf16"}, f"rules[1]: {NO_SELECTOR}"),
    ({"saved": "bf16"}, f"rules[1]: {NO_SELECTOR}"),
    ({"compute": "fp32"}, f"rules[1]: {NO_SELECTOR}"),
    ({"op_class": "matmul"}, f"rules[1]: {NO_SETTING}"),
    ({"module": "blocks.*"}, f"rules[1]: {NO_SETTING}"),
    ({"node": "fc/linear#0", "dtype": None}, f"rules[1]: {NO_SETTING}"),
    ({"op_class": "matmul", "compute": "fp32"},
     "rules[1].compute: needs a dtype in the same rule (the storage dtype)"),
])
def test_rule_without_selector_or_setting_names_what_it_lacks(tmp_path, rule, expected):
    """A rule's exact message: no selector first (whatever it sets), then nothing set (``dtype`` or
    ``saved``, either alone is a rule; ``compute`` needs ``dtype``)."""
    rules = [{"op_class": "sensitive", "dtype": "fp32"}, rule]
    path = write(tmp_path, base(schema_version=2, rules=rules))
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    assert str(e.value) == f"{path}: {expected}"
    with pytest.raises(PolicyError) as e:
        Rule(**rule)
    assert str(e.value) == "Rule: " + expected.removeprefix("rules[1]").removeprefix(": ").removeprefix(".")


@pytest.mark.parametrize("rule", [{"op_class": "matmul", "saved": "bf16"}, {"module": "a.*", "dtype": "bf16"},
                                  {"node": "fc/linear#0", "dtype": "bf16", "compute": "fp32"}])
def test_a_rule_may_set_dtype_or_saved_alone(tmp_path, rule):
    assert Policy.load(write(tmp_path, base(schema_version=2, rules=[rule]))).rules == (Rule(**rule),)


def test_missing_schema_version(tmp_path):
    d = base()
    del d["schema_version"]
    with pytest.raises(PolicyError, match=r"p\.json: schema_version: missing"):
        Policy.load(write(tmp_path, d))


@pytest.mark.parametrize("where", ["measured", "provenance"])
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_rejected_on_load(tmp_path, where, token):
    path = write(tmp_path, json.dumps(base()).replace(f'"{where}": {{}}', f'"{where}": {{"x": {token}}}'))
    with pytest.raises(PolicyError, match=rf"p\.json: {where}\.x: .*finite"):
        Policy.load(path)


def test_non_finite_loss_scaling_rejected(tmp_path):
    text = json.dumps(base()).replace('"max_scale": 16777216.0', '"max_scale": Infinity')
    with pytest.raises(PolicyError, match=r"loss_scaling\.max_scale: inf is not a finite"):
        Policy.load(write(tmp_path, text))


def test_invalid_json_names_file_line_column(tmp_path):
    path = write(tmp_path, '{\n  "schema_version": 1,\n  "default_dtype": "bf16"\n  "rules": []\n}')
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    assert str(e.value).startswith(f"{path}: invalid JSON at line 4, column 3")


@pytest.mark.parametrize("text,expected", [("[1, 2]", "expected a JSON object"), ("", "invalid JSON"),
                                           ('{"schema_version": 1, "schema_version": 1}', "duplicate key")])
def test_other_malformed_files(tmp_path, text, expected):
    with pytest.raises(PolicyError, match=expected):
        Policy.load(write(tmp_path, text))


def test_missing_file_and_directory(tmp_path):
    missing = tmp_path / "nope" / "p.json"
    with pytest.raises(PolicyError, match=rf"{missing}: no such policy file"):
        Policy.load(missing)
    with pytest.raises(PolicyError, match="is a directory"):
        Policy.load(tmp_path)


def test_policy_error_is_autoprec_error():
    with pytest.raises(AutoprecError):
        Policy.from_dict([])


def test_load_never_evaluates(tmp_path):
    """Only json is used: a pickle payload is just invalid JSON."""
    import pickle

    path = tmp_path / "p.json"
    path.write_bytes(pickle.dumps(Policy.default().to_dict()))
    with pytest.raises(PolicyError, match=str(path)):
        Policy.load(path)


# --------------------------------------------------------------------------- direct construction


@pytest.mark.parametrize("make,field", [
    (lambda: Rule(dtype="fp32"), "Rule: a rule needs"),
    (lambda: Rule(op_class="sensitive", dtype="fp64"), "Rule: dtype: 'fp64'"),
    (lambda: Rule(op_class="follow", dtype="fp8_e4m3"), "Rule: dtype"),
    (lambda: LossScalingConfig(backoff_factor=2.0), "LossScalingConfig: backoff_factor"),
    (lambda: Policy(default_dtype="fp16", loss_scaling=LossScalingConfig(mode="none")),
     "Policy: loss_scaling.mode"),
    (lambda: Policy(rules=(Rule(op_class="matmul", dtype="fp16"),),
                    loss_scaling=LossScalingConfig(mode="none")),
     "Policy: loss_scaling.mode: 'none' but rules[0].dtype is fp16"),
    (lambda: Policy(rules=({"op_class": "matmul", "dtype": "fp32"},)), "Policy: rules[0]"),
    (lambda: Policy(master_weights="bf16"), "Policy: master_weights"),
    (lambda: Policy(measured={"loss_rel": math.nan}), "Policy: measured.loss_rel"),
    (lambda: Policy(provenance={"device": object()}), "Policy: provenance.device"),
    (lambda: Policy(provenance={"x": [1.0, math.inf]}), r"Policy: provenance.x[1]"),
])
def test_constructors_validate(make, field):
    with pytest.raises(PolicyError) as e:
        make()
    assert str(e.value).startswith(field), str(e.value)


def test_rule_fp8_only_on_matmuls():
    """fp8_e4m3 is a matmul compute dtype: matmul and node rules take it (as dtype: storage fp32;
    or as compute beside a storage dtype); a rule that may select other ops is refused."""
    for kw in ({"op_class": "matmul"}, {"node": "m/linear#0"}, {"module": "m.*", "op_class": "matmul"}):
        r = Rule(dtype="fp8_e4m3", **kw)
        assert (r.storage, r.compute_dtype, r.schema2) == ("fp32", "fp8_e4m3", True)
        r2 = Rule(dtype="bf16", compute="fp8_e4m3", **kw)
        assert (r2.storage, r2.compute_dtype) == ("bf16", "fp8_e4m3")
    for kw in ({"op_class": "follow"}, {"module": "m.*"}):
        with pytest.raises(PolicyError, match=r"fp8_e4m3.*matmul compute dtype"):
            Rule(dtype="fp8_e4m3", **kw)
    rule = Rule(op_class="matmul", dtype="bf16")
    assert Policy(rules=[rule]).rules == (rule,)  # a list is stored as a tuple
    assert not rule.schema2 and (rule.storage, rule.compute_dtype) == ("bf16", "bf16")


def test_non_finite_values_are_never_written(tmp_path):
    p = Policy.default()
    object.__setattr__(p, "measured", {"grad_rel_l2": math.nan})  # bypass construction checks
    path = tmp_path / "p.json"
    with pytest.raises(PolicyError, match=r"measured\.grad_rel_l2"):
        p.save(path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- atomic save


def test_save_replaces_atomically_and_cleans_up_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    Policy.fp32().save(path)
    old = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        complex_policy().save(path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_save_failure_mid_write_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    Policy.fp32().save(path)
    old = path.read_bytes()
    real_fsync = os.fsync

    def fsync_fails(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="fsync failed"):
        complex_policy().save(path)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    assert Policy.load(path) == Policy.fp32()


def test_save_keeps_file_mode(tmp_path):
    path = tmp_path / "p.json"
    Policy.fp32().save(path)
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o600)
    Policy.default().save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Policy.load(path) == Policy.default()


# ------------------------------------------------------------------------------------ resolution


def test_resolve_later_rules_override_and_nodes_win():
    key = "model.layers.0.mlp.down_proj/linear#0"
    p = Policy(rules=(
        Rule(node=key, dtype="fp16"),
        Rule(op_class="matmul", dtype="fp32"),
        Rule(module="model.layers.0.*", dtype="bf16"),
    ))
    assert p.resolve(key, "matmul", "model.layers.0.mlp.down_proj") == "fp16"  # node rule first, still wins
    assert p.resolve("model.layers.0.mlp.up_proj/linear#0", "matmul", "model.layers.0.mlp.up_proj") == "bf16"
    assert p.resolve("model.layers.1.mlp.up_proj/linear#0", "matmul", "model.layers.1.mlp.up_proj") == "fp32"
    assert p.resolve("model.layers.1.act/silu#0", "follow", "model.layers.1.act") is None
    q = Policy(rules=(Rule(node=key, dtype="fp16"), Rule(node=key, dtype="bf16")))
    assert q.resolve(key, "matmul", "model.layers.0.mlp.down_proj") == "bf16"  # last node rule
    assert Policy.default().resolve("norm/rsqrt#0", "sensitive", "norm") == "fp32"
    assert Policy.default().resolve("lm_head/linear#0", "matmul", "lm_head") is None
    assert Policy.fp32().resolve("x/linear#0", "matmul", "x") is None


@pytest.mark.parametrize("glob,module_path,expected", [
    ("model.layers.0.*", "model.layers.0.mlp", True),
    ("model.layers.0.*", "model.layers.0.mlp.down_proj", True),
    ("model.layers.0.*", "model.layers.0", True),  # the prefix itself
    ("model.layers.0.*", "model.layers.01", False),
    ("model.layers.0.*", "model.layers.1.mlp", False),
    ("model.layers.0*", "model.layers.0", True),
    ("model.layers.0*", "model.layers.0.attn", True),
    ("model.layers.*.mlp", "model.layers.7.mlp", True),
    ("model.layers.*.mlp", "model.layers.7.attn", False),
    ("lm_head", "lm_head", True),
    ("lm_head", "lm_head.inner", False),
    ("Model.*", "model.x", False),  # case-sensitive
    ("*", "", True),
])
def test_rule_module_glob(glob, module_path, expected):
    assert Rule(module=glob, dtype="fp32").matches(f"{module_path}/add#0", "follow", module_path) is expected


def test_rule_all_given_fields_must_match():
    r = Rule(module="model.layers.0.*", op_class="matmul", node="model.layers.0.q/linear#0", dtype="fp32")
    assert r.matches("model.layers.0.q/linear#0", "matmul", "model.layers.0.q")
    assert not r.matches("model.layers.0.q/linear#0", "follow", "model.layers.0.q")
    assert not r.matches("model.layers.0.q/linear#1", "matmul", "model.layers.0.q")
    assert not r.matches("model.layers.0.q/linear#0", "matmul", "model.layers.1.q")
    assert Rule(op_class="matmul", dtype="bf16").matches("anything", "matmul", "x")


def test_property_round_trip(tmp_path):
    """Hypothesis: any valid policy survives save/load unchanged."""
    hyp = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    names = st.text("abc.0", min_size=1, max_size=8)
    rules = st.one_of(
        st.builds(Rule, dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
                  op_class=st.sampled_from(["matmul", "sensitive", "follow"])),
        st.builds(Rule, dtype=st.sampled_from(["fp32", "bf16", "fp16"]), node=names),
        st.builds(Rule, dtype=st.sampled_from(["fp32", "bf16"]), module=names),
    )
    finite = st.floats(allow_nan=False, allow_infinity=False)
    policies = st.builds(
        Policy, default_dtype=st.sampled_from(["fp32", "bf16", "fp16"]), rules=st.lists(rules, max_size=5),
        accumulate=st.sampled_from(["fp32", "none"]),
        measured=st.dictionaries(st.text(max_size=5), st.one_of(finite, st.integers())),
        provenance=st.dictionaries(st.text(max_size=5), st.one_of(st.text(), st.integers(), st.none())),
    )

    @hyp.settings(max_examples=60, deadline=None)
    @hyp.given(policies)
    def check(p):
        assert Policy.from_dict(json.loads(p.to_json())) == p
        p.save(tmp_path / "h.json")
        assert Policy.load(tmp_path / "h.json") == p

    check()


def test_activation_memory_budget_round_trip_and_validation(tmp_path):
    p = dataclasses.replace(Policy.fp32(), activation_memory_budget=0.25)
    path = tmp_path / "p.json"
    p.save(path)
    back = Policy.load(path)
    assert back == p and back.activation_memory_budget == 0.25
    assert "activation memory budget 0.25" in back.summary()
    assert Policy.from_dict({"schema_version": 1, "default_dtype": "fp32"}).activation_memory_budget == 1.0
    for bad, msg in ((1.5, "outside [0, 1]"), (-0.1, "outside [0, 1]"), ("0.5", "expected a number"),
                     (True, "expected a number")):
        d = {**p.to_dict(), "activation_memory_budget": bad}
        path.write_text(json.dumps(d))
        with pytest.raises(PolicyError, match=rf"p.json: activation_memory_budget: .*{re.escape(msg)}"):
            Policy.load(path)


# ------------------------------------------------------------- issue 11: one validation, deep nesting


def test_load_validates_each_object_once(tmp_path, monkeypatch):
    """Policy.load checks the policy, each rule and the loss-scaling block exactly once (it used to
    check a draft naming the file, then again in the constructors)."""
    from autoprec.policy import core

    calls: dict[str, int] = {}

    def counting(cls, name):
        real = cls._validate

        def wrapper(self, *a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(self, *a, **k)
        monkeypatch.setattr(cls, "_validate", wrapper)

    for cls in (Policy, Rule, LossScalingConfig):
        counting(cls, cls.__name__)
    real_fields = core._check_fields
    n_fields = []
    monkeypatch.setattr(core, "_check_fields", lambda p, s: (n_fields.append(s), real_fields(p, s))[1])
    path = write(tmp_path, complex_policy().to_dict())
    expected = complex_policy()
    calls.clear()
    n_fields.clear()
    loaded = Policy.load(path)
    assert calls == {"Policy": 1, "Rule": 4, "LossScalingConfig": 1}, calls
    assert n_fields == [str(path)]  # once, naming the file
    assert loaded == expected


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text", ["[" * 100000, "{\"a\": " * 100000, _nested(100000)])
def test_deeply_nested_json_is_a_policy_error(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    assert str(e.value).startswith(f"{path}: invalid JSON") and "nested too deeply" in str(e.value)


def test_deep_provenance_is_a_policy_error(tmp_path):
    """Nesting that json can parse but that would overflow the validator's recursion."""
    text = json.dumps(base()).replace('"provenance": {}', f'"provenance": {{"x": {_nested(500)}}}')
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=rf"^{re.escape(str(path))}: provenance\.x(\[0\])+: "
                                          r"nested deeper than"):
        Policy.load(path)
    with pytest.raises(PolicyError, match=r"^Policy: provenance\.x"):
        Policy(provenance={"x": json.loads(_nested(500))})
    shallow = json.loads(_nested(10))
    assert Policy(provenance={"x": shallow}).provenance["x"] == shallow


@pytest.mark.parametrize("text", ["[" * 100000, json.dumps(base()).replace(
    '"provenance": {}', f'"provenance": {{"x": {_nested(500)}}}')])
def test_cli_show_deeply_nested_exits_2(tmp_path, capsys, text):
    from autoprec.cli import main

    path = write(tmp_path, text)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autoprec show: error: {path}: ") and "Traceback" not in err, err


# ------------------------------------------------- issue 11: loss-scaling defaults and ranges, one home


def test_loss_scaling_defaults_are_the_scalers():
    """LossScalingConfig and DynamicLossScaler take their defaults from one place
    (autoprec.policy.loss_scaling; torch.amp.GradScaler's, plus autoprec's floor and cap)."""
    import inspect

    from autoprec.policy import loss_scaling as ls
    from autoprec.training.scaler import DynamicLossScaler

    cfg = LossScalingConfig()
    params = inspect.signature(DynamicLossScaler).parameters
    for name in ls.LOSS_SCALING_KEYS[1:]:
        assert params[name].default == getattr(cfg, name) == getattr(ls, name.upper()), name
    ref = torch_gradscaler_defaults()
    assert {k: getattr(cfg, k) for k in ref} == ref


def torch_gradscaler_defaults() -> dict:
    import inspect

    import torch

    p = inspect.signature(torch.amp.GradScaler).parameters
    return {k: p[k].default for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}


@pytest.mark.parametrize("kw,field", [
    ({"min_scale": 0.1}, "min_scale"),  # not a float32 value: the scaler's clamp would move it
    ({"max_scale": 2.0**200, "init_scale": 2.0**16}, "max_scale"),  # above float32 max
    ({"max_scale": 2.0**24 + 1}, "max_scale"),
])
def test_policy_refuses_what_the_scaler_refuses(tmp_path, kw, field):
    """A policy that loads always builds its loss scaler: the ranges are the scaler's (they used to
    differ, so such a policy loaded and then failed at train time with a ValueError)."""
    from autoprec.training.scaler import DynamicLossScaler

    with pytest.raises(ValueError, match=field):
        DynamicLossScaler(**kw)
    with pytest.raises(PolicyError, match=rf"^LossScalingConfig: {field}: "):
        LossScalingConfig(**kw)
    path = write(tmp_path, base(default_dtype="fp16", loss_scaling={**Policy().loss_scaling.to_dict(), **kw}))
    with pytest.raises(PolicyError, match=rf"^{re.escape(str(path))}: loss_scaling\.{field}: "):
        Policy.load(path)


def test_property_config_and_scaler_accept_the_same():
    hyp = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")
    from autoprec.training.scaler import DynamicLossScaler

    nums = st.one_of(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, 3.0, 2.0**16, 2.0**24, 2.0**128, -1.0]),
                     st.floats(-10, 2.0**130, allow_nan=False))
    keys = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")

    @hyp.settings(max_examples=300, deadline=None)
    @hyp.given(st.fixed_dictionaries({k: nums for k in keys}), st.integers(-1, 3))
    def check(kw, gi):
        kw = {**kw, "growth_interval": gi}
        try:
            LossScalingConfig(**kw)
            cfg_ok = True
        except PolicyError:
            cfg_ok = False
        try:
            DynamicLossScaler(**kw)
            scaler_ok = True
        except ValueError:
            scaler_ok = False
        assert cfg_ok == scaler_ok, kw

    check()


# --------------------------------------------------------------------------------------- schema 2


def schema2_policy() -> Policy:
    return Policy(default_dtype="bf16", rules=(
        Rule(op_class="sensitive", dtype="fp32"),
        Rule(op_class="matmul", dtype="bf16", compute="fp32"),
        Rule(module="model.layers.0.*", op_class="matmul", dtype="fp8_e4m3"),
        Rule(node="lm_head/linear#0", dtype="bf16", compute="fp8_e4m3"),
        Rule(op_class="follow", saved="fp8_e5m2"),
        Rule(module="model.layers.1.*", saved="bf16"),
    ))


def test_schema2_round_trips(tmp_path):
    """compute, saved and fp8 rules survive save -> load (written as schema 2, field for field)."""
    p = schema2_policy()
    path = tmp_path / "p2.json"
    p.save(path)
    d = json.loads(path.read_text())
    assert d["schema_version"] == 2
    assert d["rules"][1] == {"op_class": "matmul", "dtype": "bf16", "compute": "fp32"}
    assert d["rules"][2] == {"module": "model.layers.0.*", "op_class": "matmul", "dtype": "fp8_e4m3"}
    assert d["rules"][4] == {"op_class": "follow", "saved": "fp8_e5m2"}
    q = Policy.load(path)
    assert q == p and q.training_key() == p.training_key()
    assert q.dtypes_used() == {"bf16", "fp32", "fp8_e4m3", "fp8_e5m2"}


def test_schema1_files_load_unchanged():
    """Every schema-1 policy file committed in the repository loads, and writes back as schema 1
    with the same JSON (schema 2 changed nothing for them)."""
    files = sorted(ROOT.glob("benchmarks/**/*policy*.json"))
    assert files
    for f in files:
        raw = json.loads(f.read_text())
        if raw.get("schema_version") != 1:
            continue
        p = Policy.load(f)
        d = p.to_dict()
        assert d["schema_version"] == 1
        assert d["rules"] == raw["rules"] and d["default_dtype"] == raw["default_dtype"], f


def test_resolve_compute_goes_with_dtype_and_saved_is_separate():
    p = schema2_policy()
    r = p.resolve_rule("model.layers.3.mlp/linear#0", "matmul", "model.layers.3.mlp")
    assert (r.storage, r.compute_dtype) == ("bf16", "fp32")
    # a later rule that sets dtype resets compute with it (storage fp32, compute fp8)
    r = p.resolve_rule("model.layers.0.mlp/linear#0", "matmul", "model.layers.0.mlp")
    assert (r.storage, r.compute_dtype) == ("fp32", "fp8_e4m3")
    assert p.resolve("model.layers.0.mlp/linear#0", "matmul", "model.layers.0.mlp") == "fp32"
    # node rules win
    r = p.resolve_rule("lm_head/linear#0", "matmul", "lm_head")
    assert (r.storage, r.compute_dtype) == ("bf16", "fp8_e4m3")
    # saved: the last matching rule that sets it; a saved-only rule does not change the dtype
    assert p.resolve_saved("model.layers.1.act/silu#0", "follow", "model.layers.1.act") == "bf16"
    assert p.resolve_saved("model.layers.2.act/silu#0", "follow", "model.layers.2.act") == "fp8_e5m2"
    assert p.resolve_saved("model.layers.2.mlp/linear#0", "matmul", "model.layers.2.mlp") is None
    assert p.resolve("model.layers.1.act/silu#0", "follow", "model.layers.1.act") is None
    assert Rule(op_class="matmul", dtype="bf16", compute="fp32").describe() == "matmul->bf16:fp32"


def test_saved_fp16_needs_no_loss_scaler_and_summary_names_fp8_scaling():
    p = Policy(default_dtype="fp32", rules=(Rule(op_class="follow", saved="fp16"),),
               loss_scaling=LossScalingConfig(mode="none"))
    assert not p.needs_loss_scaling
    q = Policy(default_dtype="fp32", fp8_scaling="rowwise",
               rules=(Rule(op_class="matmul", dtype="fp8_e4m3"),))
    assert "fp8 scaling rowwise" in q.summary()


def test_compile_options_round_trip_as_schema_3_and_older_files_load_unchanged(tmp_path):
    """Issue 52: a policy that records how it is compiled is written as schema 3; schemas 1 and 2
    (no ``compile_options``) load as before, with no say; a schema-2 file naming them, an unknown
    or missing option and a non-bool value are refused naming the file and the field."""
    import dataclasses
    import json

    from autoprec.errors import PolicyError
    from autoprec.policy import CompileOptions, Policy

    tuned = dataclasses.replace(Policy.default("bf16"), compile_options=CompileOptions(False, True))
    path = tmp_path / "p.json"
    tuned.save(path)
    d = json.loads(path.read_text())
    assert d["schema_version"] == 3
    assert d["compile_options"] == {"regional": False, "emulate_precision_casts": True}
    assert Policy.load(path) == tuned and "compiled flat" in tuned.summary()
    old = Policy.default("bf16").to_dict()
    assert old["schema_version"] == 1 and "compile_options" not in old
    assert Policy.from_dict(old).compile_options is None
    bad = [({**old, "compile_options": d["compile_options"]}, "compile_options: needs schema_version 3"),
           ({**d, "compile_options": {"regional": False}},
            "compile_options.emulate_precision_casts: missing"),
           ({**d, "compile_options": {**d["compile_options"], "flat": True}},
            "compile_options.flat: unknown"),
           ({**d, "compile_options": {**d["compile_options"], "regional": "no"}},
            "compile_options.regional: expected true or false")]
    for doc, match in bad:
        with pytest.raises(PolicyError, match=f"^x.json: {match}"):
            Policy.from_dict(doc, "x.json")


def test_batching_round_trips_as_schema_4_and_older_files_load_unchanged(tmp_path):
    """Issue 51: a policy that records its micro-batch and accumulation is written as schema 4
    (``tune --global-batch``); a file without ``batching`` keeps its version and loads with none;
    a schema-3 file naming it, a missing key, an unknown key and a non-integer or zero value are
    refused naming the file and the field."""
    import dataclasses
    import json

    from autoprec.errors import PolicyError
    from autoprec.policy import Batching, CompileOptions, Policy

    tuned = dataclasses.replace(Policy.default("bf16"), compile_options=CompileOptions(True, True),
                                batching=Batching(micro_batch=8, accumulation=2))
    path = tmp_path / "p.json"
    tuned.save(path)
    d = json.loads(path.read_text())
    assert d["schema_version"] == 4 and d["batching"] == {"micro_batch": 8, "accumulation": 2}
    assert Policy.load(path) == tuned and tuned.batching.global_batch == 16
    assert "micro-batch 8 x 2 accumulated (global batch 16)" in tuned.summary()
    assert tuned.training_key() != dataclasses.replace(tuned, batching=None).training_key()
    three = dataclasses.replace(tuned, batching=None).to_dict()
    assert three["schema_version"] == 3 and "batching" not in three
    assert Policy.from_dict(three).batching is None
    bad = [({**three, "batching": d["batching"]}, "batching: needs schema_version 4"),
           ({**d, "batching": {"micro_batch": 8}}, "batching.accumulation: missing"),
           ({**d, "batching": {**d["batching"], "global": 16}}, "batching.global: unknown"),
           ({**d, "batching": {**d["batching"], "micro_batch": 0}},
            "batching.micro_batch: expected an integer >= 1, got int 0"),
           ({**d, "batching": {**d["batching"], "accumulation": 2.0}},
            "batching.accumulation: expected an integer >= 1")]
    for doc, match in bad:
        with pytest.raises(PolicyError, match=f"^x.json: {match}"):
            Policy.from_dict(doc, "x.json")
    with pytest.raises(PolicyError, match="micro_batch: expected an integer >= 1, got bool True"):
        Batching(micro_batch=True)


def test_a_file_changed_since_tune_measured_it_says_so_in_show(tmp_path, capsys):
    """A user added a bf16 rule to a tuned fp32 policy by hand; ``show`` went on reporting the tuned
    "grad_rel_l2 1.72e-07" (the edited policy measures 3.9e-3) without a word. ``tune`` records
    ``provenance.measured_policy``; ``show`` (and ``train``/``bench``) note an edit since."""
    import dataclasses

    from autoprec.cli import main

    tuned = Policy.fp32().with_measured({"grad_rel_l2": 1.72e-7, "tokens_per_s": 1000.0})
    tuned = tuned.with_provenance(measured_policy=tuned.measured_key, model="m.py")
    assert tuned.edited_note("p.json") is None
    edited = dataclasses.replace(tuned, rules=(Rule(op_class="matmul", dtype="bf16"),))
    assert edited.measured_key != tuned.measured_key
    note = edited.edited_note("p.json")
    assert note.startswith("p.json was changed since tune measured it") and "autoprec bench" in note
    # a file without the record (by hand, or older), or without numbers: nothing to say
    assert dataclasses.replace(edited, provenance={}).edited_note("p.json") is None
    assert dataclasses.replace(edited, measured={}).edited_note("p.json") is None
    path = tmp_path / "p.json"
    tuned.save(path)
    assert main(["show", str(path)]) == 0 and "changed since" not in capsys.readouterr().err
    edited.save(path)
    assert main(["show", str(path)]) == 0
    assert f"autoprec show: note: {path} was changed since tune measured it" in capsys.readouterr().err
