"""GPU A/B: tiles of a row kept in registers between the fused statistics walk and the gradient
pass of kd_loss / distill_loss (kernels/kd.kd_fwd_kernel's KEEP; launch.KD_KEEP_VOCAB has the
result).

    source .whl/gpu-env.sh && python3 -m benchmarks.keep_ab > $OUT/kd_keep.txt
    source .whl/gpu-env.sh && python3 -m benchmarks.keep_ab --gather > $OUT/kd_gather.txt
    source .whl/gpu-env.sh && python3 -m benchmarks.keep_ab --power > $OUT/kd_power.txt

torch_ref's fused forward + gradient (kd_fwd_kernel, then kd_ids_kernel), N=8192, K=64, bf16,
with KEEP forced to 0, 1 and 2 (whatever launch.kd_keep_tiles says), two rounds in
alternation; the copy of the logits as the floor (read once, write the gradient once). Every
variant's loss and gradient are compared with KEEP=0's (bit-identical expected). The
cross-entropy kernel's own A/B is `benchmarks.ce_instructions --keep`. `--gather`: the walk's
gather of the logits at the teacher ids (launch.kd_walk_gathers) on and off. `--power`:
distill_loss at integer T with the cross-entropy's exp(z - m) taken as the T-th power of the
KD term's exp((z - m) / T) (launch.kd_power forced) or from its own exp, the power form with
KEEP 0 / 1 / 2 (not bit-identical: the largest differences to the first variant are printed).
"""
import torch
from triton.testing import do_bench

CASES = (("kd_loss", 128256, 1.0), ("distill_loss", 128256, 1.0), ("distill_loss", 128256, 2.0),
         ("kd_loss", 151936, 1.0), ("distill_loss", 151936, 1.0), ("kd_loss", 50257, 1.0),
         ("kd_loss", 32000, 1.0))


def _inputs(v, n=8192, k=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(v)
    x = torch.randn(n, v, device="cuda", dtype=dtype, generator=g) * 2
    t = torch.randn(n, v, device="cuda", generator=g)
    lp, ids = torch.topk(torch.log_softmax(t[:, :], -1), k, dim=-1)
    del t
    y = torch.randint(0, v, (n,), device="cuda", dtype=torch.int32, generator=g)
    return x, ids.to(torch.int32).contiguous(), lp.contiguous(), y


def _fused(x, ids, lp, y, op, temperature, keep=None, walk_gather=None, power=None):
    """A call of torch_ref's fused forward + gradient with KEEP (launch.kd_keep_tiles
    replaced), the walk's gather at the ids (launch.kd_walk_gathers) and/or the power form
    of distill_loss's two softmaxes (kd.POWER_TEMPERATURES) forced; the plan is built per
    call, under the patches."""
    from jax_fusedloss.kernels import launch
    from torch_ref.kd import _rows

    scale = torch.ones(x.shape[0], 2, device="cuda", dtype=torch.float32)

    def fn():
        saved = launch.kd_keep_tiles, launch.kd_walk_gathers, launch.kd_power
        if keep is not None:
            launch.kd_keep_tiles = lambda *_: keep
        if walk_gather is not None:
            launch.kd_walk_gathers = lambda *_: walk_gather
        if power is not None:
            launch.kd_power = lambda *_: power
        try:
            return _rows(x, ids, lp, y, scale, temperature, "full", op == "distill_loss", -100,
                         True)
        finally:
            launch.kd_keep_tiles, launch.kd_walk_gathers, launch.kd_power = saved
    return fn


def _ab(cases, variants):
    """Each case's variants ({label: kwargs of _fused}) timed twice in alternation against the
    first one's outputs."""
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for op, v, temperature, *dtype in cases:
        dtype = dtype[0] if dtype else torch.bfloat16
        x, ids, lp, y = _inputs(v, dtype=dtype)
        copy = do_bench(x.clone, rep=200)
        fns = {label: _fused(x, ids, lp, y, op, temperature, **kw)
               for label, kw in variants.items()}
        ref_loss, ref_g = next(iter(fns.values()))()
        print(f"{op} T={temperature} V={v} {dtype}: copy {copy:.3f} ms", flush=True)
        for rep in range(2):
            for label, fn in fns.items():
                loss, g = fn()
                same = torch.equal(loss, ref_loss) and torch.equal(g, ref_g)
                diff = ""
                if not same:
                    dl = ((loss - ref_loss).abs() / ref_loss.abs().clamp_min(1e-6)).max()
                    dg = (g.float() - ref_g.float()).abs().max() / ref_g.float().abs().max()
                    diff = f" (loss rel {dl.item():.2e}, grad max abs / max {dg.item():.2e})"
                t = do_bench(fn, rep=300)
                print(f"  {label} rep={rep}: {t:.3f} ms ({t / copy:.3f}x copy) "
                      f"identical to the first: {same}{diff}", flush=True)
        del x, ids, lp, y, fns, ref_loss, ref_g
        torch.cuda.empty_cache()


def main():
    import sys

    if "--gather" in sys.argv:  # where the row walk should gather at the ids for kd_ids_kernel
        cases = tuple(("kd_loss", v, 1.0) for v in (50257, 50256, 32000, 65536, 128256))
        return _ab(cases + (("distill_loss", 50257, 1.0),),
                   {"walk gathers": dict(walk_gather=True),
                    "ids kernel gathers": dict(walk_gather=False)})
    if "--power" in sys.argv:  # distill_loss's softmaxes at integer T from one exp
        cases = tuple(("distill_loss", v, t) for v, t in ((128256, 2.0), (151936, 2.0),
                                                          (50257, 2.0), (32000, 2.0),
                                                          (65536, 2.0), (100000, 2.0),
                                                          (128256, 4.0)))
        cases += (("distill_loss", 128256, 2.0, torch.float32),
                  ("distill_loss", 50257, 2.0, torch.float32))
        variants = {"two exps keep=0": dict(power=False, keep=0)}
        variants.update({f"power keep={k}": dict(power=True, keep=k) for k in (0, 1, 2)})
        return _ab(cases, variants)
    _ab(CASES, {f"keep={k}": dict(keep=k) for k in (0, 1, 2)})


if __name__ == "__main__":
    main()
