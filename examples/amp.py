"""Mixed precision with hvd_zoadam: ``torch.amp`` autocast, and ``GradScaler`` where it is needed.

On a GPU: fp16 autocast with ``torch.amp.GradScaler``. On the CPU: bf16 autocast (no loss
scaling needed). The model's parameters, the optimizer state and all 0/1 Adam math stay in
float32. Run::

    horovodrun -np 2 -H localhost:2 --gloo python examples/amp.py

GradScaler and hvd_zoadam: ``scaler.step(optimizer)`` always calls ``optimizer.step()`` on
every rank (hvd_zoadam sets ``_step_supports_amp_scaling``), so the ranks stay in lockstep
even when only one rank overflows; the gradients are unscaled before any exchange, and a
step whose gradient is NaN/Inf on any rank is skipped by all. To clip, call
``scaler.unscale_(optimizer)`` and clip the local gradients; do not call
``optimizer.synchronize()`` yourself.
"""
from __future__ import annotations

import argparse
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_zoadam


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = ap.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                          named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler(device, enabled=amp_dtype is torch.float16)
    gen = torch.Generator().manual_seed(hvd.rank())
    w_true = torch.randn(32, 4, generator=torch.Generator().manual_seed(42))
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=amp_dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(opt)
        scaler.update()
    if hvd.rank() == 0:
        print(json.dumps({"device": device, "autocast": str(amp_dtype), "final_loss": loss.item(),
                          "param_dtype": str(next(model.parameters()).dtype),
                          "skipped_steps": opt.comm_stats()["skipped_steps"]}))


if __name__ == "__main__":
    main()
