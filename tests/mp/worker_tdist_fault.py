"""torchrun worker: rank 1 never issues the exchange; rank 0 must raise CollectiveTimeoutError
(HVD_ZOADAM_TIMEOUT_S bounds the wait) naming the collective, instead of hanging."""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import hvd_zoadam
from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport


def main():
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()
    n = 1000
    we, se = torch.zeros(hvd_zoadam.padded_numel(n, 2)), torch.zeros(hvd_zoadam.padded_numel(n, 2) // 2)
    if dist.get_rank() == 0:
        try:
            hvd_zoadam.compressed_allreduce(torch.randn(n), we, se, transport=transport)
        except hvd_zoadam.CollectiveTimeoutError as exc:
            assert "did not complete within" in str(exc) and "zoadam.car." in str(exc), str(exc)
            print(f"rank 0: CollectiveTimeoutError: {exc}", flush=True)
            sys.exit(0)
        sys.exit("rank 0: the exchange completed without its peer")
    time.sleep(8)  # rank 1: alive, but issues nothing


if __name__ == "__main__":
    main()
