"""Resumes keep the error feedback: the pooled state of checkpoint files, and bad files refused."""
from __future__ import annotations

import pytest
import torch

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam import checkpoint
from hvd_zoadam.bench import resume as _bench_resume
from hvd_zoadam.bench.cli import main as bench_main


def _build(transport, sizes=(37, 5, 1, 64), knobs=_bench_resume.RegressionCase.knobs):
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.full((n,), 0.1)) for n in sizes)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), transport=transport,
                                          named_parameters=model.named_parameters(), **knobs)
    return model, opt


def _train(model, opt, rank, steps):
    for t in range(1, steps + 1):
        opt.zero_grad()
        x, y = _bench_resume._regression_batch(t, rank)
        torch.nn.functional.mse_loss(x @ torch.cat(list(model)), y).backward()
        opt.step()


def test_pooled_state_holds_what_the_ranks_owe_and_loads_at_any_world_size():
    """At P = 4, past the freeze: the pooled worker error is the mean of the four, the pooled server
    errors are the four chunks in order; loaded at P' = 1, 2, 3, 5 each rank holds that mean and its
    own chunk of the server errors, so the owed total is the same."""
    def save(rank, transport):
        model, opt = _build(transport)
        _train(model, opt, rank, 12)
        b = opt._buckets[0].exchange
        return opt.error_feedback_state(), b.worker_error[:b.numel].clone(), b.server_error.clone(), b.numel

    out = run_threads(4, save)
    pooled, n = out[0][0], out[0][3]
    assert all(o[0]["worker_error"].keys() == pooled["worker_error"].keys() for o in out)
    flat = {k: torch.cat([pooled[k][i] for i in sorted(pooled[k])]) for k in ("worker_error", "server_error")}
    for o in out[1:]:  # the same on every rank
        assert all(torch.equal(o[0][k][i], pooled[k][i]) for k in ("worker_error", "server_error") for i in pooled[k])
    total = out[0][1].double() + out[1][1].double() + out[2][1].double() + out[3][1].double()
    assert flat["worker_error"].abs().sum() > 0
    assert torch.equal(flat["worker_error"], (total / 4).float())
    assert torch.equal(flat["server_error"], torch.cat([o[2] for o in out])[:n])
    assert pooled["names"] == {0: "0", 1: "1", 2: "2", 3: "3"}

    for world in (1, 2, 3, 5):
        def load(rank, transport):
            model, opt = _build(transport)
            assert opt.load_error_feedback(pooled)
            b = opt._buckets[0].exchange
            return b.worker_error.clone(), b.server_error.clone()
        got = run_threads(world, load)
        for worker, _ in got:
            assert torch.equal(worker[:n], flat["worker_error"]) and not worker[n:].any()
        assert torch.equal(torch.cat([s for _, s in got])[:n], flat["server_error"])


def test_error_feedback_of_other_parameters_is_refused():
    def body(rank, transport):
        model, opt = _build(transport)
        state = opt.error_feedback_state()
        _, other = _build(transport, sizes=(37, 6, 1, 64))
        with pytest.raises(ValueError, match=r"saved for parameter '1' of 5 elements .* '1' of 6 elements"):
            other.load_error_feedback(state)
        assert not opt.load_error_feedback(None) and not opt._buckets[0].exchange.worker_error.any()
    run_threads(1, body)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not-a-checkpoint", "other-model", "missing"])
def test_a_bad_checkpoint_file_is_refused_naming_the_file(tmp_path, damage):
    prefix = str(tmp_path / "ckpt")

    def body(rank, transport):
        model, opt = _build(transport)
        _train(model, opt, rank, 3)
        checkpoint.save(prefix, model, opt, step=3)
        path = tmp_path / "ckpt.rank0.pt"
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:200])
        elif damage == "garbage":
            path.write_bytes(b"\x00not a zip" * 50)
        elif damage == "not-a-checkpoint":
            torch.save({"weights": torch.ones(3)}, path)
        elif damage == "missing":
            path.unlink()
            (tmp_path / "ckpt.pt").unlink()
        if damage == "other-model":
            model, opt = _build(transport, sizes=(37, 5, 2, 64))
        else:
            model, opt = _build(transport)
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.load(prefix, model, opt)
        return str(info.value)

    message = run_threads(1, body)[0]
    assert "ckpt" in message
    expect = {"truncated": "cannot be read", "garbage": "cannot be read", "not-a-checkpoint": "not an hvd_zoadam",
              "other-model": "does not fit this model", "missing": "does not exist"}[damage]
    assert expect in message, message


def test_bench_resume_keeps_the_progress_that_zeroed_buffers_lose(tmp_path, capsys):
    """The regression case of ``bench resume`` (saved at P = 4, step 12; 6 more steps): the exact
    resume is bitwise (gain 1), and so is the common file split by groups at P' = 4; the pooled
    error feedback keeps >= 0.9 of the progress at P' = 4 and 3, and the zeroed buffers keep less."""
    out = tmp_path / "r.json"
    assert bench_main(["resume", "--to", "4,3", "--json", str(out)]) == 0
    import json
    report = json.loads(out.read_text())
    rows = {(r["world_size"], r["mode"]): r for r in report["runs"]}
    assert rows[(4, "rank-files")]["val_loss"] == report["uninterrupted"][0]["val_end"]
    assert rows[(4, "grouped")]["val_loss"] == report["uninterrupted"][0]["val_end"]  # each rank's own state
    for p in (4, 3):
        assert rows[(p, "pooled")]["gain"] >= 0.9
        assert rows[(p, "zeroed")]["gain"] < rows[(p, "pooled")]["gain"]


def test_the_first_exchange_after_a_pooled_load_matches_the_oracle():
    """Pooled at P = 4, loaded at P' = 2 and 3: the next 1-bit exchange of the bucket equals the
    in-process simulation started from worker errors ē on every rank and the server errors cut
    from the pooled vector, bit for bit (outputs and both error buffers)."""
    from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce

    def save(rank, transport):
        model, opt = _build(transport)
        _train(model, opt, rank, 12)
        return opt.error_feedback_state()

    pooled = run_threads(4, save)[0]
    for world in (2, 3):
        def exchange(rank, transport):
            model, opt = _build(transport)
            opt.load_error_feedback(pooled)
            ex = opt._buckets[0].exchange
            start = (ex.worker_error.clone(), ex.server_error.clone())
            y = ex.input
            y.zero_()
            y[:ex.numel] = torch.randn(ex.numel, generator=torch.Generator().manual_seed(50 + rank))
            token = ex.prepare(y)
            out = ex.finish(None, token, torch.empty(ex.numel))
            return start, out, ex.worker_error.clone(), ex.server_error.clone(), ex.offsets
        got = run_threads(world, exchange)
        offsets = got[0][4]
        inputs = [torch.randn(offsets[-1], generator=torch.Generator().manual_seed(50 + r)) for r in range(world)]
        we = [g[0][0].clone() for g in got]
        se = [g[0][1].clone() for g in got]
        assert all(torch.equal(w, we[0]) for w in we) and we[0].abs().sum() > 0
        numels = [b - a for a, b in zip(offsets, offsets[1:])]
        want = simulate_compressed_allreduce(inputs, we, se, numels)
        for r, g in enumerate(got):
            assert torch.equal(g[1], want) and torch.equal(g[2], we[r]) and torch.equal(g[3], se[r])


WINDOW = _bench_resume.WindowCase.knobs  # freeze at 6, then SYNC 7, 8, 10, 14, 18: 11-13 are local steps


@pytest.mark.parametrize("save_at", [12, 14])
def test_the_common_file_holds_the_ranks_mean_inside_a_window(tmp_path, save_at):
    """Saved at P = 4 after step 12 (local steps 11 and 12 since the anchor of step 10), the
    common file holds the means over the four ranks of the parameters and of the momentum, with
    the window's anchor and Λ as they are; each rank's own file and the job itself keep their
    own state, bit for bit. Saved at the SYNC step 14, the common file is rank 0's state."""
    prefix = str(tmp_path / "ckpt")

    def body(rank, transport):
        model, opt = _build(transport, knobs=WINDOW)
        _train(model, opt, rank, save_at)
        b = opt._buckets[0]
        before = [q.detach().clone() for q in model] + [b.exp_avg.clone(), b.anchor.clone()]
        lr_sum = opt.param_groups[0]["lr_sum"]
        checkpoint.save(prefix, model, opt, step=save_at)
        after = [q.detach().clone() for q in model] + [b.exp_avg.clone(), b.anchor.clone()]
        assert all(torch.equal(u, v) for u, v in zip(before, after))
        return torch.cat(before[:4]), before[4], before[5], lr_sum

    ranks = run_threads(4, body)
    common = checkpoint.read(prefix + ".pt")
    x = torch.cat([common["model"][str(i)] for i in range(4)])
    state = common["optimizer"]["state"]
    m = torch.cat([state[i]["exp_avg"] for i in range(4)])
    anchor = torch.cat([state[i]["anchor"] for i in range(4)])
    assert common["optimizer"]["param_groups"][0]["lr_sum"] == ranks[0][3]
    assert torch.equal(anchor, ranks[0][2])
    if save_at == 14:
        assert ranks[0][3] == 0 and torch.equal(x, ranks[0][0]) and torch.equal(m, ranks[0][1])
        return
    assert ranks[0][3] > 0 and not all(torch.equal(ranks[0][0], r[0]) for r in ranks[1:])  # drifted apart
    torch.testing.assert_close(x, torch.stack([r[0] for r in ranks]).mean(0), rtol=0, atol=1e-7)
    torch.testing.assert_close(m, torch.stack([r[1] for r in ranks]).mean(0), rtol=0, atol=1e-9)
    own = checkpoint.read(prefix + ".rank0.pt")
    assert torch.equal(torch.cat([own["model"][str(i)] for i in range(4)]), ranks[0][0])


def test_a_resume_at_world_size_one_puts_what_the_ranks_owed_into_the_parameters(tmp_path):
    """Loaded at P' = 1 past the freeze, where no exchange will ever deliver it, the pooled error
    feedback (mean worker error plus the server errors) moves the parameters and the anchor at
    once, and the buffers stay at zero; before the freeze nothing moves."""
    for save_at in (5, 14):  # a COMPRESSED step before the freeze, a SYNC step after it
        prefix = str(tmp_path / f"ckpt{save_at}")

        def save(rank, transport):
            model, opt = _build(transport, knobs=WINDOW)
            _train(model, opt, rank, save_at)
            checkpoint.save(prefix, model, opt, step=save_at)
        run_threads(4, save)
        common = checkpoint.read(prefix + ".pt")
        ef = common["error_feedback"]
        owed = torch.cat([ef["worker_error"][i] + ef["server_error"][i] for i in range(4)])
        assert owed.abs().sum() > 0

        def load(rank, transport):
            model, opt = _build(transport, knobs=WINDOW)
            checkpoint.load(prefix, model, opt)
            ex = opt._buckets[0].exchange
            return torch.cat([q.detach() for q in model]), opt._buckets[0].anchor.clone(), ex.worker_error.any()
        x, anchor, errors_left = run_threads(1, load)[0]
        saved = torch.cat([common["model"][str(i)] for i in range(4)])
        saved_anchor = torch.cat([common["optimizer"]["state"][i]["anchor"] for i in range(4)])
        if save_at == 5:
            assert torch.equal(x, saved) and torch.equal(anchor, saved_anchor)
        else:
            assert torch.equal(x, saved - owed) and not errors_left and torch.equal(anchor, saved_anchor - owed)


# -- the worker errors, x and m split by groups of saving ranks -------------------------------------

def _save_window(prefix, save_at=12):
    """P = 4 thread-ranks save after ``save_at`` steps (12: inside a window of local steps, 14: a
    SYNC step); returns each rank's (worker error, server error, x, m) as saved."""
    def body(rank, transport):
        model, opt = _build(transport, knobs=WINDOW)
        _train(model, opt, rank, save_at)
        checkpoint.save(prefix, model, opt, step=save_at)
        b = opt._buckets[0]
        return (b.exchange.worker_error[:b.numel].clone(), b.exchange.server_error.clone(),
                torch.cat([q.detach() for q in model]), b.exp_avg.clone())
    return run_threads(4, body)


def _load_window(prefix, world, **kw):
    """``checkpoint.load`` on ``world`` thread-ranks; each rank's (worker error, server error, x, m)."""
    def body(rank, transport):
        model, opt = _build(transport, knobs=WINDOW)
        checkpoint.load(prefix, model, opt, **kw)
        b = opt._buckets[0]
        return (b.exchange.worker_error.clone(), b.exchange.server_error.clone(),
                torch.cat([q.detach() for q in model]), b.exp_avg.clone())
    return run_threads(world, body)


def test_a_resume_at_half_the_ranks_splits_by_pairs_of_saving_ranks(tmp_path):
    """Saved at P = 4 inside a window, with every rank's file, resumed at P' = 2: rank 0 takes the
    worker error (e_0 + e_1)/2 and rank 1 (e_2 + e_3)/2 (not the mean of the four), and likewise
    continues from (x_0 + x_1)/2 and (m_0 + m_1)/2, rank 1 from the other pair's; the means over
    the new ranks are the saved means, and the server chunks are cut from the pooled vector."""
    prefix = str(tmp_path / "ckpt")
    saved = _save_window(prefix)
    n = saved[0][0].numel()
    e, x, m = ([s[k] for s in saved] for k in (0, 2, 3))
    assert not torch.equal(e[0], e[1]) and not torch.equal(x[0], x[1])  # the ranks differ
    got = _load_window(prefix, 2)
    for rank, (a, b) in enumerate(((0, 1), (2, 3))):
        worker, _, x_new, m_new = got[rank]
        assert torch.equal(worker[:n], ((e[a].double() + e[b].double()) * 2 / 4).float()) and not worker[n:].any()
        torch.testing.assert_close(worker[:n], (e[a] + e[b]) / 2, rtol=0, atol=1e-9)
        torch.testing.assert_close(x_new, (x[a] + x[b]) / 2, rtol=0, atol=1e-7)
        torch.testing.assert_close(m_new, (m[a] + m[b]) / 2, rtol=0, atol=1e-9)
    torch.testing.assert_close((got[0][0] + got[1][0])[:n] / 2, sum(e) / 4, rtol=0, atol=1e-9)
    assert torch.equal(torch.cat([g[1] for g in got])[:n], torch.cat([s[1] for s in saved])[:n])


def test_a_resume_at_three_and_five_ranks_keeps_what_the_ranks_owe(tmp_path):
    """P = 4 onto P' = 3: the groups {0, 1}, {2}, {3}, each sum times 3/4; onto P' = 5: rank i < 4
    takes 5/4 e_i and rank 4 zero. The owed total Σ e'/P' is the saved Σ e/4 either way."""
    prefix = str(tmp_path / "ckpt")
    saved = _save_window(prefix)
    e = [s[0].double() for s in saved]
    n = e[0].numel()
    for world, groups in ((3, [[0, 1], [2], [3]]), (5, [[0], [1], [2], [3], []])):
        got = _load_window(prefix, world)
        for rank, group in enumerate(groups):
            want = (sum((e[i] for i in group), torch.zeros(n, dtype=torch.float64)) * world / 4).float()
            assert torch.equal(got[rank][0][:n], want), (world, rank)
        owed = sum(g[0][:n].double() for g in got) / world
        torch.testing.assert_close(owed, sum(e) / 4, rtol=0, atol=1e-9)
    assert not got[4][0].any() and got[0][0].abs().sum() > 0


@pytest.mark.parametrize("save_at", [12, 14])
def test_a_resume_from_the_common_file_at_the_same_world_size_is_each_ranks_own_state(tmp_path, save_at):
    """From ``{prefix}.pt`` with the per-rank files next to it (``exact=False``), at P' = P = 4
    every rank gets back its own worker error, server error, parameters and momentum, bit for bit,
    inside a window (12) and at a SYNC step (14); without the split (``per_group=False``) it
    is the means."""
    prefix = str(tmp_path / "ckpt")
    saved = _save_window(prefix, save_at)
    n = saved[0][0].numel()
    got = _load_window(prefix, 4, exact=False)
    for s, g in zip(saved, got):
        assert torch.equal(g[0][:n], s[0]) and torch.equal(g[1], s[1])
        assert torch.equal(g[2], s[2]) and torch.equal(g[3], s[3])
    pooled = _load_window(prefix, 4, exact=False, per_group=False)
    mean = sum(s[0].double() for s in saved) / 4
    assert all(torch.equal(p[0][:n], mean.float()) for p in pooled)


@pytest.mark.parametrize("damage", ["missing", "truncated", "other-step"])
def test_a_missing_saving_rank_file_gives_every_rank_the_means(tmp_path, damage):
    """Saved at P = 4 and resumed at P' = 2 when saving rank 2's file is missing, unreadable or
    from another save: every new rank (also rank 0, whose group's files are all there) takes the
    mean worker error and the saved means of x and m, as without any per-rank file."""
    prefix = str(tmp_path / "ckpt")
    saved = _save_window(prefix)
    n = saved[0][0].numel()
    path = tmp_path / "ckpt.rank2.pt"
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:300])
    else:
        other = str(tmp_path / "other")
        _save_window(other, 13)
        (tmp_path / "other.rank2.pt").replace(path)
    got = _load_window(prefix, 2)
    common = checkpoint.read(prefix + ".pt")
    ef = common["error_feedback"]["worker_error"]
    mean_x = torch.cat([common["model"][str(i)] for i in range(4)])
    mean_m = torch.cat([common["optimizer"]["state"][i]["exp_avg"] for i in range(4)])
    for worker, _, x, m in got:
        assert torch.equal(worker[:n], torch.cat([ef[i] for i in range(4)]))
        assert torch.equal(x, mean_x) and torch.equal(m, mean_m)


@pytest.mark.parametrize("side", ["saved", "loaded"])
def test_the_two_level_exchange_takes_the_mean(tmp_path, side):
    """With the two-level exchange on either side (worker errors per node, held in shards by the
    node's ranks), a resume from the common file takes the means even with every per-rank file
    there: saved with it at 4 ranks on 2 nodes and loaded flat at 2, or saved flat at 4 and loaded
    with it at 4 ranks on 2 nodes. A small bucket (8 elements), whose shards hold the whole
    bucket's length."""
    prefix, sizes = str(tmp_path / "ckpt"), (5, 3)
    two_level = {**WINDOW, "hierarchical": True}

    def save(rank, transport):
        model, opt = _build(transport, sizes, knobs=two_level if side == "saved" else WINDOW)
        for t in range(1, 13):
            opt.zero_grad()
            target = torch.randn(8, generator=torch.Generator().manual_seed(1000 * t + rank))
            ((torch.cat(list(model)) - target) ** 2).sum().backward()
            opt.step()
        checkpoint.save(prefix, model, opt)
    run_threads(4, save, ranks_per_node=2 if side == "saved" else None)
    common = checkpoint.read(prefix + ".pt")
    mean = torch.cat([common["error_feedback"]["worker_error"][i] for i in range(2)])
    assert mean.abs().sum() > 0

    def load(rank, transport):
        model, opt = _build(transport, sizes, knobs=two_level if side == "loaded" else WINDOW)
        checkpoint.load(prefix, model, opt, exact=False)
        ex = opt._buckets[0].exchange
        x = torch.cat([q.detach() for q in model])
        return ex.worker_error.clone(), getattr(ex, "lo", 0), getattr(ex, "hi", 8), x
    got = run_threads(2 if side == "saved" else 4, load, ranks_per_node=2 if side == "loaded" else None)
    for worker, lo, hi, x in got:
        assert torch.equal(worker[:hi - lo], mean[lo:hi])
        assert torch.equal(x, torch.cat([common["model"][str(i)] for i in range(2)]))


class _WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.full((n,), 0.1)) for n in (37, 5, 1, 64))
        self.register_buffer("running_var", torch.ones(3))


def test_the_group_split_leaves_buffers_alone_and_keeps_the_means_past_the_saving_world_size(tmp_path):
    """Buffers (here a running variance of 1.0 on rank 0 and 0.4 on the others, per rank as
    BatchNorm's are) are not split: the spread would push one rank's below 0. At P' > P the
    parameters are the common file's means on every rank (a split would scale single ranks'
    deviations by P'/P); at P' < P they are split."""
    prefix = str(tmp_path / "ckpt")

    def build(transport):
        model = _WithBuffer()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), transport=transport,
                                              named_parameters=model.named_parameters(), **WINDOW)
        return model, opt

    def save(rank, transport):
        model, opt = build(transport)
        _train(model.w, opt, rank, 12)
        model.running_var.fill_(1.0 if rank == 0 else 0.4)
        checkpoint.save(prefix, model, opt, step=12)

    run_threads(4, save)
    common = checkpoint.read(prefix + ".pt")["model"]
    for world in (2, 5):
        def load(rank, transport):
            model, opt = build(transport)
            checkpoint.load(prefix, model, opt)
            return model.running_var.clone(), torch.cat([q.detach() for q in model.w])
        got = run_threads(world, load)
        x_mean = torch.cat([common[f"w.{i}"] for i in range(4)])
        for var, x in got:
            assert torch.equal(var, torch.ones(3))
            assert torch.equal(x, x_mean) == (world == 5)
