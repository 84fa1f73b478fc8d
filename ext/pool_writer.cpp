#include "pool_writer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <dlfcn.h>
#endif

namespace es {

namespace {

// The few CUDA runtime entry points the writer uses, declared here so that nothing is
// linked against (cuda_runtime_api.h gives the same signatures; the enum values are
// CUDA's: cudaMemcpyDefault 4, cudaMemoryTypeDevice 2, cudaMemoryTypeManaged 3,
// cudaStreamNonBlocking 1, cudaHostRegisterPortable | cudaHostRegisterMapped 3,
// cudaEventDisableTiming 2, cudaErrorNotReady 600, cudaStreamCaptureModeRelaxed 2).
using Stream = void*;
using Event = void*;
struct PointerAttributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
  char reserved[256];  // room for fields a later runtime may add
};

struct Cuda {
  int (*pointer_attributes)(PointerAttributes*, const void*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*stream_create)(Stream*, unsigned) = nullptr;
  int (*memcpy_async)(void*, const void*, size_t, int, Stream) = nullptr;
  int (*memset_async)(void*, int, size_t, Stream) = nullptr;
  int (*stream_sync)(Stream) = nullptr;
  int (*stream_query)(Stream) = nullptr;
  int (*host_register)(void*, size_t, unsigned) = nullptr;
  int (*host_unregister)(void*) = nullptr;
  int (*host_device_pointer)(void**, void*, unsigned) = nullptr;
  int (*event_create)(Event*, unsigned) = nullptr;
  int (*event_record)(Event, Stream) = nullptr;
  int (*event_query)(Event) = nullptr;
  int (*event_destroy)(Event) = nullptr;
  int (*exchange_capture_mode)(int*) = nullptr;  // optional
  const char* (*error_string)(int) = nullptr;
};

// The runtime MLX loaded, or null (no CUDA backend in this process).
const Cuda* cuda() {
  static Cuda table;
  static const Cuda* found = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__linux__)
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
      void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (!h) continue;
      auto sym = [h](auto& fn, const char* s) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, s));
        return fn != nullptr;
      };
      if (sym(table.pointer_attributes, "cudaPointerGetAttributes") &&
          sym(table.set_device, "cudaSetDevice") &&
          sym(table.stream_create, "cudaStreamCreateWithFlags") &&
          sym(table.memcpy_async, "cudaMemcpyAsync") &&
          sym(table.memset_async, "cudaMemsetAsync") &&
          sym(table.stream_sync, "cudaStreamSynchronize") &&
          sym(table.stream_query, "cudaStreamQuery") &&
          sym(table.host_register, "cudaHostRegister") &&
          sym(table.host_unregister, "cudaHostUnregister") &&
          sym(table.host_device_pointer, "cudaHostGetDevicePointer") &&
          sym(table.event_create, "cudaEventCreateWithFlags") &&
          sym(table.event_record, "cudaEventRecord") &&
          sym(table.event_query, "cudaEventQuery") &&
          sym(table.event_destroy, "cudaEventDestroy") &&
          sym(table.error_string, "cudaGetErrorString")) {
        sym(table.exchange_capture_mode, "cudaThreadExchangeStreamCaptureMode");
        found = &table;
        return;
      }
    }
#endif
  });
  return found;
}

void check(int rc, const char* what) {
  if (rc != 0)
    throw std::runtime_error(std::string("pool write: ") + what + " failed: " +
                             cuda()->error_string(rc));
}

constexpr int kNotReady = 600;  // cudaErrorNotReady: an event's work has not all run

// Non-blocking streams for pool writes, one per concurrent writer, kept for the process:
// a stream is never destroyed, so no thread exit or interpreter shutdown races the
// runtime's own teardown. At most one per thread that ever wrote at once.
class StreamPool {
 public:
  Stream take(int device) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second != device) continue;
        Stream s = it->first;
        free_.erase(it);
        return s;
      }
    }
    Stream s = nullptr;
    check(cuda()->stream_create(&s, 1), "cudaStreamCreateWithFlags");
    return s;
  }
  void give(Stream s, int device) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.emplace_back(s, device);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<Stream, int>> free_;
};

StreamPool& streams() {
  static auto* pool = new StreamPool;  // never destroyed, like its streams
  return *pool;
}

// Runs `issue(stream)` on a pool stream of `device` and waits for that stream alone.
template <typename F>
void on_stream(int device, F&& issue) {
  check(cuda()->set_device(device), "cudaSetDevice");
  Stream s = streams().take(device);
  try {
    issue(s);
    check(cuda()->stream_sync(s), "cudaStreamSynchronize");
  } catch (...) {
    // The copies issued before the failure may still run: wait for them, so that none
    // reads the caller's buffer after it is reused or writes a row after it changes hands.
    cuda()->stream_sync(s);
    streams().give(s, device);
    throw;
  }
  streams().give(s, device);
}

// `spans` (not overlapping) ordered by destination, each run of spans of one segment that
// continue one another in both destination and source made one span (rows of consecutive
// slots copied to consecutive rows: one span per segment), empty ones left out: each
// device copy costs the runtime microseconds of the host's time, whatever its size.
std::vector<Span> coalesced(std::vector<Span> spans) {
  const auto at = [](const uint8_t* p) { return reinterpret_cast<uintptr_t>(p); };
  std::sort(spans.begin(), spans.end(),
            [&](const Span& a, const Span& b) { return at(a.dst) < at(b.dst); });
  std::vector<Span> out;
  out.reserve(spans.size());
  for (const auto& s : spans) {
    if (s.bytes == 0) continue;
    Span* last = out.empty() ? nullptr : &out.back();
    if (last && s.segment >= 0 && last->segment == s.segment &&
        at(last->dst) + last->bytes == at(s.dst) && at(last->src) + last->bytes == at(s.src))
      last->bytes += s.bytes;
    else
      out.push_back(s);
  }
  return out;
}

}  // namespace

PoolWriter::PoolWriter(const void* probe) {
  const Cuda* c = cuda();
  if (!c || !probe) return;
  PointerAttributes a{};
  if (c->pointer_attributes(&a, probe) != 0) return;  // not CUDA memory
  if (a.type == 2 || a.type == 3) device_ = a.device;
}

void PoolWriter::copy(const std::vector<Span>& spans) const {
  if (device_ < 0) {  // a host memcpy costs nothing per call: no merging
    for (const auto& s : spans) std::memcpy(s.dst, s.src, s.bytes);
    return;
  }
  const std::vector<Span> runs = spans.size() > 1 ? coalesced(spans) : spans;
  on_stream(device_, [&](Stream st) {
    for (const auto& s : runs)
      check(cuda()->memcpy_async(s.dst, s.src, s.bytes, 4, st), "cudaMemcpyAsync");
  });
}

bool PoolWriter::pin(void* p, size_t bytes) const {
  if (device_ < 0 || !p || bytes == 0) return false;
  return cuda()->host_register(p, bytes, 0) == 0;
}

uintptr_t PoolWriter::map(void* p, size_t bytes) const {
  if (device_ < 0 || !p || bytes == 0) return 0;
  const Cuda* c = cuda();
  if (c->set_device(device_) != 0 || c->host_register(p, bytes, 3) != 0) return 0;
  void* device_pointer = nullptr;
  if (c->host_device_pointer(&device_pointer, p, 0) != 0) {
    c->host_unregister(p);
    return 0;
  }
  return reinterpret_cast<uintptr_t>(device_pointer);
}

void PoolWriter::unpin(void* p) {
  if (const Cuda* c = cuda()) c->host_unregister(p);
}

void PoolWriter::zero(uint8_t* dst, size_t bytes) const {
  if (device_ < 0) {
    std::memset(dst, 0, bytes);
    return;
  }
  on_stream(device_, [&](Stream st) {
    check(cuda()->memset_async(dst, 0, bytes, st), "cudaMemsetAsync");
  });
}

CopyStream::CopyStream(const PoolWriter& writer, int depth) : device_(writer.device_) {
  if (depth < 1)
    throw std::invalid_argument("copy stream depth must be >= 1, got " + std::to_string(depth));
  marks_.resize(static_cast<size_t>(depth), nullptr);
  unmarked_.resize(marks_.size(), 0);
  errors_.resize(marks_.size());
  if (device_ < 0) return;
  check(cuda()->set_device(device_), "cudaSetDevice");
  stream_ = streams().take(device_);
  for (auto& e : marks_) {
    const int rc = cuda()->event_create(&e, 2);
    if (rc != 0) {
      release();
      check(rc, "cudaEventCreateWithFlags");
    }
  }
}

CopyStream::~CopyStream() { release(); }

void CopyStream::release() {
  if (device_ < 0) return;
  if (stream_) {
    // The copies still read staging slots and write pool rows: they end first.
    cuda()->stream_sync(stream_);
    streams().give(stream_, device_);
    stream_ = nullptr;
  }
  for (auto& e : marks_)
    if (e) cuda()->event_destroy(e), e = nullptr;
}

// A thread that queues and polls is not one that captures a graph: relaxed, so that a
// capture another thread makes in the global mode neither refuses these calls nor is
// spoiled by them (MLX's own captures are thread-local).
void relax_capture() {
  static thread_local bool relaxed = false;
  if (relaxed) return;
  relaxed = true;
  int mode = 2;
  if (cuda()->exchange_capture_mode) cuda()->exchange_capture_mode(&mode);
}

void CopyStream::queue(const std::vector<Span>& copies) {
  if (full()) throw std::logic_error("copy stream: " + std::to_string(marks_.size()) +
                                     " batches in flight already");
  const size_t slot = (first_ + in_flight_) % marks_.size();
  ++in_flight_;
  errors_[slot].clear();
  unmarked_[slot] = 0;
  if (device_ < 0) {
    held_.push_back(copies);  // copied by the next poll(), in order
    return;
  }
  relax_capture();
  // The batch is in flight from here on, whatever fails: it lands once the copies issued
  // before a failure have run. The calling thread's device may be another
  // (cudaSetDevice is per thread).
  int rc = cuda()->set_device(device_);
  const char* what = rc == 0 ? "cudaMemcpyAsync" : "cudaSetDevice";
  for (const auto& s : coalesced(copies)) {
    if (rc != 0) break;
    rc = cuda()->memcpy_async(s.dst, s.src, s.bytes, 4, stream_);
  }
  if (const int recorded = cuda()->event_record(marks_[slot], stream_); recorded != 0) {
    unmarked_[slot] = 1;  // lands with the next batch whose mark passes, or at the end
    if (rc == 0) rc = recorded, what = "cudaEventRecord";
  }
  if (rc != 0) {
    errors_[slot] = std::string("fill batch: ") + what + " failed: " + cuda()->error_string(rc);
    throw std::runtime_error(errors_[slot]);
  }
}

std::vector<std::string> CopyStream::poll() {
  std::vector<std::string> landed;
  if (device_ < 0) {
    // The oldest batch once it has waited kHostPolls polls, so that it lands after the
    // requests that follow it, as a device's copies may.
    for (; in_flight_ > 0 && ++polls_ >= kHostPolls;
         --in_flight_, first_ = (first_ + 1) % marks_.size()) {
      for (const auto& s : held_.front()) std::memmove(s.dst, s.src, s.bytes);
      held_.erase(held_.begin());
      landed.push_back(errors_[first_]);
      polls_ = 0;
    }
    return landed;
  }
  relax_capture();
  // The oldest batches up to the last marked one whose mark has passed (stream order:
  // every copy queued before it has run, unmarked batches' too); unmarked ones after it
  // once the whole stream is idle.
  int n = 0;
  bool waiting = false;
  for (int i = 0; i < in_flight_ && !waiting; ++i) {
    const size_t slot = (first_ + static_cast<size_t>(i)) % marks_.size();
    if (unmarked_[slot]) continue;
    const int q = cuda()->event_query(marks_[slot]);
    waiting = q == kNotReady;
    if (waiting) break;
    if (q != 0 && errors_[slot].empty())
      errors_[slot] = std::string("fill batch: a copy failed: ") + cuda()->error_string(q);
    n = i + 1;
  }
  if (!waiting && n < in_flight_ && cuda()->stream_query(stream_) != kNotReady) n = in_flight_;
  for (; n > 0; --n, --in_flight_, first_ = (first_ + 1) % marks_.size())
    landed.push_back(errors_[first_]);
  return landed;
}

MappedHost::MappedHost(const PoolWriter& writer, size_t bytes, const std::string& what) {
  const size_t page = 4096;
  bytes_ = (bytes + page - 1) / page * page;
  data_ = static_cast<uint8_t*>(std::aligned_alloc(page, bytes_));
  if (!data_) throw std::bad_alloc();
  if (std::strcmp(writer.kind(), "cuda") != 0) {
    device_address_ = reinterpret_cast<uintptr_t>(data_);
    return;
  }
  device_address_ = writer.map(data_, bytes_);
  if (!device_address_) {
    std::free(data_);
    throw std::runtime_error("the CUDA runtime refused to map " + std::to_string(bytes_) +
                             " bytes of host memory for " + what);
  }
  mapped_ = true;
}

MappedHost::~MappedHost() {
  if (!data_) return;
  if (mapped_) PoolWriter::unpin(data_);
  std::free(data_);
}

}  // namespace es
