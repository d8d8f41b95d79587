"""The race rule of ``tune``'s final choice (:class:`Race`): compiled contenders head to head with
the baselines a user has without autoprec, timed in the same interleaved rounds
(docs/architecture.md#how-a-policy-is-chosen).

The contenders are the compiled finalists that passed the drift and memory checks
(the autocast twin and all-fp32 among them) and the baselines: torch.autocast + torch.compile,
fp32 + torch.compile (the all-fp32 policy compiled) and fp32 eager. :func:`decide` takes the
fastest; every contender whose throughput ties with it (the bootstrap band of the ratio contains
1.0: :func:`autoprec.measure.noise.compare`) is as fast within the noise, and among those the one
with the lowest drift, then the fewest rules, is written: a tie goes to the lower-drift, simpler
policy. torch.autocast is not a policy; when it is the fastest, the policy that ties with it (the
twin, normally) is written, and when none does (fp32 eager fastest on a tiny model, say) the
policies that tie with the fastest policy are taken by the same rule, and the decision says by
how much the one written trails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from autoprec.measure import Comparison, Narrow, Retire, Settled, Timing, compare
from autoprec.policy import Policy

__all__ = ["EQUIVALENCE_MARGIN", "Contender", "Decision", "Race", "all_fp32", "decide", "out_of_the_running",
           "settled", "tie_key", "tie_order"]

#: Throughput differences within ±this fraction are not resolved by more rounds of the
#: head-to-head (:func:`settled`): a tie whose ratio's band cannot reach past it on the side that
#: would change what is written stays a tie.
#: The same configurations timed in two tunes of one model on one machine differed by more (fp32 +
#: torch.compile of the 24-layer Qwen2 of benchmarks/depth_scaling.py: 822 and 908 tok/s, 10%), so a
#: gain under 5% measured in one run would not be one a user could count on.
EQUIVALENCE_MARGIN = 0.05


@dataclass
class Contender:
    """One configuration of the final head-to-head.

    Attributes:
        name: For the log and the report (``"trial 7"``, ``"autocast twin"``,
            ``"torch.autocast + torch.compile"``).
        policy: The policy to write if it wins; None for torch.autocast (not a policy).
        timing: Its interleaved timing (:func:`autoprec.measure.timing.time_interleaved`).
        grad_rel_l2: Its drift (mean over the drift batches; 0.0 for fp32).
        baseline: What a user gets without autoprec (torch.autocast + torch.compile, fp32 +
            torch.compile, fp32 eager): the bar the written policy must not fall below.
    """

    name: str
    policy: Policy | None
    timing: Timing
    grad_rel_l2: float
    baseline: bool = False

    @property
    def timed(self) -> bool:
        """Whether it has step times (it did not fail or get dropped before any)."""
        return bool(self.timing.step_times) and self.timing.error is None


@dataclass
class Decision:
    """What :func:`decide` chose and why.

    Attributes:
        chosen: The contender whose policy is written.
        fastest: The fastest contender by median tokens/s.
        best_baseline: The fastest baseline (None when no baseline was timed).
        vs_baseline: ``chosen`` against ``best_baseline`` (ratio > 1: faster), or None.
        tied: Names of the contenders tied with ``fastest`` (``fastest`` included).
        verdict: ``"beats"``, ``"tie"`` or ``"slower"`` (against ``best_baseline``; ``"beats"``
            without a baseline).
        rejected: Names of earlier choices rejected on their trajectory (set by the caller, which
            timed the others again without them); :meth:`describe` names them.
        unwritable: Names in ``tied`` without a policy to write (fp32 eager), ``chosen`` aside.
    """

    chosen: Contender
    fastest: Contender
    best_baseline: Contender | None
    vs_baseline: Comparison | None
    tied: list[str]
    verdict: str
    rejected: list[str] = field(default_factory=list)
    unwritable: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One log line, e.g. ``"chosen: trial 7, 1.08x torch.autocast + torch.compile (band
        1.03-1.12, 6 rounds paired): beats torch.autocast + torch.compile"``, with the rejected
        earlier choices after it."""
        after = (f" (after {', '.join(self.rejected)} failed the trajectory check)" if self.rejected
                 else "")
        return self._describe() + after

    def _describe(self) -> str:
        if self.best_baseline is None or self.vs_baseline is None:
            return f"chosen: {self.chosen.name} (no baseline timed)"
        c, b = self.vs_baseline, self.best_baseline.name
        if self.chosen is self.best_baseline:
            return (f"chosen: {self.chosen.name}, the fastest baseline: no searched policy beat it beyond "
                    "the noise")
        paired = f", {c.rounds} rounds paired" if c.rounds else ""  # not the tables' ratio of medians
        text = f"chosen: {self.chosen.name}, {c.ratio:.2f}x {b} (band {c.band[0]:.2f}-{c.band[1]:.2f}" \
            f"{paired})"
        if self.verdict == "tie":
            ties = [n for n in self.tied if n != self.chosen.name and n not in self.unwritable]
            simpler = f", the lower-drift, simpler of {', '.join([self.chosen.name, *ties])}" if ties else ""
            other = self.unwritable
            also = (f"; {', '.join(other)} tie{'s' if len(other) == 1 else ''} too, but "
                    f"{'is' if len(other) == 1 else 'are'} no policy to write" if other else "")
            return text + f": tie{simpler}{also}"
        if self.verdict == "slower":
            return text + f": no policy was as fast as {b} within the noise"
        return text + f": beats {b}"


def _simplicity(c: Contender) -> tuple[float, int]:
    """Sort key of a tie: lower drift, then fewer rules."""
    return tie_key(c.policy, c.grad_rel_l2)


def tie_key(policy: Policy | None, grad_rel_l2: float) -> tuple[float, int]:
    """The tie rule's sort key of a policy and its drift (:func:`_simplicity`): lower drift (a
    non-finite one last), then fewer rules (None, not a policy: none). Also the micro-batch phase's
    (:func:`autoprec.search.micro_batch.pick`)."""
    g = grad_rel_l2 if math.isfinite(grad_rel_l2) else math.inf
    return g, len(policy.rules) if policy is not None else 0


def all_fp32(pol: Policy) -> bool:
    """Whether ``pol`` computes everything in fp32 (what fp32 + torch.compile runs), whatever its
    rules: the all-fp32 finalist is a baseline."""
    return pol.dtypes_used() <= {"fp32"} and pol.activation_memory_budget >= 1.0


def decide(contenders: list[Contender]) -> Decision:
    """Choose the policy to write from the timed contenders (the module docstring's rule).

    Args:
        contenders: Finalists and baselines, each feasible (drift and memory checked by the
            caller, which checks the trajectory of the choice); those without step times, and
            those the head-to-head retired (``Timing.retired``), are ignored.

    Returns:
        A :class:`Decision`.

    Raises:
        ValueError: no contender with a policy was timed (and not retired).
    """
    # A retired contender was judged out of the running on the rounds it had; on a machine whose
    # speed drifts, the others' later rounds need not agree with its rate (the table keeps it), so
    # it is none of the roles below. The retire rule never retires the fastest, the fastest
    # baseline or the fastest policy.
    timed = [c for c in contenders if c.timed and not c.timing.retired]
    writable = [c for c in timed if c.policy is not None]
    if not writable:
        raise ValueError("no policy was timed in the final head-to-head")
    fastest = max(timed, key=lambda c: c.timing.tokens_per_s)
    tied = [c for c in timed if c is fastest or compare(c.timing, fastest.timing).tie]
    pool = [c for c in tied if c.policy is not None]
    if not pool:  # no policy is as fast as the fastest: those as fast as the fastest policy
        top = max(writable, key=lambda c: c.timing.tokens_per_s)
        pool = [c for c in writable if c is top or compare(c.timing, top.timing).tie]
    chosen = min(pool, key=_simplicity)
    baselines = [c for c in timed if c.baseline]
    best = max(baselines, key=lambda c: c.timing.tokens_per_s) if baselines else None
    names = [c.name for c in tied]
    unwritable = [c.name for c in tied if c.policy is None]
    if best is None:
        return Decision(chosen, fastest, None, None, names, "beats", unwritable=unwritable)
    vs = compare(chosen.timing, best.timing)
    verdict = "tie" if vs.tie else ("beats" if vs.winner == "a" else "slower")
    return Decision(chosen, fastest, best, vs, names, verdict, unwritable=unwritable)


def out_of_the_running(baselines: set[str], policies: set[str]) -> Retire:
    """The head-to-head's retire rule (:func:`autoprec.measure.timing.time_interleaved`), from
    :func:`decide`'s: the policy written is one that ties with the fastest contender, or, when none
    does, the fastest policy, and it is judged against the fastest baseline. So a contender slower
    than the fastest beyond the noise (:func:`autoprec.measure.noise.compare`: the ratio's 95% band
    excludes 1.0) is timed no further, unless it is the fastest baseline or the fastest policy. Its
    tokens/s keeps the rounds it was timed in, with their (wider) band. A configuration timed beside
    the contenders but not one of them (torch.autocast + torch.compile over the drift budget: a row
    of the report's table) is retired the same way, but is never the fastest the others are judged
    against. On the Qwen2s of benchmarks/depth_scaling.py three of five contenders were retired
    after three rounds, and the head-to-head took 58 s against 87 s (24 layers) and 10 s against
    23 s (4 layers; benchmarks/results/depth_2026-12-03_retire).

    Args:
        baselines: Names of the contenders that are baselines (``Contender.baseline``).
        policies: Names of the contenders with a policy to write (``Contender.policy``); the
            contenders are ``baselines | policies``.

    Returns:
        ``{name: Timing}`` -> ``{name: reason}`` (the reason: the ratio, its band and the rounds).
    """
    def retire(timings: dict[str, Timing]) -> dict[str, str]:
        timed = {n: t for n, t in timings.items() if t.step_times}
        if (fastest := _fastest(timed, baselines | policies)) is None:
            return {}
        keep = {fastest, _fastest(timed, baselines), _fastest(timed, policies)}
        out = {}
        for n, t in timed.items():
            c = compare(t, timed[fastest])
            if n not in keep and c.winner == "b":
                there = timed[fastest].tokens_per_s
                out[n] = (f"{c.ratio:.2f}x {fastest}, band {c.band[0]:.2f}-{c.band[1]:.2f}, in the "
                          f"{t.rounds} rounds both ran ({fastest}: {there:.0f} tok/s there): out of the "
                          "running, timed no further")
        return out
    return retire


def settled(baselines: set[str], policies: set[str], tie_order: Sequence[str] | None = None) -> Settled:
    """The head-to-head's early stop (:func:`autoprec.measure.timing.time_interleaved`'s
    ``settled``), from :func:`decide`'s rule: the decision is fixed once every contender still
    timed either does not tie with the fastest (:func:`autoprec.measure.noise.compare`: its
    ratio's 95% band excludes 1.0) or could change the decision only by a difference under
    :data:`EQUIVALENCE_MARGIN`. After :func:`out_of_the_running` those still timed are the fastest,
    the fastest baseline, the fastest policy and the ties, so once none ties, the policy written and
    its verdict against the fastest baseline ("beats" or "slower") are what more rounds would give
    too: they would only narrow the bands.

    A tie is settled as a tie by the margin (the two one-sided tests of equivalence, Schuirmann 1987,
    "A comparison of the two one-sided tests procedure and the power approach for assessing the
    equivalence of average bioavailability", J. Pharmacokinet. Biopharm. 15(6), each side at the
    band's 97.5%), on the side where more rounds could change what is written: a contender that
    :func:`decide` would write before the fastest in a tie (earlier in ``tie_order``: lower drift,
    fewer rules) is written as long as it ties, so only its falling behind by more than the margin
    matters (band's low end >= 1 - margin); any other one changes the decision only by turning out
    faster than the fastest (band's high end <= 1 + margin). Without ``tie_order``, and for the
    policies tied with a fastest contender that has no policy (torch.autocast), both ends must lie
    within the margin. A configuration timed beside the contenders but not one of them is ignored.
    The rule must hold after two rounds in a row, so one lucky round of six steps does not end the
    timing (each look at the bands is another chance of a separation by noise).

    On the 24-layer Qwen2 of benchmarks/depth_scaling.py the band rule alone kept the two survivors
    timed to ``max_rounds`` (torch.autocast + torch.compile's band stayed at ±4.6%); two tied
    survivors (fp32 + torch.compile and a bf16-storage policy, 908 against 903 tok/s) were timed
    until both bands were ±3%; and a searched policy at 0.94x fp32 + torch.compile (band 0.92-0.99
    at the end) was timed 11 rounds, 43 s of finalists, until its band left 1.0, although from its
    first rounds it could not have been over 5% faster.

    Args:
        baselines: Names of the contenders that are baselines (``Contender.baseline``).
        policies: Names of the contenders with a policy to write (``Contender.policy``).
        tie_order: The names in ``policies`` in the order :func:`decide` prefers them in a tie
            (:func:`tie_order`), or None.

    Returns:
        ``{name: Timing}`` of those still timed, once per round -> whether the decision has been
        fixed after this round and the one before (a fresh predicate per head-to-head).
    """
    in_a_row = 0
    rank = {n: i for i, n in enumerate(tie_order)} if tie_order is not None else None

    def settled_against(name: str, fastest: str, c: Comparison) -> bool:
        """Whether more rounds of ``name`` against ``fastest`` cannot change the decision."""
        if not c.tie:
            return True
        low_ok, high_ok = c.band[0] >= 1 - EQUIVALENCE_MARGIN, c.band[1] <= 1 + EQUIVALENCE_MARGIN
        if rank is None or (name in rank and fastest not in rank):
            return low_ok and high_ok
        if name in rank and rank[name] < rank[fastest]:  # written while it ties
            return low_ok
        return high_ok

    def done(timings: dict[str, Timing]) -> bool:
        nonlocal in_a_row
        timed = {n: t for n, t in timings.items() if t.step_times and n in baselines | policies}
        fastest = _fastest(timed, baselines | policies)
        fixed = fastest is not None and all(settled_against(n, fastest, compare(t, timed[fastest]))
                                            for n, t in timed.items() if n != fastest)
        in_a_row = in_a_row + 1 if fixed else 0
        return in_a_row >= 2
    return done


def tie_order(candidates: Iterable[tuple[str, Policy, float]]) -> list[str]:
    """Names of ``(name, policy, grad_rel_l2)`` in the order :func:`decide` prefers them in a tie:
    lower drift, then fewer rules (:func:`settled`'s ``tie_order``)."""
    return [name for name, pol, g in sorted(candidates, key=lambda c: tie_key(c[1], c[2]))]


@dataclass(frozen=True)
class Race:
    """The race rule of one head-to-head, in one object: which contenders are baselines, which have a
    policy to write, and the order a tie is broken in; from these, the retire rule
    (:func:`out_of_the_running`), the early stop (:func:`settled`) and the verdict (:func:`decide`)
    all follow :func:`decide`'s rule (the module docstring).

    Attributes:
        baselines: Names of the baselines (``Contender.baseline``).
        policies: Names of the contenders with a policy to write (``Contender.policy``).
        order: ``policies`` in the order :func:`decide` prefers them in a tie (:func:`tie_order`).
    """

    baselines: frozenset[str]
    policies: frozenset[str]
    order: tuple[str, ...] = ()

    @classmethod
    def of(cls, contenders: Iterable[Contender]) -> Race:
        """The race of ``contenders`` (their timings unused: the race is fixed before timing)."""
        lineup = list(contenders)
        writable = [(c.name, c.policy, c.grad_rel_l2) for c in lineup if c.policy is not None]
        return cls(frozenset(c.name for c in lineup if c.baseline), frozenset(n for n, _p, _g in writable),
                   tuple(tie_order(writable)))

    def retire(self) -> Retire:
        """A fresh retire rule for :func:`autoprec.measure.timing.time_interleaved`
        (:func:`out_of_the_running`)."""
        return out_of_the_running(set(self.baselines), set(self.policies))

    def settled(self) -> Settled:
        """A fresh early stop for :func:`autoprec.measure.timing.time_interleaved` (:func:`settled`)."""
        return settled(set(self.baselines), set(self.policies), list(self.order))

    def narrow(self, lineup: Callable[[dict[str, Timing]], list[Contender]]) -> Narrow:
        """The head-to-head's last rounds (:func:`autoprec.measure.timing.time_interleaved`'s
        ``narrow``): once the decision is settled, the policy written (:func:`decide` on the timings
        so far, ``lineup`` making the contenders of them) and every baseline still timed go on
        until their bands are narrow, so the ratios the policy file and the report give (the
        written policy against the fastest baseline and fp32 eager) have bands like ``autoprec
        bench``'s, each side timed in the same rounds (whichever baseline ends fastest); the other
        policies stop (their ratios to the fastest stay paired over the rounds they share). Every
        contender still timed goes on when no policy was timed."""
        def kept(timings: dict[str, Timing]) -> set[str]:
            try:
                chosen = self.decide(lineup(timings)).chosen.name
            except ValueError:
                return set(timings)
            return {chosen} | {n for n in timings if n in self.baselines}
        return kept

    def decide(self, contenders: list[Contender]) -> Decision:
        """The verdict among the timed ``contenders`` (:func:`decide`), each a baseline as this race
        says (:attr:`baselines`: the roles the retire and stop rules timed them by).

        Raises:
            ValueError: no contender with a policy was timed (and not retired).
        """
        return decide([replace(c, baseline=c.name in self.baselines) for c in contenders])


def _fastest(timed: dict[str, Timing], names: set[str]) -> str | None:
    """The name in ``names`` with the highest tokens/s among ``timed`` (None: none timed)."""
    named = [n for n in timed if n in names]
    return max(named, key=lambda n: timed[n].tokens_per_s) if named else None
