// Runs a CPU AOTInductor package minted with link_libtorch=False against
// libtcg_shim.so alone: opens the model .so, creates its container, runs it
// three times on the input and compares every output with eager's, then
// checks that no libtorch is mapped in the process. Driven by
// tests/package_host.rs; prints "ok" last on success.
//
// usage: run_package MODEL_SO DATA_DIR
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

using Create = int32_t (*)(void**, size_t, const char*, const char*);
using Run = int32_t (*)(void*, AtenTensorHandle*, size_t, AtenTensorHandle*, size_t, void*, void*);
using Delete = int32_t (*)(void*);

static bool load(const std::string& path, std::vector<float>& v) {
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  return static_cast<bool>(f);
}

#define CHECK(x)                                                  \
  do {                                                            \
    if (!(x)) {                                                   \
      std::printf("FAILED line %d: %s\n", __LINE__, #x);          \
      return 1;                                                   \
    }                                                             \
  } while (0)

int main(int argc, char** argv) {
  CHECK(argc == 3);
  const std::string dir = argv[2];
  void* so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (so == nullptr) {
    std::printf("dlopen: %s\n", dlerror());
    return 1;
  }
  auto create = reinterpret_cast<Create>(dlsym(so, "AOTInductorModelContainerCreateWithDevice"));
  auto run = reinterpret_cast<Run>(dlsym(so, "AOTInductorModelContainerRun"));
  auto destroy = reinterpret_cast<Delete>(dlsym(so, "AOTInductorModelContainerDelete"));
  CHECK(create && run && destroy);
  void* container = nullptr;
  CHECK(create(&container, 1, "cpu", nullptr) == 0);

  // Expected logical shapes of the three outputs (sizes only; strides are
  // read from the handles, so a strided output is compared correctly).
  const int64_t shapes[3][2] = {{4, 16}, {16, 4}, {16, 4}};
  std::vector<float> x(64);
  CHECK(load(dir + "/x.bin", x));
  for (int iter = 0; iter < 3; iter++) {
    int64_t sz[2] = {4, 16};
    AtenTensorHandle in = nullptr;
    CHECK(aoti_torch_empty_strided(2, sz, nullptr, aoti_torch_dtype_float32(),
                                   aoti_torch_device_type_cpu(), 0, &in) == AOTI_TORCH_SUCCESS);
    void* p = nullptr;
    CHECK(aoti_torch_get_data_ptr(in, &p) == AOTI_TORCH_SUCCESS);
    std::memcpy(p, x.data(), 64 * 4);
    AtenTensorHandle outs[3] = {nullptr, nullptr, nullptr};
    CHECK(run(container, &in, 1, outs, 3, nullptr, nullptr) == 0);  // steals `in`
    for (int o = 0; o < 3; o++) {
      int64_t dim = 0;
      int64_t* s = nullptr;
      int64_t* t = nullptr;
      float* q = nullptr;
      CHECK(aoti_torch_get_dim(outs[o], &dim) == AOTI_TORCH_SUCCESS && dim == 2);
      CHECK(aoti_torch_get_sizes(outs[o], &s) == AOTI_TORCH_SUCCESS);
      CHECK(aoti_torch_get_strides(outs[o], &t) == AOTI_TORCH_SUCCESS);
      CHECK(s[0] == shapes[o][0] && s[1] == shapes[o][1]);
      CHECK(aoti_torch_get_data_ptr(outs[o], reinterpret_cast<void**>(&q)) == AOTI_TORCH_SUCCESS);
      std::vector<float> ref(64);
      CHECK(load(dir + "/out" + std::to_string(o) + ".bin", ref));
      double worst = 0;
      for (int64_t i = 0; i < s[0]; i++) {
        for (int64_t j = 0; j < s[1]; j++) {
          worst = std::fmax(worst, std::fabs(q[i * t[0] + j * t[1]] - ref[i * s[1] + j]));
        }
      }
      std::printf("run %d out%d strides [%ld, %ld] max_abs_diff %g\n", iter, o,
                  static_cast<long>(t[0]), static_cast<long>(t[1]), worst);
      CHECK(worst <= 1e-5);
      CHECK(aoti_torch_delete_tensor_object(outs[o]) == AOTI_TORCH_SUCCESS);
    }
  }
  CHECK(destroy(container) == 0);

  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    CHECK(line.find("libtorch") == std::string::npos && line.find("libc10") == std::string::npos);
  }
  std::printf("ok\n");
  return 0;
}
