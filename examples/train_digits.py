"""A small CNN on scikit-learn's bundled ``load_digits`` (1797 8x8 images, 10 classes), under Horovod.

Run::

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_digits.py --optimizer zoadam

Each rank trains on its own shard of the training split; rank 0 prints the test accuracy
and, with ``--summary PATH``, writes a JSON summary (accuracy, loss, comm_stats).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_zoadam


def load(seed: int):
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_model():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=["zoadam", "adam"], default="zoadam")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    import horovod.torch as hvd  # here, so that load() and make_model() import without Horovod
    hvd.init()
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = load(args.seed)
    xtr, ytr = xtr[hvd.rank()::hvd.size()], ytr[hvd.rank()::hvd.size()]
    torch.manual_seed(args.seed)
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.optimizer == "zoadam":
        opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    for _ in range(args.steps):
        idx = torch.randint(len(ytr), (args.batch_size,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean()
    acc = hvd.allreduce(acc, op=hvd.Average, name="acc").item()  # each rank's model, averaged
    if hvd.rank() == 0:
        summary = {"optimizer": args.optimizer, "world_size": hvd.size(), "steps": args.steps, "test_accuracy": acc,
                   "final_loss": loss.item(),
                   "comm_stats": opt.comm_stats() if args.optimizer == "zoadam" else None}
        print(json.dumps(summary))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
