"""Distil a trained teacher into a smaller student with `jax_fusedloss.linear_distill_loss`.

A teacher is trained in-process (as in `train_lm.py`), then students with the same
initialisation, data, order and number of steps:

* `distilled`: `linear_distill_loss(student_hidden, head_table, labels, teacher_ids,
  teacher_logprobs, alpha=ALPHA)` = `alpha * cross-entropy + (1 - alpha) * KD` over the
  teacher's top-K token ids, the student's LM head fused in (its `[B, T, V]` logits never
  exist), with the teacher's log-probabilities computed on the fly (the teacher is frozen and
  runs inside the student's jitted train step). `--tail` adds the (K+1)-th "tail" bucket
  (the KD term becomes a true divergence), `--divergence jsd` takes the generalised
  Jensen-Shannon divergence over those buckets instead of the forward KL;
* `distilled-logits` (unless `--no-logits-path`): the same loss through `distill_loss` on the
  student's materialised logits, to compare validation loss and memory;
* `baseline`: `jax_fusedloss.cross_entropy` on the labels alone.

All are scored by the same validation cross-entropy; `metrics.json` also holds each
distilled objective's loss + gradient temporaries (XLA's memory_analysis) and, on a GPU, the
device's peak memory after each run.

    python -m examples.distill                         # CPU default: a few minutes on 2 cores
    python -m examples.distill --preset gpu --tail --divergence jsd --out out/distill_gpu

Writes `metrics.json` and `loss_curves.png` to `--out`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jax_fusedloss

if __package__:
    from examples import _common, _data, train_lm
else:
    import _common
    import _data
    import train_lm

PRESETS: dict[str, dict] = {
    # About 4 minutes on a 2-core CPU.
    "cpu": dict(teacher_steps=300, steps=200, batch=16, seq_len=128, vocab=8192,
                teacher_d_model=128, teacher_layers=2, teacher_heads=4,
                d_model=64, layers=2, heads=4, lr=3e-3, text_mb=4.0, dtype="float32"),
    "gpu": dict(teacher_steps=1000, steps=1000, batch=32, seq_len=512, vocab=32768,
                teacher_d_model=512, teacher_layers=8, teacher_heads=8,
                d_model=256, layers=4, heads=4, lr=1e-3, text_mb=32.0, dtype="bfloat16"),
}


SIZE_FLAGS: dict[str, dict] = {
    "teacher_steps": dict(type=int, help="teacher training steps"),
    "steps": dict(type=int, help="training steps of each student"),
    "batch": dict(type=int, help="sequences per batch"),
    "seq_len": dict(type=int, help="tokens per sequence"),
    "vocab": dict(type=int, help="BPE vocabulary size"),
    "teacher_d_model": dict(type=int, help="teacher width"),
    "teacher_layers": dict(type=int, help="teacher blocks"),
    "teacher_heads": dict(type=int, help="teacher attention heads"),
    "d_model": dict(type=int, help="student width"),
    "layers": dict(type=int, help="student blocks"),
    "heads": dict(type=int, help="student attention heads"),
    "lr": dict(type=float, help="peak learning rate (teacher and students)"),
    "text_mb": dict(type=float, help="megabytes of standard-library source"),
    "dtype": dict(choices=["float32", "bfloat16"], help="compute / logits dtype"),
}


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags; the size flags left unset come from `--preset`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_common.HelpFormatter)
    _common.add_preset_flags(p, PRESETS, SIZE_FLAGS)
    p.add_argument("--k", type=int, default=32, help="teacher top-K ids per token")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="weight of the label cross-entropy; 1 - alpha weighs the KD term")
    p.add_argument("--temperature", type=float, default=1.0, help="KD temperature")
    p.add_argument("--tail", action="store_true",
                   help="add the teacher's residual mass as a (K+1)-th bucket")
    p.add_argument("--divergence", choices=["kl", "jsd"], default="kl",
                   help="KD divergence (jsd needs --tail)")
    p.add_argument("--beta", type=float, default=0.5, help="the jsd's beta, in (0, 1)")
    p.add_argument("--no-logits-path", action="store_true",
                   help="skip the student trained through distill_loss on its logits")
    p.add_argument("--z-loss", type=float, default=1e-4, help="teacher z-loss coefficient")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up steps / steps")
    p.add_argument("--eval-every", type=int, default=0, help="0: ten evaluations per run")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of the documents held out for validation")
    p.add_argument("--seed", type=int, default=0, help="data order, inits and file subset")
    p.add_argument("--out", type=Path, default=Path("out/distill"), help="output directory")
    p.add_argument("--cache-dir", type=Path, help="tokenizer cache (default: OUT/cache)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses `argv` and fills the unset size flags from the preset."""
    args = _common.apply_preset(build_parser().parse_args(argv), PRESETS)
    if not 0.0 <= args.alpha <= 1.0:
        raise SystemExit(f"--alpha={args.alpha} must lie in [0, 1]")
    if args.divergence == "jsd" and not args.tail:
        raise SystemExit("--divergence jsd needs --tail")
    return args


def teacher_top_k(teacher: nnx.Module, x: jax.Array, k: int,
                  temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The frozen teacher's top-`k` token ids `[B, T, k]` and their float32 log-probabilities
    under the teacher's softmax at `temperature` (over the whole vocabulary)."""
    logits = jax.lax.stop_gradient(teacher(x)).astype(jnp.float32) / temperature
    top_logits, top_ids = jax.lax.top_k(logits, k)
    return top_ids, top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def distill_objective(k: int, alpha: float, temperature: float, *, fused: bool = True,
                      tail: bool = False, divergence: str = "kl",
                      beta: float = 0.5) -> _common.LossFn:
    """The student's `LossFn` against the teacher passed as `aux`: `linear_distill_loss` of
    the student's final hidden states and tied embedding table (`fused`), or `distill_loss`
    of its logits.

    Padding tokens (label `IGNORE_INDEX`) are skipped by both terms. With a temperature T the
    teacher's log-probabilities are taken at T as well, and the KD term is scaled by T**2
    (Hinton et al., 2015); at the default T = 1 both are no-ops.
    """
    opts = dict(alpha=alpha, temperature=temperature, ignore_index=_data.IGNORE_INDEX,
                temperature_squared=True, tail=tail, divergence=divergence, beta=beta)

    def loss_fn(student: nnx.Module, teacher: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        ids, logprobs = teacher_top_k(teacher, x, k, temperature)
        if fused:
            return jax_fusedloss.linear_distill_loss(
                student.hidden(x), student.head_table(), y, ids, logprobs,
                weight_layout="vd", **opts)
        return jax_fusedloss.distill_loss(student(x), y, ids, logprobs, **opts)

    return loss_fn


def _temp_bytes(model: nnx.Module, objective: _common.LossFn, teacher: Any, data,
                args) -> int | None:
    """The compiled loss + gradient's temporaries on one training batch."""
    x, y = next(_data.batches(data.train_inputs, data.train_labels, args.batch, args.seed))
    return _common.loss_grad_temp_bytes(
        model, lambda m, aux, x, y: objective(m, teacher, x, y), x, y)


def _summary(hist: dict, model: nnx.Module) -> dict:
    keys = ("first_loss", "final_loss", "first_val_loss", "final_val_loss", "tokens_per_s",
            "wall_s", "val_curve")
    return dict({key: hist[key] for key in keys}, num_params=_common.num_params(model))


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example and returns the metrics it writes to `OUT/metrics.json`."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = train_lm.load_data(args)
    train_cfg = train_lm.train_config(args)
    teacher_cfg = _common.ModelConfig(
        vocab_size=data.vocab_size, seq_len=args.seq_len, d_model=args.teacher_d_model,
        n_layers=args.teacher_layers, n_heads=args.teacher_heads, dtype=args.dtype)
    student_cfg = train_lm.model_config(args, data.vocab_size)
    if not 1 <= args.k <= data.vocab_size:
        raise SystemExit(f"--k={args.k} must lie in [1, {data.vocab_size}]")

    teacher = _common.TransformerLM(teacher_cfg, rngs=nnx.Rngs(args.seed + 1))
    teacher_hist = _common.train(
        teacher, _common.ce_objective("fused", args.z_loss), data,
        dataclasses.replace(train_cfg, steps=args.teacher_steps), desc="teacher")
    runs = {"teacher": teacher_hist}
    students = {}
    kd_opts = dict(tail=args.tail, divergence=args.divergence, beta=args.beta)
    objectives = {"distilled": (distill_objective(args.k, args.alpha, args.temperature,
                                                  **kd_opts), teacher)}
    if not args.no_logits_path:
        objectives["distilled-logits"] = (distill_objective(
            args.k, args.alpha, args.temperature, fused=False, **kd_opts), teacher)
    objectives["baseline"] = (_common.ce_objective("fused", 0.0), None)
    kd_name = args.divergence + ("+tail" if args.tail else "")
    labels = {"distilled": f"{args.alpha:g}*ce+{1 - args.alpha:g}*{kd_name}",
              "distilled-logits": f"{args.alpha:g}*ce+{1 - args.alpha:g}*{kd_name} (logits)",
              "baseline": "ce"}
    for name, (objective, aux) in objectives.items():
        student = _common.TransformerLM(student_cfg, rngs=nnx.Rngs(args.seed))
        temps = None if aux is None else _temp_bytes(student, objective, aux, data, args)
        runs[name] = _common.train(student, objective, data, train_cfg, aux=aux,
                                   desc=f"student ({name})", loss_label=labels[name])
        students[name] = dict(_summary(runs[name], student), loss_grad_temp_bytes=temps,
                              peak_memory_bytes_after=_common.peak_memory_bytes())

    metrics = dict(
        val_loss_distilled=runs["distilled"]["final_val_loss"],
        val_loss_baseline=runs["baseline"]["final_val_loss"],
        val_loss_distilled_logits=runs.get("distilled-logits", {}).get("final_val_loss"),
        teacher_val_loss=teacher_hist["final_val_loss"],
        teacher=_summary(teacher_hist, teacher), students=students,
        runtime=_common.runtime_info(), data=data.info,
        teacher_model=dataclasses.asdict(teacher_cfg),
        student_model=dataclasses.asdict(student_cfg),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    _common.plot_curves(runs, args.out / "loss_curves.png",
                        f"distill: top-{args.k} {kd_name}, alpha={args.alpha}, "
                        f"T={args.temperature} "
                        f"({students['distilled']['num_params'] / 1e6:.2f}M-parameter students)",
                        no_train_curve=("distilled",))
    _common.write_metrics(metrics, args.out)
    print(f"validation loss: teacher {metrics['teacher_val_loss']:.4f} | student distilled "
          f"(LM head fused) {metrics['val_loss_distilled']:.4f} | student baseline "
          f"{metrics['val_loss_baseline']:.4f} | wrote {args.out}")
    for name, st in students.items():
        if st["loss_grad_temp_bytes"] is not None:
            peak = st["peak_memory_bytes_after"]
            print(f"  {name}: val {st['final_val_loss']:.4f}, loss+grad temporaries "
                  f"{st['loss_grad_temp_bytes'] / 2**20:.1f} MiB"
                  + ("" if peak is None else f", device peak so far {peak / 2**20:.0f} MiB"))
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
