"""Run as a script with 4 CPU devices (or on GPUs): linear_kd_loss / linear_distill_loss under
the sharding layouts of tests/multidevice_linear_check.py (tokens, vocabulary, both,
replicated; jit with Auto and Explicit axes; shard_map with vocab_axis), against the
single-device result, with the same checks (values, gradients, their shardings, no big
collective). The tail forms' vocabulary-parallel rows merge their tail sums with one O(N)
all-reduce.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multidevice_kd_check xla

`vp` instead of an implementation: kd_loss / distill_loss on logits sharded on the vocabulary
inside shard_map (vocab_axis) with implementation="triton" (the interpreter on CPUs, with
JFL_CHECK_INTERPRET=1), against float64 references of the naive formulas: the
vocabulary-parallel Triton rows (kd_partial_kernel's slice statistics, the O(N) and O(N*K)
merges, kd_bwd_kernel's slice gradient) over a grid of options (`vp_cases`), each checked to
have launched those kernels and to move nothing of the logits' size between devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JFL_CHECK_INTERPRET=1 \
        python -m tests.multidevice_kd_check vp
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedloss as jfl
from tests import multidevice_linear_check as base

K = 4
_BASE_INPUTS = base.inputs


def cases():
    """name -> (layout, with bias, loss(h, w, b, aux, impl, vocab_axis, reduction))."""

    def make(layout, fn, mode, per_token=False, **opts):
        def loss(h, w, b, a, impl, va, red):
            y, ids, lp, wt = a
            kw = dict(bias=b, weight_layout=layout, chunk_size=base.CHUNK, mode=mode,
                      implementation=impl, vocab_axis=va,
                      reduction="none" if per_token else red, **opts)
            out = (jfl.linear_kd_loss(h, w, ids, lp, weights=wt, **kw) if fn == "kd" else
                   jfl.linear_distill_loss(h, w, y, ids, lp, alpha=0.4, **kw))
            return jnp.sum(out * wt) if per_token else out
        return loss

    return {"dv_bias_kd_tail_fused": ("dv", True, make("dv", "kd", "fast", tail=True)),
            "vd_distill_jsd_lean": ("vd", False, make("vd", "distill", "lean", tail=True,
                                                      divergence="jsd", temperature=2.0)),
            "vd_bias_kd_tail_recompute": ("vd", True, make("vd", "kd", "fast", per_token=True,
                                                           tail=True)),
            "dv_distill_fused": ("dv", True, make("dv", "distill", "low_precision",
                                                  temperature=1.5))}


def inputs(layout: str):
    h, w, b, (y, _, _) = _BASE_INPUTS(layout)
    keys = jax.random.split(jax.random.key(7), 2)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(
        jax.random.normal(keys[0], (base.N, base.V)) * 3.0), K)
    wt = jax.random.uniform(keys[1], (base.N,), minval=-0.5, maxval=1.5)
    return h, w, b, (y, ids.astype(jnp.int32), lp, wt)


# ----------------------------------------------------------------- logits, vocabulary-parallel
VP_N, VP_V, VP_K = 8, 84, 6  # V: 42 columns a slice over 2 devices (ALIGN 2), 21 over 4 (ALIGN 1)


def vp_cases():
    """name -> (op, options, dtype, vocabulary shards, cotangent). The tokens are split
    over the devices left (4 CPU devices: a (2, 2) mesh for 2 vocabulary shards), except for
    a "mean" (global: a (1, shards) mesh); cases with more shards than devices are skipped.
    Cotangent "unit": the gradient written in the forward;
    "rows": per-token weights on a "none" loss (the saved gradient rescaled); "scale": the loss
    times 3 (float16: the gradient recomputed from the logits, kd_bwd_kernel alone)."""
    ce = dict(label_smoothing=0.1, z_loss=1e-3)
    return {
        "kd_full_T2_sum": ("kd", dict(temperature=2.0, reduction="sum"), "float32", 2, "unit"),
        "kd_full_mean_weights": ("kd", dict(reduction="mean", weights=True), "float32", 4,
                                 "unit"),
        "kd_topk_T1.5_none": ("kd", dict(normalize="topk", temperature=1.5, reduction="none"),
                              "float32", 2, "rows"),
        "kd_topk_mean": ("kd", dict(normalize="topk", reduction="mean"), "float32", 4, "unit"),
        "kd_full_fp16_recompute": ("kd", dict(temperature=0.7, reduction="sum"), "float16", 2,
                                   "scale"),
        "distill_T1_sum": ("distill", dict(alpha=0.5, reduction="sum"), "float32", 2, "unit"),
        "distill_T2_sq_mean_ce": ("distill", dict(alpha=0.3, temperature=2.0, reduction="mean",
                                                  temperature_squared=True, **ce),
                                  "float32", 4, "unit"),
        "distill_T2_power_none": ("distill", dict(alpha=0.6, temperature=2.0, reduction="none",
                                                  power=True), "bfloat16", 2, "rows"),
        "distill_topk_softcap_sum": ("distill", dict(alpha=0.4, normalize="topk",
                                                     temperature=1.5, logit_softcap=4.0,
                                                     reduction="sum", **ce), "float32", 2,
                                     "unit"),
        "distill_T1.5_fp16_recompute": ("distill", dict(alpha=0.5, temperature=1.5,
                                                        reduction="sum", **ce), "float16", 4,
                                        "scale"),
        # the LM-head forms on a vocabulary-parallel head (dW summed over the token shards)
        "linear_distill_T2_sum": ("linear_distill", dict(alpha=0.5, temperature=2.0,
                                                         reduction="sum", **ce), "float32", 2,
                                  "unit"),
        "linear_kd_topk_none": ("linear_kd", dict(normalize="topk", reduction="none"),
                                "float32", 2, "rows"),
    }


def vp_inputs():
    """Logits (std 2), teacher top-K entries spread over every slice with a repeated id (row
    0), one id listed K times (row 1), ids outside [0, V) (row 2), a zero-probability entry
    (row 3), masked entries and an all-masked row (row 4), labels with ignore_index (row 5),
    and labels and ids at the slices' edges."""
    keys = jax.random.split(jax.random.key(11), 6)
    x = jax.random.normal(keys[0], (VP_N, VP_V)) * 2.0
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(keys[1], (VP_N, VP_V)) * 2), VP_K)
    ids = ids.at[0, 1].set(ids[0, 0]).at[1].set(20).at[2, 0].set(VP_V + 3).at[2, 1].set(-5)
    ids = ids.at[6, :4].set(jnp.array([20, 21, 41, 42]))  # both sides of the slice edges
    lp = lp.at[3, 2].set(-jnp.inf)
    mask = jax.random.uniform(keys[2], (VP_N, VP_K)) > 0.25
    mask = mask.at[4].set(False).at[0, :2].set(True)
    labels = jax.random.randint(keys[3], (VP_N,), 0, VP_V)
    labels = labels.at[5].set(-100).at[6].set(41).at[7].set(42)
    weights = jax.random.uniform(keys[4], (VP_N,), minval=-0.5, maxval=1.5)
    cot = jax.random.uniform(keys[5], (VP_N,), minval=0.5, maxval=2.0)
    return x, ids.astype(jnp.int32), lp, mask, labels.astype(jnp.int32), weights, cot


def _vp_loss(op, opts, lib):
    """loss(primals, ids, lp, mask, labels, weights) of `lib` (jax_fusedloss or a reference):
    primals (logits,) or, for the "linear_" ops, (hidden, weight) of a "dv" LM head."""
    opts = {k: v for k, v in opts.items() if k not in ("power", "weights")}
    linear = op.startswith("linear_")

    def loss(primals, ids, lp, mask, y, wt, **kw):
        if linear and lib is jfl:
            kw = dict(kw, chunk_size=VP_N // 4)
            x, kd_fn, distill_fn = primals, lib.linear_kd_loss, lib.linear_distill_loss
        else:
            x = (primals[0] @ primals[1],) if linear else primals
            kd_fn, distill_fn = lib.kd_loss, lib.distill_loss
        if op.endswith("kd"):
            return kd_fn(*x, ids, lp, mask, weights=wt, **opts, **kw)
        return distill_fn(*x, y, ids, lp, mask, weights=wt, **opts, **kw)
    return loss


def _objective(out, cot, kind):
    if kind == "rows":
        return jnp.sum(out * cot.astype(out.dtype))
    return out * 3.0 if kind == "scale" else out


def _vp_primals(op, dtype):
    """(logits,) or (hidden [N, D], weight [D, V]) for the "linear_" ops, and their specs
    inside shard_map with tokens split over `rows`."""
    x = vp_inputs()[0].astype(dtype)
    if not op.startswith("linear_"):
        return (x,), lambda rows: (P(rows, "model"),)
    keys = jax.random.split(jax.random.key(12), 2)
    h = jax.random.normal(keys[0], (VP_N, 16)).astype(dtype)
    w = (jax.random.normal(keys[1], (16, VP_V)) * 0.5).astype(dtype)
    return (h, w), lambda rows: (P(rows, None), P(None, "model"))


def vp_main(only: str | None = None) -> int:
    from jax_fusedloss import _triton_jax
    from jax_fusedloss.kernels import launch
    from tests.multidevice_check import big_collectives
    from tests.reference import jax_ref, kd_tail_ref

    launched = []
    run_plan = _triton_jax.run_plan

    def recording(plan, results=None, **arrays):
        launched.extend(step.kernel.__name__ for step in plan.launches)
        return run_plan(plan, results, **arrays)

    _triton_jax.run_plan = recording
    power_vocab = dict(launch.KD_POWER_MIN_VOCAB)
    _, ids, lp, mask, labels, weights, cot = vp_inputs()
    failures = 0
    for name, (op, opts, dtype, shards, kind) in vp_cases().items():
        if only and name not in only.split(","):
            continue
        launch.KD_POWER_MIN_VOCAB = {2: 0, 4: 0} if opts.get("power") else power_vocab
        wt = weights if opts.get("weights") else None
        primals, primal_specs = _vp_primals(op, dtype)
        with jax_ref.x64():
            ref_v, ref_g = jax.value_and_grad(lambda p: jnp.sum(_objective(
                _vp_loss(op, opts, kd_tail_ref)(p, ids, lp, mask, labels,
                                                None if wt is None else wt.astype(jnp.float64)),
                cot.astype(jnp.float64), kind)))(tuple(a.astype(jnp.float64) for a in primals))
        ndev = len(jax.devices())
        if shards > ndev:
            print(f"SKIP vp {name}: {shards} vocabulary shards, {ndev} devices", flush=True)
            continue
        data = 1 if opts["reduction"] == "mean" else ndev // shards  # a "mean" is global
        mesh = jax.make_mesh((data, shards), ("data", "model"),
                             axis_types=(AxisType.Explicit,) * 2,
                             devices=jax.devices()[:data * shards])
        rows = "data" if data > 1 else None
        fused = _vp_loss(op, opts, jfl)
        aux = (ids, lp, mask, labels, weights if wt is not None else jnp.zeros((VP_N,)), cot)

        def body(*args):
            p, (ids, lp, mask, y, w, c) = args[:len(primals)], args[len(primals):]

            def f(p):
                out = fused(p, ids, lp, mask, y, w if wt is not None else None,
                            implementation="triton", vocab_axis="model")
                return jnp.sum(_objective(out, c, kind))
            v, g = jax.value_and_grad(f)(p)
            return (jax.lax.psum(v, "data") if rows else v), g

        in_specs = primal_specs(rows) + (P(rows),) * len(aux)
        launched.clear()
        try:
            sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                       out_specs=(P(), primal_specs(rows))))
            args = [jax.device_put(a, NamedSharding(mesh, sp))
                    for a, sp in zip(primals + aux, in_specs)]
            with jax.set_mesh(mesh):
                compiled = sm.lower(*args).compile()
                v, g = compiled(*args)
        except Exception as e:  # noqa: BLE001 - report and go on
            failures += 1
            print(f"FAIL vp {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        extra = ""
        want = {"kd_bwd_kernel"} | ({"kd_partial_kernel"} if "distill" in op or
                                    opts.get("normalize", "full") == "full" else set())
        if not want <= set(launched):
            extra += f"launched {sorted(set(launched))}, not {sorted(want)} "
        # the LM head's weight-slice gradient [D, V / shards] is all-reduced over the token
        # axis (data parallelism); at these sizes it outgrows a device's logits
        dw = (primals[1].shape[0], VP_V // shards) if op.startswith("linear_") else None
        big = big_collectives(compiled.as_text(), VP_N * VP_V // 4, (dw,) if rows else ())
        if big:
            extra += f"big collectives {big[:2]}"
        tol = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-3}[dtype]
        dv = abs(float(v) - float(ref_v))
        dg = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(r)).max())
                 / max(float(np.abs(np.asarray(r)).max()), 1e-30) for a, r in zip(g, ref_g))
        finite = all(np.isfinite(np.asarray(a, np.float64)).all() for a in g)
        ok = dv <= tol * max(1.0, abs(float(ref_v))) and dg <= tol and not extra and finite
        failures += not ok
        print(f"{'OK' if ok else 'FAIL'} vp {name} ({opts['reduction']}, {dtype}, {shards} "
              f"vocab shards, {kind}): |dv|={dv:.2e} |dg|/max={dg:.2e} {extra}", flush=True)
    launch.KD_POWER_MIN_VOCAB = power_vocab
    _triton_jax.run_plan = run_plan
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "vp":
        sys.exit(vp_main(sys.argv[2] if len(sys.argv) > 2 else None))
    base.cases, base.inputs = cases, inputs
    sys.exit(base.main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
