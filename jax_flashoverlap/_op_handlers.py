"""The CUDA handler of each op, as the extension registers it: a leaf, so
that both the lowering (_primitives) and the policy that asks whether the
extension has an op (dispatch) can read it."""

FFI_TARGETS = {
    "all_gather_matmul": "jfo_all_gather_matmul",
    "matmul_reduce_scatter": "jfo_matmul_reduce_scatter",
    "matmul_all_reduce": "jfo_matmul_all_reduce",
    "all_reduce": "jfo_all_reduce",
}
