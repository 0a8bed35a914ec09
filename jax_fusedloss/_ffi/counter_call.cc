// A typed-FFI launcher for Triton kernels that need a zero-initialised arrival counter.
//
// jax_fusedloss's one-launch split reductions merge a row's slice partials in the program that
// arrives last on a per-row counter. Through jaxlib's Triton call the counter is an XLA buffer
// that must be zero-filled before every launch: one more node in XLA's command buffer (~1.5 us
// on H100), more than the whole launch costs at one row. Here the counter lives in device
// memory owned by this library instead: one per (call site, CUDA context), carved from a zeroed
// slab, and returned to zero by the kernel itself (its last program stores 0 after
// the merge), so the next launch of that call site finds it at zero without any fill.
//
// Why that is safe: a call site is one custom call of one lowered program (an id drawn fresh
// at each lowering), and one device executes that program's launches in stream order, so two
// launches of one site never overlap on one device; a device-side fault leaves the CUDA
// context unusable, so a counter left non-zero by an aborted launch is never read again.
//
// Stages: "initialize" (outside command-buffer capture) loads the module for the stream's
// context and allocates the site's counter; "execute" (recorded into XLA's command buffers,
// kCmdBufferCompatible) only builds the parameter list and calls cuLaunchKernel. The CUDA
// driver is reached through dlopen, so building needs only a C++17 compiler and jaxlib's FFI
// headers (jax.ffi.include_dir()).
//
// Attributes (all set by jax_fusedloss/_counter_call.py):
//   site (i64)            unique id of the call site
//   name (string)         kernel symbol
//   image (bytes)         the kernel's cubin (Triton's ptxas), or its PTX for the driver to
//                         compile where ptxas was not at hand
//   num_warps, shared, grid_x, grid_y, grid_z (i64)
//   counter_words (i64)   int32 words of the counter
//   kinds, values (i64 arrays) one entry per kernel parameter, in order:
//     0 operand buffer values[i], 1 result buffer values[i], 2 the counter,
//     3 i32, 4 i64, 5 f32 (bits), 6 u32, 7 u64, 8 bool, 9 f64 (bits)
//   then Triton's two trailing pointers (global and profile scratch) are passed as null: the
//   kernels launched here use neither (the Python side refuses kernels that do).

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ------------------------------------------------------------------ the CUDA driver (dlopen)
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // NOLINT
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

constexpr int kFuncAttrMaxDynamicShared = 8;   // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kDevAttrSharedOptin = 97;        // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kCaptureActive = 1;              // CU_STREAM_CAPTURE_STATUS_ACTIVE

struct Driver {
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*CtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*StreamGetCtx)(CUstream, CUcontext*) = nullptr;
  CUresult (*StreamIsCapturing)(CUstream, int*) = nullptr;
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*MemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*MemsetD32)(CUdeviceptr, unsigned int, size_t) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, CUstream, void**, void**) = nullptr;
  std::string error;
};

template <typename F>
bool Load(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) error->assign(std::string("libcuda lacks ") + name);
  return *fn != nullptr;
}

const Driver& GetDriver() {
  static const Driver* driver = [] {
    auto* d = new Driver();
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d->error = "cannot dlopen libcuda.so.1";
      return d;
    }
    Load(lib, "cuGetErrorString", &d->GetErrorString, &d->error);
    Load(lib, "cuCtxGetCurrent", &d->CtxGetCurrent, &d->error);
    Load(lib, "cuCtxPushCurrent_v2", &d->CtxPushCurrent, &d->error);
    Load(lib, "cuCtxPopCurrent_v2", &d->CtxPopCurrent, &d->error);
    Load(lib, "cuCtxGetDevice", &d->CtxGetDevice, &d->error);
    Load(lib, "cuStreamGetCtx", &d->StreamGetCtx, &d->error);
    Load(lib, "cuStreamIsCapturing", &d->StreamIsCapturing, &d->error);
    Load(lib, "cuDeviceGetAttribute", &d->DeviceGetAttribute, &d->error);
    Load(lib, "cuModuleLoadData", &d->ModuleLoadData, &d->error);
    Load(lib, "cuModuleGetFunction", &d->ModuleGetFunction, &d->error);
    Load(lib, "cuFuncSetAttribute", &d->FuncSetAttribute, &d->error);
    Load(lib, "cuMemAlloc_v2", &d->MemAlloc, &d->error);
    Load(lib, "cuMemsetD32_v2", &d->MemsetD32, &d->error);
    Load(lib, "cuLaunchKernel", &d->LaunchKernel, &d->error);
    return d;
  }();
  return *driver;
}

ffi::Error CudaError(const Driver& cu, CUresult r, const char* what) {
  const char* msg = "unknown error";
  if (cu.GetErrorString != nullptr) cu.GetErrorString(r, &msg);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_fusedloss counter call: ") + what + ": " + msg);
}

#define JFL_CU(expr, what)                         \
  do {                                             \
    CUresult r_ = (expr);                          \
    if (r_ != 0) return CudaError(cu, r_, what);   \
  } while (0)

// The stream's context; inside graph capture cuStreamGetCtx is unreliable on some drivers,
// and the capturing thread has the stream's context current.
ffi::Error StreamContext(const Driver& cu, CUstream stream, CUcontext* ctx) {
  int capture = 0;
  JFL_CU(cu.StreamIsCapturing(stream, &capture), "cuStreamIsCapturing");
  if (capture == kCaptureActive) {
    JFL_CU(cu.CtxGetCurrent(ctx), "cuCtxGetCurrent");
  } else {
    JFL_CU(cu.StreamGetCtx(stream, ctx), "cuStreamGetCtx");
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ per-context resources
struct Site {
  CUfunction function = nullptr;
  CUdeviceptr counter = 0;
};

std::mutex& Mutex() {
  static auto* m = new std::mutex();
  return *m;
}

// (site id, context) -> function and counter; (kernel name, image hash, context) -> function.
std::map<std::pair<int64_t, CUcontext>, Site>& Sites() {
  static auto* sites = new std::map<std::pair<int64_t, CUcontext>, Site>();
  return *sites;
}

std::map<std::tuple<std::string, size_t, CUcontext>, CUfunction>& Functions() {
  static auto* fns = new std::map<std::tuple<std::string, size_t, CUcontext>, CUfunction>();
  return *fns;
}

// Counters are carved from zeroed slabs of device memory, one open slab per context: a site
// needs a few hundred bytes, and a device allocation of its own each would round up to the
// driver's allocation granularity for every call site of every compiled program.
constexpr size_t kSlabBytes = 1 << 16;
constexpr size_t kCounterAlign = 256;

struct Slab {
  CUdeviceptr base = 0;
  size_t size = 0, used = 0;
};

std::map<CUcontext, Slab>& Slabs() {
  static auto* slabs = new std::map<CUcontext, Slab>();
  return *slabs;
}

// `bytes` of zeros in the current context `ctx` (caller holds Mutex()); never freed, never
// handed out twice.
CUresult CarveCounter(const Driver& cu, CUcontext ctx, size_t bytes, CUdeviceptr* out) {
  bytes = (bytes + kCounterAlign - 1) / kCounterAlign * kCounterAlign;
  Slab& slab = Slabs()[ctx];
  if (slab.base == 0 || slab.used + bytes > slab.size) {
    Slab fresh;
    fresh.size = bytes > kSlabBytes ? bytes : kSlabBytes;
    CUresult r = cu.MemAlloc(&fresh.base, fresh.size);
    if (r == 0) r = cu.MemsetD32(fresh.base, 0, fresh.size / 4);  // synchronous: zero first
    if (r != 0) return r;
    slab = fresh;
  }
  *out = slab.base + slab.used;
  slab.used += bytes;
  return 0;
}

ffi::Error LoadFunction(const Driver& cu, CUcontext ctx, const std::string& name,
                        std::string_view image, int64_t shared, CUfunction* out) {
  auto key = std::make_tuple(name, std::hash<std::string_view>()(image), ctx);
  auto it = Functions().find(key);
  if (it != Functions().end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  std::string data(image);  // a cubin, or PTX (NUL-terminated by std::string)
  CUmodule module = nullptr;
  JFL_CU(cu.ModuleLoadData(&module, data.c_str()), "cuModuleLoadData");
  CUfunction fn = nullptr;
  JFL_CU(cu.ModuleGetFunction(&fn, module, name.c_str()), "cuModuleGetFunction");
  if (shared > 49152) {  // above the static limit: opt in to dynamic shared memory
    CUdevice device = 0;
    JFL_CU(cu.CtxGetDevice(&device), "cuCtxGetDevice");
    int optin = 0;
    JFL_CU(cu.DeviceGetAttribute(&optin, kDevAttrSharedOptin, device), "cuDeviceGetAttribute");
    if (shared > optin) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jax_fusedloss counter call: kernel needs " + std::to_string(shared) +
                            " bytes of shared memory, the device allows " +
                            std::to_string(optin));
    }
    JFL_CU(cu.FuncSetAttribute(fn, kFuncAttrMaxDynamicShared, static_cast<int>(shared)),
           "cuFuncSetAttribute");
  }
  Functions()[key] = fn;
  *out = fn;
  return ffi::Error::Success();
}

#define JFL_ATTR(var, type, key)                              \
  auto var##_or = attrs.get<type>(key);                       \
  if (var##_or.has_error()) return var##_or.error();          \
  type var = *var##_or

ffi::Error Initialize(CUstream stream, ffi::Dictionary attrs) {
  const Driver& cu = GetDriver();
  if (!cu.error.empty()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable, "jax_fusedloss counter call: " + cu.error);
  }
  JFL_ATTR(site, int64_t, "site");
  JFL_ATTR(name, std::string_view, "name");
  JFL_ATTR(image, std::string_view, "image");
  JFL_ATTR(shared, int64_t, "shared");
  JFL_ATTR(words, int64_t, "counter_words");
  CUcontext ctx = nullptr;
  if (ffi::Error e = StreamContext(cu, stream, &ctx); e.failure()) return e;

  std::lock_guard<std::mutex> lock(Mutex());
  auto key = std::make_pair(site, ctx);
  if (Sites().count(key)) return ffi::Error::Success();
  JFL_CU(cu.CtxPushCurrent(ctx), "cuCtxPushCurrent");
  Site s;
  ffi::Error e = LoadFunction(cu, ctx, std::string(name), image, shared, &s.function);
  if (e.success()) {
    size_t bytes = static_cast<size_t>(words > 0 ? words : 1) * 4;
    CUresult r = CarveCounter(cu, ctx, bytes, &s.counter);
    if (r != 0) e = CudaError(cu, r, "counter allocation");
  }
  CUcontext popped = nullptr;
  cu.CtxPopCurrent(&popped);
  if (e.failure()) return e;
  Sites()[key] = s;
  return ffi::Error::Success();
}

ffi::Error Execute(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  const Driver& cu = GetDriver();
  JFL_ATTR(site, int64_t, "site");
  JFL_ATTR(num_warps, int64_t, "num_warps");
  JFL_ATTR(shared, int64_t, "shared");
  JFL_ATTR(gx, int64_t, "grid_x");
  JFL_ATTR(gy, int64_t, "grid_y");
  JFL_ATTR(gz, int64_t, "grid_z");
  JFL_ATTR(kinds, ffi::Span<const int64_t>, "kinds");
  JFL_ATTR(values, ffi::Span<const int64_t>, "values");
  CUcontext ctx = nullptr;
  if (ffi::Error e = StreamContext(cu, stream, &ctx); e.failure()) return e;
  Site s;
  {
    std::lock_guard<std::mutex> lock(Mutex());
    auto it = Sites().find(std::make_pair(site, ctx));
    if (it == Sites().end()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jax_fusedloss counter call: executed before its initialize stage");
    }
    s = it->second;
  }
  size_t n = kinds.size();
  if (values.size() != n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_fusedloss counter call: kinds and values differ in length");
  }
  std::vector<uint64_t> slots(n + 2, 0);  // each parameter's bytes (at most 8); 2 scratch
  std::vector<void*> params(n + 2, nullptr);
  for (size_t i = 0; i < n; ++i) {
    int64_t v = values[i];
    void* p = &slots[i];
    switch (kinds[i]) {
      case 0: {
        auto buf = args.get<ffi::AnyBuffer>(static_cast<size_t>(v));
        if (buf.has_error()) return buf.error();
        void* ptr = buf->untyped_data();
        std::memcpy(p, &ptr, sizeof(ptr));
        break;
      }
      case 1: {
        auto buf = rets.get<ffi::AnyBuffer>(static_cast<size_t>(v));
        if (buf.has_error()) return buf.error();
        void* ptr = (*buf)->untyped_data();
        std::memcpy(p, &ptr, sizeof(ptr));
        break;
      }
      case 2:
        std::memcpy(p, &s.counter, sizeof(s.counter));
        break;
      case 3: case 6: {  // i32 / u32: the low 4 bytes
        uint32_t x = static_cast<uint32_t>(v);
        std::memcpy(p, &x, 4);
        break;
      }
      case 5: {  // f32 bits
        uint32_t x = static_cast<uint32_t>(v);
        std::memcpy(p, &x, 4);
        break;
      }
      case 8: {
        bool b = v != 0;
        std::memcpy(p, &b, 1);
        break;
      }
      case 4: case 7: case 9:
        std::memcpy(p, &v, 8);
        break;
      default:
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "jax_fusedloss counter call: unknown parameter kind " +
                              std::to_string(kinds[i]));
    }
    params[i] = p;
  }
  params[n] = &slots[n];          // Triton's global scratch: null
  params[n + 1] = &slots[n + 1];  // Triton's profile scratch: null
  JFL_CU(cu.LaunchKernel(s.function, static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                         static_cast<unsigned>(gz), static_cast<unsigned>(32 * num_warps), 1, 1,
                         static_cast<unsigned>(shared), stream, params.data(), nullptr),
         "cuLaunchKernel");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflCounterCallInitialize, Initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Attrs(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JflCounterCallExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs(),
                              {ffi::Traits::kCmdBufferCompatible});

// A probe for the loader: the library's ABI revision (bumped with any attribute change).
extern "C" int JflCounterCallRevision() { return 3; }
