"""The ``autoprec:`` keys of study and trial user attributes, and the infeasible sentinel.

Optuna stores what a trial measured as user attributes (optuna-integration's LightGBMTuner keeps
its own under a prefix too); every module of the search reads and writes them through these
names, so a key is spelt in one place. A study written by an older autoprec keeps working as long
as these strings do not change.
"""

from __future__ import annotations

__all__ = [
    "ACCEPTED", "ATTR", "CASTS", "CONSTRAINT", "CUT", "DRIFT_BUDGET", "DRIFT_RULE", "ERROR", "FINGERPRINT",
    "GRAD_REL_L2", "GRAD_REL_L2_BATCHES", "GRAD_SQNR_DB_MIN", "GRAPH", "INFEASIBLE", "INTERRUPTED",
    "LOSS_REL", "MEASURED", "MEASURE_VERSION", "NOTE", "PEAK_BYTES", "POLICY", "RESULT", "REUSED_FROM",
    "SENSITIVITY", "SPACE", "STEP_S", "STEP_TIMES", "TOKENS_PER_S", "TOKENS_PER_S_BAND", "WORKER",
]

#: Namespace of every user attribute autoprec writes.
ATTR = "autoprec:"

# Trial attributes.
POLICY = ATTR + "policy"  #: the sampled policy, ``Policy.to_dict()``
FINGERPRINT = ATTR + "fingerprint"  #: hash of the per-node dtypes (objective.policy_fingerprint)
#: DriftBudget.excess of the measurement (search/drift_budget.py); feasible when <= 0
CONSTRAINT = ATTR + "constraint"
ERROR = ATTR + "error"  #: why the trial failed (lowering error, non-finite values, ...)
NOTE = ATTR + "note"  #: a remark that does not invalidate the measurement
#: why the trial's drift passes stopped early (search/screen_cut.py): measured in part, never a finalist
CUT = ATTR + "cut"
#: why the trial's drift passes stopped early with the trial accepted (search/screen_cut.py): its drift is
#: within the budget beyond noise on the batches it ran; a finalist candidate like any whole measurement
ACCEPTED = ATTR + "accepted"
WORKER = ATTR + "worker"  #: ``host:pid`` of the process measuring it (workers.is_dead_worker)
INTERRUPTED = ATTR + "interrupted"  #: cut short by Ctrl-C or a killed worker: not counted
REUSED_FROM = ATTR + "reused_from"  #: number of the trial whose measurement of the same graph it copies
CASTS = ATTR + "casts"  #: casts the placement inserted
TOKENS_PER_S = ATTR + "tokens_per_s"
STEP_S = ATTR + "step_s"
STEP_TIMES = ATTR + "step_times"  #: every timed step's seconds (a list), the band's sample
#: ``[lo, hi]`` tokens/s, the bootstrap 95% band of the median step (measure/timing.py, Timing.from_steps)
TOKENS_PER_S_BAND = ATTR + "tokens_per_s_band"
GRAD_REL_L2 = ATTR + "grad_rel_l2"  #: mean over the drift batches
GRAD_REL_L2_BATCHES = ATTR + "grad_rel_l2_batches"  #: per drift batch (a list; non-finite values as None)
LOSS_REL = ATTR + "loss_rel"
GRAD_SQNR_DB_MIN = ATTR + "grad_sqnr_db_min"
PEAK_BYTES = ATTR + "peak_bytes"
#: The Measurement fields a trial records -> their keys.
MEASURED = {"tokens_per_s": TOKENS_PER_S, "step_s": STEP_S, "step_times": STEP_TIMES,
            "grad_rel_l2": GRAD_REL_L2, "grad_rel_l2_batches": GRAD_REL_L2_BATCHES, "loss_rel": LOSS_REL,
            "grad_sqnr_db_min": GRAD_SQNR_DB_MIN, "peak_bytes": PEAK_BYTES}

# Study attributes.
DRIFT_BUDGET = ATTR + "drift_budget"  #: DriftBudget.value of the run that last opened the study
DRIFT_RULE = ATTR + "drift_rule"  #: DriftBudget.to_dict() of that run (the rule behind the constraint)
SENSITIVITY = ATTR + "sensitivity"  #: grad_rel_l2 with only one region lowered, per region
SPACE = ATTR + "space"  #: ``{"dtypes": [...]}`` of the search space the study samples
MEASURE_VERSION = ATTR + "measure_version"  #: storage.MEASURE_VERSION of the trials' measurements
#: ``{"fingerprint": nodekeys.graph_fingerprint, "model": path}`` of the captured graph the trials measure
GRAPH = ATTR + "graph"
#: The last finished tune's choice, for ``autoprec report``: ``{"table", "policy", "timings", "shapes",
#: "levers", "decision"}`` (``search.report.write_report``'s arguments; the policy as a dict)
RESULT = ATTR + "result"

#: The constraint (and sensitivity) recorded for what has no finite drift: larger than any
#: budget, finite so Optuna's constrained samplers and JSON storage accept it.
INFEASIBLE = 1e30
