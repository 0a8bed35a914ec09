"""Train a small decoder-only transformer (Flax NNX + optax) with `jax_fusedloss.cross_entropy`.

The text is the Python standard library's own source (see `_data.py`), tokenised with a
byte-level BPE trained locally. The training objective is the mean next-token cross-entropy over
the tokens that are not padding, plus a small z-loss; `--loss optax` swaps in optax's
cross-entropy (same objective, same data, same seed) for an A/B comparison, and
`--loss fused-linear` fuses the LM head into the loss (`jax_fusedloss.linear_cross_entropy`
of the final hidden states and the tied embedding table, never materialising the logits).
Each run reports tokens/s and memory: the compiled loss + gradient's temporary bytes (any
backend) and the device's peak memory in use (GPUs; "n/a" on the CPU).

    python -m examples.train_lm                      # CPU default: a few minutes on 2 cores
    python -m examples.train_lm --loss optax --out out/train_lm_optax
    python -m examples.train_lm --loss fused-linear --out out/train_lm_linear
    python -m examples.train_lm --preset gpu --out out/train_lm_gpu
    python -m examples.train_lm --preset gpu --mesh data=2 --out out/train_lm_dp2
    python -m examples.train_lm --preset gpu --mesh data=1,model=2 --out out/train_lm_vp2

`--mesh` runs on every device JAX sees: "data" splits each batch, "model" splits the vocabulary
of the LM head (the tied embedding), so the logits are laid out `P("data", None, "model")`;
run it with `--loss fused`, `--loss fused-linear` (the table split by vocabulary: each device
projects onto its slice and merges softmax statistics) and `--loss optax` to compare tokens/s
on one mesh. On a CPU,
`XLA_FLAGS=--xla_force_host_platform_device_count=4` gives four devices.

Writes `metrics.json` and `loss_curves.png` to `--out`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
from flax import nnx

if __package__:
    from examples import _common, _data, _mesh
else:
    import _common
    import _data
    import _mesh

PRESETS: dict[str, dict] = {
    # About 2 minutes on a 2-core CPU: 1.5M parameters (1.0M of them the tied embedding),
    # 8192-token vocabulary, 0.6M training tokens seen (about half an epoch of 4 MB of text).
    "cpu": dict(steps=300, batch=16, seq_len=128, vocab=8192, d_model=128, layers=2, heads=4,
                lr=3e-3, text_mb=4.0, dtype="float32"),
    # One GPU: 42M parameters, 32768-token vocabulary, bfloat16 logits, the whole standard
    # library (about 30 MB of text), 16M training tokens seen.
    "gpu": dict(steps=1000, batch=32, seq_len=512, vocab=32768, d_model=512, layers=8, heads=8,
                lr=1e-3, text_mb=32.0, dtype="bfloat16"),
}


SIZE_FLAGS: dict[str, dict] = {
    "steps": dict(type=int, help="optimiser steps"),
    "batch": dict(type=int, help="sequences per batch"),
    "seq_len": dict(type=int, help="tokens per sequence"),
    "vocab": dict(type=int, help="BPE vocabulary size"),
    "d_model": dict(type=int, help="model width"),
    "layers": dict(type=int, help="transformer blocks"),
    "heads": dict(type=int, help="attention heads"),
    "lr": dict(type=float, help="peak learning rate"),
    "text_mb": dict(type=float, help="megabytes of standard-library source (train + validation)"),
    "dtype": dict(choices=["float32", "bfloat16"], help="compute / logits dtype"),
}


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags; the size flags left unset come from `--preset`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_common.HelpFormatter)
    _common.add_preset_flags(p, PRESETS, SIZE_FLAGS)
    p.add_argument("--loss", choices=_common.LM_LOSSES, default="fused",
                   help="fused: jax_fusedloss.cross_entropy; optax: optax's cross-entropy; "
                        "fused-linear: jax_fusedloss.linear_cross_entropy (LM head + loss, "
                        "no logits kept)")
    p.add_argument("--z-loss", type=float, default=1e-4, help="z-loss coefficient")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up steps / steps")
    p.add_argument("--eval-every", type=int, default=0, help="0: ten evaluations per run")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of the documents held out for validation")
    p.add_argument("--seed", type=int, default=0, help="data order, model init and file subset")
    p.add_argument("--out", type=Path, default=Path("out/train_lm"), help="output directory")
    p.add_argument("--cache-dir", type=Path, help="tokenizer cache (default: OUT/cache)")
    p.add_argument("--mesh", metavar="AXIS=N,...",
                   help="a device mesh over all devices: data=N splits the batch, model=M the "
                        "LM head's vocabulary (e.g. data=2 or data=1,model=2; sizes multiply to "
                        "the device count); unset: no mesh, one device")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses `argv`, fills the unset size flags from the preset and turns `--mesh` into a
    `jax.sharding.Mesh` (a usage error if it does not name "data"/"model" sizes that multiply
    to the device count)."""
    parser = build_parser()
    args = _common.apply_preset(parser.parse_args(argv), PRESETS)
    if args.mesh is not None:
        try:
            args.mesh = _mesh.make_mesh(_mesh.parse_mesh(args.mesh))
        except ValueError as e:
            parser.error(str(e))
    return args


def load_data(args: argparse.Namespace) -> _data.LMData:
    """The packed train / validation examples for the flags in `args`."""
    return _data.load_lm_data(text_bytes=int(args.text_mb * 1e6), vocab_size=args.vocab,
                              seq_len=args.seq_len, cache_dir=args.cache_dir,
                              val_fraction=args.val_fraction, seed=args.seed)


def model_config(args: argparse.Namespace, vocab_size: int) -> _common.ModelConfig:
    """The model for the flags in `args` (the vocabulary is the tokenizer's actual size)."""
    return _common.ModelConfig(vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                               n_layers=args.layers, n_heads=args.heads, dtype=args.dtype)


def train_config(args: argparse.Namespace) -> _common.TrainConfig:
    """The optimiser and loop settings for the flags in `args`."""
    return _common.TrainConfig(steps=args.steps, batch_size=args.batch, lr=args.lr,
                               warmup_frac=args.warmup_frac, weight_decay=args.weight_decay,
                               seed=args.seed, eval_every=args.eval_every,
                               progress=not args.no_progress)


def first_batch(data: _data.LMData, args: argparse.Namespace):
    """The first training batch (on the mesh, if any)."""
    x, y = next(_data.batches(data.train_inputs, data.train_labels, args.batch, args.seed))
    if args.mesh is None:
        return x, y
    place = _mesh.placer(args.mesh)
    return place(x), place(y)


def first_step_check(model: nnx.Module, data: _data.LMData, args: argparse.Namespace) -> dict:
    """Every loss on the first training batch at the initial parameters (they must agree)."""
    def losses(model: nnx.Module, x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
        logits = model(x)
        out = {impl: _common.lm_loss(logits, y, impl=impl, z_loss=args.z_loss)
               for impl in _common.LOSS_IMPLS}
        out["fused-linear"] = _common.linear_lm_loss(model, x, y, z_loss=args.z_loss)
        return out

    return {impl: float(v) for impl, v in nnx.jit(losses)(model, *first_batch(data, args)).items()}


def place_on_mesh(model: nnx.Module, objective, data: _data.LMData,
                  args: argparse.Namespace) -> dict:
    """Moves `model` onto `args.mesh`, compiles the loss once there and prints the layout.

    Returns `_mesh.logits_report`'s `logits_spec` and `logits_collectives`.
    """
    mesh = args.mesh
    _mesh.check_sizes(mesh, batch=args.batch, vocab=data.vocab_size)
    _mesh.shard_(model, mesh)
    report = _mesh.logits_report(model, objective, mesh, *first_batch(data, args))
    layout = report["logits_spec"] or "never materialised (fused LM head)"
    print(f"mesh: {_mesh.describe(mesh)} | logits {layout} | logits-sized "
          f"collectives in the compiled loss + gradient: {len(report['logits_collectives'])}")
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example and returns the metrics it writes to `OUT/metrics.json`."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = load_data(args)
    cfg = model_config(args, data.vocab_size)
    model = _common.TransformerLM(cfg, rngs=nnx.Rngs(args.seed))
    mesh = args.mesh
    objective = functools.partial(
        _common.ce_objective, args.loss, args.z_loss,
        logits_sharding=None if mesh is None else _mesh.logits_sharding(mesh))
    sharding = {} if mesh is None else place_on_mesh(model, objective, data, args)
    check = first_step_check(model, data, args)
    temp_bytes = _common.loss_grad_temp_bytes(model, objective(), *first_batch(data, args))
    print(f"data: {data.info['train_tokens']:,} training tokens, {data.info['val_seqs']} "
          f"validation sequences, padding {100 * data.info['padding_fraction']:.2f}% | "
          f"model: {_common.num_params(model):,} parameters | loss: {args.loss}")
    hist = _common.train(model, objective(), data, train_config(args), mesh=mesh,
                         desc=f"train_lm ({args.loss})")
    metrics = dict(
        loss_impl=args.loss, first_loss=hist["first_loss"], final_loss=hist["final_loss"],
        first_val_loss=hist["first_val_loss"], final_val_loss=hist["final_val_loss"],
        tokens_per_s=hist["tokens_per_s"], wall_s=hist["wall_s"],
        loss_grad_temp_bytes=temp_bytes, peak_memory_bytes=_common.peak_memory_bytes(),
        first_step_check=check, num_params=_common.num_params(model),
        mesh=None if mesh is None else dict(mesh.shape), **sharding,
        runtime=_common.runtime_info(), data=data.info, model=dataclasses.asdict(cfg),
        args={k: v if v is None or isinstance(v, int | float | str) else str(v)
              for k, v in vars(args).items()} | {"mesh": mesh and _mesh.describe(mesh)},
        train_losses=hist["train_losses"], val_curve=hist["val_curve"])
    _common.plot_curves({args.loss: hist}, args.out / "loss_curves.png",
                        f"train_lm: {_common.num_params(model) / 1e6:.1f}M parameters, "
                        f"vocabulary {data.vocab_size}, loss={args.loss}")
    _common.write_metrics(metrics, args.out)
    tok_s = hist["tokens_per_s"] or float("nan")
    peak = metrics["peak_memory_bytes"]
    print(f"train loss {hist['first_loss']:.4f} -> {hist['final_loss']:.4f} | validation loss "
          f"{hist['first_val_loss']:.4f} -> {hist['final_val_loss']:.4f} | {tok_s:,.0f} tok/s | "
          f"{hist['wall_s']:.1f} s | loss+grad temp {_mib(temp_bytes)}, peak device memory "
          f"{_mib(peak)} | first-step loss "
          + " ".join(f"{k} {v:.6f}" for k, v in check.items())
          + f"{'' if mesh is None else ' | mesh ' + _mesh.describe(mesh)} | wrote {args.out}")
    return metrics


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


if __name__ == "__main__":
    main(sys.argv[1:])
