"""In-process oracle: P workers of the 1-bit exchange and of 0/1 Adam in plain torch loops.

Built only on :mod:`hvd_zoadam.native.reference` and the paper's formulas, with no
transport, threads or Numba, so the tests can compare the real multi-process
product against it. Each worker is a list of tensors; one bucket holds all of
them as segments, in order (as the optimizer lays out a model smaller than its
bucket cap).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from hvd_zoadam.core.layout import node_shards, padded_numel, scale_segments, segment_offsets, shard_segments
from hvd_zoadam.core.schedule import AutoFreeze, Schedule, StepKind
from hvd_zoadam.native import reference
from hvd_zoadam.oracle.stacked import compressed_allreduce_stacked, hierarchical_allreduce_stacked, row_sum


def simulate_compressed_allreduce(inputs: list[torch.Tensor], worker_errors: list[torch.Tensor],
                                  server_errors: list[torch.Tensor], numels: list[int] | None = None,
                                  server_exact: bool = False):
    """C(y) over P simulated workers.

    Args:
        inputs: P float32 tensors y_r of n elements each.
        worker_errors: P float32[padded_numel(n, P)], updated in place.
        server_errors: P float32[padded_numel(n, P) // P], updated in place.
        numels: segment sizes (default: one segment of n).
        server_exact: an ablation, not the protocol: the result is the exact average of the P
            workers' compressed messages (no server-side recompression; ``server_errors``
            untouched).

    Returns:
        float32[n], the common result; or None when a worker or server scale is non-finite
        (then no buffer changes).
    """
    world_size = len(inputs)
    n = inputs[0].numel()
    offsets = segment_offsets(numels if numels is not None else [n])
    big_n = padded_numel(n, world_size)
    chunk = big_n // world_size
    ys = []
    for y in inputs:
        padded = torch.zeros(big_n)
        padded[:n] = y.reshape(-1).float()
        ys.append(padded)
    if world_size == 1:
        return ys[0][:n].clone() if torch.isfinite(ys[0]).all() else None
    scales = torch.stack([reference.worker_scales(y, e, offsets) for y, e in zip(ys, worker_errors)])
    if not torch.isfinite(scales).all():
        return None
    before = [e.clone() for e in worker_errors], [e.clone() for e in server_errors]
    packed = [reference.worker_pack(y, e, offsets, s) for y, e, s in zip(ys, worker_errors, scales)]
    if server_exact:
        messages = [reference.decompress(pk, sc.expand(world_size, -1), offsets, n) for pk, sc in zip(packed, scales)]
        return sum(messages[1:], messages[0].clone()) / world_size
    server_packed, server_scales = [], []
    for r in range(world_size):
        recv = torch.stack([pk[r * chunk // 8:(r + 1) * chunk // 8] for pk in packed])
        pk, sc = reference.server_reduce(recv, scales, server_errors[r], offsets, r * chunk)
        server_packed.append(pk)
        server_scales.append(sc)
    if not torch.isfinite(torch.stack(server_scales)).all():  # finite worker scales summed past float32
        for now, then in zip(worker_errors + server_errors, before[0] + before[1]):
            now.copy_(then)
        return None
    return reference.decompress(torch.cat(server_packed), torch.stack(server_scales), offsets, n)


def simulate_hierarchical_allreduce(inputs: list[torch.Tensor], worker_errors: list[torch.Tensor],
                                    server_errors: list[torch.Tensor], ranks_per_node: int,
                                    numels: list[int] | None = None):
    """The two-level C_2(y) of :mod:`hvd_zoadam.comm.hierarchical` over P = N·L simulated workers.

    Rank r is local rank r mod L of node r // L. Local rank l's shard (``node_shards``) is
    averaged over its node in float32 (the sum in local-rank order, then divided by L), and the
    N node averages go through :func:`simulate_compressed_allreduce` with the segments cut at
    the shard's ends.

    Args:
        inputs: P float32 tensors of n elements.
        worker_errors, server_errors: P float32 tensors each, rank r's buffers of its shard's
            exchange: ``padded_numel(len_l, N)`` and that over N elements; updated in place.
        ranks_per_node: L (dividing P).
        numels: segment sizes of the bucket (default: one segment of n).

    Returns:
        float32[n], the common result; or None when some node average is non-finite (then no
        buffer changes).
    """
    world_size, local = len(inputs), ranks_per_node
    nodes, n = world_size // local, inputs[0].numel()
    offsets = segment_offsets(numels if numels is not None else [n])
    out = torch.zeros(n)
    staged = []
    for l, (lo, hi) in enumerate(node_shards(n, local)):
        if hi == lo:
            continue
        averages = []
        for a in range(nodes):
            total = inputs[a * local][lo:hi].reshape(-1).float().clone()
            for j in range(1, local):
                total += inputs[a * local + j][lo:hi].reshape(-1).float()
            averages.append(total / local)
        ranks = [a * local + l for a in range(nodes)]
        we, se = [worker_errors[r].clone() for r in ranks], [server_errors[r].clone() for r in ranks]
        result = simulate_compressed_allreduce(averages, we, se, shard_segments(offsets, lo, hi))
        if result is None:
            return None
        out[lo:hi] = result
        staged += list(zip(ranks, we, se))
    for r, we, se in staged:
        worker_errors[r].copy_(we)
        server_errors[r].copy_(se)
    return out


def simulate_zoadam(params: list[torch.Tensor], grad_fn: Callable[..., list[torch.Tensor]] | None = None, *,
                    world_size: int, steps: int, schedule: Schedule, lr_fn: Callable[[int], float],
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float | torch.Tensor = 0.0, decoupled: bool = False, bias_correction: bool = True,
                    scale_block_numel: int = 2048, precondition: bool = True, auto_mask: bool = True,
                    exact: tuple[str, ...] = (), server_exact: bool = False, clip_scale: float | str = 1.0,
                    trace: list[dict] | None = None, ranks_per_node: int | None = None,
                    batched_grad_fn: Callable[..., torch.Tensor] | None = None, stacked: bool = True,
                    sync_momentum_average: float = 0.0, auto_freeze: AutoFreeze | None = None):
    """0/1 Adam (algorithm.md §2) on P simulated workers, one bucket of all ``params``, with one
    scale per block of ``scale_block_numel`` elements of each tensor (as the optimizer).

    The P workers' x and m are rows of float32[P, n] tensors, so every update is one
    elementwise operation over all ranks (bitwise what P separate updates give).
    ``precondition`` and ``auto_mask`` mirror the optimizer's ``precondition_compression``
    and ``auto_exp_avg_mask``; with both False this is the paper's algorithm to the letter.

    Args:
        params: list of float32 tensors, the common initial x.
        grad_fn: ``grad_fn(step, rank, xs) -> list of tensors``, rank r's gradient at x = xs
            (views of rank r's row, shaped as ``params``; read only).
        batched_grad_fn: instead of ``grad_fn``, ``batched_grad_fn(step, x) -> float32[P, n]``,
            every rank's flat gradient (bucket order) at x = float32[P, n] (read only).
        stacked: the exchange of :mod:`hvd_zoadam.oracle.stacked` (vectorised over ranks and
            segments; for large P); False: the per-rank one of this module, built on
            :mod:`hvd_zoadam.native.reference` call by call. The two differ at most in the
            last float64 bit of a scale's sum of squares.
        lr_fn: ``lr_fn(step) -> float``.
        auto_freeze: an :class:`~hvd_zoadam.core.schedule.AutoFreeze` when T_f is decided during
            the run, as the optimizer's ``var_freeze_step="auto"`` (``schedule.var_freeze_step``
            is then :data:`~hvd_zoadam.core.schedule.NEVER`); None: ``schedule``'s T_f.
        weight_decay: λ, a float, or (decoupled only) a float32[n] tensor of per-element λ in
            bucket order (e.g. 0 for biases and norms, as param groups do).

    Ablations, for diagnosis (the defaults are 0/1 Adam):
        exact: a subset of ``{"compressed", "sync", "sync-momentum"}``: those steps use the
            exact average of the workers' inputs instead of C(.); ``"sync-momentum"``: a SYNC
            step rebuilds x from C(u) but m from the exact average of u.
        sync_momentum_average: a in [0, 1): a SYNC step's rebuilt m becomes
            a·m' + (1 − a)·m, with m' what the previous SYNC step left (an exponential average
            of the rebuilt momenta). With error feedback the compression errors of consecutive
            syncs largely cancel in such an average (C(u_k) ≈ u_k + e_k − e_{k+1}).
        server_exact: C(.) without the server side's recompression (see
            :func:`simulate_compressed_allreduce`).
        clip_scale: multiplies the bound on |g|/s of preconditioned steps, sqrt(P)/sqrt(1 − β2)
            (``inf``: no bound; 1/sqrt(P): the bound without its sqrt(P); ``"k"``: times
            sqrt(1 − β2^(k+1)), the earlier bound, Adam's at its (k+1)-th update of v).
        trace: a list that receives, per COMPRESSED and SYNC step, a dict of the step, its
            kind, the mean worker and server error norms and the norm of the exchanged result.
        ranks_per_node: L for the two-level exchange (:func:`simulate_hierarchical_allreduce`,
            the optimizer's ``hierarchical=True`` with nodes of L consecutive ranks); None: flat.

    Returns:
        (xs, kinds): per rank the final list of parameter tensors, and the list of step kinds.

    Raises:
        TypeError: if neither or both of ``grad_fn`` and ``batched_grad_fn`` are given.
        FloatingPointError: when an exchange meets a non-finite scale (the run diverged; the
            product would skip such steps, this oracle stops).
    """
    if (grad_fn is None) == (batched_grad_fn is None):
        raise TypeError("simulate_zoadam takes exactly one of grad_fn and batched_grad_fn")
    run = _Run(params, grad_fn, batched_grad_fn, world_size, betas, eps, weight_decay, decoupled, bias_correction,
               scale_block_numel, precondition, auto_mask, exact, server_exact, clip_scale, trace, ranks_per_node,
               stacked, sync_momentum_average)
    freeze_state, kinds = {}, []  # freeze_state: the optimizer's counters of var_freeze_step="auto"
    for t in range(1, steps + 1):
        lr = lr_fn(t)
        sched = schedule if auto_freeze is None else auto_freeze.schedule(schedule, freeze_state)
        kind = sched.kind(t, lr=lr, freeze_lr=run.freeze_lr)
        # after the kind: a T_f decided at t is >= t (the optimizer observes after the step)
        if auto_freeze is not None:
            auto_freeze.observe(freeze_state, t, lr)
        kinds.append(kind)
        if kind in (StepKind.LOCAL, StepKind.SYNC) and t == sched.var_freeze_step + 1:
            run.enter_freeze(lr)
        run.step(t, kind, lr, sched)
    return [[c.view_as(p).clone() for c, p in zip(xr.split(run.numels), params)] for xr in run.x], kinds


class _Run:
    """One :func:`simulate_zoadam` run: the P workers' x and m (rows of float32[P, n]), the one v
    and anchor every rank shares, the error buffers, the counters, and each step kind's math."""

    def __init__(self, params: list[torch.Tensor], grad_fn: Callable[..., list[torch.Tensor]] | None,
                 batched_grad_fn: Callable[..., torch.Tensor] | None, world_size: int, betas: tuple[float, float],
                 eps: float, weight_decay: float | torch.Tensor, decoupled: bool, bias_correction: bool,
                 scale_block_numel: int, precondition: bool, auto_mask: bool, exact: tuple[str, ...],
                 server_exact: bool, clip_scale: float | str, trace: list[dict] | None, ranks_per_node: int | None,
                 stacked: bool, sync_momentum_average: float):
        self.params, self.grad_fn, self.batched_grad_fn, self.world_size = params, grad_fn, batched_grad_fn, world_size
        (self.beta1, self.beta2), self.eps, self.weight_decay, self.decoupled = betas, eps, weight_decay, decoupled
        self.bias_correction, self.precondition, self.exact, self.server_exact = (bias_correction, precondition,
                                                                                  exact, server_exact)
        self.clip_scale, self.trace, self.stacked = clip_scale, trace, stacked
        self.sync_momentum_average, self.auto_mask_on = sync_momentum_average, auto_mask
        self.numels = [p.numel() for p in params]
        self.segments = scale_segments(self.numels, scale_block_numel)
        self.n = n = sum(self.numels)
        self.x = torch.cat([p.reshape(-1).float() for p in params]).expand(world_size, n).clone()
        self.m = torch.zeros(world_size, n)
        self.v = torch.zeros(n)
        self.anchor = torch.zeros(n)
        self.errors = _ErrorBuffers(n, world_size, ranks_per_node)
        self.k, self.lr_sum, self.decay, self.freeze_lr = 0, 0.0, 1.0, None
        self.sync_momentum = None  # the previous SYNC step's m (the sync_momentum_average ablation)
        self.has_decay = bool(torch.as_tensor(weight_decay).ne(0).any())

    def flat_grads(self, t: int):
        if self.batched_grad_fn is not None:
            return self.batched_grad_fn(t, self.x).float()
        out = torch.empty(self.world_size, self.n)
        for r in range(self.world_size):
            views = [c.view_as(p) for c, p in zip(self.x[r].split(self.numels), self.params)]
            out[r] = torch.cat([g.reshape(-1).float() for g in self.grad_fn(t, r, views)])
        return out

    def adam_denom(self, k_: int):
        bc2 = 1 - self.beta2 ** max(k_, 1) if self.bias_correction else 1.0
        return reference.sqrt_rn(self.v).div_(bc2 ** 0.5).add_(self.eps)

    def bound(self, k_: int):  # step_math.normalized_gradient_bound
        scale = self.clip_scale
        if self.clip_scale == "k":  # the earlier bound, Adam's at its (k+1)-th update
            scale = math.sqrt(1 - self.beta2 ** (k_ + 1)) if self.bias_correction else 1.0
        return math.sqrt(self.world_size) / math.sqrt(1 - self.beta2) * scale

    def exchange(self, inputs: torch.Tensor, phase: str, t: int):
        if phase in self.exact:
            out = row_sum(inputs) / self.world_size
        else:
            out = self.errors.allreduce(inputs, self.segments, self.server_exact, self.stacked)
        if out is None:
            raise FloatingPointError(f"simulate_zoadam: a non-finite scale in the {phase} exchange of step {t}: "
                                     "the run diverged")
        if self.trace is not None:
            self.trace.append({"step": t, "kind": phase, **self.errors.norms(), "result": float(out.norm())})
        return out

    def momentum(self, x_: torch.Tensor, m_: torch.Tensor, grad: torch.Tensor, denom: torch.Tensor, lr: float,
                 bc1: float, mask: torch.Tensor | None, bound: torch.Tensor | None = None):  # all ranks', or one's
        if self.decoupled and self.has_decay:
            x_.mul_(1 - lr * self.weight_decay)
        if not self.decoupled and self.weight_decay:
            grad = grad.add(x_, alpha=self.weight_decay)
        if bound is not None:  # after the L2 term, as reference.local_step
            grad = torch.maximum(torch.minimum(grad, bound), -bound)
        m_.lerp_(grad, 1 - self.beta1)
        if mask is not None:
            m_.mul_(mask)
        x_.addcdiv_(m_, denom, value=-lr / bc1)

    def enter_freeze(self, lr: float) -> None:
        self.freeze_lr = lr
        self.errors.zero_()
        self.anchor = self.x[0].clone()

    def step(self, t: int, kind: StepKind, lr: float, sched: Schedule) -> None:
        bc1 = 1 - self.beta1 ** t if self.bias_correction else 1.0
        g = self.flat_grads(t)
        mask = (self.v != 0) if self.auto_mask_on else None
        if kind is StepKind.VARIANCE:
            self.variance(t, lr, bc1, g, sched.variance_update_steps(t, self.k))
        elif kind is StepKind.COMPRESSED:
            self.compressed(t, lr, bc1, g, mask)
        else:
            self.local_and_sync(t, kind, lr, bc1, g, mask)

    def variance(self, t: int, lr: float, bc1: float, g: torch.Tensor, interval: int) -> None:
        """I = ``interval``: v's update weighs as I steps."""
        x, m, v = self.x, self.m, self.v
        self.k += interval
        avg = row_sum(g) / self.world_size
        if self.decoupled and self.has_decay:
            x.mul_(1 - lr * self.weight_decay)
        gr = (avg.add(x, alpha=self.weight_decay) if (not self.decoupled and self.weight_decay)
              else avg.expand(self.world_size, self.n))
        m.lerp_(gr, 1 - self.beta1)
        b2 = self.beta2 ** interval
        v.mul_(b2).addcmul_(gr[0], gr[0], value=1 - b2)
        x.addcdiv_(m, self.adam_denom(self.k), value=-lr / bc1)

    def compressed(self, t: int, lr: float, bc1: float, g: torch.Tensor, mask: torch.Tensor | None) -> None:
        denom = self.adam_denom(self.k)
        if self.world_size > 1:
            if self.precondition:
                c = self.bound(self.k)
                g = (g / denom).clamp(-c, c)
            out = self.exchange(g, "compressed", t)
            if self.precondition:
                out = out * denom
            if mask is not None:
                out = out * mask
                self.errors.mask_(mask)
            g = out.expand(self.world_size, self.n)
        self.momentum(self.x, self.m, g, denom, lr, bc1, mask)

    def local_and_sync(self, t: int, kind: StepKind, lr: float, bc1: float, g: torch.Tensor,
                       mask: torch.Tensor | None) -> None:
        """LOCAL, and the local part of SYNC, then a SYNC step's exchange and rebuild."""
        denom = self.adam_denom(self.k)
        finite = torch.isfinite(g).all(dim=1)
        bound = denom * self.bound(self.k) if self.precondition else None
        if bool(finite.all()):
            self.momentum(self.x, self.m, g, denom, lr, bc1, mask, bound)
        else:  # a rank whose gradient is not finite skips its local step
            for r in finite.nonzero().flatten().tolist():
                self.momentum(self.x[r], self.m[r], g[r], denom, lr, bc1, mask, bound)
        self.lr_sum += lr
        if self.decoupled and self.has_decay:
            self.decay = self.decay * (1 - lr * self.weight_decay)
        if kind is StepKind.SYNC and self.lr_sum > 0:
            self.sync(t, bc1, denom, mask)

    def sync(self, t: int, bc1: float, denom: torch.Tensor, mask: torch.Tensor | None) -> None:
        """SYNC steps 2-7: the window's update exchanged, x, m and the anchor rebuilt from it."""
        n, anchor = self.n, self.anchor
        if self.decoupled and self.has_decay:
            anchor.mul_(self.decay)
        u = anchor - self.x if self.precondition else (anchor - self.x) * denom
        w = self.exchange(u, "sync", t)
        if mask is not None:
            w = w * mask
        x0, m0 = torch.empty(n), torch.empty(n)
        reference.sync_rebuild(w, anchor.clone(), x0, m0, denom, bc1 / self.lr_sum, preconditioned=self.precondition)
        if "sync-momentum" in self.exact:
            w_exact = row_sum(u) / self.world_size * (mask if mask is not None else 1)
            reference.sync_rebuild(w_exact, anchor.clone(), torch.empty(n), m0, denom, bc1 / self.lr_sum,
                                   preconditioned=self.precondition)
        if self.sync_momentum_average:
            if self.sync_momentum is not None:
                m0.mul_(1 - self.sync_momentum_average).add_(self.sync_momentum, alpha=self.sync_momentum_average)
            self.sync_momentum = m0.clone()
        self.x.copy_(x0.expand(self.world_size, n))
        self.m.copy_(m0.expand(self.world_size, n))
        if mask is not None:
            self.errors.mask_(mask)
        self.anchor = x0.clone()
        self.lr_sum, self.decay = 0.0, 1.0


class _ErrorBuffers:
    """The P ranks' worker and server errors of one bucket, flat or two-level: per local rank
    l (one, for the flat exchange) the N·… stacks of :mod:`hvd_zoadam.oracle.stacked`, with
    rank r = a·L + l in row a of stack l."""

    def __init__(self, n: int, world_size: int, ranks_per_node: int | None = None):
        self.n, self.world_size = n, world_size
        self.local = ranks_per_node or 1
        self.nodes = world_size // self.local
        self.shards = node_shards(n, self.local) if ranks_per_node is not None else [(0, n)]
        self.hierarchical = ranks_per_node is not None
        self.worker = [torch.zeros(self.nodes, padded_numel(hi - lo, self.nodes)) for lo, hi in self.shards]
        self.server = [torch.zeros(self.nodes, w.shape[1] // self.nodes) for w in self.worker]

    def rank_lists(self):
        """Rank r's worker and server error (views), r = 0 … P − 1."""
        ranks = [(r % self.local, r // self.local) for r in range(self.world_size)]
        return [self.worker[l][a] for l, a in ranks], [self.server[l][a] for l, a in ranks]

    def allreduce(self, inputs: torch.Tensor, segments: list[int], server_exact: bool, stacked: bool):
        """C(.) (or C_2) of float32[P, n] over the P ranks, these buffers updated."""
        if self.hierarchical:
            if stacked:
                return hierarchical_allreduce_stacked(inputs, self.worker, self.server, self.local, segments)
            we, se = self.rank_lists()
            return simulate_hierarchical_allreduce(list(inputs), we, se, self.local, segments)
        if stacked:
            return compressed_allreduce_stacked(inputs, self.worker[0], self.server[0], segments,
                                                server_exact=server_exact)
        we, se = self.rank_lists()
        return simulate_compressed_allreduce(list(inputs), we, se, segments, server_exact=server_exact)

    def zero_(self):
        for e in self.worker + self.server:
            e.zero_()

    def mask_(self, mask: torch.Tensor):
        """Zero both errors where ``mask`` (bool[n]) is False, each rank over its shard."""
        for (lo, hi), we, se in zip(self.shards, self.worker, self.server):
            own = mask[lo:hi]
            we[:, :hi - lo].mul_(own)
            se.view(-1)[:hi - lo].mul_(own)

    def norms(self) -> dict:
        """The mean over ranks of each error's norm."""
        we, se = self.rank_lists()
        return {"worker_error": float(sum(e.norm() for e in we)) / self.world_size,
                "server_error": float(sum(e.norm() for e in se)) / self.world_size}


def simulate_onebit(params: list[torch.Tensor], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    grad_fn: Callable[..., list[torch.Tensor]], *, world_size: int, first_step: int, steps: int,
                    exp_avg_sq_steps: int, lr_fn: Callable[[int], float], betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False,
                    bias_correction: bool = True, scale_block_numel: int = 2048,
                    worker_errors: list[torch.Tensor] | None = None, server_errors: list[torch.Tensor] | None = None):
    """1-bit Adam's compressed steps (algorithm.md §9) on P simulated workers, one bucket of
    all ``params``, from a state after the freeze (the oracle of the optimizer's
    ``algorithm="onebit"``): at each step t every rank's momentum
    m_r = m.lerp(g_r + L2, 1 − β1) goes through C(.), m ← the result (masked where v is 0, as
    ``auto_exp_avg_mask``), and x ← x·(1 − γλ) (AdamW) − γ/(1 − β1^t)·m/s with the frozen v.

    Args:
        params, exp_avg, exp_avg_sq: the common x (list of tensors), m and v (float32[n] in
            bucket order) at the start of step ``first_step``.
        grad_fn: ``grad_fn(step, rank, xs) -> list of tensors``.
        steps: the last step run. exp_avg_sq_steps: k, the VARIANCE steps before the freeze.
        worker_errors, server_errors: the P error buffers to start from (default zeros; the
            optimizer zeroes them at ``freeze_step + 1``); updated in place.

    Returns:
        (x float32[n], m float32[n], worker_errors, server_errors), the same on every rank.
    """
    beta1, beta2 = betas
    numels = [p.numel() for p in params]
    segments = scale_segments(numels, scale_block_numel)
    n = sum(numels)
    big_n = padded_numel(n, world_size)
    x = torch.cat([p.reshape(-1).float() for p in params])
    m, v = exp_avg.clone(), exp_avg_sq.clone()
    we = worker_errors if worker_errors is not None else [torch.zeros(big_n) for _ in range(world_size)]
    se = server_errors if server_errors is not None else [torch.zeros(big_n // world_size) for _ in range(world_size)]
    bc2 = 1 - beta2 ** max(exp_avg_sq_steps, 1) if bias_correction else 1.0
    denom = reference.sqrt_rn(v).div_(bc2 ** 0.5).add_(eps)
    mask = v.ne(0) if bool(v.eq(0).any()) else None
    for t in range(first_step, steps + 1):
        lr = lr_fn(t)
        views = [c.view_as(p) for c, p in zip(x.split(numels), params)]
        inputs = []
        for r in range(world_size):
            g = torch.cat([q.reshape(-1).float() for q in grad_fn(t, r, views)])
            if weight_decay and not decoupled:
                g = g.add(x, alpha=weight_decay)
            inputs.append(torch.lerp(m, g, 1 - beta1))
        out = simulate_compressed_allreduce(inputs, we, se, segments)
        if out is None:
            continue
        m.copy_(out)
        if mask is not None:
            m.mul_(mask)
            chunk = big_n // world_size
            for r in range(world_size):
                we[r][:n].mul_(mask)
                lo, hi = r * chunk, min(n, (r + 1) * chunk)
                if hi > lo:
                    se[r][:hi - lo].mul_(mask[lo:hi])
        if weight_decay and decoupled:
            x.mul_(1 - lr * weight_decay)
        bc1 = 1 - beta1 ** t if bias_correction else 1.0
        x.addcdiv_(m, denom, value=-lr / bc1)
    return x, m, we, se
