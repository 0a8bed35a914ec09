"""Shared pieces of the examples: a small Flax NNX transformer, the losses, the training loop."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import jax_fusedloss

if __package__:
    from examples import _mesh
    from examples._data import IGNORE_INDEX, LMData, batches
else:
    import _mesh
    from _data import IGNORE_INDEX, LMData, batches

# (model, aux, inputs, labels) -> scalar loss; `aux` is any extra pytree or module (a teacher).
LossFn = Callable[[nnx.Module, Any, jax.Array, jax.Array], jax.Array]
LOSS_IMPLS = ("fused", "optax")  # losses of the logits
# ...and the LM head's projection + loss in one op, never materialising the logits.
LM_LOSSES = LOSS_IMPLS + ("fused-linear",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: pre-RMSNorm blocks, learned positions, tied embeddings."""

    vocab_size: int
    seq_len: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"  # compute dtype (and so the logits' dtype); parameters stay float32


class Block(nnx.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.n_heads = cfg.n_heads
        self.attn_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dtype, kernel_init=init, rngs=rngs)
        self.attn_out = nnx.Linear(d, d, use_bias=False, dtype=dtype, kernel_init=out_init,
                                   rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, use_bias=False, dtype=dtype,
                                 kernel_init=init, rngs=rngs)
        self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, use_bias=False, dtype=dtype,
                                  kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).reshape(b, t, 3, self.n_heads, d // self.n_heads)
        attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                            is_causal=True)
        x = x + self.attn_out(attn.reshape(b, t, d))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Token ids `[B, T]` -> next-token logits `[B, T, V]` in the compute dtype."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}")
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                           (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """Token ids `[B, T]` -> the final normalised hidden states `[B, T, D]` (the LM head's
        input)."""
        x = self.embed(tokens)
        x = x + self.pos[: tokens.shape[1]].astype(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def head_table(self) -> jax.Array:
        """The LM head's weight: the tied embedding table `[V, D]` in the compute dtype."""
        return self.embed.embedding[...].astype(jnp.dtype(self.embed.dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.embed.attend(self.hidden(tokens))


def num_params(model: nnx.Module) -> int:
    """Number of trainable parameters."""
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------- losses
def lm_loss(logits: jax.Array, labels: jax.Array, *, impl: str, z_loss: float) -> jax.Array:
    """Mean next-token cross-entropy + `z_loss * lse**2` over the tokens that are not padding.

    `impl="fused"` calls `jax_fusedloss.cross_entropy`; `impl="optax"` computes the same
    objective from `optax.softmax_cross_entropy_with_integer_labels` in float32 (optax has no
    ignore index or z-loss, so the mask and the z-loss term are written out here).
    """
    if impl == "fused":
        return jax_fusedloss.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                           z_loss=z_loss)
    if impl != "optax":
        raise ValueError(f"loss implementation {impl!r} must be one of {LOSS_IMPLS}")
    logits = logits.astype(jnp.float32)
    mask = labels != IGNORE_INDEX
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    if z_loss:
        per_token = per_token + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def linear_lm_loss(model: TransformerLM, tokens: jax.Array, labels: jax.Array, *,
                   z_loss: float) -> jax.Array:
    """`lm_loss` with the LM head fused in: `jax_fusedloss.linear_cross_entropy` of the final
    hidden states and the tied embedding table `[V, D]` (`weight_layout="vd"`, no transposed
    copy), so the `[B, T, V]` logits and their gradient are never materialised."""
    return jax_fusedloss.linear_cross_entropy(
        model.hidden(tokens), model.head_table(), labels, weight_layout="vd",
        ignore_index=IGNORE_INDEX, z_loss=z_loss)


def ce_objective(impl: str, z_loss: float, *,
                 logits_sharding: jax.sharding.Sharding | None = None,
                 on_logits: Callable[[jax.Array], None] | None = None) -> LossFn:
    """The language-model training objective as a `LossFn` (no auxiliary input).

    `logits_sharding` pins the logits' layout (on a mesh: `P("data", None, "model")`);
    `on_logits` is a debugging hook called, while tracing, on the logits the loss receives.
    `impl="fused-linear"` (`linear_lm_loss`) has no logits: neither applies.
    """

    def loss_fn(model: nnx.Module, aux: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        del aux
        if impl == "fused-linear":
            return linear_lm_loss(model, x, y, z_loss=z_loss)
        logits = model(x)
        if logits_sharding is not None:
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        if on_logits is not None:
            on_logits(logits)
        return lm_loss(logits, y, impl=impl, z_loss=z_loss)

    return loss_fn


@nnx.jit
def _eval_sums(model: nnx.Module, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss = jax_fusedloss.cross_entropy(model(x), y, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, jnp.sum(y != IGNORE_INDEX)


def evaluate(model: nnx.Module, inputs: np.ndarray, labels: np.ndarray, batch_size: int, *,
             place: Callable[[np.ndarray], Any] = np.asarray) -> float:
    """Token-weighted mean cross-entropy (no z-loss, padding ignored) over a whole split.

    `place` puts each host batch where the model expects it (on a mesh: split over "data")."""
    n = len(inputs)
    pad = (-n) % batch_size  # pad to whole batches with ignored rows: one compiled shape
    inputs = np.concatenate([inputs, np.zeros((pad, inputs.shape[1]), inputs.dtype)])
    labels = np.concatenate([labels, np.full((pad, labels.shape[1]), IGNORE_INDEX, labels.dtype)])
    total, count = 0.0, 0
    for i in range(0, len(inputs), batch_size):
        loss, cnt = _eval_sums(model, place(inputs[i:i + batch_size]),
                               place(labels[i:i + batch_size]))
        total += float(loss)
        count += int(cnt)
    return total / max(count, 1)


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser and loop settings: AdamW with linear warm-up and cosine decay to lr / 10."""

    steps: int
    batch_size: int
    lr: float = 3e-3
    warmup_frac: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0
    eval_every: int = 0  # 0: ten evaluations over the run
    log_every: int = 10
    progress: bool = True


def make_optimizer(model: nnx.Module, cfg: TrainConfig) -> nnx.Optimizer:
    """AdamW (decay on matrices only) with warm-up + cosine decay and global-norm clipping."""
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr / 10)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _make_step(loss_fn: LossFn):
    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, aux: Any, x: jax.Array,
             y: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, aux, x, y))(model)
        optimizer.update(model, grads)
        return loss

    return step


def train(model: nnx.Module, loss_fn: LossFn, data: LMData, cfg: TrainConfig, *,
          aux: Any = None, desc: str = "train", loss_label: str = "loss",
          mesh: jax.sharding.Mesh | None = None) -> dict:
    """Trains `model` in place on `data` and returns its history.

    Batches depend only on `cfg.seed`, so two runs with one seed see the same data in the same
    order. The validation loss is measured before the first step, every `eval_every` steps and
    after the last. `first_loss` is the first step's training loss, `final_loss` the mean
    training loss over the last 10% of the steps (at most 10) for less batch-to-batch noise.
    tokens/s counts every input position of a batch, padding included, and leaves out the
    first (compiling) step and the evaluations.

    The progress bar shows the steps done, the training loss of the latest step (named
    `loss_label`: say what the objective is when it is not the plain cross-entropy), the
    latest validation loss with the step it was measured after (`val=4.83@300`), and tokens/s.

    With a `mesh`, the model and the optimiser state are placed on it (see `_mesh`: replicated
    but for the LM head, split by vocabulary over "model") and every batch is split over "data".
    """
    optimizer = make_optimizer(model, cfg)
    place: Callable[[np.ndarray], Any] = np.asarray
    if mesh is not None:
        _mesh.shard_(model, mesh)
        _mesh.shard_(optimizer, mesh)
        place = _mesh.placer(mesh)
    step_fn = _make_step(loss_fn)
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    eval_batch = 2 * cfg.batch_size
    tokens_per_step = cfg.batch_size * data.train_inputs.shape[1]
    stream = batches(data.train_inputs, data.train_labels, cfg.batch_size, cfg.seed)
    losses: list[jax.Array] = []
    val_curve = [(0, evaluate(model, data.val_inputs, data.val_labels, eval_batch, place=place))]
    train_time, timed_steps, last_sync = 0.0, 0, 1
    t0 = time.perf_counter()
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc=desc, disable=not cfg.progress, dynamic_ncols=True)
    postfix = {loss_label: "", "val": f"{val_curve[0][1]:.3f}@0", "tok_s": ""}
    pending = 0  # steps done but not yet counted on the bar
    for step in range(1, cfg.steps + 1):
        x, y = next(stream)
        losses.append(step_fn(model, optimizer, aux, place(x), place(y)))
        pending += 1
        if step == 1 or step % cfg.log_every == 0 or step % eval_every == 0 or step == cfg.steps:
            loss = float(losses[-1])  # waits for the step to finish
            now = time.perf_counter()
            if step > 1:
                train_time += now - start
                timed_steps += step - last_sync
            last_sync = step
            tok_s = f"{timed_steps * tokens_per_step / train_time:,.0f}" if train_time else "-"
            postfix.update({loss_label: f"{loss:.3f}", "tok_s": tok_s})
            if step % eval_every == 0 or step == cfg.steps:
                val = evaluate(model, data.val_inputs, data.val_labels, eval_batch, place=place)
                val_curve.append((step, val))
                postfix["val"] = f"{val:.3f}@{step}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(pending)  # the count and the numbers beside it are of the same step
            pending = 0
            start = time.perf_counter()
    bar.close()
    train_losses = [float(v) for v in losses]
    tail = max(1, min(10, cfg.steps // 10))
    return dict(train_losses=train_losses, val_curve=val_curve,
                first_loss=train_losses[0], final_loss=float(np.mean(train_losses[-tail:])),
                first_val_loss=val_curve[0][1], final_val_loss=val_curve[-1][1],
                tokens_per_s=timed_steps * tokens_per_step / train_time if train_time else None,
                wall_s=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- CLI and outputs
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (a flag filled in from `--preset` or from another flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_preset_flags(parser: argparse.ArgumentParser, presets: dict[str, dict],
                     flags: dict[str, dict]) -> None:
    """Adds `--preset` and a flag per preset key (`flags[key]`: `add_argument` keywords); the
    help of each lists its preset values. Call `apply_preset` after parsing."""
    parser.add_argument("--preset", choices=list(presets), default=next(iter(presets)),
                        help="defaults of the size flags that are not given")
    for key in next(iter(presets.values())):
        values = ", ".join(f"{name}: {preset[key]}" for name, preset in presets.items())
        kwargs = dict(flags[key])
        kwargs["help"] = f"{kwargs.get('help', '')} ({values})"
        parser.add_argument("--" + key.replace("_", "-"), **kwargs)


def apply_preset(args: argparse.Namespace, presets: dict[str, dict]) -> argparse.Namespace:
    """Fills the preset flags left unset, and `cache_dir` (default `out / "cache"`)."""
    for key, value in presets[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.cache_dir is None:
        args.cache_dir = args.out / "cache"
    return args


def plot_curves(runs: dict[str, dict], path: Path, title: str,
                no_train_curve: tuple[str, ...] = ()) -> None:
    """One PNG with each run's train loss (thin; not for the runs in `no_train_curve`) and
    validation loss (markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, hist) in enumerate(runs.items()):
        color = f"C{i}"
        train_losses = hist["train_losses"]
        if name not in no_train_curve:
            ax.plot(range(1, len(train_losses) + 1), train_losses, color=color, alpha=0.35,
                    lw=0.8, label=f"{name} train")
        steps, vals = zip(*hist["val_curve"], strict=True)
        ax.plot(steps, vals, "o-", color=color, ms=4, label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_metrics(metrics: dict, out: Path) -> None:
    """Writes `metrics.json` to `out`."""
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def peak_memory_bytes() -> int | None:
    """The device's peak memory in use so far (`memory_stats()["peak_bytes_in_use"]`, which
    GPUs report), or None where the backend does not report it (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def loss_grad_temp_bytes(model: nnx.Module, loss_fn: LossFn, x: jax.Array,
                         y: jax.Array) -> int | None:
    """Temporary memory of the compiled loss + gradient (XLA's `memory_analysis()`: what the
    program allocates beyond its inputs and outputs; on any backend), or None if unknown."""
    graphdef, state = nnx.split(model)
    grad = jax.jit(jax.value_and_grad(
        lambda state, x, y: loss_fn(nnx.merge(graphdef, state), None, x, y)))
    analysis = grad.lower(state, x, y).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def runtime_info() -> dict:
    """The JAX backend and device (`jax_fusedloss` runs its Triton kernels on a CUDA GPU and
    its pure-XLA implementation elsewhere)."""
    return dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                device_count=jax.device_count(), jax_version=jax.__version__)
