"""The conformance cases as data: one named `Case` per precision bug class that fused-loss
libraries found late (issue 31), each with inputs built from a seed, a float64 oracle, metrics
and a tolerance per dtype. `benchmarks.conformance` runs them over every implementation (the
columns, `benchmarks.conformance_impls`); tests/test_conformance.py runs them over ours.

Inputs are exact in the case's dtype (numpy float32/float16 or ml_dtypes.bfloat16); the oracle
is the naive formula of tests/reference/torch_oracle.py in float64 on those same values, its
gradient from torch.autograd. Every implementation returns the op's value and the gradient of
`loss_scale * sum(value)` w.r.t. the logits; metrics compare them with the oracle's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import ml_dtypes
import numpy as np

NP_DTYPES = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}
IGNORE = -100
# Options an implementation may lack (then its cell is "n/a"), with their neutral values.
DEFAULTS = dict(reduction="mean", label_smoothing=0.0, z_loss=0.0, temperature=1.0,
                loss_scale=1.0, ignore_index=False, vocab_parallel=False)


@dataclasses.dataclass
class Inputs:
    x: np.ndarray                 # [N, V] logits in the case's dtype
    labels: np.ndarray            # [N] int32 (IGNORE where ignored)
    ids: np.ndarray | None = None  # [N, K] teacher top-K ids (op "kd")
    lp: np.ndarray | None = None   # [N, K] float32 teacher log-probabilities (op "kd")
    rows: np.ndarray | None = None  # rows the metrics look at (all when None)


@dataclasses.dataclass(frozen=True)
class Check:
    metric: str                   # a key of benchmarks.conformance_metrics.METRICS
    tol: dict                     # dtype -> largest passing error


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    bug: str                      # the bug class and where it was reported
    op: str                       # "ce" (cross-entropy), "logprobs" (token log-probs) or "kd"
    dtypes: tuple
    build: Callable               # (rng, dtype, gpu) -> Inputs
    checks: tuple                 # Check, ...; the first one's error is the cell's number
    options: tuple = ()           # (name, value) pairs overriding DEFAULTS
    gpu_only: bool = False
    seed: int = 0

    def opts(self) -> dict:
        return {**DEFAULTS, **dict(self.options)}

    def required(self) -> set:
        """The options this case sets away from their neutral values."""
        return {k for k, v in self.opts().items() if v != DEFAULTS[k]}


# ----------------------------------------------------------------------------- input builders
def cast(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(a).astype(NP_DTYPES[dtype])


def _lse(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=-1, keepdims=True)))[..., 0]


def _with_peak(x: np.ndarray, y: np.ndarray, p: float) -> np.ndarray:
    """Sets x[i, y_i] so that softmax(x)[i, y_i] = p (before rounding to the case's dtype)."""
    rows = np.arange(len(y))
    x = x.copy()
    x[rows, y] = -np.inf
    x[rows, y] = _lse(x) + np.log(p / (1 - p))
    return x


def peaked(p: float) -> Callable:
    def build(rng, dtype, gpu):
        n, vocab = (64, 32000) if gpu else (4, 8192)
        y = rng.integers(0, vocab, n).astype(np.int32)
        return Inputs(cast(_with_peak(rng.normal(size=(n, vocab)), y, p), dtype), y)

    return build


def kl_peaked(p_teacher: float, q_student: float, k: int = 8) -> Callable:
    """Student softmax q at its label y; teacher top-K with p at y and the rest of its mass on
    K - 1 other ids (the teacher sums to 1, so top-K KL is the full KL)."""
    def build(rng, dtype, gpu):
        n, vocab = (64, 32000) if gpu else (4, 8192)
        y = rng.integers(0, vocab, n).astype(np.int32)
        x = _with_peak(rng.normal(size=(n, vocab)), y, q_student)
        others = np.stack([rng.choice(np.setdiff1d(np.arange(64), [0]), k - 1, replace=False)
                           for _ in range(n)])
        ids = np.concatenate([y[:, None], (y[:, None] + others) % vocab], axis=1)
        rest = rng.dirichlet(np.ones(k - 1), n) * (1 - p_teacher)
        lp = np.log(np.concatenate([np.full((n, 1), p_teacher), rest], axis=1))
        return Inputs(cast(x, dtype), y, ids.astype(np.int32), lp.astype(np.float32))

    return build


def offset(magnitude: float) -> Callable:
    """Rows at +magnitude and -magnitude (alternating) plus N(0, 2) noise."""
    def build(rng, dtype, gpu):
        n, vocab = (64, 32000) if gpu else (4, 8192)
        sign = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)[:, None]
        x = magnitude * sign + 2 * rng.normal(size=(n, vocab))
        return Inputs(cast(x, dtype), rng.integers(0, vocab, n).astype(np.int32))

    return build


def normal(n_gpu: int, n_cpu: int, vocab: int, std: float = 2.0, ignore_every: int = 0,
           cpu_vocab: int | None = None):
    def build(rng, dtype, gpu):
        n = n_gpu if gpu else n_cpu
        v = vocab if gpu or cpu_vocab is None else cpu_vocab
        y = rng.integers(0, v, n).astype(np.int32)
        if ignore_every:
            y[::ignore_every] = IGNORE
        return Inputs(cast(std * rng.normal(size=(n, v)), dtype), y)

    return build


def vocab_tail(rng, dtype, gpu):
    """V = 129920 (not a multiple of 1024 or 4096) with every row's maximum in the last 896
    columns (past the last multiple of 1024); half the labels on that maximum."""
    n, vocab = (64, 129920) if gpu else (2, 129920)
    x = 2 * rng.normal(size=(n, vocab))
    top = vocab - 1 - rng.integers(0, vocab % 1024, n)
    x[np.arange(n), top] = x.max(axis=1) + 4
    y = np.where(np.arange(n) % 2 == 0, top, rng.integers(0, vocab, n)).astype(np.int32)
    return Inputs(cast(x, dtype), y)


def past_2pow31(rng, dtype, gpu):
    """N * V = 16768 * 128256 > 2**31 elements. 61 distinct rows tiled (a row read from the
    wrong offset has other values); the metrics look at rows on both sides of element 2**31."""
    n, vocab = 16768, 128256
    base = cast(2 * rng.normal(size=(61, vocab)), dtype)
    x = np.tile(base, (n // 61 + 1, 1))[:n]
    y = rng.integers(0, vocab, n).astype(np.int32)
    edge = 2**31 // vocab
    rows = np.array([0, 1, edge - 1, edge, edge + 1, n - 2, n - 1])
    return Inputs(x, y, rows=rows)


def nan_inf_rows(rng, dtype, gpu):
    """Rows: 0 ordinary; 1 a NaN; 2 a +inf; 3 some -inf entries (masked tokens); 4 NaN and
    +inf; 5 ordinary. Expected: NaN loss and gradient rows for 1, 2 and 4 only."""
    n, vocab = 6, 5000
    x = 2 * rng.normal(size=(n, vocab))
    x[1, 4100] = np.nan
    x[2, 7] = np.inf
    x[3, rng.choice(vocab, 50, replace=False)] = -np.inf
    x[4, 10], x[4, 20] = np.nan, np.inf
    y = rng.integers(0, vocab, n).astype(np.int32)
    y[3] = np.flatnonzero(np.isfinite(x[3]))[0]
    return Inputs(cast(x, dtype), y)


def confident(rng, dtype, gpu):
    """The label's logit 25 above the rest: p_y = 1 - O(V e^-25), a loss below float32's
    resolution at z_y (so only its sign is checked)."""
    n, vocab = (64, 32000) if gpu else (4, 8192)
    x = rng.normal(size=(n, vocab))
    y = rng.integers(0, vocab, n).astype(np.int32)
    x[np.arange(n), y] = x.max(axis=1) + 25
    return Inputs(cast(x, dtype), y)


def all_ignored(rng, dtype, gpu):
    x = 2 * rng.normal(size=(8, 4096))
    return Inputs(cast(x, dtype), np.full(8, IGNORE, np.int32))


# ----------------------------------------------------------------------------- the table
# A gradient rounded once: bf16 allows one ulp (2**-7; round-to-nearest gives <= 2**-8, Triton's
# interpreter measured up to 0.74% at p_y = 0.999), fp32, fp16.
BF16_GRAD, FP32_GRAD, FP16_GRAD = 1e-2, 1e-5, 2e-3
VALUE = 1e-5                                          # values accumulate in float32


def _near_one(p: float) -> float:
    """8 float32 ulps of a probability p near 1, relative to 1 - p: the floor of a float32
    computation of p_y - 1 (or of the loss -log p_y) that rounds p_y, or the row's sum
    1 + sum_{j != y} e^(z_j - z_y), first (measured on CPU: up to 3.9 ulps, ours and the naive
    float32 formulas alike; the GPU's approximate exp2 and log add some)."""
    return 8 * 2.0**-23 / (1 - p)


def _t(bf16=BF16_GRAD, fp32=FP32_GRAD, fp16=FP16_GRAD) -> dict:
    return {"bf16": bf16, "fp32": fp32, "fp16": fp16}


_GRAD = Check("grad_rows", _t())
_VALUE = Check("value_rel", _t(VALUE, VALUE, VALUE))

CASES = tuple(
    [Case(f"peaked_softmax_p{p}", "bf16 gradient cancellation at a peaked softmax (Liger PR "
          "#1329, TransformerEngine PR #3193): true-class gradient (p_y - 1)/N",
          "ce", ("bf16", "fp32"), peaked(p),
          (Check("grad_true_class", _t(2.0**-7 + _near_one(p), _near_one(p))),
           Check("value_rel", _t(_near_one(p), _near_one(p)))), seed=i)
     for i, p in enumerate((0.99, 0.999, 0.9999))]
    + [Case(f"kl_grad_p{p}_q{q}", "bf16 KL gradient q - p at a peak (vllm speculators PR #788, "
            "acceptance 0.95-0.98): relative error at the teacher's top token",
            "kd", ("bf16", "fp32"), kl_peaked(p, q), (Check("grad_peak", _t(1e-2, 1e-4)),
                                                      _VALUE), seed=10 + i)
       for i, (p, q) in enumerate(((0.95, 0.98), (0.98, 0.99)))]
    + [Case(f"logit_offset_{m}", "logits far from 0 (marin PR #8217: forward and backward at "
            "different precisions, softmax error 2.6% / 38.6% / 85.8% at |logit| 10 / 160 / 640)",
            "ce", ("bf16", "fp32"), offset(m), (_GRAD, _VALUE), seed=20 + i)
       for i, m in enumerate((10, 160, 640))]
    + [
        Case("vocab_tail_129920", "vocabulary not a multiple of the block, maximum in the tail "
             "(verl #2899: V=129920, log-probs up to +123)", "logprobs", ("bf16", "fp32"),
             vocab_tail, (Check("value_abs", _t(1e-5, 1e-5)), _GRAD), seed=30),
        Case("vocab_parallel_smoothing", "vocabulary split over 4 devices with label smoothing "
             "(Megatron #737/#7464: local V in smoothing; ms-swift PR #9947: non-owner shards' "
             "gradients)", "ce", ("fp32",), normal(64, 8, 1000, ignore_every=5),
             (_VALUE, _GRAD), options=(("label_smoothing", 0.1), ("z_loss", 1e-3),
                                       ("ignore_index", True), ("vocab_parallel", True)),
             seed=32),
        Case("label_smoothing_z_loss", "label smoothing over the whole vocabulary and z-loss, "
             "one device", "ce", ("fp32", "bf16"), normal(64, 8, 5000, ignore_every=3),
             (_VALUE, _GRAD), options=(("label_smoothing", 0.1), ("z_loss", 1e-3),
                                       ("ignore_index", True)), seed=33),
        Case("fp16_loss_scale", "float16 loss scaling (x1024) must not flush small gradients "
             "(entries p_j/N below fp16's range before scaling)", "ce", ("fp16",),
             normal(256, 32, 2000, std=3.0),
             (Check("grad_rel_normal", _t(fp16=2e-3)),), options=(("loss_scale", 1024.0),),
             seed=34),
        Case("vocab_256k_fp32_accumulator", "accumulators past V=250K need float32 (Megatron "
             "PR #2206)", "ce", ("bf16",), normal(64, 2, 256000, std=0.5), (_VALUE, _GRAD),
             seed=35),
        Case("loss_in_input_dtype", "the loss computed in the input dtype (optax #1020)", "ce",
             ("bf16",), normal(64, 8, 32000, cpu_vocab=8192), (_VALUE,), seed=36),
        Case("nan_inf_policy", "NaN or +inf logit: NaN loss and gradient for that row only; "
             "-inf logits (masked tokens) are ordinary", "ce", ("fp32", "bf16"), nan_inf_rows,
             (Check("nan_policy", _t(0, 0)), _GRAD), options=(("reduction", "none"),), seed=37),
        Case("temperature_tiny", "log-probs at temperature 0.01 (z = x / T about 600)",
             "logprobs", ("fp32", "bf16"), normal(64, 4, 5000),
             (Check("value_scaled", _t(1e-6, 1e-6)), _GRAD),
             options=(("temperature", 0.01),), seed=38),
        Case("temperature_huge", "log-probs at temperature 1e4 (a nearly uniform softmax)",
             "logprobs", ("fp32", "bf16"), normal(64, 4, 5000),
             (Check("value_rel", _t(VALUE, VALUE)), _GRAD),
             options=(("temperature", 1e4),), seed=39),
        Case("all_ignored", "every label ignored under reduction='mean': loss 0 and gradient "
             "0, not NaN", "ce", ("fp32", "bf16"), all_ignored, (Check("zero", _t(0, 0)),),
             options=(("ignore_index", True),), seed=40),
        Case("confident_nonnegative", "a confidently right token: per-token loss >= 0 (no "
             "negative loss from lse - z_y)", "ce", ("bf16", "fp32"), confident,
             (Check("nonnegative", _t(0, 0)),),
             options=(("reduction", "none"),), seed=41),
        # Last: an implementation that faults here (a sticky CUDA error) spoils only its row.
        Case("nv_past_2pow31", "more than 2**31 logits (Liger #803, pytorch #111484): per-row "
             "loss and gradient on both sides of element 2**31", "ce", ("bf16",), past_2pow31,
             (_VALUE, _GRAD), options=(("reduction", "none"),), gpu_only=True, seed=31),
    ])
BY_NAME = {c.name: c for c in CASES}
