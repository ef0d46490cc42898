"""The step schedule of 0/1 Adam (algorithm.md §4): a pure object.

From the step number t (1, 2, ...) and the config, :meth:`Schedule.kind` says what
kind of step t is, so every rank agrees with no communication. Nothing here imports
torch or horovod, and nothing is stored: the variance intervals follow from t
alone, and the local-step interval from t (``"steps"`` and ``"constant"``
policies) or from the current and the freeze-time learning rate (``"lr"``).
A checkpoint therefore only needs t (and the freeze-time lr), and a reload can
never reset a schedule (algorithm.md §7 #6).
"""
from __future__ import annotations

import enum
import functools
import math
import numbers
from dataclasses import dataclass, replace

LOCAL_STEP_POLICIES = ("steps", "lr", "constant")
VAR_UPDATE_WEIGHTINGS = ("interval", "paper")
NEVER = 2 ** 62  # a var_freeze_step no run reaches: v not frozen (yet)

# The schedule's defaults, in one place: :class:`Schedule`'s fields and every front end's
# ``DistributedOptimizer`` read them, so that ``Schedule(T_f, κ, var_update_interval_max=
# var_update_interval_max(β2))`` gives the step kinds of an optimizer built with the same T_f
# and κ and no other knob.
DEFAULT_LOCAL_STEP_SCALER = 32768
DEFAULT_LOCAL_STEP_CLIPPER = 8
DEFAULT_LOCAL_STEP_POLICY = "lr"
DEFAULT_VAR_UPDATE_WEIGHTING = "interval"
SCHEDULE_DEFAULTS = {"local_step_scaler": DEFAULT_LOCAL_STEP_SCALER, "local_step_clipper": DEFAULT_LOCAL_STEP_CLIPPER,
                     "local_step_policy": DEFAULT_LOCAL_STEP_POLICY,
                     "var_update_weighting": DEFAULT_VAR_UPDATE_WEIGHTING}


class StepKind(enum.Enum):
    """The four kinds of step of algorithm.md §2."""

    VARIANCE = "variance"      #: before the freeze, t in T_v: full-precision average of g
    COMPRESSED = "compressed"  #: before the freeze, t not in T_v: 1-bit allreduce of g
    LOCAL = "local"            #: after the freeze: no communication
    SYNC = "sync"              #: after the freeze, t in T_u: 1-bit allreduce of the window's update


def check_positive_int(value: object, name: str, hint: str = "") -> int:
    """Return ``value`` as an int >= 1 or raise TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int (steps), got {value!r} of type "
                        f"{type(value).__name__}. {hint}".rstrip())
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}. {hint}".rstrip())
    return int(value)


@dataclass(frozen=True)
class Schedule:
    """T_v and T_u of algorithm.md §4. The defaults are the optimizer's (:data:`SCHEDULE_DEFAULTS`).

    Args:
        var_freeze_step: T_f (steps, >= 1). Steps t <= T_f are before the variance freeze.
        var_update_scaler: kappa (>= 1). The variance interval I starts at 1 and doubles
            after every kappa-th variance step, up to ``var_update_interval_max``; t in T_v
            iff t <= T_f and t mod I == 0.
        local_step_scaler: alpha (steps, >= 1; 32768 by default). With the ``"steps"`` policy
            the local-step interval H doubles after every alpha steps past the freeze.
        local_step_clipper: H_max (steps, a power of 2; 8 by default), the cap on H. H takes
            the values 1, 2, 4, ... H_max, so windows between syncs never exceed H_max.
        local_step_policy: ``"lr"`` (the default: H doubles each time the learning rate has
            halved relative to its value at the freeze; paper §4; :meth:`kind` then needs
            ``lr`` and ``freeze_lr``), ``"steps"`` (DeepSpeed's rule) or ``"constant"``
            (H = H_max).
        var_update_weighting: how much an update of v at t in T_v weighs (algorithm.md §4,
            "Weighting the variance updates"): ``"interval"`` (the default) as the
            I = t − t' steps since the previous t' in T_v, v <- β2^I·v + (1 − β2^I)·ḡ², so
            that v weighs time as Adam's does however thin T_v gets; ``"paper"`` as one
            step, v <- β2·v + (1 − β2)·ḡ² (the paper's Algorithm 1 and DeepSpeed's).
        var_update_interval_max: the longest I (a power of 2; :data:`NEVER` by default, the
            paper's T_v). The optimizer's ``"interval"`` weighting sets it to
            :func:`var_update_interval_max` of β2 (8 at 0.95), so that v is updated at least
            once a half-life of β2 (algorithm.md §4).

    Raises:
        TypeError, ValueError: for a knob that is not a positive int, or an unknown policy.
    """

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int = DEFAULT_LOCAL_STEP_SCALER
    local_step_clipper: int = DEFAULT_LOCAL_STEP_CLIPPER
    local_step_policy: str = DEFAULT_LOCAL_STEP_POLICY
    var_update_weighting: str = DEFAULT_VAR_UPDATE_WEIGHTING
    var_update_interval_max: int = NEVER

    def __post_init__(self):
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                     "var_update_interval_max"):
            object.__setattr__(self, name, check_positive_int(getattr(self, name), name))
        if self.var_update_interval_max & (self.var_update_interval_max - 1):
            raise ValueError(f"var_update_interval_max must be a power of 2, got {self.var_update_interval_max}: "
                             "T_v's steps fall on multiples of its interval, which doubles")
        h_max = self.local_step_clipper
        if h_max & (h_max - 1):
            raise ValueError(f"local_step_clipper must be a power of 2 (1, 2, 4, 8, 16, ...), got {h_max}: "
                             "sync steps fall on multiples of H counted from the freeze, and only powers of 2 "
                             "keep every window within local_step_clipper steps")
        if self.local_step_policy not in LOCAL_STEP_POLICIES:
            raise ValueError(f"local_step_policy must be one of {LOCAL_STEP_POLICIES}, "
                             f"got {self.local_step_policy!r}")
        if self.var_update_weighting not in VAR_UPDATE_WEIGHTINGS:
            raise ValueError(f"var_update_weighting must be one of {VAR_UPDATE_WEIGHTINGS}, "
                             f"got {self.var_update_weighting!r}")

    # -- before the freeze ---------------------------------------------------------------
    def variance_state(self, step: int) -> dict:
        """After step ``step`` (counting only steps <= T_f): the variance bookkeeping.

        Returns a dict with ``is_variance`` (step in T_v), ``var_interval`` (I in force
        for the next step), ``var_counter`` (variance steps since I last doubled) and
        ``exp_avg_sq_steps`` (K, the exponent of β2 in v's bias correction: the variance
        steps <= step under ``"paper"`` weighting, the last of them under ``"interval"``,
        whose intervals tile 1 … that step).
        """
        kappa, limit = self.var_update_scaler, min(step, self.var_freeze_step)
        interval, counter, k, last = 1, 0, 0, 0
        while True:
            first = (last // interval + 1) * interval
            if first > limit:
                break
            room = kappa if interval < self.var_update_interval_max else NEVER
            taken = min(room, (limit - first) // interval + 1)
            k += taken
            last = first + (taken - 1) * interval
            if taken < room:
                counter = taken
                break
            interval *= 2
            counter = 0
        return {"is_variance": 1 <= step <= self.var_freeze_step and last == step,
                "var_interval": interval, "var_counter": counter,
                "exp_avg_sq_steps": last if self.var_update_weighting == "interval" else k,
                "last_variance_step": last}

    def variance_update_steps(self, step: int, exp_avg_sq_steps: int) -> int:
        """I, how many steps the update of v at ``step`` (in T_v) stands for: 1 under
        ``"paper"`` weighting; under ``"interval"`` the steps since the last one v covered,
        t − K with K = ``exp_avg_sq_steps`` before this step. That is t − t' with t' the previous
        step in T_v, or after an Adam checkpoint (K = its step count) the steps since it; a
        skipped VARIANCE step leaves its steps to the next update. The update is
        v <- β2^I·v + (1 − β2^I)·ḡ², and K grows by I."""
        if self.var_update_weighting == "paper":
            return 1
        return max(1, step - exp_avg_sq_steps)

    def variance_steps(self, last_step: int) -> list[int]:
        """All t in T_v with t <= last_step, in order (for tests and plots)."""
        out, kappa, interval, t = [], self.var_update_scaler, 1, 0
        limit = min(last_step, self.var_freeze_step)
        while True:
            for _ in range(kappa):
                t = (t // interval + 1) * interval
                if t > limit:
                    return out
                out.append(t)
            interval = min(2 * interval, self.var_update_interval_max)

    # -- after the freeze ----------------------------------------------------------------
    def local_step_interval(self, step: int, lr: float | None = None, freeze_lr: float | None = None) -> int:
        """H in force at step ``step`` (> T_f).

        ``lr``/``freeze_lr`` (the learning rate now and at the freeze) are needed by the
        ``"lr"`` policy only; there H = min(H_max, 2**h) where h is the number of
        halvings of ``lr`` relative to ``freeze_lr`` (H_max when lr == 0).
        """
        h_max = self.local_step_clipper
        if self.local_step_policy == "constant":
            return h_max
        if self.local_step_policy == "lr":
            if lr is None or freeze_lr is None:
                raise ValueError("local_step_policy='lr' needs the current lr and the lr at the freeze")
            if lr <= 0:
                return h_max
            interval, x = 1, float(lr)
            while interval < h_max and 2.0 * x <= freeze_lr:
                x *= 2.0
                interval = min(h_max, 2 * interval)
            return interval
        doublings = (step - self.var_freeze_step - 1) // self.local_step_scaler
        interval = 1
        for _ in range(doublings):
            if interval >= h_max:
                break
            interval = min(h_max, 2 * interval)
        return min(interval, h_max)

    def kind(self, step: int, lr: float | None = None, freeze_lr: float | None = None) -> StepKind:
        """The kind of step ``step`` (1-based). See the class docstring for the rules."""
        step = check_positive_int(step, "step")
        if step <= self.var_freeze_step:
            return StepKind.VARIANCE if self.variance_state(step)["is_variance"] else StepKind.COMPRESSED
        if freeze_lr is None and self.local_step_policy == "lr":
            freeze_lr = lr
        interval = self.local_step_interval(step, lr, freeze_lr)
        return StepKind.SYNC if (step - self.var_freeze_step) % interval == 0 else StepKind.LOCAL

    def describe(self, step: int, lr: float | None = None, freeze_lr: float | None = None) -> dict:
        """Everything a rank can report about the schedule after ``step`` steps (0 = none yet)."""
        var = self.variance_state(step)
        frozen = step > self.var_freeze_step
        out = {"step": step, "frozen": frozen, "var_interval": var["var_interval"],
               "var_counter": var["var_counter"], "exp_avg_sq_steps": var["exp_avg_sq_steps"],
               "local_step_interval": 1, "local_step_counter": 0}
        if frozen:
            past = step - self.var_freeze_step
            if freeze_lr is None and self.local_step_policy == "lr":
                freeze_lr = lr
            out["local_step_interval"] = self.local_step_interval(step, lr, freeze_lr)
            out["local_step_counter"] = past % self.local_step_scaler
        return out


@dataclass(frozen=True)
class AutoFreeze:
    """``var_freeze_step="auto"`` (algorithm.md §4, "The freeze, decided during training"): T_f
    from the learning rate, which every rank reads alike, so that no rank asks another.

    T_f is the first step t at which t >= 2W and t >= E and, unless t >= 2E, the rate has fallen
    since its last rise: W the last step so far whose learning rate rose above the step before's
    (0 while it has not risen), so that the warm-up is over once the rate has not risen for as
    long as it rose (a warm-up that rises in plateaus, as one stepped per epoch, is not taken as
    over on a plateau); and E = max(S, ⌈(1/4)/(1 − β2)⌉), no earlier than S, the step by which v
    has had min(4κ, 32) updates (120 at κ = 8, the end of T_v's fourth interval; 56 at κ = 14),
    nor than a quarter of v's horizon 1/(1 − β2) (250 steps at β2 = 0.999, 13 at 0.98). So twice
    the warm-up, or E with a decaying rate; a rate that has not fallen since its warm-up (a
    constant rate, or a step schedule before its first drop) waits for its first fall or 2E (240
    at κ = 8 and β2 <= 0.995, 500 at 0.999), because v frozen at E and used at the full rate for the rest of
    the run cost 0/1 Adam 1.3–1.9 % against Adam over a random sweep (docs/performance.md, "The
    defaults over a random sweep"). Once decided, T_f never changes. A rate that stays flat for
    2E steps and only then rises (a warm-up stepped per epoch of more than 2E steps) freezes at
    2E, before its rise.

    Args:
        var_update_scaler: κ of the schedule. beta2: β2 of the first param group.
    """

    var_update_scaler: int
    beta2: float

    def earliest(self) -> int:
        """The earliest T_f whatever the warm-up, in steps: max(S, ⌈(1/4)/(1 − β2)⌉), S the step of
        v's min(4κ, 32)-th update in T_v without ``var_update_interval_max`` (120 at κ = 8, 56 at
        κ = 14; the cap moves none of those updates where it is 8 or more, β2 ≥ 0.92)."""
        return _earliest_freeze(self.var_update_scaler, self.beta2)

    def observe(self, state: dict, step: int, lr: float) -> int | None:
        """Take step ``step``'s learning rate into ``state`` (a dict the caller keeps, the same on
        every rank: ``lr_rise_step``, ``lr_fall_step``, ``last_lr``, ``var_freeze_step``; empty at first), and
        return T_f once decided (also ``state["var_freeze_step"]``), else None. Pure but for
        ``state``: the same calls give the same answers on every rank. T_f is ``step`` itself
        when decided, so the kind of ``step`` does not depend on whether it was observed."""
        if state.get("var_freeze_step") is not None:
            return state["var_freeze_step"]
        last = state.get("last_lr")
        if last is not None and lr > last:
            state["lr_rise_step"] = step
        if last is not None and lr < last:
            state["lr_fall_step"] = step
        state["last_lr"] = float(lr)
        rise, earliest = state.get("lr_rise_step") or 0, self.earliest()
        fallen = (state.get("lr_fall_step") or 0) > rise
        if step >= 2 * rise and step >= earliest and (fallen or step >= 2 * earliest):
            state["var_freeze_step"] = step
        return state.get("var_freeze_step")

    def schedule(self, base: Schedule, state: dict) -> Schedule:
        """``base`` with the T_f decided in ``state`` (:data:`NEVER` while undecided)."""
        decided = state.get("var_freeze_step")
        return base if decided is None or decided == base.var_freeze_step else replace(base, var_freeze_step=decided)


def constant_rate_freeze_risk(auto: AutoFreeze | None, step: int, var_freeze_step: int | None, lr: float,
                              freeze_lr: float | None) -> str | None:
    """The regime in which the random sweep found the defaults' freeze costly (docs/performance.md,
    "The defaults over a random sweep"), as a sentence with what to set, else None: under
    ``var_freeze_step="auto"``, v froze at twice the earliest step (``2 * auto.earliest()``: the
    rate had not fallen by then, so the warm-up did not decide it) and the learning rate ``lr`` at
    ``step`` is still the rate at the freeze ``freeze_lr``, ``step`` at least twice the freeze: a
    long run at a constant rate, where a later freeze did better. Pure: every rank gives the same
    answer."""
    if auto is None or var_freeze_step is None or freeze_lr is None or var_freeze_step != 2 * auto.earliest():
        return None
    if step < 2 * var_freeze_step or lr != freeze_lr:
        return None
    return (f"v froze after step {var_freeze_step} with the learning rate unchanged since its warm-up, and the rate "
            f"has not changed since: on a long run at a constant rate v can freeze too early (a random sweep of "
            f"set-ups found 0/1 Adam 1.7 % behind Adam on a 1,134-step run frozen at step 240, 0.2 % frozen at step "
            f"480). If the loss trails Adam's, set var_freeze_step={2 * var_freeze_step}.")


def low_beta2_risk(auto: AutoFreeze | None) -> str | None:
    """The other regime in which the random sweep found the defaults risky: under
    ``var_freeze_step="auto"``, β2 (``auto.beta2``) of 0.95 or less, whose horizon of 20 steps is
    not much longer than the intervals between v's updates before the freeze (8 at 0.95). A
    sentence with what to do, else None. Pure."""
    if auto is None or auto.beta2 > 0.95:
        return None
    return (f"beta2={auto.beta2}: over a random sweep of set-ups the defaults passed 7 of 11 at beta2 = 0.95 (an "
            f"MLP at a high learning rate stopped learning) and 22 of 25 at beta2 >= 0.98 "
            f"(docs/performance.md, 'The defaults over a random sweep'). Prefer beta2 >= 0.98, or compare the loss "
            f"with Adam's early in the run.")


def var_update_interval_max(beta2: float) -> int:
    """The longest interval of T_v under ``"interval"`` weighting at ``beta2``: the largest power
    of 2 within β2's half-life ln ½ / ln β2 (4 at 0.9, 8 at 0.95, 32 at 0.98, 64 at 0.99, 128 at
    0.995, 512 at 0.999; :data:`NEVER` at β2 = 0), so that v is updated at least once a
    half-life: an update then weighs at most 1 − β2^I ≤ ½, and v never lags ḡ² by more than a
    half-life (algorithm.md §4). At κ = 8 this leaves T_v as it was up to step 120 at 0.95, 504
    at 0.98 and 1,016 at 0.99."""
    if not 0 < beta2 < 1:
        return NEVER
    half_life = math.log(0.5) / math.log(beta2)
    return 2 ** min(61, max(0, math.floor(math.log2(max(1.0, half_life)))))


@functools.lru_cache(maxsize=16)
def _earliest_freeze(var_update_scaler: int, beta2: float) -> int:
    """:meth:`AutoFreeze.earliest`, computed once per (κ, β2): it is read at every step before T_f."""
    updates = Schedule(NEVER, var_update_scaler, 1, 1).variance_steps(16 * var_update_scaler)
    return max(updates[min(4 * var_update_scaler, 32) - 1], math.ceil(0.25 / max(1e-12, 1.0 - beta2)))
