"""Run as a script with 4 CPU devices (or on GPUs): linear_cross_entropy under every sharding
layout against the single-device result. Prints one line per case, `OK ...` or `FAIL ...`;
exits 1 on a FAIL.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multidevice_linear_check xla

Layouts on a ("data", "model") mesh: hidden `[N, D]` sharded over tokens, weight sharded over
the vocabulary (`[D, V]` on V for "dv", `[V, D]` on V for "vd", bias with it), both (2-D),
replicated; under jax.jit with NamedSharding (Auto and Explicit axes) and inside jax.shard_map
(vocab_axis); JFL_CHECK_QUICK=1 runs a subset of them. Checks: the loss and the gradients
w.r.t. hidden, weight and bias equal the single-device ones, each gradient keeps its input's
sharding (a replicated weight's gradient comes back replicated), and the compiled HLO gathers
nothing of the weight's or the hidden states' size and all-reduces nothing of the logits'
size.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("JFL_CHECK_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fusedloss as jfl  # noqa: E402
from tests.multidevice_check import collectives, leftover_sharding_calls  # noqa: E402

N, D, V, CHUNK = 128, 16, 96, 32  # local chunks: 2 or 4 (ragged ones: single-device tests)
# JFL_CHECK_DTYPE=bfloat16: 16-bit inputs, which take the fused head GEMMs
# (kernels/head_gemm.py) on GPUs; the sharded results then differ from the single-device
# ones by bfloat16 roundings of the outputs.
DTYPE = jnp.dtype(os.environ.get("JFL_CHECK_DTYPE", "float32"))
TOL = 1e-4 if DTYPE == jnp.float32 else 2e-3
# (token axis, vocabulary axis) layouts; JFL_CHECK_QUICK=1 (the test suite) runs fewer.
QUICK = os.environ.get("JFL_CHECK_QUICK") == "1"
_ALL = (("data", None), (None, "model"), ("data", "model"), (None, None))
# FSDP: the weight sharded over the token axis, on V ("data", "data") or on D ("data", "d:data")
_FSDP = (("data", "data"), ("data", "d:data"))
JIT_LAYOUTS = {"Auto": {False: _ALL + _FSDP, True: _ALL[:3] + _FSDP},
               "Explicit": {False: _ALL, True: (("data", "model"),)}}
SHARD_MAP_LAYOUTS = {False: _ALL[:3], True: (("data", None), ("data", "model"))}


def layouts_per_case(quick: bool = True) -> int:
    """How many OK/FAIL lines one case prints (what the tests that run this harness expect)."""
    return (len(JIT_LAYOUTS["Auto"][quick]) + len(JIT_LAYOUTS["Explicit"][quick])
            + len(SHARD_MAP_LAYOUTS[quick]))


def cases():
    """name -> (layout, with bias, loss(h, w, b, aux, impl, vocab_axis, reduction))."""

    def fused(layout, mode="fast"):  # "fast"/"low_precision": the gradients in the forward
        def loss(h, w, b, a, impl, va, red):
            return jfl.linear_cross_entropy(
                h, w, a[0], bias=b, weight_layout=layout, reduction=red, label_smoothing=0.1,
                z_loss=1e-3, chunk_size=CHUNK, implementation=impl, vocab_axis=va, mode=mode)
        return loss

    def recompute(layout, mode="fast"):  # per-token cotangents and a differentiable lse
        def loss(h, w, b, a, impl, va, red):
            per_token, lse = jfl.linear_cross_entropy(
                h, w, a[0], bias=b, weight_layout=layout, reduction="none", return_lse=True,
                logit_softcap=5.0, chunk_size=CHUNK, implementation=impl, vocab_axis=va,
                mode=mode)
            return jnp.sum(per_token * a[1]) + 0.1 * jnp.sum(lse * a[2])
        return loss

    return {"dv_bias_fused": ("dv", True, fused("dv")),
            "vd_fused": ("vd", False, fused("vd")),
            "vd_bias_recompute": ("vd", True, recompute("vd")),
            "dv_recompute": ("dv", False, recompute("dv")),
            # "lean": the vocabulary walk in the backward (per-device slices, global stats)
            "vd_bias_lean": ("vd", True, fused("vd", "lean")),
            "dv_lean_recompute": ("dv", False, recompute("dv", "lean")),
            "dv_low_precision": ("dv", True, fused("dv", "low_precision"))}


def inputs(layout: str):
    k = jax.random.split(jax.random.key(3), 6)
    h = jax.random.normal(k[0], (N, D))
    w = jax.random.normal(k[1], (D, V) if layout == "dv" else (V, D)) * 0.5
    b = jax.random.normal(k[2], (V,)) * 0.5
    y = jax.random.randint(k[3], (N,), 0, V)
    y = y.at[1].set(-100).at[N // 2].set(V - 1).at[N // 2 + 1].set(0)
    y = y.at[N // 2 + 2:N // 2 + 2 + N // 4].set(-100)  # one token shard mostly ignored
    aux = (y, jax.random.normal(k[4], (N,)), jax.random.normal(k[5], (N,)))
    return h.astype(DTYPE), w.astype(DTYPE), b.astype(DTYPE), aux


def specs(layout: str, rows, vocab):
    """(hidden, weight, bias, row array) partition specs for token axes `rows` and vocab axes
    `vocab` (None: not sharded; "d:<axis>": the weight's D dimension sharded instead)."""
    if vocab is not None and vocab.startswith("d:"):
        d = vocab[2:]
        return P(rows, None), P(d, None) if layout == "dv" else P(None, d), P(), P(rows)
    w = P(None, vocab) if layout == "dv" else P(vocab, None)
    return P(rows, None), w, P(vocab), P(rows)


def fsdp(rows, vocab) -> bool:
    """A layout whose weight is sharded over the token axis: gathering the weight (on D) or
    the tokens (on V) is the plan there, not a defect."""
    return vocab is not None and (vocab.startswith("d:") or vocab == rows)


def bad_collectives(hlo: str, ndev: int, logits_only: bool = False) -> list[str]:
    """All-gathers (or all-to-alls, permutes) of a device's share of W or of the hidden states,
    and all-reduces of a device's share of the logits (only the latter with `logits_only`)."""
    out = []
    for op, arrays, text in collectives(hlo):
        if logits_only and op != "all-reduce":
            continue
        limit = N * V // ndev if op == "all-reduce" else min(N, V) * D // ndev
        if any(int(np.prod(dims)) >= limit for _, dims in arrays):
            out.append(text)
    return out


def main(impl: str, only: str | None = None) -> int:
    ndev = len(jax.devices())
    model = 2 if ndev >= 2 else 1
    data = ndev // model
    failures = 0
    for name, (layout, with_bias, loss) in cases().items():
        if only and name not in only.split(","):
            continue
        h, w, b, aux = inputs(layout)
        b = b if with_bias else None
        argnums = (0, 1, 2) if with_bias else (0, 1)

        def grad_fn(red, va=None):
            return jax.value_and_grad(
                lambda h, w, b, *a: loss(h, w, b, a, impl, va, red), argnums)

        refs = {red: jax.jit(grad_fn(red))(h, w, b, *aux) for red in ("mean", "sum")}

        def check(tag, v, grads, red, extra=""):
            nonlocal failures
            ref_v, ref_g = refs[red]
            dv = abs(float(v) - float(ref_v))
            dg = max(float(np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32)).max())
                     / max(float(np.abs(np.asarray(r, np.float32)).max()), 1e-30)
                     for g, r in zip(grads, ref_g))
            ok = dv <= TOL * max(1.0, abs(float(ref_v))) and dg <= TOL * 10 and not extra
            failures += not ok
            print(f"{'OK' if ok else 'FAIL'} {name} {impl} {tag}: |dv|={dv:.2e} "
                  f"|dg|/max={dg:.2e} {extra}", flush=True)

        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(axis_type,) * 2)
            for rows, vocab in JIT_LAYOUTS[axis_type.name][QUICK]:
                hs, ws, bs, rs = specs(layout, rows, vocab)
                args = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s))
                             for a, s in zip((h, w, b) + aux, (hs, ws, bs) + (rs,) * len(aux)))
                f = jax.jit(grad_fn("mean"))
                tag = f"jit {axis_type.name} rows={rows} vocab={vocab}"
                try:
                    with jax.set_mesh(mesh):
                        compiled = f.lower(*args).compile()
                        v, g = compiled(*args)
                    hlo = compiled.as_text()
                except Exception as e:  # noqa: BLE001 - report and go on
                    failures += 1
                    print(f"FAIL {name} {impl} {tag}: {type(e).__name__}: {str(e)[:400]}",
                          flush=True)
                    continue
                extra = ""
                for grad, arg, what in zip(g, args, ("dH", "dW", "db")):
                    if not grad.sharding.is_equivalent_to(arg.sharding, grad.ndim):
                        extra += f"{what} sharding {grad.sharding.spec} != {arg.sharding.spec} "
                bad = bad_collectives(hlo, ndev, logits_only=fsdp(rows, vocab))
                if bad:
                    extra += f"big collectives {bad[:2]}"
                if leftover_sharding_calls(hlo):
                    extra += f"{leftover_sharding_calls(hlo)} Sharding custom calls"
                check(tag, v, g, "mean", extra)
        mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        for rows, vocab in SHARD_MAP_LAYOUTS[QUICK]:
            hs, ws, bs, rs = specs(layout, rows, vocab)
            in_specs = (hs, ws, bs if with_bias else P()) + (rs,) * len(aux)

            def body(h, w, b, *a):
                v, g = grad_fn("sum", vocab)(h, w, b if with_bias else None, *a)
                return (jax.lax.psum(v, "data") if rows else v), g

            out_specs = (P(), (hs, ws, bs) if with_bias else (hs, ws))
            tag = f"shard_map rows={rows} vocab={vocab}"
            try:
                sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                           out_specs=out_specs))
                args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                        zip((h, w, b if with_bias else jnp.zeros(())) + aux, in_specs)]
                with jax.set_mesh(mesh):
                    compiled = sm.lower(*args).compile()
                    v, g = compiled(*args)
                hlo = compiled.as_text()
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAIL {name} {impl} {tag}: {type(e).__name__}: {str(e)[:400]}",
                      flush=True)
                continue
            bad = bad_collectives(hlo, ndev)
            check(tag, v, g, "sum", f"big collectives {bad[:2]}" if bad else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
