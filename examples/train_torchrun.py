"""An ordinary torchrun + DistributedDataParallel + AdamW script, and the same script with the
README's one-line change to 0/1 Adam.

    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --optimizer ddp
    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --optimizer zoadam

A 2-layer causal transformer LM on a synthetic Markov language (each token has a few likely
successors), AdamW with two parameter groups (weight decay for matrices, none for biases and
norms) and a linear warm-up then a cosine decay written into ``param_groups`` every iteration,
as existing scripts do. With ``--optimizer zoadam`` the DDP wrapper is dropped and the AdamW is
wrapped by ``hvd_zoadam.distributed.DistributedOptimizer`` with no knob set. The backward pass
and the step go through a ``torch.amp.GradScaler`` (disabled: float32 on the CPU), called as a
mixed-precision script calls it.
``--accumulate N`` accumulates N micro-batches per step as DDP scripts do, all but the last
inside ``no_sync()`` (the model's under DDP, the optimizer's under 0/1 Adam: the one other
line that changes); ``--clip C`` clips the gradient norm to C between ``backward()`` and
``step()``, as DDP scripts do (under 0/1 Adam: the local gradient, before its exchange). Rank 0
prints one JSON line: the optimizer, wall time, steps per second, the final validation loss and,
for 0/1 Adam, the bytes sent as a fraction of Adam's. ``python -m hvd_zoadam.bench torchrun``
runs both in one invocation.

Checkpoints as DDP scripts write them: rank 0 saves ``{"model", "optimizer": opt.state_dict(),
"iter"}`` to ``--ckpt`` every ``--ckpt-every`` iterations; ``--resume`` loads that file on every
rank and goes on from its iteration. ``--stop-at N`` ends after iteration N (saving there), as
an interruption would. Iteration i's batches come from a generator seeded with (seed, rank, i),
so they are the same whether or not the run was resumed.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def markov_language(vocab: int, seed: int) -> torch.Tensor:
    """The transition matrix: each token's next token is one of 4 likely ones (90 %) or any."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    for token in range(vocab):
        likely = torch.randperm(vocab, generator=gen)[:4]
        probs[token, likely] += torch.tensor([0.45, 0.25, 0.12, 0.08])
    return probs / probs.sum(1, keepdim=True)


def sample(probs: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """int64[batch, length + 1] sequences of the language."""
    seq = torch.empty(batch, length + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, probs.shape[0], (batch,), generator=gen)
    for t in range(length):
        seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=gen).squeeze(1)
    return seq


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[:tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.causal[:tokens.shape[1], :tokens.shape[1]], is_causal=True))


def lm_loss(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))


def learning_rate(i: int, args) -> float:
    """Iteration i's learning rate: linear warm-up over ``--warmup`` iterations, then a cosine decay to 0 at
    ``--steps``."""
    if i < args.warmup:
        return args.lr * (i + 1) / args.warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (i + 1 - args.warmup) / max(1, args.steps - args.warmup))))


def batch_generator(seed: int, rank: int, i: int) -> torch.Generator:
    """Iteration i's data on this rank, whatever iteration the run started at."""
    return torch.Generator().manual_seed(((seed * 4096 + rank) << 32) + i)


def schedule_step(opt) -> int:
    """The optimizer's own step count: 0/1 Adam's schedule counter, or AdamW's step."""
    group = opt.param_groups[0]
    if "zoadam" in group:
        return int(group["zoadam"]["step"])
    state = opt.state.get(group["params"][0], {})
    return int(state["step"]) if "step" in state else 0


def save_checkpoint(path: str, model: nn.Module, opt, i: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter": i}, tmp)
    os.replace(tmp, path)  # a run killed while saving leaves the previous checkpoint whole


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=["ddp", "zoadam"], default="zoadam")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync() for all but one)")
    ap.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this after backward() (0: off)")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on matrices (none on biases, norms)")
    ap.add_argument("--ckpt", help="rank 0 saves {model, optimizer, iter} here (torch.save)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save to --ckpt every this many iterations (0: only "
                    "at --stop-at)")
    ap.add_argument("--resume", action="store_true", help="load --ckpt on every rank and go on from its iteration")
    ap.add_argument("--compile", choices=["off", "model", "blocks"], default="off",
                    help="torch.compile the model as a whole (its backward is one graph: every gradient is ready "
                    "at its end, so no exchange overlaps it) or block by block (gradients ready block by block)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend (aot_eager: Dynamo and AOTAutograd without inductor's kernels, "
                    "which keeps eager's bits)")
    ap.add_argument("--stop-at", type=int, default=0, help="end after this many iterations, saving to --ckpt "
                    "if given (0: run all --steps)")
    args = ap.parse_args(argv)
    if (args.resume or args.ckpt_every) and not args.ckpt:
        ap.error("--resume and --ckpt-every need --ckpt PATH (the checkpoint file)")
    if args.ckpt_every < 0:
        ap.error(f"--ckpt-every must be >= 0 (0: save only at --stop-at), got {args.ckpt_every}")
    if not 0 <= args.stop_at <= args.steps:
        ap.error(f"--stop-at must be between 1 and --steps ({args.steps}), or 0 for no stop; got {args.stop_at}")
    if args.resume and not os.path.isfile(args.ckpt):
        ap.error(f"--resume: no checkpoint at --ckpt {args.ckpt}; run with --ckpt and --stop-at or --ckpt-every first")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # as in many scripts: each rank its own initialisation
    probs = markov_language(args.vocab, args.seed)
    model = TinyLM(args.vocab, args.width, args.layers, args.length)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases, norms
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # float32 on the CPU; a GPU script enables it
    if args.optimizer == "ddp":
        train_model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        no_sync = train_model.no_sync
    else:
        import hvd_zoadam.distributed as zd
        train_model = model
        opt = zd.DistributedOptimizer(opt, model.named_parameters())
        zd.broadcast_parameters(model.state_dict(), root_rank=0)
        no_sync = opt.no_sync

    if args.compile == "model":
        train_model = torch.compile(train_model, backend=args.compile_backend)
    elif args.compile == "blocks":  # each block's forward (Module.compile() would skip torch.nn's own classes)
        for layer in model.blocks.layers:
            layer.forward = torch.compile(layer.forward, backend=args.compile_backend)

    first = 0
    if args.resume:  # rank 0's file, on every rank
        ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        first = ckpt["iter"]
    last = args.stop_at or args.steps
    held_out = sample(probs, 64, args.length, torch.Generator().manual_seed(99))
    dist.barrier()
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    clipped = 0  # steps whose gradient norm (this rank's: 0/1 Adam clips before the exchange) exceeded --clip
    for i in range(first, last):
        for group in opt.param_groups:
            group["lr"] = learning_rate(i, args)
        data = batch_generator(args.seed, rank, i)
        opt.zero_grad()
        for micro in range(args.accumulate):
            with no_sync() if micro < args.accumulate - 1 else contextlib.nullcontext():
                loss = lm_loss(train_model, sample(probs, args.batch_size, args.length, data))
                scaler.scale(loss / args.accumulate).backward()
        if args.clip:
            scaler.unscale_(opt)
            clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip) > args.clip)
        scaler.step(opt)
        scaler.update()
        if rank == 0 and args.ckpt and ((args.ckpt_every and (i + 1) % args.ckpt_every == 0) or i + 1 == last):
            save_checkpoint(args.ckpt, model, opt, i + 1)
    dist.barrier()
    wall = time.perf_counter() - start
    with torch.no_grad():
        val = lm_loss(model, held_out).item()
        logits = model(held_out[:, :-1])  # each held-out sequence's mean loss: their spread is the evaluation's noise
        per_seq = F.cross_entropy(logits.transpose(1, 2), held_out[:, 1:], reduction="none").mean(1)
        val_se = (per_seq.std() / math.sqrt(per_seq.numel())).item()
    if rank == 0:
        ran = last - first
        out = {"optimizer": args.optimizer, "world_size": world, "steps": ran, "wall_s": round(wall, 3),
               "steps_per_s": round(ran / wall, 3) if ran else 0.0, "final_val_loss": round(val, 5),
               "final_val_loss_se": round(val_se, 5), "final_val_loss_hex": float(val).hex(),
               "final_train_loss": round(loss.item(), 5),
               "clipped_steps": clipped, "first_iter": first, "iter": last, "schedule_step": schedule_step(opt),
               "model_sha256": hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                                       for t in model.state_dict().values())).hexdigest()[:16]}
        if args.optimizer == "zoadam":
            import numba
            stats = opt.comm_stats()
            out.update(bytes_vs_adam=round(stats["bytes_sent_total"] / stats["adam_equivalent_bytes"], 4),
                       steps_by_kind={kind: stats[kind]["steps"]
                                      for kind in ("variance", "compressed", "local", "sync")},
                       kernel_threads=numba.get_num_threads())
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
