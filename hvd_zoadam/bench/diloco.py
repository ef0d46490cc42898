"""One replica of ``bench network``'s DiLoCo runs (``diloco-h8``, ``diloco-h32``): torchft 0.2.0
(PyPI; a benchmark dependency, not the library's) over ``ProcessGroupGloo`` on the CPU.

Inner AdamW on the char LM of examples/train_lm.py with the same parameter groups, LR schedule,
batches and seeds as ``_bench_lm``; outer SGD (lr 0.7, momentum 0.9, Nesterov) every H steps
(DiLoCo, Douillard et al., arXiv 2311.08105). One replica per simulated host, launched by mpirun
only to start the processes: replica 0 runs the lighthouse in-process on its host's address;
every replica serves its own TCPStore at its own address, and its Manager uses
``use_async_quorum=False``, ``init_sync=False`` (the default made one replica throw its first
window away), ``hostname`` = its address and ``max_retries`` (torchft swallows errors and rolls
back, so a misconfiguration shows as missing syncs: the report carries the count of committed
syncs). Quantization is off (it needs Triton). The validation loss is rank 0's own model on the
held-out batches.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from hvd_zoadam.bench.lm import StepClock, _data, _train_lm, _val_loss, backward_on_batch


def _my_address(master: str) -> str:
    """This host's address on the link that reaches ``master`` (the interface the kernel picks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))
        return s.getsockname()[0]


def parse(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="diloco-h<H>")
    for name, default in (("--steps", 60), ("--warmup", 12), ("--skip", 3), ("--n-layer", 4), ("--n-embd", 256),
                          ("--n-head", 4), ("--block-size", 128), ("--batch-size", 16), ("--eval-every", 0),
                          ("--eval-batches", 4), ("--port", 29533)):
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--master", default=os.environ.get("ZO_MASTER", "127.0.0.1"))
    ap.add_argument("--out", required=True)
    args, _ = ap.parse_known_args(argv)  # the 0/1 Adam knobs of --model-args do not apply
    args.sync_every = int(args.run.split("-h")[1])
    return args


def _manager(args, rank: int, world: int, me: str, model, inner):
    """``(its store, the torchft Manager)`` of this rank's replica: one replica of one rank per
    host, a quorum of every replica, the lighthouse at ``--master``."""
    from torchft import Manager, ProcessGroupGloo
    store_port = args.port + 1 + rank
    store = torch.distributed.TCPStore(me, store_port, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=world,
                      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                                  inner.load_state_dict(sd["inner"])),
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      use_async_quorum=False, init_sync=False, replica_id=f"replica{rank}", store_addr=me,
                      store_port=store_port, rank=0, world_size=1, lighthouse_addr=f"http://{args.master}:{args.port}",
                      hostname=me, port=args.port + 100 + rank, max_retries=3,
                      timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
                      connect_timeout=timedelta(seconds=60))
    return store, manager


def main(argv: list[str] | None = None):
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    args = parse(argv)
    lm = _train_lm()
    torch.set_num_threads(1)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    me = _my_address(args.master) if world > 1 else "127.0.0.1"
    lighthouse = None
    if rank == 0:
        lighthouse = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=world)
    data, val_batches, vocab = _data(lm, args)
    torch.manual_seed(1234)
    model = lm.CharGPT(vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    inner = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.98))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lm.lr_lambda(args.warmup, args.steps))
    store, manager = _manager(args, rank, world, me, model, inner)
    gen = torch.Generator().manual_seed(1234 * 1000 + rank)
    losses, clock = [], StepClock(args.skip)
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        for step in range(1, args.steps + 1):
            clock.tick(step)
            loss = backward_on_batch(model, inner, lm, data, args, gen)
            inner.step()   # DiLoCo's hook runs the outer step every sync_every steps
            sched.step()
            losses.append(loss.item())
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                clock.validate(step, lambda: _val_loss(model, val_batches, None, None, None, 1, step))  # rank 0's model
    elapsed = clock.elapsed()
    syncs = manager.current_step()
    out = {"run": args.run, "world_size": world, "steps": args.steps, "timed_steps": args.steps - args.skip,
           "steps_per_s": (args.steps - args.skip) / elapsed, "timed_s": elapsed,
           "final_loss": sum(losses[-10:]) / len(losses[-10:]), "steady_steps_per_s": None,
           "params": sum(p.numel() for p in model.parameters()), "val_curve": clock.val_curve,
           "eval_seconds": clock.eval_s,
           "syncs_committed": syncs, "syncs_expected": args.steps // args.sync_every,
           "rounds": syncs, "config": {"sync_every": args.sync_every, "outer": "SGD(0.7, 0.9, nesterov)",
                                       "torchft": "0.2.0", "quantization": False}}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    manager.shutdown()
    del store
    if lighthouse is not None:
        time.sleep(1.0)
        lighthouse.shutdown()


if __name__ == "__main__":
    sys.exit(main())
