// ds4::qgemv's CPU kernel in C++ for the compiled step (backends/cpu/step_kernel.py, docs/cpu.md "The compiled step,
// session 15"): the same pool_rows call as kernels.qgemv_op (the rows split in the same chunks, so the same bits), with
// no Python between the step's C++ wrapper and the kernel library. The library's pool_rows and qgemv are found at
// setup; the thread count is set before each step (ds4_qgemv_threads).
#include <ATen/ATen.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

typedef int (*pool_rows_fn)(void *kernel, int type, const uint8_t *w, int64_t expert_bytes, const int64_t *experts,
                            int64_t N, int64_t K, const void *x, int64_t M, float *y, int64_t ldy, int64_t parts,
                            int threads);

static pool_rows_fn pool_rows = nullptr;
static void *qgemv_kernel = nullptr;
static int64_t chunks_per_thread = 4, split_bytes = 1 << 20;
static const char *const *type_names = nullptr;   // by GGUF type number, for errors (kernels.type_name)
static int64_t n_type_names = 0;

extern "C" {
int ds4_qgemv_threads = 1;

// The kernel library at `path` (already loaded by the process), kernels.py's chunking and the type names (`names`,
// kept by the caller); 0, or -1 if not found.
int ds4_qgemv_setup(const char *path, int64_t chunks, int64_t split, const char *const *names, int64_t n_names) {
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!library) return -1;
    pool_rows = (pool_rows_fn)dlsym(library, "pool_rows");
    qgemv_kernel = dlsym(library, "qgemv");
    chunks_per_thread = chunks;
    split_bytes = split;
    type_names = names;
    n_type_names = n_names;
    return pool_rows && qgemv_kernel ? 0 : -1;
}
}

static at::Tensor qgemv(const at::Tensor &x_in, const at::Tensor &data_in, int64_t type, int64_t n,
                        const std::optional<at::Tensor> &experts) {
    TORCH_CHECK(pool_rows, "qgemv: the kernel library is not set up (ds4_qgemv_setup)");
    at::Tensor x = x_in.to(at::kFloat).contiguous(), data = data_in.contiguous(), ids;
    int64_t M = x.size(0), K = x.size(1), expert_bytes = experts ? data[0].numel() : 0;
    if (experts) ids = experts->to(at::kLong).contiguous();
    at::Tensor y = at::empty({M, n}, x.options());
    int64_t weight_bytes = experts ? expert_bytes : data.numel();
    int64_t parts = std::min<int64_t>(chunks_per_thread * ds4_qgemv_threads, weight_bytes / split_bytes);
    int rc = pool_rows(qgemv_kernel, (int)type, data.data_ptr<uint8_t>(), expert_bytes,
                       experts ? ids.data_ptr<int64_t>() : nullptr, n, K, x.data_ptr<float>(), M, y.data_ptr<float>(),
                       n, parts, ds4_qgemv_threads);
    TORCH_CHECK(rc != -2, "qgemv: no memory for the group sums of ", M, " rows of ", K, " values");
    const char *name = type >= 0 && type < n_type_names && type_names[type] ? type_names[type] : nullptr;
    TORCH_CHECK_VALUE(rc == 0, "qgemv: unsupported call (", name ? name : std::to_string(type), ", M=", M, ")");
    return y;
}

TORCH_LIBRARY_IMPL(ds4, CPU, m) { m.impl("qgemv", qgemv); }
