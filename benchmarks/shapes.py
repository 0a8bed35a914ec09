"""Named shapes, the benchmark grid and its priority order, and the bandwidth floor.

Nothing here imports jax or torch: the runner's parent process builds the grid and each
framework's worker expands a problem into one case per implementation it knows.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

VOCABS = {"llama2": 32000, "gpt2": 50257, "llama3": 128256, "qwen": 151936, "gemma": 256000}
TOKENS = (1, 8, 64, 1024, 8192, 32768)
OPS = ("cross_entropy", "kd_loss", "distill_loss", "logsumexp", "entropy", "token_logprobs")
# Ops timed at the target shape only (N=TARGET_N, V=TARGET_V, both modes).
TARGET_ONLY_OPS = ("distill_loss",)
# distill_loss's options in the suite: half cross-entropy, half KD at temperature 2 against
# the teacher's top KD_K ("full" normalization), the usual distillation set-up.
DISTILL_ALPHA, DISTILL_TEMPERATURE = 0.5, 2.0
MODES = ("fwd", "fwd_bwd")
ITEMSIZE = {"bf16": 2, "fp32": 4}
KD_K = 64
# The shape the targets are stated for (H100, bf16, forward+backward).
TARGET_N, TARGET_V = 8192, VOCABS["llama3"]
# logsumexp's few-row target (against jax.nn.logsumexp) is stated for these token counts at
# TARGET_V (its bandwidth target for N >= 1024).
LSE_SMALL_N = (1, 8, 64)
# At those token counts the JAX worker also times the op as a user gets it inside a jitted
# program: device time per call of PROGRAM_CALLS calls on distinct inputs (rows of this mode).
PROGRAM_MODE = "fwd_in_program"
PROGRAM_CALLS = 64
PROGRAM_OPS = ("logsumexp", "token_logprobs")

COLUMNS = ("op", "impl", "mode", "n", "v", "k", "dtype", "median_ms", "p20_ms", "p80_ms",
           "peak_bytes", "floor_ms", "device", "versions", "commit", "date")


class Problem(NamedTuple):
    """One op on one shape in one mode: every implementation is timed on it."""

    op: str
    mode: str  # "fwd" or "fwd_bwd"
    n: int  # tokens (rows)
    v: int  # vocabulary
    k: int  # teacher top-K for kd_loss and distill_loss, 0 otherwise
    dtype: str  # "bf16" or "fp32"
    tier: int  # 0: the target shapes, 1: the N and V sweeps, 2: the rest


def dtypes_for(op: str) -> tuple[str, ...]:
    """bf16 for every op; fp32 as well for cross_entropy (the upcast baselines' home turf)."""
    return ("bf16", "fp32") if op == "cross_entropy" else ("bf16",)


def floor_bytes(op: str, mode: str, n: int, v: int, dtype: str) -> int:
    """Bytes that must move: read the logits once, and for fwd_bwd write their gradient once."""
    del op  # the same floor for every op: labels, ids and per-row outputs are O(N)
    return n * v * ITEMSIZE[dtype] * (2 if mode == "fwd_bwd" else 1)


def is_target(op: str, mode: str, n: int, v: int, dtype: str) -> bool:
    if v != TARGET_V:
        return False
    if n == TARGET_N:
        return True
    return op == "logsumexp" and mode == "fwd"  # its bandwidth and latency targets, any N


def in_program(p: "Problem") -> bool:
    """Whether the JAX worker adds PROGRAM_MODE rows for problem `p`."""
    return (p.op in PROGRAM_OPS and p.mode == "fwd" and p.v == TARGET_V
            and p.n in LSE_SMALL_N and p.dtype == "bf16")


def teacher_k(op: str) -> int:
    """The teacher's top-K of an op's problems (0 for ops without a teacher)."""
    return KD_K if op in ("kd_loss", "distill_loss") else 0


def op_options(op: str) -> dict:
    """The suite's keyword options of an op (the same for jax_fusedloss and torch_ref)."""
    if op == "kd_loss":
        return dict(normalize="full")
    if op == "distill_loss":
        return dict(normalize="full", alpha=DISTILL_ALPHA, temperature=DISTILL_TEMPERATURE)
    return {}


def input_kind(op: str) -> str:
    """Which inputs an op takes besides the logits: "labels", "teacher", "both" or ""."""
    return {"cross_entropy": "labels", "token_logprobs": "labels", "kd_loss": "teacher",
            "distill_loss": "both"}.get(op, "")


def _tier(op: str, mode: str, n: int, v: int, dtype: str) -> int:
    if is_target(op, mode, n, v, dtype):
        return 0
    return 1 if (v == TARGET_V or n == TARGET_N) else 2


def _shapes(op: str, dtype: str, quick: bool, cross: bool) -> set[tuple[int, int]]:
    """(n, v) pairs for one op and dtype.

    Full grid: every vocabulary x every token count for bf16 cross-entropy (or for every op
    with `cross`); the other ops and fp32 get the "plus": the token sweep at llama3's
    vocabulary and the vocabulary sweep at N=8192. Quick grid: the target shape, the other
    vocabularies at N=8192 for bf16 cross-entropy, and logsumexp's latency shapes.
    """
    vocabs = VOCABS.values()
    if op in TARGET_ONLY_OPS:
        return {(TARGET_N, TARGET_V)}
    if quick:
        shapes = {(TARGET_N, TARGET_V)}
        if op == "cross_entropy" and dtype == "bf16":
            shapes |= {(TARGET_N, v) for v in vocabs}
        if op == "logsumexp":
            shapes |= {(n, TARGET_V) for n in (1, 8, 64)}
        return shapes
    if cross or (op == "cross_entropy" and dtype == "bf16"):
        return {(n, v) for n in TOKENS for v in vocabs}
    return {(n, TARGET_V) for n in TOKENS} | {(TARGET_N, v) for v in vocabs}


def build_grid(ops: Iterable[str], *, quick: bool = False, cross: bool = False,
               ns: Iterable[int] | None = None, vocabs: Iterable[int] | None = None,
               modes: Iterable[str] = MODES) -> list[Problem]:
    """The problems to time, most important first (a run that hits its budget drops the tail).

    Within a tier, problems sharing a shape are adjacent so the workers reuse their inputs.
    In the quick grid, logsumexp's forward+backward is timed at N=8192 only.
    """
    ns = set(ns) if ns else None
    vocabs = set(vocabs) if vocabs else None
    out = []
    for op in ops:
        if op not in OPS:
            raise ValueError(f"op={op!r} must be one of {OPS}")
        for dtype in dtypes_for(op):
            for n, v in _shapes(op, dtype, quick, cross):
                if (ns and n not in ns) or (vocabs and v not in vocabs):
                    continue
                for mode in modes:
                    if quick and op == "logsumexp" and mode == "fwd_bwd" and n != TARGET_N:
                        continue
                    out.append(Problem(op, mode, n, v, teacher_k(op), dtype,
                                       _tier(op, mode, n, v, dtype)))
    return sorted(out, key=lambda p: (p.tier, p.n, p.v, p.dtype, OPS.index(p.op),
                                      MODES.index(p.mode)))


def smoke_grid(ops: Iterable[str]) -> list[Problem]:
    """A tiny grid for the CPU smoke test: one shape with an odd vocabulary, both modes."""
    return [Problem(op, mode, 16, 3001, min(teacher_k(op), 8), "bf16", 0) for op in ops
            for mode in MODES]


def parse_vocabs(text: str) -> list[int]:
    """'llama3,gpt2' or '128256,50257' -> vocabulary sizes."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item in VOCABS:
            out.append(VOCABS[item])
        elif item.isdigit():
            out.append(int(item))
        else:
            raise ValueError(f"vocabulary {item!r} must be a number or one of {sorted(VOCABS)}")
    return out


def vocab_name(v: int) -> str:
    """'llama3 128256' for a named vocabulary, else the number."""
    names = [name for name, size in VOCABS.items() if size == v]
    return f"{names[0]} {v}" if names else str(v)
