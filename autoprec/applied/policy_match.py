"""Whether a policy belongs to the model it is applied to (docs/architecture.md#runtime, "A policy of
another model").

A tuned policy names the modules and nodes of the graph it was tuned on. Applied to another
model, none of its module or node rules may select a node: it would then train as its op-class
rules alone while its file (and its ``measured`` block) say otherwise. :func:`check_policy_matches`
refuses that case unless forced; op-class rules (``sensitive->fp32``) are model-independent and
never make a policy "of another model", even on a model with no node of that class; a policy of which some
rules match trains, with one warning per rule that matches nothing (``autoprec.passes.assign``).
"""

from __future__ import annotations

import dataclasses
import os

from torch import fx

from autoprec.errors import PolicyError
from autoprec.nodekeys import graph_fingerprint
from autoprec.nodemeta import read_meta
from autoprec.passes.assign import nearest_node_key, unmatched_rules
from autoprec.policy import Policy

__all__ = ["check_policy_file", "check_policy_matches", "tuned_elsewhere"]

#: Rules listed by name in the refusal message (the rest are counted).
_SHOWN = 6


def check_policy_matches(policy: Policy, gm: fx.GraphModule, source: str | os.PathLike | None = None,
                         force: bool = False) -> None:
    """Refuse a policy none of whose module or node rules selects a node of ``gm`` (a policy of
    another model).

    A policy without module or node rules (everything by ``default_dtype`` and op class) and a
    policy with at least one matching module or node rule pass; so does anything with ``force``.

    Args:
        policy: The policy about to be applied.
        gm: The captured graph of the model it is applied to.
        source: The policy file, named in the message (None: "the policy").
        force: Do not check (``autoprec train --force``, ``apply(..., force=True)``).

    Raises:
        PolicyError: every module or node rule matches no node; the message names the policy file, each rule
            that matched nothing (a node rule with the nearest node key), the graph the policy was
            tuned on against this graph's fingerprint (:func:`autoprec.nodekeys.graph_fingerprint`;
            the same graph: rules edited by hand, not another model's policy), and ``--force``.
    """
    specific = [i for i, r in enumerate(policy.rules) if r.module is not None or r.node is not None]
    if force or not specific:
        return
    unmatched = [i for i in unmatched_rules(policy, gm.graph.nodes) if i in specific]
    if len(unmatched) < len(specific):
        return
    name = os.fspath(source) if source is not None else "the policy"
    shown = "; ".join(f"rules[{i}] {policy.rules[i].describe()}{_near(policy.rules[i].node, gm)}"
                      for i in unmatched[:_SHOWN])
    more = f"; … (+{len(unmatched) - _SHOWN} more)" if len(unmatched) > _SHOWN else ""
    here = graph_fingerprint(gm)
    prov = dict(policy.provenance or {})
    tuned = prov.get("graph_fingerprint")
    s = "s" if len(specific) > 1 else ""
    if tuned == here:  # tuned on this very graph: the rules were edited since
        raise PolicyError(
            f"{name}: none of its {len(specific)} module/node rule{s} matches a node of this model's graph "
            f"({shown}{more}), though it was tuned on this graph (fingerprint {here}): the rule{s} "
            "changed by hand since. Fix them (autoprec show POLICY --model MODEL lists each node's key and "
            "module), or pass --force (train, bench) / force=True (apply) to train without them")
    if tuned:
        where = (f"it was tuned on {prov.get('model', 'another model')} (graph fingerprint {tuned}), "
                 f"this model's graph is {here}")
    else:
        where = f"it records no graph fingerprint (this model's graph is {here})"
    wrapped = _wrapper_prefix(policy, gm, specific)
    inside = (f" Under the module prefix {wrapped[0]!r}, {wrapped[1]} of them match: this model wraps the "
              "one the policy was tuned on (peft's PeftModel adds 'base_model.model.'); apply it to the "
              "wrapped model (peft: model.get_base_model(), whose modules hold the adapters)."
              if wrapped else "")
    edited = (", or one whose rules were edited by hand (a node rule has a near key here)"
              if "(did you mean" in shown else "")
    raise PolicyError(
        f"{name}: none of its {len(specific)} module/node rule{s} matches a "
        f"node of this model's graph ({shown}{more}); {where}. It would train by default_dtype "
        f"{policy.default_dtype} and op-class rules alone, not as its "
        f"file says: it looks like the policy of another model{edited}.{inside} Tune this model (autoprec "
        "tune), or pass --force (train, bench) / force=True (apply) to train with it anyway")


def _near(node: str | None, gm: fx.GraphModule) -> str:
    """`` (did you mean 'key'?)`` for a node rule naming ``node`` with a near key in ``gm``
    (:func:`autoprec.passes.assign.nearest_node_key`), else empty."""
    near = nearest_node_key(node, gm.graph.nodes) if node is not None else None
    return f" (did you mean {near!r}?)" if near else ""


def _wrapper_prefix(policy: Policy, gm: fx.GraphModule, specific: list[int]) -> tuple[str, int] | None:
    """The module-path prefix of ``gm`` (``"base_model.model."``: a wrapper's modules around the
    tuned model's) under which the most of ``policy``'s module/node rules ``specific`` match, and
    how many; None when no prefix of up to :data:`_PREFIX_DEPTH` path components makes one match."""
    paths = {read_meta(n).module or "" for n in gm.graph.nodes if n.op == "call_function"}
    prefixes = {".".join(p.split(".")[:k]) + "." for p in paths for k in range(1, _PREFIX_DEPTH + 1)
                if p.count(".") >= k}
    best = None
    for prefix in sorted(prefixes):
        rules = tuple(dataclasses.replace(r, module=None if r.module is None else prefix + r.module,
                                          node=None if r.node is None else prefix + r.node)
                      for r in policy.rules)
        missed = set(unmatched_rules(dataclasses.replace(policy, rules=rules), gm.graph.nodes))
        hits = sum(i not in missed for i in specific)
        if hits and (best is None or hits > best[1]):
            best = (prefix, hits)
    return best


#: Path components of a wrapper prefix :func:`_wrapper_prefix` tries (peft: two).
_PREFIX_DEPTH = 3


def tuned_elsewhere(policy: Policy, source: str | os.PathLike, gm: fx.GraphModule,
                    model_path: str) -> str | None:
    """The warning ``train`` and ``bench`` print when ``policy`` (the file ``source``) was tuned on a
    graph other than ``gm`` (its ``provenance.graph_fingerprint``,
    :func:`autoprec.nodekeys.graph_fingerprint`), else None (same graph, or none recorded)."""
    tuned = policy.provenance.get("graph_fingerprint") if policy.provenance else None
    if tuned and tuned != (here := graph_fingerprint(gm)):
        return (f"{os.fspath(source)} was tuned on {policy.provenance.get('model', '?')} (graph {tuned}), "
                f"not on this model {model_path} (graph {here}); its node rules may not match and its "
                "measurements do not apply")
    return None


def check_policy_file(policy: Policy, source: str | os.PathLike | None, gm: fx.GraphModule,
                      model_path: str, force: bool = False, at_batching: bool = True) -> str | None:
    """What ``train`` and ``bench`` (one process or ``--nproc``) check of a policy before using it
    on the model captured as ``gm``: refuse the policy of another model (:func:`check_policy_matches`,
    naming ``source``, unless ``force``), and return the warning to print when the policy file was
    tuned on another graph (:func:`tuned_elsewhere`) or changed since it was measured
    (:meth:`~autoprec.policy.Policy.edited_note`), else None (also when ``source`` is None: a
    :class:`~autoprec.policy.Policy` given in Python has no file to name). ``at_batching``: whether
    ``gm`` was captured at the policy's ``batching`` micro-batch (``train``, ``bench
    --global-batch``); False (``bench`` at the model file's batch, which says so): the graph of a
    policy with ``batching`` was recorded at its micro-batch, so it is not compared.

    Raises:
        PolicyError: as :func:`check_policy_matches`.
    """
    check_policy_matches(policy, gm, source, force)
    if source is None:
        return None
    compared = at_batching or policy.batching is None
    other = tuned_elsewhere(policy, source, gm, model_path) if compared else None
    notes = [n for n in (other, policy.edited_note(source)) if n]
    return "; ".join(notes) or None
