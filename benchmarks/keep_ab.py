"""GPU A/B: tiles of a row kept in registers between the fused statistics walk and the gradient
pass of kd_loss / distill_loss (kernels/kd.kd_fwd_kernel's KEEP; launch.KD_KEEP_VOCAB has the
result).

    source .whl/gpu-env.sh && python3 -m benchmarks.keep_ab > $OUT/kd_keep.txt

torch_ref's fused forward + gradient (kd_fwd_kernel, then kd_ids_kernel), N=8192, K=64, bf16,
with KEEP forced to 0, 1 and 2 (whatever launch.kd_keep_tiles says), two rounds in
alternation; the copy of the logits as the floor (read once, write the gradient once). Every
variant's loss and gradient are compared with KEEP=0's (bit-identical expected). The
cross-entropy kernel's own A/B is `benchmarks.ce_instructions --keep`.
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


def _fused(x, ids, lp, y, op, temperature, keep):
    """A call of torch_ref's fused forward + gradient with KEEP forced (the plan is built per
    call, with kd_fwd_plan's kd_keep_tiles replaced)."""
    from jax_fusedloss.kernels import kd
    from torch_ref.kd import _rows

    scale = torch.ones(x.shape[0], 2, device="cuda", dtype=torch.float32)

    def fn():
        saved, kd.kd_keep_tiles = kd.kd_keep_tiles, lambda *_: keep
        try:
            return _rows(x, ids, lp, y, scale, temperature, "full", op == "distill_loss", -100,
                         True)
        finally:
            kd.kd_keep_tiles = saved
    return fn


def main():
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for op, v, temperature in CASES:
        x, ids, lp, y = _inputs(v)
        copy = do_bench(x.clone, rep=200)
        fns = {keep: _fused(x, ids, lp, y, op, temperature, keep) for keep in (0, 1, 2)}
        ref_loss, ref_g = fns[0]()
        print(f"{op} T={temperature} V={v}: copy {copy:.3f} ms", flush=True)
        for rep in range(2):
            for keep, fn in fns.items():
                loss, g = fn()
                same = torch.equal(loss, ref_loss) and torch.equal(g, ref_g)
                t = do_bench(fn, rep=300)
                print(f"  keep={keep} rep={rep}: {t:.3f} ms ({t / copy:.3f}x copy) "
                      f"identical to keep=0: {same}", flush=True)
        del x, ids, lp, y, fns, ref_loss, ref_g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
