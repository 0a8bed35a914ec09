"""Sharded cross-entropy, distillation and LM head on every device present: jax_fusedloss
against optax / XLA under the same sharding, and against our own op on one device at the
per-device token count.

    python -m benchmarks.sharded --out out/sharded          # cross_entropy on 1, 2, ... GPUs
    python -m benchmarks.sharded --out out/sharded --kd     # kd_loss, distill_loss (top-K=64)
    python -m benchmarks.sharded --out out/sharded --head   # linear_cross_entropy (LM head)

Distillation (`--kd`, bf16 logits, K teacher entries a token, fwd+bwd): kd_loss, distill_loss
(alpha 0.5) and "xla-naive-kd" (float32 log_softmax, gather at the ids) in the layouts of
cross_entropy below (the vocabulary layout runs our vocabulary-parallel rows); rows go to
`<out>/sharded_kd.csv`.

LM head (`--head`, bf16 hidden `[N, D]` and weight `[V, D]`, D=4096, fwd+bwd for both):
"data" (tokens sharded, weight replicated: data parallelism), "fsdp_d" / "fsdp_v" (tokens
and the weight sharded over the same axis, the weight on D or on V, as FSDP partition rules
do), "vocab" (all tokens on every device, weight split over V); ours in each mode against
"xla-naive" (logits materialised, optax in float32) under the same sharding, and ours and
XLA's on one device at the per-device token count (rows "one_device").

For each layout (tokens sharded, vocabulary sharded, and a 2-D mesh when there are 4 or more
devices) it times `jit(value_and_grad(loss))` (median of host-clock runs with
block_until_ready, after a warm-up) and reads from the compiled HLO the bytes each device
sends through collectives (sum of collective result sizes) and XLA's temp allocation. Rows
go to `<out>/sharded.csv` with device, versions and date.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os

import jax
import jax.numpy as jnp
import optax

from benchmarks import record, timing
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedloss as jfl

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def comm_bytes(hlo: str) -> int:
    """Bytes of the arrays the compiled program's collectives produce (tests/multidevice_check:
    synchronous and async forms, single and tuple results; until 2026-11-26 the tuple and
    async forms were missed, so rows before then may under-count)."""
    from tests.multidevice_check import collectives

    return sum(math.prod(dims) * BYTES.get(dtype, 4) for _, arrays, _ in collectives(hlo)
               for dtype, dims in arrays)


def time_ms(f, *args) -> float:
    """Steady-state ms per call of a jitted step called in a loop (benchmarks.timing.time_jax:
    the fixed cost of a run, the first dispatch and the host's wake-up, cancels). Until the
    twelfth session each sample was one call ended by block_until_ready, which kept that cost
    (~0.3-0.8 ms) in every row: it inflated the few-ms distillation rows, not the LM head's."""
    out_bytes = sum(a.nbytes for a in jax.tree.leaves(args))
    return timing.time_jax(lambda: f(*args), 1, out_bytes).median_ms


def losses():
    return {
        "jax_fusedloss": lambda x, y: jfl.cross_entropy(x, y),
        "optax": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
        "optax_fp32": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(
            x.astype(jnp.float32), y).mean(),
    }


def kd_losses():
    def naive(x, y, ids, lp):
        logq = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
        qk = jnp.take_along_axis(logq, ids, axis=-1)
        return jnp.mean(jnp.sum(jnp.exp(lp) * (lp - qk), axis=-1))

    return {"kd_loss": lambda x, y, ids, lp: jfl.kd_loss(x, ids, lp),
            "distill_loss": lambda x, y, ids, lp: jfl.distill_loss(x, y, ids, lp, alpha=0.5),
            "xla-naive-kd": naive}


def layouts(n_dev: int) -> dict:
    """Mesh shape and logits spec of each layout: tokens, vocabulary, 2-D from 4 devices."""
    out = {"tokens": ((n_dev, 1), P("data", None)), "vocab": ((1, n_dev), P(None, "model"))}
    if n_dev >= 4:
        out["2d"] = ((n_dev // 2, 2), P("data", "model"))
    return out


def kd_rows(args, meta) -> list[dict]:
    """Distillation's rows (module docstring): one device at the per-device token count, then
    each layout."""
    n_dev = len(jax.devices())
    per, vocab, k = args.tokens_per_device, args.vocab, args.k
    n = per * n_dev
    keys = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(keys[0], (n, vocab), jnp.float32) * 2).astype(jnp.bfloat16)
    y = jax.random.randint(keys[1], (n,), 0, vocab)
    ids = jax.random.randint(keys[2], (n, k), 0, vocab)
    lp = jax.nn.log_softmax(jax.random.normal(keys[3], (n, k)) * 2, axis=-1)
    meta = dict(meta, N=n, K=k, op="kd")
    rows = []
    for name, loss in kd_losses().items():
        f = jax.jit(jax.value_and_grad(loss))
        args1 = (x[:per], y[:per], ids[:per], lp[:per])
        rows.append(dict(meta, layout="one_device", N=per, impl=name, ms=time_ms(f, *args1),
                         comm_bytes=0, temp_bytes=f.lower(*args1).compile().memory_analysis()
                         .temp_size_in_bytes))
        print(rows[-1], flush=True)
    for layout, (shape, spec) in layouts(n_dev).items():
        mesh = jax.make_mesh(shape, ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        aux = [jax.device_put(a, NamedSharding(mesh, P(spec[0], *([None] * (a.ndim - 1)))))
               for a in (y, ids, lp)]
        for name, loss in kd_losses().items():
            f = jax.jit(jax.value_and_grad(loss))
            compiled = f.lower(xs, *aux).compile()
            _, g = compiled(xs, *aux)
            rows.append(dict(meta, layout=layout, impl=name, ms=time_ms(compiled, xs, *aux),
                             comm_bytes=comm_bytes(compiled.as_text()),
                             temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                             grad_sharding=str(g.sharding.spec)))
            print(rows[-1], flush=True)
    return rows


def head_losses(modes=("fast", "low_precision", "lean")):
    def naive(h, w, y):
        z = (h @ w.T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()

    out = {f"ours-{m}": (lambda h, w, y, m=m: jfl.linear_cross_entropy(
        h, w, y, weight_layout="vd", mode=m)) for m in modes}
    out["xla-naive"] = naive
    return out


def head_rows(args, meta) -> list[dict]:
    """The LM head's rows (module docstring)."""
    devs = jax.devices()
    n_dev = len(devs)
    per, d, vocab = args.tokens_per_device, args.dim, args.vocab
    n = per * n_dev
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (vocab, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, vocab)
    meta = dict(meta, N=n, D=d, op="linear_cross_entropy")
    rows = []
    for name, loss in head_losses().items():
        f = jax.jit(jax.value_and_grad(loss, (0, 1)))
        args1 = (h[:per], w, y[:per])
        rows.append(dict(meta, layout="one_device", N=per, impl=name, ms=time_ms(f, *args1),
                         comm_bytes=0, temp_bytes=f.lower(*args1).compile().memory_analysis()
                         .temp_size_in_bytes))
        print(rows[-1], flush=True)
    mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layouts = {"data": (P("data", None), P(None, None), P("data")),
               "fsdp_d": (P("data", None), P(None, "data"), P("data")),
               "fsdp_v": (P("data", None), P("data", None), P("data")),
               "vocab": (P(None, None), P("data", None), P(None))}
    for layout, specs in layouts.items():
        hs, ws, ys = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((h, w, y), specs))
        # the gradients laid out like their parameters, as a train step's optimizer wants them
        outs = (NamedSharding(mesh, P()), (hs.sharding, ws.sharding))
        for name, loss in head_losses().items():
            try:
                f = jax.jit(jax.value_and_grad(loss, (0, 1)), out_shardings=outs)
                compiled = f.lower(hs, ws, ys).compile()
                _, g = compiled(hs, ws, ys)
                rows.append(dict(meta, layout=layout, impl=name, ms=time_ms(compiled, hs, ws, ys),
                                 comm_bytes=comm_bytes(compiled.as_text()),
                                 temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                                 grad_sharding=f"{g[0].sharding.spec} {g[1].sharding.spec}"))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append(dict(meta, layout=layout, impl=name, ms=float("nan"), comm_bytes=0,
                                 temp_bytes=0, grad_sharding=f"error: {str(e)[:200]}"))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/sharded", help="folder for sharded.csv")
    ap.add_argument("--tokens-per-device", type=int, default=8192, help="N per device")
    ap.add_argument("--vocab", type=int, default=128256, help="V (llama3: 128256)")
    ap.add_argument("--head", action="store_true", help="the LM head instead of cross_entropy")
    ap.add_argument("--dim", type=int, default=4096, help="D of the LM head")
    ap.add_argument("--kd", action="store_true", help="kd_loss / distill_loss instead")
    ap.add_argument("--k", type=int, default=64, help="teacher entries a token (--kd)")
    args = ap.parse_args()
    if args.head or args.kd:
        meta = dict(device=jax.devices()[0].device_kind, n_devices=len(jax.devices()),
                    jax=jax.__version__, date=datetime.date.today().isoformat(),
                    commit=record.commit(), V=args.vocab, dtype="bfloat16")
        if args.kd:
            return _write(args.out, "sharded_kd.csv", kd_rows(args, meta))
        return _write(args.out, "sharded_head.csv", head_rows(args, meta))
    devs = jax.devices()
    n_dev = len(devs)
    n, vocab = args.tokens_per_device * n_dev, args.vocab
    x = (jax.random.normal(jax.random.key(0), (n, vocab), jnp.float32) * 2).astype(jnp.bfloat16)
    y = jax.random.randint(jax.random.key(1), (n,), 0, vocab)
    rows = []
    meta = dict(device=devs[0].device_kind, n_devices=n_dev, jax=jax.__version__,
                date=datetime.date.today().isoformat(), commit=record.commit(), N=n, V=vocab,
                dtype="bfloat16")

    # One device, per-device token count: the reference for the sharded rows.
    x1, y1 = x[: args.tokens_per_device], y[: args.tokens_per_device]
    for name, loss in losses().items():
        f = jax.jit(jax.value_and_grad(loss))
        rows.append(dict(meta, layout="one_device", N=args.tokens_per_device, impl=name,
                         ms=time_ms(f, x1, y1), comm_bytes=0,
                         temp_bytes=f.lower(x1, y1).compile().memory_analysis()
                         .temp_size_in_bytes))
    for layout, (shape, spec) in layouts(n_dev).items():
        mesh = jax.make_mesh(shape, ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        ys = jax.device_put(y, NamedSharding(mesh, P(spec[0])))
        for name, loss in losses().items():
            f = jax.jit(jax.value_and_grad(loss))
            compiled = f.lower(xs, ys).compile()
            _, g = f(xs, ys)
            rows.append(dict(meta, layout=layout, impl=name, ms=time_ms(f, xs, ys),
                             comm_bytes=comm_bytes(compiled.as_text()),
                             temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                             grad_sharding=str(g.sharding.spec)))
    _write(args.out, "sharded.csv", rows)


def _write(out: str, name: str, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['layout']:>10} {r['impl']:>14} N={r['N']:>6} {r['ms']:8.3f} ms "
              f"comm {r['comm_bytes'] / 2**20:9.3f} MiB temp {r['temp_bytes'] / 2**30:6.3f} GiB "
              f"{r.get('grad_sharding', '')}")
    print("wrote", path)


if __name__ == "__main__":
    main()
