"""The quick start over MPI without Horovod: ``mpirun -np 2 python examples/quickstart_mpi.py``.

A Horovod + AdamW script with Horovod dropped: mpi4py initialises MPI, the AdamW is wrapped by
``hvd_zoadam.mpi.DistributedOptimizer``, and the broadcasts come from ``hvd_zoadam.mpi``.
Prints the first and last loss and what rank 0 sent.
"""
import torch
from mpi4py import MPI  # initialises MPI; no hvd.init()

import hvd_zoadam.mpi as zm

rank = MPI.COMM_WORLD.Get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
opt = zm.DistributedOptimizer(opt, model.named_parameters())
zm.broadcast_parameters(model.state_dict(), root_rank=0)
zm.broadcast_optimizer_state(opt, root_rank=0)

target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
losses = []
for step in range(80):
    x = torch.randn(64, 32, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x @ target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
if rank == 0:
    stats = opt.comm_stats()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; sent {stats['bytes_sent_total']} bytes "
          f"({stats['bytes_sent_total'] / stats['adam_equivalent_bytes']:.3f} of Adam's) over {stats['transport']}")
