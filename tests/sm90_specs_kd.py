"""Top-K distillation kernels to compile for sm_90: (module, kernel, signature, constexprs, warps).

The launch parameters come from the real heuristics (row_config, kd_constexprs) at the
llama3 vocabulary, for every option combination a launch can produce: kd_loss "full" / "topk",
distill_loss at T = 1 (shared statistics) and T != 1; fused row path with and without the
gradient, split path (partials, merge, backward); K = 1, 64 and 128.
"""
from jax_fusedloss.kernels.kd import bwd_constexprs, kd_constexprs, needs_vocab_pass
from jax_fusedloss.kernels.launch import merge_block, row_config

M = "jax_fusedloss.kernels.kd"
V = 128256
OPTIONS = [("full", False, 2.0), ("topk", False, 1.0), ("full", True, 1.0), ("full", True, 2.0),
           ("topk", True, 2.0)]
SPECS = []


def _fwd_sig(dt):
    return dict(logits_ptr=f"*{dt}", ids_ptr="*i32", logprobs_ptr="*fp32", labels_ptr="*i32",
                row_scale_ptr="*fp32", part_ptr="*fp32", V="i32", K="i32", stride_row="i32",
                inv_temp="fp32", ignore_index="i32", loss_ptr="*fp32", stats_ptr="*fp32",
                grad_ptr=f"*{dt}")


for dt, itemsize in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
    for normalize, distill, temperature in OPTIONS:
        flags = kd_constexprs(normalize, distill, temperature, 64)
        for write_grad in (True, False):
            rows = row_config(8192, V, itemsize, 132, write_grad)
            SPECS.append((M, "kd_fwd_kernel", _fwd_sig(dt), dict(
                BLOCK_V=rows.block_v, NUM_SPLITS=1, BLOCK_S=2, FROM_PARTS=False,
                WRITE_GRAD=write_grad, ALIGN=rows.align, **flags), rows.num_warps))
        split = row_config(8, V, itemsize, 132, True)
        assert split.num_splits > 1
        if needs_vocab_pass(flags):
            SPECS.append((M, "kd_partial_kernel", dict(
                logits_ptr=f"*{dt}", V="i32", stride_row="i32", inv_temp="fp32",
                part_ptr="*fp32"),
                dict(SPLIT_V=split.split_v, BLOCK_V=split.block_v, ALIGN=1,
                     CE_STATS=flags["DISTILL"], KD_STATS=flags["KD_STATS"]), split.num_warps))
        SPECS.append((M, "kd_fwd_kernel", _fwd_sig(dt), dict(
            BLOCK_V=split.block_v, NUM_SPLITS=split.num_splits,
            BLOCK_S=merge_block(split.num_splits),
            FROM_PARTS=needs_vocab_pass(flags), WRITE_GRAD=False, ALIGN=8, **flags), 4))
        SPECS.append((M, "kd_bwd_kernel", dict(
            logits_ptr=f"*{dt}", ids_ptr="*i32", logprobs_ptr="*fp32", labels_ptr="*i32",
            stats_ptr="*fp32", V="i32", K="i32", stride_row="i32", inv_temp="fp32",
            ignore_index="i32", grad_ptr=f"*{dt}"),
            dict(SPLIT_V=split.split_v, BLOCK_V=split.block_v, ALIGN=split.align,
                 **bwd_constexprs(flags)), split.num_warps))
for k in (1, 128):
    rows = row_config(8192, V, 2, 132, True)
    SPECS.append((M, "kd_fwd_kernel", _fwd_sig("bf16"), dict(
        BLOCK_V=rows.block_v, NUM_SPLITS=1, BLOCK_S=2, FROM_PARTS=False, WRITE_GRAD=True,
        ALIGN=rows.align, **kd_constexprs("full", True, 2.0, k)), rows.num_warps))
