"""Reduction kernels to compile for sm_90: (module, kernel, signature, constexprs, warps)."""
M = "jax_fusedloss.kernels.reductions"
FLAGS = [dict(HAS_ENTROPY=False, HAS_LABEL=False), dict(HAS_ENTROPY=True, HAS_LABEL=False),
         dict(HAS_ENTROPY=False, HAS_LABEL=True), dict(HAS_ENTROPY=True, HAS_LABEL=True)]
SPECS = []
# As launched (kernels/launch.py): forward 4096-element tiles and 8 warps; the backward, which
# writes a gradient, 16384-element tiles and 32 warps. ALIGN 16 (e.g. V=128256), 8 and 1.
for dt in ("bf16", "fp16", "fp32"):
    for flags in FLAGS:
        for finish, align in ((True, 16), (False, 1)):
            SPECS.append((M, "red_fwd_kernel", dict(
                logits_ptr=f"*{dt}", labels_ptr="*i32", V="i32", stride_row="i32",
                inv_temp="fp32", part_ptr="*fp32", lse_ptr="*fp32", ent_ptr="*fp32",
                logp_ptr="*fp32"), dict(SPLIT_V=(1 if finish else 4) * 4096, BLOCK_V=4096,
                                        FINISH=finish, ALIGN=align, **flags), 8))
        SPECS.append((M, "red_bwd_kernel", dict(
            logits_ptr=f"*{dt}", labels_ptr="*i32", lse_ptr="*fp32", ent_ptr="*fp32",
            cot_ptr="*fp32", V="i32", stride_row="i32", inv_temp="fp32", grad_ptr=f"*{dt}"),
            dict(SPLIT_V=2 * 16384, BLOCK_V=16384, ALIGN=8, **flags), 32))
for flags in FLAGS:
    SPECS.append((M, "red_merge_kernel", dict(
        part_ptr="*fp32", labels_ptr="*i32", V="i32", lse_ptr="*fp32", ent_ptr="*fp32",
        logp_ptr="*fp32"), dict(NUM_SPLITS=17, BLOCK_S=32, **flags), 1))
# V == 1 (and so stride_row == 1): Triton specialises integer arguments equal to 1 as constexpr.
ALL = dict(HAS_ENTROPY=True, HAS_LABEL=True)
SPECS.append((M, "red_fwd_kernel", dict(
    logits_ptr="*bf16", labels_ptr="*i32", inv_temp="fp32", part_ptr="*fp32", lse_ptr="*fp32",
    ent_ptr="*fp32", logp_ptr="*fp32"), dict(V=1, stride_row=1, SPLIT_V=16, BLOCK_V=16,
                                             FINISH=True, ALIGN=1, **ALL), 4))
SPECS.append((M, "red_bwd_kernel", dict(
    logits_ptr="*bf16", labels_ptr="*i32", lse_ptr="*fp32", ent_ptr="*fp32", cot_ptr="*fp32",
    inv_temp="fp32", grad_ptr="*bf16"), dict(V=1, stride_row=1, SPLIT_V=16, BLOCK_V=16, ALIGN=1,
                                             **ALL), 4))
# temperature 1: jax-triton passes a float scalar equal to 1 as the constexpr 1 as well.
for finish in (True, False):
    SPECS.append((M, "red_fwd_kernel", dict(
        logits_ptr="*bf16", labels_ptr="*i32", V="i32", stride_row="i32", part_ptr="*fp32",
        lse_ptr="*fp32", ent_ptr="*fp32", logp_ptr="*fp32"),
        dict(inv_temp=1, SPLIT_V=8192, BLOCK_V=4096, FINISH=finish, ALIGN=16, **ALL), 8))
SPECS.append((M, "red_bwd_kernel", dict(
    logits_ptr="*bf16", labels_ptr="*i32", lse_ptr="*fp32", ent_ptr="*fp32", cot_ptr="*fp32",
    V="i32", stride_row="i32", grad_ptr="*bf16"),
    dict(inv_temp=1, SPLIT_V=16384, BLOCK_V=16384, ALIGN=16, **ALL), 32))
