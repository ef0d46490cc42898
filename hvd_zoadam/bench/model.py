"""``python -m hvd_zoadam.bench model``: an alpha-beta model of a step's time, validated
against a ``bench network`` JSON when given, and projected to BERT-Large on 16–1024 workers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hvd_zoadam.bench.network import UNSHAPED, _parse_rate

if TYPE_CHECKING:
    import argparse


def exchange_node_bytes(system: str, *, n: float, p: int, ranks_per_node: int = 1,
                        scale_block_numel: int | None = None) -> float:
    """Bytes one node sends to other nodes in one 1-bit exchange of n elements (algorithm.md §3).

    ``"zoadam"`` (the flat exchange): each of the node's L ranks sends 2(P−1)/P of its
    n/8 + 4n/block bytes, of which (P−L)/(P−1) go to ranks of other nodes. ``"zoadam-2level"``:
    each local rank sends what one rank of a flat exchange at world size N = P/L sends, for its
    shard of n/L elements. ``"1bit-adam"``: the flat exchange with scales per tensor.
    """
    per_element = 1 / 8 + (4 / scale_block_numel if scale_block_numel and system != "1bit-adam" else 0.0)
    local = ranks_per_node
    if system == "zoadam-2level":
        nodes = p // local
        return local * 2 * (nodes - 1) / nodes * n / local * per_element
    return local * 2 * (p - local) / p * n * per_element


def step_time(system: str, *, n: float, p: int, bandwidth_bps: float, latency_s: float, compute_s: float,
              frac: dict | None = None, width_bytes: int = 4, scale_block_numel: int | None = None,
              ranks_per_node: int = 1, intra_bandwidth_bps: float = 1.2e12, intra_latency_s: float = 2e-6) -> float:
    """Alpha-beta step time in seconds for one training step averaged over a run.

    n: parameters; p: workers, ``ranks_per_node`` L per node; bandwidth_bps: each node's link
    to the others, bits/s per direction; latency_s: alpha per message round; compute_s:
    forward + backward + optimizer per step. Collectives use the bandwidth-optimal ring/pairwise
    forms, and a node's link carries what its ranks send to other nodes: an allreduce of B
    bytes (a ring through the nodes) costs 2(p−1)·alpha + 2(p−1)/p·B/beta; the flat 1-bit
    exchange (algorithm.md §3) costs 2 rounds and :func:`exchange_node_bytes` over beta,
    ~2(p−1)/p·n/8 bytes at L = 1 and L times that per node at large p; the two-level exchange
    (``"zoadam-2level"``, algorithm.md §3 "Two levels") 2(p/L − 1) rounds between nodes for
    about L times fewer bytes per node, plus 8(L−1)/L·n bytes of fp32 per rank inside the node
    at ``intra_bandwidth_bps`` (default 1.2 Tbit/s, NVLink-class) with 2(L − 1) rounds of
    ``intra_latency_s``. ``frac``: share of steps of each kind (variance, compressed, local,
    sync); systems: "adam" (fp32), "adam-fp16", "1bit-adam", "zoadam", "zoadam-2level" (no
    overlap of communication with compute is assumed).

    ``scale_block_numel`` (0/1 Adam): one float32 scale per block of that many elements; each
    scale travels only to the server of its chunk and back, 2(p−1)/p·4·n/scale_block_numel
    bytes per rank, 32/block of the bits at any p. None: scales per tensor, negligible (as
    for 1-bit Adam).
    """
    beta = bandwidth_bps / 8.0
    full = lambda w: 2 * (p - 1) * latency_s + 2 * (p - 1) / p * w * n / beta  # noqa: E731
    if p == 1:
        return compute_s
    if system == "adam":
        return compute_s + full(4)
    if system == "adam-fp16":
        return compute_s + full(2)
    frac = frac or {}
    kw = dict(n=n, p=p, ranks_per_node=ranks_per_node, scale_block_numel=scale_block_numel)
    if system == "1bit-adam":
        warm = frac.get("variance", 0.15)
        onebit = 2 * (p - 1) * latency_s + exchange_node_bytes("1bit-adam", **kw) / beta
        return compute_s + warm * full(4) + (1 - warm) * onebit
    if system == "zoadam":
        onebit = 2 * (p - 1) * latency_s + exchange_node_bytes("zoadam", **kw) / beta
    elif system == "zoadam-2level":
        local, nodes = ranks_per_node, p // ranks_per_node
        onebit = (2 * (nodes - 1) * latency_s + exchange_node_bytes("zoadam-2level", **kw) / beta
                  + 2 * (local - 1) * intra_latency_s + 8 * (local - 1) / local * n / (intra_bandwidth_bps / 8))
    else:
        raise ValueError(f"unknown system {system!r}")
    return compute_s + frac.get("variance", 0.0) * full(4) + (frac.get("compressed", 0.0)
                                                              + frac.get("sync", 0.0)) * onebit


def _node_bytes_per_step(system: str, frac: dict, *, n: float, p: int, ranks_per_node: int, block,
                         warm_1bit: float) -> float:
    """Bytes a node sends to other nodes per step, averaged over the run (fp16 for Adam)."""
    ring = lambda w: 2 * (p - 1) / p * w * n  # noqa: E731  (a ring's traffic through each node)
    kw = dict(n=n, p=p, ranks_per_node=ranks_per_node, scale_block_numel=block)
    if system == "adam-fp16":
        return ring(2)
    if system == "1bit-adam":
        return warm_1bit * ring(4) + (1 - warm_1bit) * exchange_node_bytes("1bit-adam", **kw)
    return frac["variance"] * ring(4) + (frac["compressed"] + frac["sync"]) * exchange_node_bytes(system, **kw)


def cmd_model(args: argparse.Namespace) -> dict:
    out = {"benchmark": "model", "formula": step_time.__doc__.strip().split("\n\n")[1].strip()}
    if args.measured:
        rep = json.loads(Path(args.measured).read_text())
        checks = []
        for rate, block in rep["rates"].items():
            runs = {r["run"]: r for r in block["runs"] if r.get("ok")}
            if "compute" not in runs or rate == UNSHAPED:  # no link rate to model
                continue
            bps = _parse_rate(rate)
            n, p = runs["compute"]["params"], rep["ranks"]
            compute_s = 1.0 / runs["compute"]["steps_per_s"]
            for run, system in (("adam", "adam"), ("adam-fp16", "adam-fp16"), ("zoadam", "zoadam")):
                if run not in runs:
                    continue
                frac = None
                if run == "zoadam":
                    kinds = runs[run]["kinds"]
                    total = sum(kinds.values())
                    frac = {k: v / total for k, v in kinds.items()}
                pred = 1.0 / step_time(system, n=n, p=p, bandwidth_bps=bps, latency_s=args.latency,
                                       compute_s=compute_s, frac=frac, scale_block_numel=args.measured_scale_block)
                checks.append({"rate": rate, "run": run, "predicted_steps_per_s": pred,
                               "measured_steps_per_s": runs[run]["steps_per_s"],
                               "error": pred / runs[run]["steps_per_s"] - 1})
        out["validation"] = checks
    # BERT-Large projection (paper §5's setting, in this model's terms), L ranks per node.
    n, local = 340e6, args.ranks_per_node
    frac_zo = {"variance": args.zo_variance_frac, "compressed": args.zo_compressed_frac,
               "sync": args.zo_sync_frac,
               "local": 1 - args.zo_variance_frac - args.zo_compressed_frac - args.zo_sync_frac}
    proj = []
    for gbit in (10, 40, 100):
        for p in (16, 32, 64, 128, 256, 512, 1024):
            row = {"gbit_per_s": gbit, "workers": p, "nodes": p // local}
            for system in ("adam-fp16", "1bit-adam", "zoadam", "zoadam-2level"):
                row[system + "_s"] = step_time(system, n=n, p=p, bandwidth_bps=gbit * 1e9, latency_s=args.latency_bert,
                                               compute_s=args.bert_compute_s, frac=frac_zo, width_bytes=2,
                                               scale_block_numel=args.scale_block_numel, ranks_per_node=local,
                                               intra_bandwidth_bps=args.intra_gbit * 1e9)
                row[system + "_node_MB_per_step"] = _node_bytes_per_step(
                    system, frac_zo, n=n, p=p, ranks_per_node=local, block=args.scale_block_numel,
                    warm_1bit=0.15) / 1e6
            row["zoadam_speedup_vs_adam_fp16"] = row["adam-fp16_s"] / row["zoadam_s"]
            row["zoadam_speedup_vs_1bit_adam"] = row["1bit-adam_s"] / row["zoadam_s"]
            row["zoadam_2level_speedup_vs_flat"] = row["zoadam_s"] / row["zoadam-2level_s"]
            row["zoadam_2level_speedup_vs_adam_fp16"] = row["adam-fp16_s"] / row["zoadam-2level_s"]
            proj.append(row)
    out["bert_large"] = {"params": n, "compute_s_per_step": args.bert_compute_s, "latency_s": args.latency_bert,
                         "ranks_per_node": local, "intra_node_gbit_per_s": args.intra_gbit,
                         "zoadam_scale_block_numel": args.scale_block_numel,
                         "zoadam_step_fractions": frac_zo, "1bit_adam_warmup_fraction": 0.15, "rows": proj}
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    mo = sub.add_parser("model", help="alpha-beta step-time model: validation and BERT-Large projection")
    mo.add_argument("--measured", help="a `bench network` JSON to validate against")
    mo.add_argument("--latency", type=float, default=1e-4, help="alpha on the simulated links, seconds")
    mo.add_argument("--latency-bert", type=float, default=5e-6, help="alpha on the projected cluster, seconds")
    mo.add_argument("--bert-compute-s", type=float, default=0.15,
                    help="BERT-Large compute per step and GPU, seconds (assumption; see docs/performance.md)")
    mo.add_argument("--scale-block-numel", type=int, default=2048,
                    help="0/1 Adam's elements per 1-bit scale in the projection (0: per tensor)")
    mo.add_argument("--measured-scale-block", type=int, default=256,
                    help="the same for the measured run (the bench's zoadam run uses 256)")
    mo.add_argument("--zo-variance-frac", type=float, default=0.002)
    mo.add_argument("--zo-compressed-frac", type=float, default=0.01)
    mo.add_argument("--zo-sync-frac", type=float, default=0.10)
    mo.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node of the projected cluster")
    mo.add_argument("--intra-gbit", type=float, default=1200.0,
                    help="bandwidth per rank inside a node of the projected cluster, Gbit/s (NVLink-class)")
    mo.add_argument("--json")
    mo.set_defaults(run=cmd_model)
