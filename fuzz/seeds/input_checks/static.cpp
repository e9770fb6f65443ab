
AOTI_NOINLINE static void check_input_0(
    AtenTensorHandle* input_handles
) {
    ConstantHandle arg4_1 = ConstantHandle(input_handles[0]);
    int32_t arg4_1_expected_dtype = aoti_torch_dtype_float32();
    if (arg4_1_expected_dtype != arg4_1_dtype) {
        throw std::runtime_error(std::move(ss).str());
    }
    auto arg4_1_size = arg4_1.sizes();
    if (4 != arg4_1_size[0]) {
        ss << "input_handles[0]: unmatched dim value at 0, "
    }
    if (16 != arg4_1_size[1]) {
    }
    auto arg4_1_stride = arg4_1.strides();
    if (16 != arg4_1_stride[0]) {
    }
    if (1 != arg4_1_stride[1]) {
    }
}

AOTI_NOINLINE static void check_input_1(
    AtenTensorHandle* input_handles
) {
    int32_t arg5_1_expected_dtype = aoti_torch_dtype_int64();
    if (arg5_1_size[0] < 2) {
    }
    if (arg5_1_size[0] > 16) {
    }
    if (32 != arg5_1_size[1]) {
    }
    if (1 != arg5_1_stride[2]) {
    }
}

static bool _check_aoti_runtime_check_inputs_env() {
    if (4 != other_size[9]) {}
}
