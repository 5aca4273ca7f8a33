#include "cuda_driver.h"

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "engine.h"

namespace tfl::cuda {

namespace {

template <class F>
void resolve(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  if (fn == nullptr) throw Error(Error::kInvalid, std::string("libcuda.so.1 has no ") + name);
}

// The call counter of TORCH_FASTLOAD_COUNT_DRIVER_CALLS: each entry point's pointer replaced by
// a trampoline that counts the call under the calling thread's id, then makes it.
std::mutex count_mu;
std::map<std::pair<long, const char*>, uint64_t> counts;

void count(const char* name) {
  thread_local const long tid = static_cast<long>(::syscall(SYS_gettid));
  std::lock_guard<std::mutex> lock(count_mu);
  ++counts[{tid, name}];
}

template <int Id, class F>
struct Counted;

template <int Id, class R, class... A>
struct Counted<Id, R (*)(A...)> {
  static inline R (*original)(A...) = nullptr;
  static inline const char* name = nullptr;
  static R call(A... args) {
    count(name);
    return original(args...);
  }
};

template <int Id, class F>
void counted(F& fn, const char* name) {
  if (fn == nullptr) return;
  Counted<Id, F>::original = fn, Counted<Id, F>::name = name;
  fn = &Counted<Id, F>::call;
}

void count_every_call(Api& t) {
  counted<0>(t.ctx_get_current, "cuCtxGetCurrent");
  counted<1>(t.ctx_set_current, "cuCtxSetCurrent");
  counted<2>(t.event_create, "cuEventCreate");
  counted<3>(t.event_destroy, "cuEventDestroy");
  counted<4>(t.event_record, "cuEventRecord");
  counted<5>(t.event_query, "cuEventQuery");
  counted<6>(t.memcpy_htod_async, "cuMemcpyHtoDAsync");
  counted<7>(t.launch_kernel, "cuLaunchKernel");
  counted<8>(t.stream_wait_event, "cuStreamWaitEvent");
  counted<9>(t.stream_get_ctx, "cuStreamGetCtx");
  counted<10>(t.event_elapsed_time, "cuEventElapsedTime");
  counted<11>(t.memcpy_batch_async, "cuMemcpyBatchAsync");
}

}  // namespace

std::vector<CallCount> call_counts() {
  std::lock_guard<std::mutex> lock(count_mu);
  std::vector<CallCount> out;
  for (const auto& [key, calls] : counts) out.push_back({key.first, key.second, calls});
  return out;
}

const Api& api() {
  static Api table{};
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      failure = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") + (why ? why : "unknown");
      return;
    }
    try {
      resolve(lib, "cuCtxGetCurrent", table.ctx_get_current);
      resolve(lib, "cuCtxSetCurrent", table.ctx_set_current);
      resolve(lib, "cuDeviceGet", table.device_get);
      resolve(lib, "cuDevicePrimaryCtxRetain", table.primary_ctx_retain);
      resolve(lib, "cuEventCreate", table.event_create);
      resolve(lib, "cuEventDestroy_v2", table.event_destroy);
      resolve(lib, "cuEventRecord", table.event_record);
      resolve(lib, "cuEventQuery", table.event_query);
      resolve(lib, "cuMemcpyHtoDAsync_v2", table.memcpy_htod_async);
      resolve(lib, "cuGetErrorString", table.get_error_string);
      resolve(lib, "cuMemHostRegister_v2", table.mem_host_register);
      resolve(lib, "cuMemHostUnregister", table.mem_host_unregister);
      resolve(lib, "cuLaunchKernel", table.launch_kernel);
      resolve(lib, "cuStreamWaitEvent", table.stream_wait_event);
      resolve(lib, "cuStreamGetCtx", table.stream_get_ctx);
      table.event_elapsed_time =
          reinterpret_cast<decltype(table.event_elapsed_time)>(::dlsym(lib, "cuEventElapsedTime_v2"));
      if (table.event_elapsed_time == nullptr) resolve(lib, "cuEventElapsedTime", table.event_elapsed_time);
      // TORCH_FASTLOAD_DMA_BATCH=0: one cuMemcpyHtoDAsync a range instead (probes compare the two)
      const char* batch = ::getenv("TORCH_FASTLOAD_DMA_BATCH");
      if (batch == nullptr || std::string(batch) != "0")
        table.memcpy_batch_async =
            reinterpret_cast<decltype(table.memcpy_batch_async)>(::dlsym(lib, "cuMemcpyBatchAsync_v2"));
      const char* counting = ::getenv("TORCH_FASTLOAD_COUNT_DRIVER_CALLS");
      if (counting != nullptr && std::string(counting) == "1") count_every_call(table);
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw Error(Error::kInvalid, failure);
  return table;
}

int dma_src_access_order() {
  static const int order = [] {
    const char* v = ::getenv("TORCH_FASTLOAD_DMA_ORDER");
    return v != nullptr && std::string(v) == "stream" ? kSrcAccessOrderStream : kSrcAccessOrderAny;
  }();
  return order;
}

Result primary_context(int ordinal, Context* out) {
  // retained once per device for the process's life, as torch's runtime holds it too
  static std::mutex mu;
  static Context retained[64] = {};
  if (ordinal < 0 || ordinal >= 64) return 101;  // CUDA_ERROR_INVALID_DEVICE
  std::lock_guard<std::mutex> lock(mu);
  if (retained[ordinal] == nullptr) {
    const Api& cu = api();
    int device = 0;
    Result r = cu.device_get(&device, ordinal);
    if (r == kSuccess) r = cu.primary_ctx_retain(&retained[ordinal], device);
    if (r != kSuccess) return r;
  }
  *out = retained[ordinal];
  return kSuccess;
}

void check(Result r, const char* what) {
  if (r == kSuccess) return;
  const char* text = nullptr;
  if (api().get_error_string(r, &text) != kSuccess || text == nullptr) text = "unknown error";
  throw Error(Error::kInvalid, std::string(what) + " failed: CUDA error " + std::to_string(r) + " (" + text + ")");
}

void stream_wait_stream(uintptr_t waiter, uintptr_t producer) {
  // One event per thread and context: once the wait is enqueued it has captured the event, so
  // the next call may record it again.
  thread_local Context bound = nullptr;
  thread_local Event event = nullptr;
  const Api& cu = api();
  // The streams' context, made current here: a thread that only ran torch's allocator (no
  // runtime call) has none yet.
  Context ctx = nullptr, current = nullptr;
  // (the legacy default stream, handle 0, names no context: ask the other stream)
  const uintptr_t named = producer != 0 ? producer : waiter;
  if (named == 0) throw Error(Error::kInvalid, "stream_wait_stream needs one stream other than the default");
  check(cu.stream_get_ctx(reinterpret_cast<Stream>(named), &ctx), "cuStreamGetCtx");
  check(cu.ctx_get_current(&current), "cuCtxGetCurrent");
  if (current != ctx) check(cu.ctx_set_current(ctx), "cuCtxSetCurrent");
  if (ctx != bound || event == nullptr) {
    check(cu.event_create(&event, kEventDisableTiming), "cuEventCreate");
    bound = ctx;
  }
  check(cu.event_record(event, reinterpret_cast<Stream>(producer)), "cuEventRecord");
  check(cu.stream_wait_event(reinterpret_cast<Stream>(waiter), event, 0), "cuStreamWaitEvent");
}

}  // namespace tfl::cuda
