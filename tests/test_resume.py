"""Resumes keep the error feedback: the pooled state of checkpoint files, and bad files refused."""
from __future__ import annotations

import pytest
import torch

from conftest import run_threads

import hvd_zoadam
from hvd_zoadam.bench import resume as _bench_resume
from hvd_zoadam import checkpoint
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
    resume is bitwise (gain 1), the pooled error feedback keeps >= 0.9 of the progress at P' = 4 and 3,
    and the zeroed buffers keep less."""
    out = tmp_path / "r.json"
    assert bench_main(["resume", "--to", "4,3", "--json", str(out)]) == 0
    import json
    report = json.loads(out.read_text())
    rows = {(r["world_size"], r["mode"]): r for r in report["runs"]}
    assert rows[(4, "rank-files")]["val_loss"] == report["uninterrupted"][0]["val_end"]
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
