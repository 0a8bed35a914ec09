/* A typed-FFI launcher for Triton kernels that need a zero-initialised arrival counter.
 *
 * jax_fusedloss's one-launch split reductions merge a row's slice partials in the program that
 * arrives last on a per-row counter. Through jaxlib's Triton call that counter is an XLA buffer
 * that must be zero-filled before every launch: one more node in XLA's command buffer (~1.5 us
 * on H100), more than the whole launch costs at one row. Here the counter lives in device
 * memory owned by this library instead: one buffer per (call site, CUDA context), zeroed once
 * when allocated, and returned to zero by the kernel itself (its last program stores 0 after
 * the merge), so the next launch of that call site finds it at zero without any fill.
 *
 * Why that is safe: a call site is one custom call of one lowered program (an id drawn at each
 * lowering), and one device executes that program's launches in stream order, so two launches
 * of one site never overlap on one device; a device-side fault leaves the CUDA context
 * unusable, so a counter left non-zero by an aborted launch is never read again.
 *
 * Stages: "initialize" (outside command-buffer capture) loads the module for the stream's
 * context and allocates the site's counter; "execute" (recorded into XLA's command buffers: the
 * handler declares itself command-buffer compatible) only builds the parameter list and calls
 * cuLaunchKernel. Plain C against XLA's FFI C API (jax.ffi.include_dir()/xla/ffi/api/c_api.h)
 * with the CUDA driver reached through dlopen: it builds with the C compiler Triton itself
 * needs for its launcher.
 *
 * Attributes (all set by jax_fusedloss/_counter_call.py):
 *   site (i64)            unique id of the call site
 *   name, ptx (string)    kernel symbol and PTX (the driver compiles it for the device)
 *   num_warps, shared, grid_x, grid_y, grid_z (i64)
 *   counter_words (i64)   int32 words of the counter
 *   kinds, values (i64 arrays) one entry per kernel parameter, in order:
 *     0 operand buffer values[i], 1 result buffer values[i], 2 the counter,
 *     3 i32, 4 i64, 5 f32 (bits), 6 u32, 7 u64, 8 bool, 9 f64 (bits)
 *   then Triton's two trailing pointers (global and profile scratch) are passed as null: the
 *   kernels launched here use neither (the Python side refuses kernels that do).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

/* ------------------------------------------------------------------ the CUDA driver */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

enum {
  kFuncAttrMaxDynamicShared = 8, /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
  kDevAttrSharedOptin = 97,      /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
  kCaptureActive = 1,            /* CU_STREAM_CAPTURE_STATUS_ACTIVE */
  kMaxParams = 64,
};

static struct {
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*StreamGetCtx)(CUstream, CUcontext*);
  CUresult (*StreamIsCapturing)(CUstream, int*);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemsetD32)(CUdeviceptr, unsigned int, size_t);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, CUstream, void**, void**);
  const char* missing; /* NULL when every symbol loaded */
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;

static void* load_symbol(void* lib, const char* name) {
  void* fn = dlsym(lib, name);
  if (fn == NULL && cu.missing == NULL) cu.missing = name;
  return fn;
}

static void load_driver(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    cu.missing = "libcuda.so.1";
    return;
  }
  *(void**)&cu.GetErrorString = load_symbol(lib, "cuGetErrorString");
  *(void**)&cu.CtxGetCurrent = load_symbol(lib, "cuCtxGetCurrent");
  *(void**)&cu.CtxPushCurrent = load_symbol(lib, "cuCtxPushCurrent_v2");
  *(void**)&cu.CtxPopCurrent = load_symbol(lib, "cuCtxPopCurrent_v2");
  *(void**)&cu.CtxGetDevice = load_symbol(lib, "cuCtxGetDevice");
  *(void**)&cu.StreamGetCtx = load_symbol(lib, "cuStreamGetCtx");
  *(void**)&cu.StreamIsCapturing = load_symbol(lib, "cuStreamIsCapturing");
  *(void**)&cu.DeviceGetAttribute = load_symbol(lib, "cuDeviceGetAttribute");
  *(void**)&cu.ModuleLoadData = load_symbol(lib, "cuModuleLoadData");
  *(void**)&cu.ModuleGetFunction = load_symbol(lib, "cuModuleGetFunction");
  *(void**)&cu.FuncSetAttribute = load_symbol(lib, "cuFuncSetAttribute");
  *(void**)&cu.MemAlloc = load_symbol(lib, "cuMemAlloc_v2");
  *(void**)&cu.MemsetD32 = load_symbol(lib, "cuMemsetD32_v2");
  *(void**)&cu.LaunchKernel = load_symbol(lib, "cuLaunchKernel");
}

/* ------------------------------------------------------------------ FFI helpers */
static XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code,
                                 const char* what, const char* detail) {
  char msg[512];
  snprintf(msg, sizeof msg, "jax_fusedloss counter call: %s%s%s", what, detail ? ": " : "",
           detail ? detail : "");
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = msg; /* XLA copies the message */
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

static XLA_FFI_Error* cuda_error(const XLA_FFI_Api* api, CUresult r, const char* what) {
  const char* msg = "unknown CUDA error";
  if (cu.GetErrorString != NULL) cu.GetErrorString(r, &msg);
  return make_error(api, XLA_FFI_Error_Code_INTERNAL, what, msg);
}

/* Answers XLA's metadata query (the FFI version compiled against, command-buffer
 * compatibility); returns 1 when the call was that query. */
static int answer_metadata(XLA_FFI_CallFrame* frame, XLA_FFI_Error** err) {
  XLA_FFI_Extension_Base* ext = frame->extension_start;
  if (ext == NULL || ext->type != XLA_FFI_Extension_Metadata) return 0;
  XLA_FFI_Metadata* md = ((XLA_FFI_Metadata_Extension*)ext)->metadata;
  md->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  md->api_version.extension_start = NULL;
  md->api_version.major_version = XLA_FFI_API_MAJOR;
  md->api_version.minor_version = XLA_FFI_API_MINOR;
  md->traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
  md->state_type_id.type_id = 0; /* stateless */
  *err = NULL;
  return 1;
}

static int find_attr(const XLA_FFI_CallFrame* f, const char* name, XLA_FFI_AttrType type) {
  size_t n = strlen(name);
  for (int64_t i = 0; i < f->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* s = f->attrs.names[i];
    if (s->len == n && memcmp(s->ptr, name, n) == 0 && f->attrs.types[i] == type) return (int)i;
  }
  return -1;
}

static int attr_i64(const XLA_FFI_CallFrame* f, const char* name, int64_t* out) {
  int i = find_attr(f, name, XLA_FFI_AttrType_SCALAR);
  if (i < 0) return 0;
  const XLA_FFI_Scalar* s = (const XLA_FFI_Scalar*)f->attrs.attrs[i];
  if (s->dtype != XLA_FFI_DataType_S64) return 0;
  *out = *(const int64_t*)s->value;
  return 1;
}

static int attr_str(const XLA_FFI_CallFrame* f, const char* name, XLA_FFI_ByteSpan* out) {
  int i = find_attr(f, name, XLA_FFI_AttrType_STRING);
  if (i < 0) return 0;
  *out = *(const XLA_FFI_ByteSpan*)f->attrs.attrs[i];
  return 1;
}

static int attr_i64s(const XLA_FFI_CallFrame* f, const char* name, const int64_t** data,
                     size_t* size) {
  int i = find_attr(f, name, XLA_FFI_AttrType_ARRAY);
  if (i < 0) return 0;
  const XLA_FFI_Array* a = (const XLA_FFI_Array*)f->attrs.attrs[i];
  if (a->dtype != XLA_FFI_DataType_S64) return 0;
  *data = (const int64_t*)a->data;
  *size = a->size;
  return 1;
}

static XLA_FFI_Error* get_stream(XLA_FFI_CallFrame* f, CUstream* stream) {
  XLA_FFI_Stream_Get_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  args.ctx = f->ctx;
  XLA_FFI_Error* err = f->api->XLA_FFI_Stream_Get(&args);
  *stream = (CUstream)args.stream;
  return err;
}

/* The stream's context; inside graph capture cuStreamGetCtx is unreliable on some drivers,
 * and the capturing thread has the stream's context current. */
static CUresult stream_context(CUstream stream, CUcontext* ctx) {
  int capture = 0;
  CUresult r = cu.StreamIsCapturing(stream, &capture);
  if (r != 0) return r;
  return capture == kCaptureActive ? cu.CtxGetCurrent(ctx) : cu.StreamGetCtx(stream, ctx);
}

/* ------------------------------------------------------------------ per-context resources */
typedef struct Site {
  int64_t id;
  CUcontext ctx;
  CUfunction function;
  CUdeviceptr counter;
  struct Site* next;
} Site;

typedef struct Function {
  char* key; /* name + '\0' + ptx */
  size_t key_len;
  CUcontext ctx;
  CUfunction function;
  struct Function* next;
} Function;

static Site* sites = NULL;         /* guarded by mutex; entries are never freed */
static Function* functions = NULL; /* guarded by mutex */

static Site* find_site(int64_t id, CUcontext ctx) {
  for (Site* s = sites; s != NULL; s = s->next) {
    if (s->id == id && s->ctx == ctx) return s;
  }
  return NULL;
}

/* The kernel in the current context (pushed by the caller), loaded once per context. */
static XLA_FFI_Error* load_function(const XLA_FFI_Api* api, CUcontext ctx,
                                    XLA_FFI_ByteSpan name, XLA_FFI_ByteSpan ptx,
                                    int64_t shared, CUfunction* out) {
  size_t key_len = name.len + 1 + ptx.len;
  for (Function* f = functions; f != NULL; f = f->next) {
    if (f->ctx == ctx && f->key_len == key_len && memcmp(f->key, name.ptr, name.len) == 0 &&
        memcmp(f->key + name.len + 1, ptx.ptr, ptx.len) == 0) {
      *out = f->function;
      return NULL;
    }
  }
  char* key = (char*)malloc(key_len + 1); /* name '\0' ptx '\0': both NUL-terminated */
  if (key == NULL) return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "malloc", NULL);
  memcpy(key, name.ptr, name.len);
  key[name.len] = '\0';
  memcpy(key + name.len + 1, ptx.ptr, ptx.len);
  key[key_len] = '\0';
  CUmodule module = NULL;
  CUfunction fn = NULL;
  CUresult r = cu.ModuleLoadData(&module, key + name.len + 1);
  if (r != 0) {
    free(key);
    return cuda_error(api, r, "cuModuleLoadData");
  }
  r = cu.ModuleGetFunction(&fn, module, key);
  if (r != 0) {
    free(key);
    return cuda_error(api, r, "cuModuleGetFunction");
  }
  if (shared > 49152) { /* above the static limit: opt in to dynamic shared memory */
    CUdevice device = 0;
    int optin = 0;
    r = cu.CtxGetDevice(&device);
    if (r == 0) r = cu.DeviceGetAttribute(&optin, kDevAttrSharedOptin, device);
    if (r == 0 && shared > optin) {
      free(key);
      return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "the kernel needs more shared memory than the device allows", NULL);
    }
    if (r == 0) r = cu.FuncSetAttribute(fn, kFuncAttrMaxDynamicShared, (int)shared);
    if (r != 0) {
      free(key);
      return cuda_error(api, r, "shared memory opt-in");
    }
  }
  Function* f = (Function*)malloc(sizeof(Function));
  if (f == NULL) {
    free(key);
    return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "malloc", NULL);
  }
  f->key = key;
  f->key_len = key_len;
  f->ctx = ctx;
  f->function = fn;
  f->next = functions;
  functions = f;
  *out = fn;
  return NULL;
}

static XLA_FFI_Error* initialize_locked(const XLA_FFI_Api* api, CUcontext ctx, int64_t id,
                                        XLA_FFI_ByteSpan name, XLA_FFI_ByteSpan ptx,
                                        int64_t shared, int64_t words) {
  if (find_site(id, ctx) != NULL) return NULL;
  Site* s = (Site*)calloc(1, sizeof(Site));
  if (s == NULL) return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "calloc", NULL);
  XLA_FFI_Error* err = load_function(api, ctx, name, ptx, shared, &s->function);
  if (err == NULL) {
    size_t n = (size_t)(words > 0 ? words : 1);
    CUresult r = cu.MemAlloc(&s->counter, n * 4);
    if (r == 0) r = cu.MemsetD32(s->counter, 0, n); /* synchronous: zero before any use */
    if (r != 0) err = cuda_error(api, r, "counter allocation");
  }
  if (err != NULL) {
    free(s);
    return err;
  }
  s->id = id;
  s->ctx = ctx;
  s->next = sites;
  sites = s;
  return NULL;
}

/* ------------------------------------------------------------------ the two stages */
XLA_FFI_Error* JflCounterCallInitialize(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Error* err = NULL;
  if (answer_metadata(frame, &err)) return err;
  const XLA_FFI_Api* api = frame->api;
  if (frame->stage != XLA_FFI_ExecutionStage_INITIALIZE) {
    return make_error(api, XLA_FFI_Error_Code_INTERNAL, "initialize handler at another stage",
                      NULL);
  }
  pthread_once(&cu_once, load_driver);
  if (cu.missing != NULL) {
    return make_error(api, XLA_FFI_Error_Code_UNAVAILABLE, "CUDA driver lacks", cu.missing);
  }
  int64_t id, shared, words;
  XLA_FFI_ByteSpan name, ptx;
  if (!attr_i64(frame, "site", &id) || !attr_i64(frame, "shared", &shared) ||
      !attr_i64(frame, "counter_words", &words) || !attr_str(frame, "name", &name) ||
      !attr_str(frame, "ptx", &ptx)) {
    return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "missing or mistyped attribute (site, shared, counter_words, name, ptx)",
                      NULL);
  }
  CUstream stream = NULL;
  if ((err = get_stream(frame, &stream)) != NULL) return err;
  CUcontext ctx = NULL;
  CUresult r = stream_context(stream, &ctx);
  if (r != 0) return cuda_error(api, r, "the stream's context");
  r = cu.CtxPushCurrent(ctx);
  if (r != 0) return cuda_error(api, r, "cuCtxPushCurrent");
  pthread_mutex_lock(&mutex);
  err = initialize_locked(api, ctx, id, name, ptx, shared, words);
  pthread_mutex_unlock(&mutex);
  CUcontext popped = NULL;
  cu.CtxPopCurrent(&popped);
  return err;
}

XLA_FFI_Error* JflCounterCallExecute(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Error* err = NULL;
  if (answer_metadata(frame, &err)) return err;
  const XLA_FFI_Api* api = frame->api;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) {
    return make_error(api, XLA_FFI_Error_Code_INTERNAL, "execute handler at another stage",
                      NULL);
  }
  pthread_once(&cu_once, load_driver);
  if (cu.missing != NULL) {
    return make_error(api, XLA_FFI_Error_Code_UNAVAILABLE, "CUDA driver lacks", cu.missing);
  }
  int64_t id, num_warps, shared, gx, gy, gz;
  const int64_t *kinds, *values;
  size_t n, n_values;
  if (!attr_i64(frame, "site", &id) || !attr_i64(frame, "num_warps", &num_warps) ||
      !attr_i64(frame, "shared", &shared) || !attr_i64(frame, "grid_x", &gx) ||
      !attr_i64(frame, "grid_y", &gy) || !attr_i64(frame, "grid_z", &gz) ||
      !attr_i64s(frame, "kinds", &kinds, &n) || !attr_i64s(frame, "values", &values, &n_values)) {
    return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "missing or mistyped attribute (site, num_warps, shared, grid_x/y/z, "
                      "kinds, values)", NULL);
  }
  if (n != n_values || n + 2 > kMaxParams) {
    return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "kinds and values differ in length or are too long", NULL);
  }
  CUstream stream = NULL;
  if ((err = get_stream(frame, &stream)) != NULL) return err;
  CUcontext ctx = NULL;
  CUresult r = stream_context(stream, &ctx);
  if (r != 0) return cuda_error(api, r, "the stream's context");
  pthread_mutex_lock(&mutex);
  Site* site = find_site(id, ctx);
  pthread_mutex_unlock(&mutex);
  if (site == NULL) {
    return make_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                      "executed before its initialize stage on this device", NULL);
  }
  uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  memset(slots, 0, sizeof slots);
  for (size_t i = 0; i < n; ++i) {
    int64_t v = values[i];
    void* p = &slots[i];
    switch (kinds[i]) {
      case 0:
      case 1: {
        const XLA_FFI_Args* a = &frame->args;
        const XLA_FFI_Rets* rt = &frame->rets;
        int64_t size = kinds[i] == 0 ? a->size : rt->size;
        if (v < 0 || v >= size) {
          return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                            "buffer index out of range", NULL);
        }
        const XLA_FFI_Buffer* buf =
            (const XLA_FFI_Buffer*)(kinds[i] == 0 ? a->args[v] : rt->rets[v]);
        memcpy(p, &buf->data, sizeof(void*));
        break;
      }
      case 2:
        memcpy(p, &site->counter, sizeof(CUdeviceptr));
        break;
      case 3: case 5: case 6: { /* i32, f32 bits, u32: the low 4 bytes */
        uint32_t x = (uint32_t)v;
        memcpy(p, &x, 4);
        break;
      }
      case 8: {
        unsigned char b = v != 0;
        memcpy(p, &b, 1);
        break;
      }
      case 4: case 7: case 9:
        memcpy(p, &v, 8);
        break;
      default:
        return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "unknown parameter kind",
                          NULL);
    }
    params[i] = p;
  }
  params[n] = &slots[n];         /* Triton's global scratch: null */
  params[n + 1] = &slots[n + 1]; /* Triton's profile scratch: null */
  r = cu.LaunchKernel(site->function, (unsigned)gx, (unsigned)gy, (unsigned)gz,
                      (unsigned)(32 * num_warps), 1, 1, (unsigned)shared, stream, params, NULL);
  if (r != 0) return cuda_error(api, r, "cuLaunchKernel");
  return NULL;
}

/* A probe for the loader: the library's ABI revision (bumped with any attribute change). */
int JflCounterCallRevision(void) { return 2; }
