"""Reinforcement learning from hidden states: a GRPO-style update with
`jax_fusedloss.linear_token_logprobs`.

The model and data of `train_lm.py`: a small decoder-only transformer is first fine-tuned on
the standard library's source with `linear_cross_entropy` (a short supervised phase: RL
needs a policy that writes something). Then, for each RL step, it samples `--group`
continuations of `--gen-len` tokens for each of `--prompts` prompts (prefixes of training
sequences) at `--temperature`, scores each continuation with a reward, and takes `--ppo-epochs`
clipped policy-gradient steps on the group-normalised advantages (GRPO: Shao et al., 2024):

    ratio = exp(logp - logp_old),  loss = -mean(min(ratio * A, clip(ratio, 1 +- eps) * A))
                                          - entropy_coef * mean(entropy)

over the sampled tokens. `logp` and the entropy come from `linear_token_logprobs` of the final
hidden states and the tied embedding table at the sampling temperature: the `[B, T, V]` logits
are never kept, and the gradient of this nonlinear function of the log-probs (a per-token
cotangent known only in the backward) is recomputed there.

The reward is the fraction of a continuation's tokens that occur in its prompt (stay on topic:
reuse the prompt's identifiers), computed from token ids alone. What to watch: the mean reward
rises, the entropy falls slowly (the entropy bonus keeps it from collapsing), the mean log-prob
of the sampled tokens rises as the policy sharpens.

    python -m examples.rl                      # CPU default: a few minutes on 2 cores
    python -m examples.rl --preset gpu --out out/rl_gpu

Writes `metrics.json` and `rl_curves.png` to `--out`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_fusedloss

if __package__:
    from examples import _common, train_lm
else:
    import _common
    import train_lm

PRESETS: dict[str, dict] = {
    # About 2 minutes on a 2-core CPU.
    "cpu": dict(sft_steps=200, steps=40, prompts=8, group=4, gen_len=16, batch=16, seq_len=64,
                vocab=2048, d_model=128, layers=2, heads=4, lr=3e-3, text_mb=2.0,
                dtype="float32"),
    "gpu": dict(sft_steps=1000, steps=200, prompts=32, group=8, gen_len=64, batch=32,
                seq_len=256, vocab=32768, d_model=512, layers=8, heads=8, lr=1e-3,
                text_mb=32.0, dtype="bfloat16"),
}
SIZE_FLAGS: dict[str, dict] = {
    "sft_steps": dict(type=int, help="supervised steps before RL"),
    "steps": dict(type=int, help="RL steps (one batch of samples each)"),
    "prompts": dict(type=int, help="prompts per RL step"),
    "group": dict(type=int, help="sampled continuations per prompt (the GRPO group)"),
    "gen_len": dict(type=int, help="tokens per continuation"),
} | {k: v for k, v in train_lm.SIZE_FLAGS.items() if k != "steps"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=_common.HelpFormatter)
    _common.add_preset_flags(p, PRESETS, SIZE_FLAGS)
    p.add_argument("--prompt-len", type=int, default=0, help="0: seq_len - gen_len")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus")
    p.add_argument("--ppo-epochs", type=int, default=2, help="updates per batch of samples")
    p.add_argument("--rl-lr", type=float, default=3e-4, help="RL learning rate (Adam)")
    p.add_argument("--seed", type=int, default=0, help="data order, init and sampling")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out documents")
    p.add_argument("--out", type=Path, default=Path("out/rl"), help="output directory")
    p.add_argument("--cache-dir", type=Path, help="tokenizer cache (default: OUT/cache)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = _common.apply_preset(build_parser().parse_args(argv), PRESETS)
    args.prompt_len = args.prompt_len or args.seq_len - args.gen_len
    if args.prompt_len < 1 or args.prompt_len + args.gen_len > args.seq_len:
        raise SystemExit(f"--prompt-len + --gen-len must lie in (1, seq_len={args.seq_len}]")
    return args


def policy_logprobs(model, tokens: jax.Array, temperature: float):
    """Log-probs `[B, T-1]` of tokens[:, 1:] and the entropy of each next-token distribution,
    from the hidden states and the tied embedding (no `[B, T, V]` logits kept)."""
    return jax_fusedloss.linear_token_logprobs(
        model.hidden(tokens[:, :-1]), model.head_table(), tokens[:, 1:], weight_layout="vd",
        temperature=temperature, return_entropy=True)


@functools.partial(nnx.jit, static_argnames=("gen_len", "group", "temperature"))
def sample(model, prompts: jax.Array, key: jax.Array, *, gen_len: int, group: int,
           temperature: float) -> jax.Array:
    """`group` continuations of `gen_len` tokens per prompt: `[P * group, Lp + gen_len]`."""
    p, lp = prompts.shape
    buf = jnp.zeros((p * group, lp + gen_len), jnp.int32).at[:, :lp].set(
        jnp.repeat(prompts, group, axis=0))

    def body(t, buf):
        logits = model(buf)[:, lp + t - 1].astype(jnp.float32)  # no cache: small models
        tok = jax.random.categorical(jax.random.fold_in(key, t), logits / temperature)
        return buf.at[:, lp + t].set(tok)

    return jax.lax.fori_loop(0, gen_len, body, buf)


def rewards(tokens: jax.Array, prompt_len: int) -> jax.Array:
    """Fraction of each continuation's tokens that occur in its prompt `[B]`."""
    prompt, cont = tokens[:, :prompt_len], tokens[:, prompt_len:]
    return (cont[:, :, None] == prompt[:, None, :]).any(-1).mean(-1).astype(jnp.float32)


def grpo_loss(model, tokens, old_logp, adv, mask, *, temperature, clip, entropy_coef):
    """The clipped surrogate over the sampled tokens (`mask`) minus the entropy bonus; aux:
    (mean log-prob, mean entropy, clip fraction)."""
    logp, ent = policy_logprobs(model, tokens, temperature)
    ratio = jnp.exp(logp - old_logp)
    a = adv[:, None]
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
    mask = jnp.broadcast_to(mask, logp.shape)
    count = jnp.sum(mask)
    mean = (lambda v: jnp.sum(jnp.where(mask, v, 0.0)) / count)
    loss = -mean(surrogate) - entropy_coef * mean(ent)
    return loss, (mean(logp), mean(ent), mean((jnp.abs(ratio - 1) > clip).astype(jnp.float32)))


def make_rl_step(args):
    opts = dict(temperature=args.temperature, clip=args.clip, entropy_coef=args.entropy_coef)

    @nnx.jit
    def rl_step(model, optimizer, prompts, key):
        tokens = sample(model, prompts, key, gen_len=args.gen_len, group=args.group,
                        temperature=args.temperature)
        r = rewards(tokens, args.prompt_len)
        grouped = r.reshape(-1, args.group)
        adv = ((grouped - grouped.mean(1, keepdims=True))
               / (grouped.std(1, keepdims=True) + 1e-4)).reshape(-1)
        old_logp, _ = policy_logprobs(model, tokens, args.temperature)
        old_logp = jax.lax.stop_gradient(old_logp)
        mask = jnp.arange(tokens.shape[1] - 1)[None, :] >= args.prompt_len - 1
        stats = []
        for _ in range(args.ppo_epochs):
            (loss, aux), grads = nnx.value_and_grad(
                functools.partial(grpo_loss, **opts), has_aux=True)(
                model, tokens, old_logp, adv, mask)
            optimizer.update(model, grads)
            stats.append((loss,) + aux)
        loss, logp, ent, clipped = stats[-1]
        return dict(reward=r.mean(), loss=loss, logprob=stats[0][1], entropy=stats[0][2],
                    clip_frac=clipped)

    return rl_step


def first_step_check(model, tokens: jax.Array, temperature: float) -> float:
    """max |linear_token_logprobs - log_softmax(logits / T)[labels]| on one batch."""
    logp, _ = nnx.jit(policy_logprobs, static_argnums=2)(model, tokens, temperature)
    logits = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1]).astype(jnp.float32)
    naive = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature),
                                tokens[:, 1:, None], -1)[..., 0]
    return float(jnp.max(jnp.abs(logp - naive)))


def plot(history: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward", "logprob", "entropy", "loss")
    fig, axes = plt.subplots(1, len(keys), figsize=(16, 3.8))
    for ax, key in zip(axes, keys):
        ax.plot(range(1, len(history[key]) + 1), history[key], color="C0")
        ax.set_title({"logprob": "mean log-prob of samples", "entropy": "mean entropy (nats)",
                      "reward": "mean reward", "loss": "GRPO loss"}[key])
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = train_lm.load_data(args)
    cfg = train_lm.model_config(args, data.vocab_size)
    model = _common.TransformerLM(cfg, rngs=nnx.Rngs(args.seed))
    sft = _common.train(model, _common.ce_objective("fused-linear", 1e-4), data,
                        _common.TrainConfig(steps=args.sft_steps, batch_size=args.batch,
                                            lr=args.lr, seed=args.seed,
                                            progress=not args.no_progress),
                        desc="supervised (linear_cross_entropy)")
    optimizer = nnx.Optimizer(model, optax.adam(args.rl_lr), wrt=nnx.Param)
    rl_step = make_rl_step(args)
    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    history: dict[str, list[float]] = {k: [] for k in ("reward", "loss", "logprob", "entropy",
                                                       "clip_frac")}
    check = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(data.train_inputs), args.prompts)
        prompts = jnp.asarray(data.train_inputs[idx, :args.prompt_len])
        if check is None:
            tokens = sample(model, prompts, key, gen_len=args.gen_len, group=args.group,
                            temperature=args.temperature)
            check = first_step_check(model, tokens, args.temperature)
        out = {k: float(v) for k, v in rl_step(model, optimizer, prompts,
                                               jax.random.fold_in(key, step)).items()}
        for k, v in out.items():
            history[k].append(v)
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"rl step {step:4d} | reward {out['reward']:.3f} | log-prob "
                  f"{out['logprob']:.3f} | entropy {out['entropy']:.3f} | loss "
                  f"{out['loss']:+.4f} | clipped {out['clip_frac']:.3f}", flush=True)
    wall = time.perf_counter() - t0
    tail = max(1, min(5, args.steps // 5))
    metrics = dict(
        first_reward=history["reward"][0], final_reward=float(np.mean(history["reward"][-tail:])),
        first_entropy=history["entropy"][0], final_entropy=history["entropy"][-1],
        logprob_check_max_abs=check, sft_final_val_loss=sft["final_val_loss"], rl_wall_s=wall,
        history=history, runtime=_common.runtime_info(), model=dataclasses.asdict(cfg),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    plot(history, args.out / "rl_curves.png",
         f"GRPO on hidden states: {args.prompts} prompts x {args.group} samples x "
         f"{args.gen_len} tokens, T={args.temperature}")
    _common.write_metrics(metrics, args.out)
    print(f"reward {metrics['first_reward']:.3f} -> {metrics['final_reward']:.3f} | entropy "
          f"{metrics['first_entropy']:.3f} -> {metrics['final_entropy']:.3f} | fused vs naive "
          f"log-prob max |diff| {check:.2e} | {wall:.1f} s of RL | wrote {args.out}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
