// Calls libtcg_shim.so through torch's own shim.h, as a package's generated
// code does: the header's prototypes fix the argument types at every call
// site, so a signature of ours that differs from shim.h shows up as a wrong
// value here. Built and run by tests/header_abi.rs; links no libtorch.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdio>
#include <cstring>
#include <exception>

#define CHECK(x)                                                        \
  do {                                                                  \
    if (!(x)) {                                                         \
      std::fprintf(stderr, "FAILED line %d: %s\n", __LINE__, #x);       \
      return 1;                                                         \
    }                                                                   \
  } while (0)

int main() {
  CHECK(aoti_torch_dtype_float32() == 6);
  CHECK(aoti_torch_dtype_bfloat16() == 15);
  CHECK(aoti_torch_dtype_float8_e4m3fn() == 24);
  CHECK(aoti_torch_dtype_element_size(aoti_torch_dtype_complex128()) == 16);
  CHECK(aoti_torch_device_type_cpu() == 0 && aoti_torch_device_type_cuda() == 1);
  CHECK(aoti_torch_layout_strided() == 0);

  int64_t sizes[2] = {3, 4};
  int64_t strides[2] = {4, 1};
  AtenTensorHandle t = nullptr;
  CHECK(aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                 aoti_torch_device_type_cpu(), 0, &t) == AOTI_TORCH_SUCCESS);
  void* p = nullptr;
  CHECK(aoti_torch_get_data_ptr(t, &p) == AOTI_TORCH_SUCCESS);
  float* f = static_cast<float*>(p);
  for (int i = 0; i < 12; i++) f[i] = static_cast<float>(i);

  // A transposed view, its metadata, a clone and a strided copy.
  int64_t vs[2] = {4, 3};
  int64_t vst[2] = {1, 4};
  AtenTensorHandle v = nullptr;
  CHECK(aoti_torch__reinterpret_tensor(t, 2, vs, vst, 0, &v) == AOTI_TORCH_SUCCESS);
  int64_t n = 0;
  CHECK(aoti_torch_get_numel(v, &n) == AOTI_TORCH_SUCCESS && n == 12);
  CHECK(aoti_torch_get_dim(v, &n) == AOTI_TORCH_SUCCESS && n == 2);
  CHECK(aoti_torch_get_size(v, -1, &n) == AOTI_TORCH_SUCCESS && n == 3);
  CHECK(aoti_torch_get_stride(v, 1, &n) == AOTI_TORCH_SUCCESS && n == 4);
  CHECK(aoti_torch_get_storage_size(v, &n) == AOTI_TORCH_SUCCESS && n == 48);
  CHECK(aoti_torch_get_storage_numel(v, &n) == AOTI_TORCH_SUCCESS && n == 12);
  CHECK(aoti_torch_get_storage_offset(v, &n) == AOTI_TORCH_SUCCESS && n == 0);
  int64_t* arr = nullptr;
  CHECK(aoti_torch_get_sizes(v, &arr) == AOTI_TORCH_SUCCESS && arr[0] == 4 && arr[1] == 3);
  CHECK(aoti_torch_get_strides(v, &arr) == AOTI_TORCH_SUCCESS && arr[0] == 1 && arr[1] == 4);
  int32_t i32 = -5;
  CHECK(aoti_torch_get_dtype(v, &i32) == AOTI_TORCH_SUCCESS && i32 == 6);
  CHECK(aoti_torch_get_device_type(v, &i32) == AOTI_TORCH_SUCCESS && i32 == 0);
  CHECK(aoti_torch_get_device_index(v, &i32) == AOTI_TORCH_SUCCESS && i32 == 0);
  CHECK(aoti_torch_get_layout(v, &i32) == AOTI_TORCH_SUCCESS && i32 == 0);
  bool contiguous = true;
  CHECK(aoti_torch_is_contiguous(v, &contiguous) == AOTI_TORCH_SUCCESS && !contiguous);

  AtenTensorHandle c = nullptr;
  CHECK(aoti_torch_clone(v, &c) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_get_strides(c, &arr) == AOTI_TORCH_SUCCESS && arr[0] == 1 && arr[1] == 4);
  AtenTensorHandle d = nullptr;
  CHECK(aoti_torch_empty_strided(2, vs, nullptr, 6, 0, 0, &d) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_copy_(d, v, 0) == AOTI_TORCH_SUCCESS);
  float* dp = nullptr;
  CHECK(aoti_torch_get_data_ptr(d, reinterpret_cast<void**>(&dp)) == AOTI_TORCH_SUCCESS);
  CHECK(dp[0] == 0.0f && dp[1] == 4.0f && dp[2] == 8.0f && dp[3] == 1.0f && dp[11] == 11.0f);

  AtenTensorHandle alias = nullptr;
  CHECK(aoti_torch_new_tensor_handle(t, &alias) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_delete_tensor_object(t) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_get_data_ptr(alias, &p) == AOTI_TORCH_SUCCESS && static_cast<float*>(p)[5] == 5.0f);

  // Caller memory, with a storage offset; _v2 with the strided layout.
  float blob[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  int64_t bs[1] = {4};
  int64_t bst[1] = {1};
  AtenTensorHandle b = nullptr;
  CHECK(aoti_torch_create_tensor_from_blob(blob, 1, bs, bst, 2, 6, 0, 0, &b) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_get_data_ptr(b, &p) == AOTI_TORCH_SUCCESS && p == blob + 2);
  AtenTensorHandle b2 = nullptr;
  CHECK(aoti_torch_create_tensor_from_blob_v2(blob, 1, bs, bst, 0, 6, 1, 0, &b2,
                                              aoti_torch_layout_strided(), nullptr, 0) == AOTI_TORCH_SUCCESS);
  CHECK(aoti_torch_get_device_type(b2, &i32) == AOTI_TORCH_SUCCESS && i32 == 1);

  // Refusals come back as AOTI_TORCH_FAILURE.
  int64_t big[1] = {13};
  AtenTensorHandle out = nullptr;
  CHECK(aoti_torch__reinterpret_tensor(alias, 1, big, bst, 0, &out) == AOTI_TORCH_FAILURE && out == nullptr);
  CHECK(aoti_torch_get_numel(nullptr, &n) == AOTI_TORCH_FAILURE);
  CHECK(aoti_torch_delete_tensor_object(t) == AOTI_TORCH_FAILURE);

  CHECK(aoti_torch_grad_mode_is_enabled());
  aoti_torch_grad_mode_set_enabled(false);
  CHECK(!aoti_torch_grad_mode_is_enabled());

  for (AtenTensorHandle h : {v, c, d, alias, b, b2}) {
    CHECK(aoti_torch_delete_tensor_object(h) == AOTI_TORCH_SUCCESS);
  }

  // aoti_torch_check: a holding check returns; a failed one throws a C++
  // exception naming the message, the function and the line, which the
  // generated code's container catches (here: this try block). Through the
  // header's own macro, as generated kernels call it.
  aoti_torch_check(true, "f", "smoke.cpp", 1, "never");
  bool thrown = false;
  try {
    AOTI_TORCH_CHECK(n < 0, "index 7 is out of bounds");
  } catch (const std::exception& e) {
    thrown = std::strstr(e.what(), "index 7 is out of bounds") != nullptr &&
             std::strstr(e.what(), "main") != nullptr && std::strstr(e.what(), "smoke.cpp") != nullptr;
  }
  CHECK(thrown);
  thrown = false;
  try {
    aoti_torch_check(false, nullptr, nullptr, 0, nullptr);
  } catch (const std::exception& e) {
    thrown = std::strstr(e.what(), "check failed") != nullptr;
  }
  CHECK(thrown);
  std::printf("ok\n");
  return 0;
}
