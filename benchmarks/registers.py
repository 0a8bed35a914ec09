"""Registers a thread and spilled bytes of the launch plans' key compiles, loaded on the GPU with
its own Triton (counts differ between Triton versions: read them where the kernels run).

    source .whl/gpu-env.sh && python -m benchmarks.registers > $OUT/registers.txt

A 1024-thread row program gets two programs per SM only at <= 32 registers a thread; the kept
tiles (launch.KEEP_VOCAB) cost 8-16 registers each and spill with a softcap. H100 result:
benchmarks/results/registers_h100_triton36.txt.
"""
import itertools
from unittest import mock

import triton

from jax_fusedloss.kernels import cross_entropy as ce
from jax_fusedloss.kernels import kd, launch
from tests.sm90_compile import compile_sm90
from tests.sm90_plans import _specs

KEYS = ("KEEP", "PREFETCH", "ALIGN", "HAS_SOFTCAP", "WALK_GATHER", "DISTILL", "CE_STATS",
        "KD_STATS")


def show(tag, kern, sig, cx, w, maxnreg=None):
    c = compile_sm90(kern, sig, cx, w, maxnreg)
    c._init_handles()  # loads the module: n_regs and n_spills come from the driver
    print(tag, kern.__name__, {k: cx[k] for k in KEYS if k in cx}, "regs", c.n_regs,
          "spills", c.n_spills, flush=True)


def main():
    print("triton", triton.__version__)
    ce_types = dict(y="*i32", row_scale="*fp32")
    shapes = (("bf16", 128256), ("bf16", 151936), ("fp32", 50257), ("bf16", 256000),
              ("bf16", 50257), ("bf16", 32000))
    for (dt, v), sc in itertools.product(shapes, (None, 30.0)):
        for keep in ((0, 1, 2) if v in (128256, 151936) else (None,)):
            saved = launch.keep_tiles
            if keep is not None:
                launch.keep_tiles = lambda *_, k=keep: k
            try:
                plan = ce.ce_fwd_plan(8192, v, ignore_index=-100, smoothing=0.0, z_loss=0.0,
                                      softcap=sc, num_sms=132, write_grad=True,
                                      itemsize=2 if dt == "bf16" else 4)
            finally:
                launch.keep_tiles = saved
            for spec in _specs(plan, dt, ce_types):
                show(f"ce {dt} V={v} softcap={sc}", *spec)
    types = dict(ids="*i32", lp="*fp32", y="*i32", row_scale="*fp32")
    for v, distill, t in itertools.product((128256, 50257, 50256), (False, True), (1.0, 2.0)):
        plan = kd.kd_fwd_plan(8192, v, 64, temperature=t, normalize="full", distill=distill,
                              ignore_index=-100, num_sms=132, write_grad=True, itemsize=2)
        for spec in _specs(plan, "bf16", types):
            if spec[0].__name__ == "kd_fwd_kernel":
                show(f"kd V={v} distill={distill} T={t}", *spec)
    # distill_loss T=2 with and without the power form (launch.kd_power forced)
    for v, power in itertools.product((32000, 50257, 128256), (False, True)):
        with mock.patch.object(launch, "kd_power", lambda *_, p=power: p):
            plan = kd.kd_fwd_plan(8192, v, 64, temperature=2.0, normalize="full", distill=True,
                                  ignore_index=-100, num_sms=132, write_grad=True, itemsize=2)
        for spec in _specs(plan, "bf16", types):
            if spec[0].__name__ == "kd_fwd_kernel":
                show(f"distill T=2 V={v} power={power}", *spec)


if __name__ == "__main__":
    main()
