"""Elastic job for tests/test_elastic.py: hvd.elastic.run + TorchState, growing from 2 to 3 ranks
or shrinking from 3 to 2.

argv: OUT_DIR HOSTS_FILE STEPS CHANGE_AT [TO]. Rank 0 writes ``localhost:TO`` (default 3) into
HOSTS_FILE (read by the host-discovery script) after step CHANGE_AT; while the world size is
not yet TO after that, every rank waits a little per step so the driver's notice arrives well
before the end. Shrinking removes the slot of local rank 2: its worker is stopped by the
driver and never finishes. Each process
writes OUT_DIR/pid<pid>.json: one record per step it ran (world size, rank, kind, schedule
state, lr, error-buffer sizes and contents, digests of the parameters, exp_avg and exp_avg_sq)
under "records", and under "pooled" what each ``pool_errors_after_reset`` left in the buffers.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from common import loss_fn, mlp  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    out_dir, hosts_file = Path(sys.argv[1]), Path(sys.argv[2])
    steps, change_at = int(sys.argv[3]), int(sys.argv[4])
    to = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    hvd.init()
    torch.set_num_threads(1)
    model = mlp()
    # The optimizer is built before the first sync and must run no collective here.
    opt = hvd_zoadam.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(),
        var_freeze_step=6, var_update_scaler=2, local_step_policy="steps", local_step_scaler=4, local_step_clipper=4)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    records, pooled = [], []

    def errors():
        return {"worker": [b.exchange.worker_error[:b.numel].tolist() for b in opt._buckets],
                "server": [b.exchange.server_error.tolist() for b in opt._buckets]}

    pool = opt.pool_errors_after_reset

    def pool_and_record():
        survivors = pool()
        pooled.append({"survivors": survivors, "world": hvd.size(), "rank": hvd.rank(), **errors()})
        return survivors
    opt.pool_errors_after_reset = pool_and_record

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            step = state.batch
            opt.zero_grad()
            loss_fn(model, step, hvd.rank()).backward()
            opt.step()
            sched = opt.schedule_state()
            if opt.schedule.kind(sched["step"]).value == "sync":
                common.assert_same_on_all_ranks(hvd, list(model.parameters()), f"parameters after sync {step}")
            records.append({
                "step": step, "world": hvd.size(), "rank": hvd.rank(), "pid": os.getpid(),
                "kind": opt.schedule.kind(sched["step"]).value,
                "schedule": sched,
                "worker_error": [b.exchange.worker_error.numel() for b in opt._buckets],
                "server_error": [b.exchange.server_error.numel() for b in opt._buckets],
                "numel": [b.numel for b in opt._buckets],
                "params": digest(model.parameters()),
                "exp_avg": digest(opt.state[p]["exp_avg"] for p in model.parameters()),
                "exp_avg_sq": digest(opt.state[p]["exp_avg_sq"] for p in model.parameters()),
                "lr": opt.param_groups[0]["lr"], **errors(),
            })
            if step == change_at and hvd.rank() == 0:
                hosts_file.write_text(f"localhost:{to}\n")
            if step >= change_at and hvd.size() != to:
                time.sleep(0.5)
            state.batch = step + 1
            state.commit()

    train(state)
    (out_dir / f"pid{os.getpid()}.json").write_text(json.dumps({"records": records, "pooled": pooled}))


if __name__ == "__main__":
    main()
