"""Run as a script with N CPU devices (or on GPUs): every op under every sharding layout, against
the single-device result. Prints one line per case, `OK ...` or `FAIL ...`; exits 1 on a FAIL.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multidevice_check xla

Layouts: tokens sharded, vocabulary sharded, both (2-D mesh), replicated; under jax.jit with
NamedSharding (Auto axes and Explicit axes) and inside jax.shard_map (with vocab_axis).
Checks: loss and gradient equal the single-device ones, the gradient keeps the logits'
sharding, and the compiled HLO moves nothing of the logits' size between devices.
"""
from __future__ import annotations

import os
import re
import sys

if os.environ.get("JFL_CHECK_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fusedloss as jfl  # noqa: E402

# JFL_CHECK_ODD=1: V=97, which no vocabulary mesh axis divides (the op then gathers the
# vocabulary axis: correct values and gradients, logits-sized collectives expected), and all
# labels of the first token shard ignored.
ODD = os.environ.get("JFL_CHECK_ODD") == "1"
_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}=]*\})?)\s+(all-gather|all-to-all|"
                         r"collective-permute|all-reduce|reduce-scatter)(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collectives(hlo: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]], str]]:
    """(op, [(dtype, dims) of each array it produces], text) of every collective in HLO text:
    synchronous, or the -start of an async pair (XLA:GPU's form; its -done repeats the
    shapes), with one result or a tuple of them (combined collectives: every operand of a
    tuple all-reduce is reduced). The tuple of an async all-gather / permute / all-to-all
    start holds its operands and context words too: the largest array stands for it."""
    out = []
    for m in _COLLECTIVE.finditer(hlo):
        arrays = [(t, tuple(int(d) for d in dims.split(",") if d))
                  for t, dims in _ARRAY.findall(m.group(1))]
        if m.group(3) and m.group(2) != "all-reduce" and arrays:
            arrays = [max(arrays, key=lambda a: int(np.prod(a[1])))]
        out.append((m.group(2), arrays, m.group(0)[:120]))
    return out


def ops(n: int, vocab: int, k: int, dtype):
    """name -> (loss(x, aux, impl, vocab_axis, reduction), aux arrays laid out by rows)."""
    keys = jax.random.split(jax.random.key(7), 6)
    labels = jax.random.randint(keys[0], (n,), 0, vocab)
    labels = labels.at[1].set(-100).at[n // 2].set(vocab - 1).at[n // 2 + 1].set(0)
    if ODD:  # every label of the first token shard ignored
        labels = labels.at[: n // 2].set(-100)
    w = jax.random.normal(keys[1], (n,))
    w2 = jax.random.normal(keys[2], (n,))
    teacher = jax.random.normal(keys[3], (n, vocab)) * 2
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(teacher), k)
    lp = lp.astype(jnp.float32)

    def red(v, red_):
        return jnp.sum(v) if red_ == "sum" else jnp.mean(v)

    table = {
        "cross_entropy": (lambda x, a, impl, va, r: jfl.cross_entropy(
            x, a[0], reduction=r, label_smoothing=0.1, z_loss=1e-3, implementation=impl,
            vocab_axis=va), (labels,)),
        "cross_entropy_softcap_none": (lambda x, a, impl, va, r: jnp.sum(jfl.cross_entropy(
            x, a[0], reduction="none", logit_softcap=5.0, implementation=impl,
            vocab_axis=va) * a[1]), (labels, w)),
        "logsumexp": (lambda x, a, impl, va, r: red(jfl.logsumexp(
            x, temperature=0.7, implementation=impl, vocab_axis=va) * a[0], r), (w,)),
        "entropy": (lambda x, a, impl, va, r: red(jfl.entropy(
            x, implementation=impl, vocab_axis=va) * a[0], r), (w,)),
        "token_logprobs": (lambda x, a, impl, va, r: red(_logp_and_entropy(
            x, a, impl, va), r), (jnp.maximum(labels, 0), w, w2)),
        "kd_loss_full": (lambda x, a, impl, va, r: jfl.kd_loss(
            x, a[0], a[1], temperature=2.0, reduction="sum", implementation=impl,
            vocab_axis=va), (ids, lp)),
        "kd_loss_topk": (lambda x, a, impl, va, r: jfl.kd_loss(
            x, a[0], a[1], normalize="topk", reduction="sum", implementation=impl,
            vocab_axis=va), (ids, lp)),
        "distill_loss": (lambda x, a, impl, va, r: jfl.distill_loss(
            x, a[2], a[0], a[1], alpha=0.3, temperature=1.5, reduction="sum",
            label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0, implementation=impl,
            vocab_axis=va), (ids, lp, labels)),
    }
    return table


def _logp_and_entropy(x, a, impl, vocab_axis):
    logp, ent = jfl.token_logprobs(x, a[0], return_entropy=True, implementation=impl,
                                   vocab_axis=vocab_axis)
    return logp * a[1] + ent * a[2]


def row_spec(spec, a) -> P:
    """The spec of a row array laid out like the logits' token axis."""
    return P(spec[0], *([None] * (a.ndim - 1)))


def leftover_sharding_calls(hlo: str) -> int:
    """Shardy `Sharding` custom calls left in a compiled (per-device) program: no backend
    implements them (jax 0.11.2 traced custom-partitioned bodies with Explicit axes into them:
    XLA:CPU refused to compile, XLA:GPU aborted; _sharding.auto_mesh)."""
    return hlo.count('custom_call_target="Sharding"')


def big_collectives(hlo: str, limit: int, allow: tuple = ()) -> list[str]:
    """Collectives in compiled HLO with an array of at least `limit` elements, arrays of the
    shapes in `allow` (expected ones: a weight gradient's reduction) aside."""
    return [text for _, arrays, text in collectives(hlo)
            if any(int(np.prod(dims)) >= limit and dims not in allow for _, dims in arrays)]


def main(impl: str, only: str | None = None) -> int:
    n_dev = len(jax.devices())
    model = 2 if n_dev >= 2 else 1
    data = n_dev // model
    n, vocab, k = 16, 97 if ODD else 96, 5
    if os.environ.get("JFL_CHECK_BIG") == "1":
        n, vocab, k = 4096, 128256, 16
    dtype = jnp.bfloat16 if os.environ.get("JFL_CHECK_BIG") == "1" else jnp.float32
    x = (jax.random.normal(jax.random.key(0), (n, vocab)) * 2).astype(dtype)
    failures = 0
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    for name, (loss, aux) in ops(n, vocab, k, dtype).items():
        if only and not any(o == name for o in only.split(",")):
            continue
        ref_v, ref_g = jax.jit(jax.value_and_grad(
            lambda x, *a: loss(x, a, impl, None, "mean")))(x, *aux)
        ref_g = np.asarray(ref_g, np.float32)
        scale = max(float(np.abs(ref_g).max()), 1e-30)

        def check(tag, v, g, extra=""):
            nonlocal failures
            dv = float(abs(float(v) - float(ref_v)))
            dg = float(np.abs(np.asarray(g, np.float32) - ref_g).max()) / scale
            ok = dv <= tol * max(1.0, abs(float(ref_v))) and dg <= tol * 10 and not extra
            failures += not ok
            print(f"{'OK' if ok else 'FAIL'} {name} {impl} {tag}: |dv|={dv:.2e} "
                  f"|dg|/max={dg:.2e} {extra}", flush=True)

        for axis_type in (AxisType.Auto,) if ODD else (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(axis_type,) * 2)
            for spec in (P("data", None), P(None, "model"), P("data", "model"), P(None, None)):
                aux_s = [jax.device_put(a, NamedSharding(mesh, row_spec(spec, a))) for a in aux]
                if ODD:  # JAX refuses an uneven NamedSharding for an array; inside jit XLA pads
                    xs = jax.device_put(x, NamedSharding(mesh, P(spec[0], None)))

                    def inner(x, *a, spec=spec, mesh=mesh):
                        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                        return loss(x, a, impl, None, "mean")
                else:
                    xs = jax.device_put(x, NamedSharding(mesh, spec))

                    def inner(x, *a):
                        return loss(x, a, impl, None, "mean")
                f = jax.jit(jax.value_and_grad(inner))
                try:  # one compile: the program that runs is the one whose HLO is checked
                    if axis_type == AxisType.Explicit:
                        with jax.set_mesh(mesh):
                            compiled = f.lower(xs, *aux_s).compile()
                            v, g = compiled(xs, *aux_s)
                    else:
                        compiled = f.lower(xs, *aux_s).compile()
                        v, g = compiled(xs, *aux_s)
                    hlo = compiled.as_text()
                except Exception as e:  # noqa: BLE001 - report and go on
                    failures += 1
                    print(f"FAIL {name} {impl} jit {axis_type.name} {spec}: "
                          f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                extra = ""
                if not g.sharding.is_equivalent_to(xs.sharding, 2):
                    extra += f"grad sharding {g.sharding.spec} != {spec} "
                big = big_collectives(hlo, n * vocab // (data * model))
                if big and not (ODD and spec[1]):
                    extra += f"big collectives {big[:2]}"
                if leftover_sharding_calls(hlo):
                    extra += f"{leftover_sharding_calls(hlo)} Sharding custom calls"
                check(f"jit {axis_type.name} {spec}", v, g, extra)
        mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        sm_layouts = () if ODD else ((P("data", None), None), (P("data", "model"), "model"),
                                     (P(None, "model"), "model"))
        sum_ref = None  # the unsharded "sum" result, once an op
        for spec, va in sm_layouts:
            aux_specs = tuple(row_spec(spec, a) for a in aux)

            def body(x, *a):
                v, g = jax.value_and_grad(lambda x: loss(x, a, impl, va, "sum"))(x)
                return (jax.lax.psum(v, "data") if spec[0] else v), g

            try:
                sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) + aux_specs,
                                           out_specs=(P(), spec)))
                put = [jax.device_put(a, NamedSharding(mesh, sp))
                       for a, sp in zip((x,) + tuple(aux), (spec,) + aux_specs)]
                with jax.set_mesh(mesh):
                    v, g = sm(*put)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAIL {name} {impl} shard_map {spec}: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                continue
            if sum_ref is None:
                sum_ref = jax.jit(jax.value_and_grad(
                    lambda x, *a: loss(x, a, impl, None, "sum")))(x, *aux)
            sum_v, sum_g = sum_ref
            dv = abs(float(v) - float(sum_v))
            gs = np.asarray(sum_g, np.float32)
            dg = float(np.abs(np.asarray(g, np.float32) - gs).max()) / max(
                float(np.abs(gs).max()), 1e-30)
            ok = dv <= tol * max(1.0, abs(float(sum_v))) and dg <= tol * 10
            failures += not ok
            print(f"{'OK' if ok else 'FAIL'} {name} {impl} shard_map {spec}: |dv|={dv:.2e} "
                  f"|dg|/max={dg:.2e}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
