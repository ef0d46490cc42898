"""An ordinary torchrun + DistributedDataParallel + AdamW script, and the same script with the
README's one-line change to 0/1 Adam.

    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --optimizer ddp
    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --optimizer zoadam

A 2-layer causal transformer LM on a synthetic Markov language (each token has a few likely
successors), AdamW with a linear warm-up and a cosine decay built on the AdamW before anything
wraps it, as existing scripts do. With ``--optimizer zoadam`` the DDP wrapper is dropped and the
AdamW is wrapped by ``hvd_zoadam.distributed.DistributedOptimizer`` with no knob set.
``--accumulate N`` accumulates N micro-batches per step as DDP scripts do, all but the last
inside ``no_sync()`` (the model's under DDP, the optimizer's under 0/1 Adam: the one other
line that changes); ``--clip C`` clips the gradient norm to C between ``backward()`` and
``step()``, as DDP scripts do (under 0/1 Adam: the local gradient, before its exchange). Rank 0
prints one JSON line: the optimizer, wall time, steps per second, the final validation loss and,
for 0/1 Adam, the bytes sent as a fraction of Adam's. ``python -m hvd_zoadam.bench torchrun``
runs both in one invocation.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
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
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # as in many scripts: each rank its own initialisation
    probs = markov_language(args.vocab, args.seed)
    model = TinyLM(args.vocab, args.width, args.layers, args.length)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min((t + 1) / args.warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, t + 1 - args.warmup) / max(1, args.steps - args.warmup))))))
    if args.optimizer == "ddp":
        train_model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        no_sync = train_model.no_sync
    else:
        import hvd_zoadam.distributed as zd
        train_model = model
        opt = zd.DistributedOptimizer(opt, model.named_parameters())
        zd.broadcast_parameters(model.state_dict(), root_rank=0)
        no_sync = opt.no_sync

    data = torch.Generator().manual_seed(1000 + rank)
    held_out = sample(probs, 64, args.length, torch.Generator().manual_seed(99))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        for micro in range(args.accumulate):
            with no_sync() if micro < args.accumulate - 1 else contextlib.nullcontext():
                loss = lm_loss(train_model, sample(probs, args.batch_size, args.length, data))
                (loss / args.accumulate).backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        schedule.step()
    dist.barrier()
    wall = time.perf_counter() - start
    with torch.no_grad():
        val = lm_loss(model, held_out).item()
    if rank == 0:
        out = {"optimizer": args.optimizer, "world_size": world, "steps": args.steps, "wall_s": round(wall, 3),
               "steps_per_s": round(args.steps / wall, 3), "final_val_loss": round(val, 5),
               "final_train_loss": round(loss.item(), 5)}
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
