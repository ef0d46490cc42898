"""The benchmarks run and print JSON (tiny settings; the numbers go in docs/performance.md).

``bench network`` needs root for the namespaces (CI runs as root); here it runs every system
for a few steps of a tiny model over one shaped rate, to prove each launches and reports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import BIN, ROOT, run_cmd, run_job
from hvd_zoadam.bench.lm import cores_used, thread_cpu_seconds
from hvd_zoadam.bench.model import step_time
from hvd_zoadam.bench.network import DEFAULT_RUNS, _horovod_env_flags, _rate_report


def bench(*args, timeout_s=600):
    proc = run_cmd([sys.executable, "-m", "hvd_zoadam.bench", *args], timeout_s=timeout_s)
    return json.loads(proc.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root")
def test_bench_network_runs_every_system_and_reports(tmp_path):
    png = tmp_path / "n.png"
    rep = bench("network", "--rate", "1gbit", "--steps", "8", "--warmup", "3", "--skip", "1", "--png", str(png),
                "--eval-every", "4", "--breakdown", "--runs",
                ",".join([*DEFAULT_RUNS, "compute-horovod", "compute-lockstep", "zoadam-mpi"]),
                "--model-args", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
                "--batch-size", "4", "--var-update-scaler", "1", "--local-step-clipper", "2")
    runs = {r["run"]: r for r in rep["rates"]["1gbit"]["runs"]}
    assert set(runs) == {"adam", "adam-fp16", "zoadam", "zoadam-torchrun", "zoadam-mpi", "ddp-powersgd",
                         "ddp-localsgd", "compute", "compute-horovod", "compute-lockstep", "onebit", "diloco-h8",
                         "diloco-h32"}
    for name, r in runs.items():
        assert r["ok"], (name, r.get("error"))
        assert r["steps_per_s"] > 0 and r["final_loss"] > 0 and r["world_size"] == 2
    # bytes on the wire: compute-only sends next to nothing, fp16 about half of fp32
    assert runs["compute"]["wire_bytes_sent_per_rank"] < 0.05 * runs["adam"]["wire_bytes_sent_per_rank"]
    assert 0.4 < runs["adam-fp16"]["wire_bytes_sent_per_rank"] / runs["adam"]["wire_bytes_sent_per_rank"] < 0.7
    assert runs["zoadam"]["transport"].startswith("mpi")
    # 0/1 Adam's knobs pass through --model-args and are reported: kappa 1 freezing at 3 gives
    # variance steps 1 and 2 (intervals 1, 2), step 3 compressed, then local/sync steps 4-8
    z = runs["zoadam"]
    assert z["config"]["var_update_scaler"] == 1 and z["config"]["local_step_clipper"] == 2
    assert z["kinds"]["variance"] == 2 and z["kinds"]["compressed"] == 1
    assert z["kinds"]["local"] + z["kinds"]["sync"] == 5
    # the same 0/1 Adam launched by torchrun (one agent per host) over a Gloo group: the same
    # steps and counted bytes, and at P = 2 (where a sum of two has one order) the same losses
    t = runs["zoadam-torchrun"]
    assert t["transport"] == "torch.distributed (gloo)" and t["world_size"] == 2
    assert t["kinds"] == z["kinds"] and t["bytes_sent_counted"] == z["bytes_sent_counted"]
    assert t["val_curve"][1][2] == z["val_curve"][1][2] and t["final_loss"] == z["final_loss"]
    ratios = rep["rates"]["1gbit"]["ratios"]
    assert ratios["zoadam_torchrun_val_curve_equal_to_zoadam"] is True
    assert ratios["zoadam_torchrun_final_loss_minus_zoadam"] == 0.0
    assert ratios["zoadam_torchrun_steps_per_s_vs_zoadam"] == t["steps_per_s"] / z["steps_per_s"]
    assert ratios["zoadam_torchrun_steps_per_s_vs_compute"] == t["steps_per_s"] / runs["compute"]["steps_per_s"]
    # the same 0/1 Adam over mpi4py alone (no Horovod): the same steps, bytes and, at P = 2, losses
    m = runs["zoadam-mpi"]
    assert m["transport"] == "mpi (mpi4py)" and m["world_size"] == 2
    assert m["kinds"] == z["kinds"] and m["bytes_sent_counted"] == z["bytes_sent_counted"]
    assert ratios["zoadam_mpi_val_curve_equal_to_zoadam"] is True and ratios["zoadam_mpi_final_loss_equal_to_zoadam"]
    assert ratios["zoadam_mpi_steps_per_s_vs_compute"] == m["steps_per_s"] / runs["compute"]["steps_per_s"]
    assert set(m["breakdown"]["sync"]["wire_by_op"]) == {"alltoall", "allgather", "flag"}
    # 1-bit Adam: full precision for 20 % of the 8 steps (two), then a compressed step every step
    o = runs["onebit"]
    assert o["config"]["freeze_step"] == 2 and o["kinds"] == {"variance": 2, "compressed": 6}
    assert o["transport"].startswith("mpi") and o["rounds"] > z["rounds"]
    assert rep["rates"]["1gbit"]["ratios"]["zoadam_rounds_vs_onebit"] == z["rounds"] / o["rounds"]
    # DiLoCo over torchft: every outer step committed (one for H = 8, none for H = 32 in 8 steps)
    assert runs["diloco-h8"]["syncs_committed"] == 1 and runs["diloco-h32"]["syncs_committed"] == 0
    assert runs["diloco-h8"]["wire_bytes_sent_per_rank"] > runs["diloco-h32"]["wire_bytes_sent_per_rank"]
    # validation on the fixed held-out set at steps 4 and 8, wall times without the evaluations
    for name, r in runs.items():
        assert [step for step, _, _ in r["val_curve"]] == [4, 8], name
        assert 0 < r["val_curve"][0][1] < r["val_curve"][1][1] and r["eval_seconds"] > 0
    ttq = rep["rates"]["1gbit"]["time_to_quality"]
    assert ttq["target_val"] == runs["adam"]["val_curve"][1][2]  # Adam at the first evaluation >= 2/3 of 8
    assert ttq["systems"]["adam"]["reached"] and ttq["systems"]["adam"]["ttq_speedup_vs_adam"] == 1.0
    assert set(ttq["ranking"]) <= set(runs) and "adam" in ttq["ranking"]
    assert (tmp_path / "n.quality.png").stat().st_size > 0
    # the ceiling is the slowest rank's speed: nothing paces the compute-only ranks otherwise
    assert len(runs["compute"]["steps_per_s_by_rank"]) == 2
    assert runs["compute"]["steps_per_s"] == min(runs["compute"]["steps_per_s_by_rank"])
    h = runs["compute-horovod"]  # the same with Horovod started: its ceiling, taken the same way
    assert len(h["steps_per_s_by_rank"]) == 2 and h["steps_per_s"] == min(h["steps_per_s_by_rank"])
    assert "rounds" not in h and ratios["zoadam_steps_per_s_vs_compute-horovod"] == z["steps_per_s"] / h["steps_per_s"]
    lock = runs["compute-lockstep"]  # paced by its allreduce: rank 0's speed is the job's
    assert "steps_per_s_by_rank" not in lock and lock["wire_bytes_sent_per_rank"] < 0.05 * runs["adam"][
        "wire_bytes_sent_per_rank"]
    assert ratios["compute_lockstep_steps_per_s_vs_compute"] == lock["steps_per_s"] / runs["compute"]["steps_per_s"]
    assert ratios["compute_horovod_steps_per_s_vs_compute"] == h["steps_per_s"] / runs["compute"]["steps_per_s"]
    assert ratios["zoadam_steps_per_s_vs_compute-lockstep"] == z["steps_per_s"] / lock["steps_per_s"]
    assert ratios["zoadam_mpi_steps_per_s_vs_compute-lockstep"] == runs["zoadam-mpi"]["steps_per_s"] / lock[
        "steps_per_s"]
    # every timed step's one allreduce is recorded and split into wire and the wait for the other rank
    parts = lock["breakdown"]["step"]
    assert parts["steps"] == 7 and set(parts["wire_by_op"]) == {"allreduce"}
    assert parts["wire"] + parts["waiting_for_slowest"] > 0 and runs["compute"]["breakdown"]["step"]["wire"] == 0
    # the cores rank 0's threads used over the timed span, in clock ticks: over a span this short
    # one run may see no tick of its training thread (a busy machine), all of them together do
    cores = {name: r["cpu_cores"] for name, r in runs.items() if not name.startswith("diloco")}
    assert all(c["training_thread"] >= 0 and c["other_threads"] >= 0 for c in cores.values()), cores
    assert sum(c["training_thread"] for c in cores.values()) > 0, cores
    assert "latency NOT shaped" in rep["note"] and png.stat().st_size > 0
    assert rep["horovod_env"] == {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zo" not in " ".join(line.split()[0] for line in out.splitlines() if line.startswith("zo"))
    # --breakdown: the timed steps (after --skip 1) of each kind, split into parts
    assert {k: v["steps"] for k, v in z["breakdown"].items()} == {
        "variance": 1, "compressed": 1, **{k: n for k, n in z["kinds"].items() if k in ("local", "sync") and n}}
    for name in ("zoadam", "zoadam-torchrun", "zoadam-mpi", "adam", "compute", "compute-lockstep", "ddp-powersgd",
                 "onebit"):
        for kind, parts in runs[name]["breakdown"].items():
            assert parts["waiting_for_slowest"] >= 0 and parts["wire"] >= -1e-9, (name, kind)
            assert sum(parts[k] for k in parts if k not in ("steps", "wall", "wire_by_op", "kernels_by_name")) == \
                pytest.approx(parts["wall"]), name
            assert sum(parts["wire_by_op"].values()) <= parts["wire"] + 1e-6, (name, kind)
            assert sum(parts["kernels_by_name"].values()) == pytest.approx(parts["kernels"], abs=1e-9), (name, kind)
    assert runs["compute"]["breakdown"]["step"]["steps"] == 7 and "breakdown" not in runs["diloco-h8"]
    assert z["breakdown"]["sync"]["kernels"] > 0 and z["breakdown"]["local"]["wire"] == 0
    # the hooks start each SYNC step's exchange during backward: its own work is split out
    assert z["breakdown"]["sync"]["early_start"] > 0 and z["breakdown"]["local"]["early_start"] == 0
    # each round's wire apart: a SYNC step's two rounds and its flag; a LOCAL step sends nothing
    assert set(z["breakdown"]["sync"]["wire_by_op"]) == {"alltoall", "allgather", "flag"}
    assert z["breakdown"]["local"]["wire_by_op"] == {}
    # and each kernel apart: a SYNC step's window update, worker and server sides and rebuild
    assert {"local_window_update", "worker_compress", "server_reduce", "decompress_sync"} <= set(
        z["breakdown"]["sync"]["kernels_by_name"])
    assert runs["compute"]["breakdown"]["step"]["kernels_by_name"] == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root")
def test_bench_network_repeats_the_runs_in_turn_and_reports_medians():
    # over unshaped links (the same hosts with no qdisc; tc would refuse a rate named "unshaped")
    rep = bench("network", "--rate", "unshaped", "--steps", "4", "--warmup", "2", "--skip", "1", "--repeat", "2",
                "--runs", "zoadam,compute", "--model-args", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                "--block-size", "32", "--batch-size", "4")
    rate = rep["rates"]["unshaped"]
    assert rep["repeat"] == 2 and len(rate["repeats"]) == 2
    each = [r["ratios"]["zoadam_steps_per_s_vs_compute"] for r in rate["repeats"]]
    for r in rate["repeats"]:  # each repetition's ratio is its own runs' (a fresh work directory each)
        runs = {x["run"]: x for x in r["runs"]}
        assert all(x["ok"] for x in runs.values()) and list(runs) == ["zoadam", "compute"]
        assert r["ratios"]["zoadam_steps_per_s_vs_compute"] == \
            runs["zoadam"]["steps_per_s"] / runs["compute"]["steps_per_s"]
    assert rate["ratios"]["zoadam_steps_per_s_vs_compute"] == pytest.approx(sum(each) / 2)  # the median of two
    assert rate["spread"]["zoadam_steps_per_s_vs_compute"]["values"] == each
    assert rate["runs"] == rate["repeats"][0]["runs"]
    proc = subprocess.run([sys.executable, "-m", "hvd_zoadam.bench", "network", "--repeat", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--repeat" in proc.stderr


def test_repeated_runs_give_each_ratios_median_and_spread_paired_within_a_repetition():
    def run(name, steps_per_s, wire=1.0):
        return {"run": name, "label": name, "ok": True, "steps_per_s": steps_per_s, "wire_bytes_sent_per_rank": wire}
    # the machine drifts between repetitions (compute 2.0, 1.0, 4.0): the ratios pair within each
    repeats = [[run("zoadam", 1.8), run("compute", 2.0)], [run("zoadam", 0.95), run("compute", 1.0)],
               [run("zoadam", 3.0), run("compute", 4.0)]]
    rep = _rate_report(repeats)
    s = rep["spread"]["zoadam_steps_per_s_vs_compute"]
    assert s["values"] == [0.9, 0.95, 0.75] and (s["median"], s["min"], s["max"]) == (0.9, 0.75, 0.95)
    assert rep["ratios"] == {"zoadam_steps_per_s_vs_compute": 0.9}
    assert rep["spread"]["steps_per_s:compute"]["median"] == 2.0
    assert rep["spread"]["steps_per_s:zoadam"]["values"] == [1.8, 0.95, 3.0]
    assert rep["runs"] is repeats[0] and [r["runs"] for r in rep["repeats"]] == repeats
    # a run that failed in one repetition: no median over fewer values, for its ratios or its steps/s
    repeats[1][1] = {"run": "compute", "label": "compute", "ok": False, "error": "exit 1",
                     "wire_bytes_sent_per_rank": 0}
    rep = _rate_report(repeats)
    assert "zoadam_steps_per_s_vs_compute" not in rep["spread"] and "steps_per_s:compute" not in rep["spread"]
    assert "zoadam_steps_per_s_vs_compute" not in rep["ratios"]
    assert _rate_report(repeats[:1]) == {"runs": repeats[0], "ratios": {"zoadam_steps_per_s_vs_compute": 0.9},
                                         "time_to_quality": {}}


def test_thread_cpu_seconds_reads_each_threads_ticks_and_cores_used_splits_the_training_thread(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    # /proc/<pid>/task/<tid>/stat: pid (comm) state, then fields 4..; utime and stime are 14 and 15
    for tid, comm, utime, stime in ((11, "python", 3 * ticks, ticks), (12, "a (b) c", ticks // 2, 0)):
        (tmp_path / str(tid)).mkdir()
        rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 5
        (tmp_path / str(tid) / "stat").write_text(f"{tid} ({comm}) " + " ".join(rest) + "\n")
    assert thread_cpu_seconds(str(tmp_path)) == {11: 4.0, 12: 0.5}
    assert thread_cpu_seconds(str(tmp_path / "missing")) is None
    start, end = {11: 4.0, 12: 0.5}, {11: 6.0, 12: 1.0, 13: 0.5}  # thread 13 started in between
    assert cores_used(start, end, 4.0, training_thread=11) == {"training_thread": 0.5, "other_threads": 0.25}
    assert cores_used(None, end, 4.0) is None and cores_used(start, end, 0.0) is None
    mine = thread_cpu_seconds()  # this process, on Linux: the calling thread is among them
    assert mine is None or threading.get_native_id() in mine


def test_bench_network_hands_horovod_variables_to_the_ranks():
    env = {"HOROVOD_CYCLE_TIME": "5", "PATH": "/bin", "HOROVOD_FUSION_THRESHOLD": "0", "XHOROVOD_NO": "1"}
    assert _horovod_env_flags(env) == ["-x", "HOROVOD_CYCLE_TIME", "-x", "HOROVOD_FUSION_THRESHOLD"]


def test_bench_step_reports_each_kind_against_adamw():
    rep = bench("step", "--n-layer", "1", "--n-embd", "64", "--iters", "2", "--repeats", "1")
    assert set(rep["kinds"]) == {"variance", "compressed", "local", "sync"}
    for kind, r in rep["kinds"].items():
        assert r["measured_kind"] == kind and r["ms"] > 0
        parts = r["breakdown_ms"]  # exclusive parts of each step's wall time
        assert sum(parts[k] for k in ("optimizer", "kernels", "packing", "wire")) <= parts["wall"] * 1.0001
        assert parts["wire"] == 0.0  # P = 1: nothing is sent
    assert rep["kinds"]["sync"]["breakdown_ms"]["kernels"] > 0  # sync_prepare / sync_rebuild run
    assert rep["adamw_foreach_ms"] > 0 and rep["adamw_fused_ms"] > 0 and isinstance(rep["met"], bool)
    for r in rep["kinds"].values():
        assert r["vs_adamw_fused"] == pytest.approx(r["ms"] / r["adamw_fused_ms"])


def test_bench_step_runs_without_horovod_as_on_a_bare_gpu_machine():
    """native/device_check.sh runs `bench step --device cuda` where Horovod may be missing."""
    code = ("import sys; sys.modules['horovod'] = sys.modules['horovod.torch'] = None; "
            "from hvd_zoadam.bench.cli import main; "
            "sys.exit(main(['step', '--n-layer', '1', '--n-embd', '64', '--iters', '1', '--repeats', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["world_size"] == 1 and rep["device"] == "cpu"
    assert {k: r["measured_kind"] for k, r in rep["kinds"].items()} == {k: k for k in rep["kinds"]}


def test_alpha_beta_model_formulas_and_projection():
    # Adam fp32 on 2 workers, 1e6 params, 100 Mbit/s, no latency: 4 MB crosses once each way
    t = step_time("adam", n=1e6, p=2, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.5)
    assert t == pytest.approx(0.5 + 4e6 / 12.5e6)
    assert step_time("adam-fp16", n=1e6, p=2, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.5) == \
        pytest.approx(0.5 + 2e6 / 12.5e6)
    # 0/1 Adam with only local steps costs compute only; with only syncs, 1/32 of Adam's bytes
    assert step_time("zoadam", n=1e6, p=2, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.5,
                     frac={"local": 1.0}) == pytest.approx(0.5)
    assert step_time("zoadam", n=1e6, p=2, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.0,
                     frac={"sync": 1.0}) == pytest.approx(4e6 / 32 / 12.5e6)
    # per-block scales go to their chunk's server and back: 32/block of the bits at every p
    for p in (2, 64, 1024):
        bits = step_time("zoadam", n=1e6, p=p, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.0, frac={"sync": 1.0})
        assert step_time("zoadam", n=1e6, p=p, bandwidth_bps=1e8, latency_s=0.0, compute_s=0.0, frac={"sync": 1.0},
                         scale_block_numel=2048) == pytest.approx(bits * (1 + 32 / 2048))
    # nodes of L ranks: the flat exchange sends L·2(P−L)/P of the bits per node, the two-level one
    # what one rank of a flat exchange among the N = P/L nodes sends
    from hvd_zoadam.bench.model import exchange_node_bytes
    assert exchange_node_bytes("zoadam", n=8e6, p=64, ranks_per_node=8) == pytest.approx(8 * 2 * 56 / 64 * 1e6)
    assert exchange_node_bytes("zoadam-2level", n=8e6, p=64, ranks_per_node=8) == pytest.approx(2 * 7 / 8 * 1e6)
    assert exchange_node_bytes("zoadam", n=8e6, p=2) == exchange_node_bytes("zoadam-2level", n=8e6, p=2)
    rep = bench("model")
    rows = rep["bert_large"]["rows"]
    assert {(r["gbit_per_s"], r["workers"]) for r in rows} == {(g, w) for g in (10, 40, 100)
                                                              for w in (16, 32, 64, 128, 256, 512, 1024)}
    for r in rows:
        assert r["zoadam-2level_s"] <= r["zoadam_s"] <= r["1bit-adam_s"] <= r["adam-fp16_s"]
        assert r["zoadam-2level_node_MB_per_step"] < r["zoadam_node_MB_per_step"] / 4


def test_bench_model_validates_against_the_shaped_rates_of_a_network_report(tmp_path):
    def runs(compute, adam):
        return [{"run": "compute", "ok": True, "params": 1_000_000, "steps_per_s": compute},
                {"run": "adam", "ok": True, "params": 1_000_000, "steps_per_s": adam}]
    report = {"ranks": 2, "rates": {"unshaped": {"runs": runs(2.0, 1.9)}, "100mbit": {"runs": runs(2.0, 1.0)}}}
    (tmp_path / "net.json").write_text(json.dumps(report))
    checks = bench("model", "--measured", str(tmp_path / "net.json"), "--latency", "0")["validation"]
    # an unshaped link has no rate to model; at 100 Mbit/s 4 MB each way take 0.32 s
    assert [(c["rate"], c["run"]) for c in checks] == [("100mbit", "adam")]
    assert checks[0]["predicted_steps_per_s"] == pytest.approx(1 / (0.5 + 4e6 / 12.5e6))


def test_bench_kernels_refuses_cuda_without_a_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = subprocess.run([sys.executable, "-m", "hvd_zoadam.bench", "kernels", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr


def test_bench_kernels_reports_each_kernel_against_copy():
    rep = bench("kernels", "--numel", "65536", "--repeats", "1")
    assert set(rep["kernels"]) == {"worker_compress", "server_reduce", "decompress", "decompress_momentum",
                                   "decompress_sync", "decompress_sync_params", "decompress_sync_decay",
                                   "decompress_sync_scatter"}
    assert rep["kernels"]["worker_compress"]["target_vs_copy"] == 0.5  # the CPU kernels' speed targets are reported
    assert isinstance(rep["kernels"]["decompress_momentum"]["met"], bool)
    assert rep["copy_GBps"] > 0 and all(k["GBps"] > 0 and k["vs_copy"] > 0 for k in rep["kernels"].values())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert rep["provenance"]["command"] == "python -m hvd_zoadam.bench kernels --numel 65536 --repeats 1"
    assert rep["provenance"]["commit"] in (head, head + "+changes")  # the tests run in a checkout
    # memory traffic per element against the copy's 8 bytes, by hand for n = 65536, P = 2 (no padding):
    # decompress_sync reads 1/8 (bits) + 4 (x_a) + 4 (s) and writes 4 (x) + 4 (m) + 4 (x_a) for its 4 counted
    # (and with the copy into the parameters, 8 more: x read, the parameters written)
    # (the window's weight decay scales x_a in the same pass: no byte more)
    ratios = {"decompress_sync": (1 / 8 + 20) / 8, "decompress_sync_params": (1 / 8 + 20) / 8,
              "decompress_sync_decay": (1 / 8 + 20) / 8,
              "decompress_sync_scatter": (1 / 8 + 28) / 8, "decompress_momentum": (1 / 8 + 8) / 8,
              "worker_compress": (4 + 8 + 1 / 8) / 8, "server_reduce": (2 / 8 + 8 + 1 / 8) / 8}
    for name, ratio in ratios.items():
        k = rep["kernels"][name]
        assert k["traffic_vs_copy"] == pytest.approx(k["vs_copy"] * ratio, rel=1e-9), name


def test_provenance_names_the_commit_the_command_and_the_machine(tmp_path):
    import torch

    from hvd_zoadam.bench import provenance
    plain = provenance(["step", "--iters", "2"], root=tmp_path)  # not a git checkout (an installed package)
    assert plain["commit"] is None and plain["command"] == "python -m hvd_zoadam.bench step --iters 2"
    assert plain["cores"] == os.cpu_count() and plain["torch"] == torch.__version__
    assert plain["cpu"] is None or plain["cpu"]
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                              check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    own = repo / "native"
    assert provenance([], root=repo, kernels=own)["commit"] == head
    (repo / "untracked").write_text("x")       # run outputs and the like do not count
    assert provenance([], root=repo, kernels=own)["commit"] == head
    (repo / "f").write_text("2")
    assert provenance([], root=repo, kernels=own)["commit"] == head + "+changes"
    # kernels imported from another checkout (an editable install's, under a worktree) are named
    assert provenance([], root=repo, kernels=tmp_path)["commit"] == f"{head}+changes+kernels from {tmp_path.resolve()}"
    assert provenance([], root=repo)["commit"].startswith(f"{head}+changes+kernels from ")  # this test's own
    (repo / "sub").mkdir()                      # a package inside another project's checkout
    assert provenance([], root=repo / "sub")["commit"] is None


@pytest.mark.parametrize("block", ["2048", "40"])
def test_bench_load_counts_the_formulas_bytes_and_reports_memory(block):
    """`bench load` under horovodrun -np 3: 300 tensors in several buckets (a 0.2 MB cap), one
    scale per block (40: the scale slots' padding differs from chunk to chunk); every kind's
    counted bytes per step equal the formulas' (to the counter's rounding of the
    allreduces' fractional bytes at P = 3), and the memory and times are reported."""
    out = run_cmd([str(BIN / "horovodrun"), "-np", "3", "-H", "localhost:3", "--gloo", sys.executable, "-m",
                   "hvd_zoadam.bench", "load", "--model", "many-small", "--blocks", "50", "--bucket-cap-mb", "0.2",
                   "--scale-block-numel", block, "--iters", "1", "--repeats", "1"], timeout_s=300).stdout
    rep = json.loads("".join(line.split(">:", 1)[1] + "\n" for line in out.splitlines() if "<stdout>:" in line))
    assert rep["tensors"] == 300 and rep["world_size"] == 3 and rep["buckets"] > 1
    assert set(rep["kinds"]) == {"variance", "compressed", "local", "sync"}
    for kind, r in rep["kinds"].items():
        assert abs(r["bytes_per_step"] - r["formula_bytes"]) < 1 and r["bytes_match"], kind
        assert r["ms"] > 0 and r["baseline_ms"] > 0
    assert rep["kinds"]["sync"]["bytes_per_step"] > 0 and rep["kinds"]["local"]["bytes_per_step"] == 0
    assert rep["memory"]["memory_bytes"]["total"] > 0 and rep["memory"]["rss_growth_bytes"] >= 0


def test_bench_load_under_torchrun_runs_the_torch_distributed_front_end_against_ddps_work(tmp_path):
    """`bench load` under torchrun -nproc-per-node 2: the torch.distributed front end, its bytes
    equal to the formulas' on every kind, against the bucketed allreduce + AdamW that DDP runs."""
    out = tmp_path / "load.json"
    run_cmd([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "hvd_zoadam.bench", "load",
             "--model", "many-small", "--blocks", "30", "--bucket-cap-mb", "0.2", "--iters", "1", "--repeats", "1",
             "--json", str(out)], timeout_s=300)
    rep = json.loads(out.read_text())
    assert rep["launcher"] == "torchrun" and rep["baseline"] == "ddp_adamw_foreach"
    assert rep["tensors"] == 180 and rep["world_size"] == 2 and rep["buckets"] > 1
    assert set(rep["kinds"]) == {"variance", "compressed", "local", "sync"}
    for kind, r in rep["kinds"].items():
        assert r["bytes_match"] and abs(r["bytes_per_step"] - r["formula_bytes"]) < 1, kind
        assert r["ms"] > 0 and r["baseline_ms"] > 0
    assert rep["kinds"]["compressed"]["bytes_per_step"] < rep["kinds"]["variance"]["bytes_per_step"] / 10


def test_bench_lm_compression_fp16_halves_only_the_variance_steps_bytes(tmp_path):
    """``--compression fp16`` hands hvd.Compression.fp16 to the zoadam run: its VARIANCE steps
    send half the counted bytes of their averages, every other kind the same; the runs without Horovod refuse it.
    ``--overlap off`` hands ``overlap=False``: the same steps and bytes, nothing started by the hooks."""
    argv = ["-m", "hvd_zoadam.bench.lm", "--run", "zoadam", "--steps", "8", "--warmup", "3", "--n-layer", "1",
            "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
            "--var-update-scaler", "1", "--local-step-clipper", "2"]
    reports = {}
    for comp in ("none", "fp16"):
        out = tmp_path / f"{comp}.json"
        run_job("mpi", 2, [*argv, "--compression", comp, "--out", str(out)])
        reports[comp] = json.loads(out.read_text())
    fp32, fp16 = reports["none"]["bytes_sent_by_kind"], reports["fp16"]["bytes_sent_by_kind"]
    assert reports["fp16"]["config"]["compression"] == "fp16" and reports["fp16"]["kinds"]["variance"] == 2
    # the averages halve; the 4-byte flags (at most one a step) do not
    assert fp32["variance"] > 1000 and 0 <= 2 * fp16["variance"] - fp32["variance"] <= 4 * 2
    assert {k: fp16[k] for k in ("compressed", "local", "sync")} == \
        {k: fp32[k] for k in ("compressed", "local", "sync")}
    # --overlap off hands overlap=False to the optimizer: no exchange starts from the hooks; each
    # exchange step's 4-byte flag goes before the exchange instead of after: the same bytes
    out = tmp_path / "no-overlap.json"
    run_job("mpi", 2, [*argv, "--overlap", "off", "--out", str(out)])
    serial = json.loads(out.read_text())
    assert reports["none"]["config"]["overlap"] is True and serial["config"]["overlap"] is False
    assert serial["kinds"] == reports["none"]["kinds"]
    assert serial["bytes_sent_by_kind"] == fp32
    for run in ("zoadam-torchrun", "zoadam-mpi"):
        proc = run_cmd([sys.executable, "-m", "hvd_zoadam.bench.lm", "--run", run, "--compression", "fp16",
                        "--out", str(tmp_path / "t.json")], check=False)
        assert proc.returncode != 0 and f"the {run} run has no Horovod" in proc.stderr
