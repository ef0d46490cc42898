"""What the ranks agree on about a step, besides its exchange: the settings and layout check of
the first step (and that every rank starts from the same parameters and ran ``backward()``), the
4-byte flag of every later exchange step ("no gradient here?"; where the backward hooks started
the exchange, also "gradients changed since?"), and what the 1-bit exchanges announce in round
1, with the message that names the odd ranks when they disagree.

:class:`StepAgreement` is a mixin of :class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`
beside :class:`~hvd_zoadam.shell.driver.StepDriver`, which calls it.
"""
from __future__ import annotations

import warnings
from collections import Counter

from hvd_zoadam.comm.protocol import GRADS_CHANGED, NO_GRADIENT, StepMismatchError, check_layout, step_flags
from hvd_zoadam.core.engine import params_digest


class StepAgreement:
    """The checks and flags the ranks agree on (see the module docstring)."""

    def _check_layout(self, no_gradient: bool = False) -> None:
        """algorithm.md §5: settings and parameter layout compared across ranks, that every rank
        ran backward(), and before the first step of training that every rank starts from the
        same parameters (after a resume inside a window of local steps they may differ). Raises
        on every rank; the next step checks again."""
        items = self.algorithm.settings()
        items.update(bias_correction=self.bias_correction, bucket_cap_numel=self.bucket_cap_numel,
                     scale_block_numel=self.scale_block_numel, auto_exp_avg_mask=self.auto_exp_avg_mask,
                     overlap=self.overlap, backward_passes_per_step=self.backward_passes_per_step,
                     transport=self.transport.name,
                     compression=getattr(self.compression, "__name__", repr(self.compression)))
        items.update(self._engine.layout_items())
        if self.world_size > 1:  # ranks start training from one model; a resume in a window of local steps does not
            items.update(backward=not no_gradient)
            if self._counters["step"] == 0:
                items.update(parameters=params_digest(self._buckets))
        advice = {"backward": _no_backward_message("some rank"), "parameters": _PARAMETERS_DIFFER}
        try:
            check_layout(self.transport, items, advice=advice)
        except ValueError:
            self._reset_passes()  # raised on every rank, nothing exchanged: the step may be taken again
            raise
        self._checked_layout = True

    def _grads_changed_here(self) -> bool:
        """Whether a gradient the hooks' exchange read was replaced or modified since (or, for a
        SYNC step, a learning rate or weight decay)."""
        window = self._overlap.window
        if window is not None and window.lrs is not None and window.lrs != self._lrs():
            return True
        for bi, seen in (window.seen if window is not None else {}).items():
            if any(p.grad is not grad or (grad is not None and grad._version != version)
                   for p, (grad, version) in zip(self._buckets[bi].params, seen)):
                return True
        return False

    def _no_gradient_here(self) -> bool:
        """Whether this rank reached the step with no gradient at all: every laid-out parameter
        that requires one has ``grad`` None (no ``backward()`` since the last ``zero_grad()``)."""
        trainable = [p for b in self._buckets for p in b.params if p.requires_grad]
        return bool(trainable) and all(p.grad is None for p in trainable)

    def _no_gradient_anywhere(self, step: int, no_gradient: bool, armed: bool, exchanges: bool) -> bool:
        """Whether no rank has a gradient (``no_gradient``: this rank's :meth:`_no_gradient_here`),
        so that step ``step`` changes nothing on any rank, as ``torch.optim.Adam.step()`` without
        gradients (Horovod's habit of a step before training, with no ``backward()``). Known
        here at P = 1 and at the first step, whose settings check compares it (some rank
        without a gradient: ValueError on every rank); where overlap is armed the step's flag
        carries it (:meth:`_agree_on_step`; False here). A step that ``exchanges`` nothing (a
        LOCAL step) changes nothing on a rank without a gradient, as torch's, whatever the
        others do: no rank waits for it, and the ranks' counters stay what their own steps
        made them (a rank that skipped backward() alone is one step behind; such a rank warns
        once with what follows). At any other step of P > 1 ranks (overlap off, a GradScaler,
        after clipping was seen) the ranks compare the flag before the exchange
        (:meth:`_agree_on_gradient`), as an armed step does after its early exchange."""
        if not self._checked_layout:
            self._check_layout(no_gradient)
            return no_gradient
        if armed or self.world_size == 1:
            return no_gradient and not armed
        if not exchanges:
            if no_gradient:
                self._warn_no_gradient_at_local()
            return no_gradient
        return self._agree_on_gradient(step, no_gradient)

    def _agree_on_gradient(self, step: int, no_gradient: bool) -> bool:
        """Every rank's :data:`NO_GRADIENT` flag for an exchange step that starts no exchange in
        backward(), in one allgather of 4 bytes a rank (:func:`~hvd_zoadam.comm.protocol.step_flags`,
        what an armed step sends after its early exchange), before any of the step's rounds.
        True where no rank has a gradient (the step changes nothing); some rank without one:
        RuntimeError on every rank naming it, nothing exchanged; else False."""
        return self._no_rank_has_gradient(step_flags(self.transport, self._collectives, step,
                                                     NO_GRADIENT if no_gradient else 0))

    def _no_rank_has_gradient(self, flags: list[int]) -> bool:
        """From every rank's step flags: True where every rank flagged :data:`NO_GRADIENT` (the step
        changes nothing), False where none did; where some did, RuntimeError on every rank naming
        them, the step's passes reset so that it may be taken again."""
        missing = [rank for rank, flag in enumerate(flags) if flag & NO_GRADIENT]
        if missing and len(missing) < len(flags):
            self._reset_passes()
            raise RuntimeError("hvd_zoadam: " + _no_backward_message(
                f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"))
        return bool(missing)

    def _warn_no_gradient_at_local(self) -> None:
        if self._warned_no_gradient:
            return
        self._warned_no_gradient = True
        warnings.warn(f"hvd_zoadam: rank {self.transport.rank} called step() with no gradient at a LOCAL step (no "
                      "backward() since the last zero_grad()): the step changed nothing on this rank, as torch's "
                      "optimizers do. Where every rank did so (a no-op step), nothing follows; if other ranks had "
                      "gradients, this rank's optimizer is now one step behind theirs, and the runs of its "
                      "collectives pair with their next ones. Every rank must run backward() before each step().")

    def _agree_on_step(self, step: int, no_gradient: bool) -> bool:
        """The ranks' flags for a step where overlap is armed, in one allgather of 4 bytes a rank
        (:func:`~hvd_zoadam.comm.protocol.step_flags`), after every rank has started every
        bucket's early exchange (:meth:`.Overlap.complete`), so the collectives pair up.

        A rank without any gradient (:meth:`_no_gradient_here`): every rank raises RuntimeError
        naming it, after the early exchanges are completed; when no rank has one, their results
        are dropped and True is returned (the step changes nothing). Otherwise False. Some
        rank's gradients changed after the hooks started their exchange (e.g. clipped without
        synchronize()): the early
        exchanges are completed and their results dropped, and the step exchanges the
        gradients as they are now, like overlap=False (a COMPRESSED step's early worker side
        only staged its error: ``worker_error`` is untouched until round 2), and no later step
        arms overlap (:meth:`_can_overlap`): at most one step is exchanged twice."""
        mine = (GRADS_CHANGED if self._grads_changed_here() else 0) | (NO_GRADIENT if no_gradient else 0)
        flags = step_flags(self.transport, self._collectives, step, mine)
        if not any(flags):
            return False
        self._drain(self._overlap.window)
        self._overlap.window = None
        if self._no_rank_has_gradient(flags):
            return True
        # The script modifies its gradients between backward() and step() (clipping as DDP scripts do):
        # every rank saw the flag, so every rank stops starting exchanges in backward() alike.
        self._modified_after_backward = self._warned_changed = True
        warnings.warn("hvd_zoadam: gradients changed after backward() had already started their exchange "
                      "(overlap with the backward pass, as in hvd.DistributedOptimizer); this step exchanges "
                      "them again as they are now, and from now on this optimizer starts no exchange during "
                      "backward(), so that what step() exchanges is the gradient as the script leaves it (e.g. "
                      "clipped locally). To clip what the step uses instead (the average in VARIANCE steps), "
                      "call opt.synchronize() first and then `with opt.skip_synchronize(): opt.step()`; "
                      "overlap=False says the same from the first step, without this warning.")
        return False

    def _announced(self, step: int) -> int:
        """What the coming step's 1-bit exchanges announce in round 1 (int32): the iteration of
        :meth:`set_iteration` when the script gives one, else the optimizer step."""
        self._announcing = (step, self._iteration)
        return step if self._iteration is None else self._iteration

    def _naming_ranks(self, exchange, *args, **kwargs):
        """``exchange(*args, **kwargs)``; a :class:`StepMismatchError` is raised again naming
        the ranks that announced another value than most ranks. In the flat exchange every rank
        reads every server's round-2 flags, so every rank gets here together: one allgather of
        what each announced. In the two-level exchange a shard's check may reach one node only,
        so no collective runs there: the message gives this rank's own step and iteration."""
        try:
            return exchange(*args, **kwargs)
        except StepMismatchError as exc:
            if self._engine.topology() is not None:
                step, iteration = self._announcing
                raise StepMismatchError(f"{exc} (rank {self.transport.rank}: optimizer step {step}, iteration "
                                        f"{iteration})") from None
            seen = self.transport.allgather_object(self._announcing, f"zoadam.{self._collectives.prefix}.mismatch")
            raise StepMismatchError(_mismatch_message(str(exc), seen)) from None


_PARAMETERS_DIFFER = (
    "the ranks start from different parameters (a checksum of their bits differs). Make every rank's model the "
    "same before the first step: hvd.broadcast_parameters(model.state_dict(), root_rank=0) under Horovod, "
    "hvd_zoadam.distributed.broadcast_parameters(model.state_dict(), root_rank=0) under torchrun (what "
    "DistributedDataParallel did at construction), hvd_zoadam.mpi.broadcast_parameters under mpirun; or load "
    "the same checkpoint on every rank.")


def _no_backward_message(who: str) -> str:
    return (f"{who} called step() with no gradient at all (every parameter's grad is None: no backward() since "
            "the last zero_grad()). Every rank must run backward() before each step(), or the others would "
            "average its gradient as 0; to leave out a bad batch, multiply its loss by 0 on that rank.")


def _odd_ones(values: list) -> tuple:
    """``(the value most ranks hold, "rank r at V, ..." for the others)``; on a tie for the most
    common value, ``(None, every rank's value)``."""
    counts = Counter(values).most_common(2)
    usual = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else None
    return usual, ", ".join(f"rank {r} at {v}" for r, v in enumerate(values) if v != usual)


def _mismatch_message(base: str, seen: list) -> str:
    """The message of a step mismatch, from every rank's ``(optimizer step, iteration or None)``
    as its step began (``base``: the exchange's own message). Names the ranks that differ from
    most ranks (all of them on a tie): in the iteration when the steps agree (a rank skipped or
    repeated a whole iteration), else in the step."""
    steps = [t for t, _ in seen]
    iterations = [i for _, i in seen]
    restart = "; restart from the last checkpoint"
    if len(set(steps)) == 1 and len(set(iterations)) == 1:  # what was announced changed during the step
        return (f"{base} (every rank began optimizer step {steps[0]} at iteration {iterations[0]}: call "
                "set_iteration() before backward(), on every rank)")
    if len(set(steps)) == 1 and None in iterations:
        given = [r for r, i in enumerate(iterations) if i is not None]
        return (f"hvd_zoadam: set_iteration() was called on rank(s) {given} only, at optimizer step {steps[0]}: "
                "call it on every rank before each backward(), or on none")
    if len(set(steps)) == 1:
        usual, odd = _odd_ones(iterations)
        where = f", where the other ranks are at iteration {usual}" if usual is not None else ""
        return (f"hvd_zoadam: a rank skipped or repeated a whole iteration: {odd.replace(' at ', ' at iteration ')}"
                f"{where}, all at optimizer step {steps[0]}. Every rank must run backward() and step() at every "
                f"iteration (to leave out a bad batch, zero its loss on that rank){restart}")
    usual, odd = _odd_ones(steps)
    odd = odd.replace(" at ", " at step ")
    others = f", the other ranks at step {usual}" if usual is not None else ""
    if None in iterations:
        return f"{base} ({odd}{others})"
    return (f"hvd_zoadam: ranks are at different optimizer steps: {odd}{others}. Every rank must call step() "
            f"(or skip_synchronize()/synchronize() alike) at every iteration{restart}")
