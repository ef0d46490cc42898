"""The quick start without Horovod: ``torchrun --nproc-per-node 2 examples/quickstart_distributed.py``.

A torchrun + AdamW script with the one-line change: no DistributedDataParallel wrapper, the
AdamW wrapped by ``hvd_zoadam.distributed.DistributedOptimizer``. Prints the first and last
loss, what rank 0 sent and the kernel threads each rank runs.
"""
import numba
import torch
import torch.distributed as dist

import hvd_zoadam.distributed as zd

dist.init_process_group("gloo")  # "nccl" with the model on this rank's GPU
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
opt = zd.DistributedOptimizer(opt, model.named_parameters())
zd.broadcast_parameters(model.state_dict(), root_rank=0)
zd.broadcast_optimizer_state(opt, root_rank=0)

target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
data = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batches
losses = []
for step in range(80):
    x = torch.randn(64, 32, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x @ target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
if dist.get_rank() == 0:
    stats = opt.comm_stats()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; sent {stats['bytes_sent_total']} bytes "
          f"({stats['bytes_sent_total'] / stats['adam_equivalent_bytes']:.3f} of Adam's) over {stats['transport']}; "
          f"{numba.get_num_threads()} kernel thread(s) per rank")
dist.barrier()  # every rank past its last collective, then the groups destroyed: an orderly end under Gloo
dist.destroy_process_group()
