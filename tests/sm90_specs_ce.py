"""Cross-entropy kernels to compile for sm_90: (module, kernel, signature, constexprs, warps)."""
M = "jax_fusedloss.kernels.cross_entropy"
SPECS = []
for dt, block, warps in (("bf16", 16384, 32), ("fp16", 4096, 8), ("fp32", 16384, 32)):
    for flags in (dict(HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_ZLOSS=False),
                  dict(HAS_SOFTCAP=True, HAS_SMOOTHING=True, HAS_ZLOSS=True)):
        SPECS.append((M, "ce_fwd_kernel", dict(
            logits_ptr=f"*{dt}", labels_ptr="*i32", row_scale_ptr="*fp32", V="i32",
            stride_row="i32", ignore_index="i32", smoothing="fp32", z_loss="fp32",
            softcap="fp32", loss_ptr="*fp32", lse_ptr="*fp32", coef_ptr="*fp32",
            grad_ptr=f"*{dt}"), dict(BLOCK_V=block, WRITE_GRAD=True, ALIGN=16, **flags), warps))
    SPECS.append((M, "ce_partial_kernel", dict(
        logits_ptr=f"*{dt}", labels_ptr="*i32", V="i32", stride_row="i32", softcap="fp32",
        part_ptr="*fp32"), dict(SPLIT_V=4 * block, BLOCK_V=block, HAS_SOFTCAP=True,
                                HAS_SMOOTHING=True, ALIGN=1), warps))
    SPECS.append((M, "ce_bwd_kernel", dict(
        logits_ptr=f"*{dt}", labels_ptr="*i32", lse_ptr="*fp32", coef_ptr="*fp32", V="i32",
        stride_row="i32", softcap="fp32", grad_ptr=f"*{dt}"),
        dict(SPLIT_V=4 * block, BLOCK_V=block, HAS_SOFTCAP=True, ALIGN=8), warps))
    SPECS.append((M, "scale_rows_kernel", dict(
        grad_in_ptr=f"*{dt}", cot_ptr="*fp32", V="i32", grad_out_ptr=f"*{dt}"),
        dict(BLOCK_V=block, ALIGN=16), 8))
SPECS.append((M, "ce_merge_kernel", dict(
    part_ptr="*fp32", labels_ptr="*i32", row_scale_ptr="*fp32", V="i32", ignore_index="i32",
    smoothing="fp32", z_loss="fp32", loss_ptr="*fp32", lse_ptr="*fp32", coef_ptr="*fp32"),
    dict(NUM_SPLITS=5, BLOCK_S=8, HAS_SMOOTHING=True, HAS_ZLOSS=True), 1))
