"""What ``bench convergence`` and ``bench scaling`` train (``--workload``).

- ``lm``: the char LM of examples/train_lm.py (a small GPT on Shakespeare);
- ``digits``: the CNN of examples/train_digits.py (scikit-learn's 8x8 digits);
- ``gru``: :class:`CharGRU`, a character-level GRU on the Python standard library's own
  sources: another architecture (a recurrent network, no attention, no LayerNorm) on other
  data (code), to be run with other betas (``--beta2 0.999``). Nothing to download: the text
  is the ``*.py`` files at the top of this interpreter's ``sysconfig`` stdlib directory;
- ``mlp``: :class:`TeacherMLP`'s task, an MLP classifying points labelled by a fixed random
  teacher network (data torch generates from a seed: nothing to download).

Each builder takes the example module it needs and the bench's arguments and returns a
:class:`Workload`. Rank r's batches come from its own generator (seed·1000 + r, set by the
bench); the validation batches are fixed.
"""
from __future__ import annotations

import argparse
import functools
import glob
import os
import sysconfig
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Workload:
    """What the bench trains: the model (its parameters the common initial x), how a rank draws
    its next batch from its own generator, the loss of the model's output, the fixed validation
    batches, and the learning rate of step t."""
    model: torch.nn.Module
    batch: Callable[[torch.Generator], tuple]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    val_batches: list
    lr_fn: Callable[[int], float]


def _char_workload(train_lm, args, data: torch.Tensor, make_model) -> Workload:
    """A next-character workload on ``data`` (int64[n] character codes) split 90/10, with
    train_lm's batches (``args.batch_size`` windows of ``args.block_size``) and its warm-up and
    cosine learning rate; ``args.eval_batches`` fixed validation batches (seed 12345). The model
    is ``make_model()`` right after ``torch.manual_seed(args.seed)``."""
    split = int(0.9 * len(data))
    torch.manual_seed(args.seed)
    model = make_model()
    gen = torch.Generator().manual_seed(12345)
    val = [train_lm.get_batch(data[split:], args.batch_size, args.block_size, gen) for _ in range(args.eval_batches)]
    lam = train_lm.lr_lambda(args.warmup, args.steps)
    return Workload(model, lambda g: train_lm.get_batch(data[:split], args.batch_size, args.block_size, g),
                    lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), val,
                    lambda t: args.lr * lam(t - 1))


def lm_workload(train_lm: ModuleType, args: argparse.Namespace) -> Workload:
    """The char LM of examples/train_lm.py (:func:`_char_workload` on its corpus)."""
    data, vocab = shakespeare_codes(train_lm)
    return _char_workload(train_lm, args, data, lambda: train_lm.CharGPT(vocab, args.block_size, args.n_layer,
                                                                         args.n_embd, args.n_head))


@functools.lru_cache(maxsize=1)
def shakespeare_codes(train_lm: ModuleType) -> tuple[torch.Tensor, int]:
    """train_lm's corpus as int64[n] codes of its sorted characters, and how many there are; read
    once per process (about 15 s) and the same tensor after (``bench sweep`` builds the workload
    for every run): read it, do not modify it."""
    text = train_lm.load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


def digits_workload(train_digits: ModuleType, args: argparse.Namespace) -> Workload:
    """The CNN of examples/train_digits.py on scikit-learn's digits: each rank draws
    ``args.batch_size`` images at random from the whole training split (80 %), the validation
    loss is over the test split in one batch, and the learning rate is ``args.lr`` throughout
    (as that example)."""
    (xtr, ytr), val = train_digits.load(args.seed)
    torch.manual_seed(args.seed)

    def batch(g: torch.Generator):
        idx = torch.randint(len(ytr), (args.batch_size,), generator=g)
        return xtr[idx], ytr[idx]
    return Workload(train_digits.make_model(), batch, F.cross_entropy, [val], lambda t: args.lr)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> torch.Tensor:
    """The ``*.py`` files at the top of this interpreter's stdlib directory, in sorted order,
    concatenated, as ASCII codes: int64[n], values in [0, 128), non-ASCII characters as ``?``
    (4.70 M characters under CPython 3.11), read once per process and the same tensor after
    (``bench scaling`` builds the workload at every P): read it, do not modify it. Raises
    FileNotFoundError where there are none."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files in {sysconfig.get_paths()['stdlib']!r}: the gru workload "
                                "trains on the Python standard library's sources")
    text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    return torch.frombuffer(bytearray(text.encode("ascii", "replace")), dtype=torch.uint8).long()


class CharGRU(nn.Module):
    """Embedding -> ``layers`` GRU layers of width ``d`` -> linear head over the 128 ASCII codes.

    The GRU is written out (the equations of ``torch.nn.GRU``, h0 = 0) so that
    ``torch.func.vmap`` batches the P ranks' copies; ``forward``: int64[B, T] -> float32[B, T, vocab]."""

    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.ih = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.hh = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor):
        x = self.tok(idx)
        for ih, hh in zip(self.ih, self.hh):
            h = x.new_zeros(x.shape[0], x.shape[2])
            out = []
            for xt in ih(x).unbind(1):  # unbind, not x[:, t]: its backward is one stack, not T copies
                r, z, n = xt.chunk(3, -1)
                hr, hz, hn = hh(h).chunk(3, -1)
                r, z = torch.sigmoid(r + hr), torch.sigmoid(z + hz)
                h = (1 - z) * torch.tanh(n + r * hn) + z * h
                out.append(h)
            x = torch.stack(out, 1)
        return self.head(x)


def gru_workload(train_lm: ModuleType, args: argparse.Namespace) -> Workload:
    """:class:`CharGRU` (``args.n_layer`` layers of width ``args.n_embd``) on :func:`stdlib_corpus`
    (:func:`_char_workload`: train_lm's batches and learning rate)."""
    return _char_workload(train_lm, args, stdlib_corpus(), lambda: CharGRU(128, args.n_embd, args.n_layer))


class TeacherMLP:
    """A classification task made by torch from a seed: 32-dimensional Gaussian points, each
    labelled with the arg-max of a fixed random teacher (32 -> 64 tanh -> 10) plus Gumbel noise
    of scale 0.5 (so the best loss is above 0). 8,192 training and 2,048 validation points."""
    dim, classes, train, val = 32, 10, 8192, 2048

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(7000 + seed)
        w1 = torch.randn(self.dim, 64, generator=gen) / self.dim ** 0.5
        w2 = torch.randn(64, self.classes, generator=gen) * 2 / 64 ** 0.5
        x = torch.randn(self.train + self.val, self.dim, generator=gen)
        noise = -torch.log(-torch.log(torch.rand(len(x), self.classes, generator=gen).clamp_min(1e-12)))
        y = (torch.tanh(x @ w1) @ w2 + 0.5 * noise).argmax(1)
        self.xtr, self.ytr = x[:self.train], y[:self.train]
        self.xval, self.yval = x[self.train:], y[self.train:]

    @staticmethod
    def model(width: int) -> nn.Module:
        """The student: 32 -> ``width`` GELU -> ``width`` GELU -> 10."""
        return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def mlp_workload(args: argparse.Namespace) -> Workload:
    """:class:`TeacherMLP`'s task (task seed 0, whatever ``args.seed``: the seed sets the
    student's initialisation and, through the bench, the batches) with a student of width ``args.n_embd``: each
    rank draws ``args.batch_size`` points at random from the training split; the validation
    loss is over the validation split in one batch; the learning rate ``args.lr`` throughout."""
    task = TeacherMLP(0)
    torch.manual_seed(args.seed)
    model = TeacherMLP.model(args.n_embd)

    def batch(g: torch.Generator):
        idx = torch.randint(len(task.ytr), (args.batch_size,), generator=g)
        return task.xtr[idx], task.ytr[idx]
    return Workload(model, batch, F.cross_entropy, [(task.xval, task.yval)], lambda t: args.lr)


def build(name: str, examples: Callable[[str], ModuleType], args: argparse.Namespace) -> Workload:
    """The workload ``name`` (``"lm"``, ``"digits"``, ``"gru"`` or ``"mlp"``); ``examples``: a function of an
    example's name (``"train_lm"``, ``"train_digits"``) that gives it as a module."""
    if name == "lm":
        return lm_workload(examples("train_lm"), args)
    if name == "digits":
        return digits_workload(examples("train_digits"), args)
    if name == "gru":
        return gru_workload(examples("train_lm"), args)
    if name == "mlp":
        return mlp_workload(args)
    raise ValueError(f"workload={name!r}: choose lm, digits, gru or mlp")
