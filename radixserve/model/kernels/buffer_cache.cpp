// The CPU allocator a serving process runs its steps on (kernels.keep_step_buffers installs
// it): buffers of 1 MiB and more are mappings of their own, and a freed one is kept to serve
// the next request it fits, so a step's large temporaries (a 512-token chunk's FFN
// activations: 32 MiB on a 1B model) are the same pages every step, faulted in once. Smaller
// ones go to c10's allocation as torch's default allocator's do.
//
// Why not glibc's heap: kept in one heap (mallopt M_MMAP_MAX 0), a step's temporaries are
// reused too, but the heap's free space fragments: one 512-token prefill step of a 1B model,
// whose live temporaries peak at 86 MB, grew the heap by about 300 MB. Given each its own
// mapping (glibc's default for large blocks), none is reused and the same step ran 1.4x slower,
// each new mapping's pages faulted in and zeroed again.
//
// A request takes the smallest kept buffer that holds it, if that is at most twice its size;
// kept buffers beyond `limit` bytes are unmapped, the least recently freed first. Thread-safe.
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace radixserve {
namespace {

constexpr size_t kLargeBytes = size_t{1} << 20;  // from here on, a mapping of its own
constexpr size_t kGranule = size_t{2} << 20;     // mappings in 2 MiB steps: near sizes share

struct Buffer {
  size_t bytes;    // the mapping's length
  uint64_t freed;  // when it was last freed (a counter), while kept
};

class BufferCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = n < kLargeBytes ? small(n) : large(n);
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &BufferCache::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_limit(size_t limit) {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      limit_ = limit;
      trim(drop);
    }
    unmap(drop);
  }
  // [bytes kept, bytes mapped, requests served from kept buffers, mappings made]
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {static_cast<int64_t>(kept_bytes_), static_cast<int64_t>(mapped_bytes_),
            static_cast<int64_t>(reused_), static_cast<int64_t>(mapped_)};
  }
  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: buffers outlive exit
    return *cache;
  }

 private:
  static void* small(size_t n) { return c10::alloc_cpu(n); }

  void* large(size_t n) {
    const size_t bytes = (n + kGranule - 1) / kGranule * kGranule;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = kept_.lower_bound(bytes);
      if (it != kept_.end() && it->first <= 2 * bytes) {
        void* p = it->second;
        kept_.erase(it);
        kept_bytes_ -= buffers_.at(p).bytes;
        ++reused_;
        return p;
      }
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      c10::profiledCPUMemoryReporter().OutOfMemory(n);
      TORCH_CHECK(false, "radixserve's CPU allocator: could not map ", bytes, " bytes");
    }
    std::lock_guard<std::mutex> g(mu_);
    buffers_.emplace(p, Buffer{bytes, 0});
    mapped_bytes_ += bytes;
    ++mapped_;
    return p;
  }

  static void release(void* p) {
    c10::profiledCPUMemoryReporter().Delete(p);
    get().put(p);
  }

  void put(void* p) {
    std::vector<std::pair<void*, size_t>> drop;
    bool small_one = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = buffers_.find(p);
      if (it == buffers_.end()) {
        small_one = true;
      } else {
        Buffer& b = it->second;
        b.freed = ++clock_;
        kept_.emplace(b.bytes, p);
        kept_bytes_ += b.bytes;
        trim(drop);
      }
    }
    if (small_one) c10::free_cpu(p);  // outside the lock
    unmap(drop);
  }

  // Takes kept buffers out, the least recently freed first, until at most limit_ bytes stay
  // kept (under mu_); the caller unmaps them after letting go of the lock.
  void trim(std::vector<std::pair<void*, size_t>>& drop) {
    while (kept_bytes_ > limit_) {
      auto oldest = kept_.begin();
      for (auto it = kept_.begin(); it != kept_.end(); ++it)
        if (buffers_.at(it->second).freed < buffers_.at(oldest->second).freed) oldest = it;
      void* p = oldest->second;
      const size_t bytes = oldest->first;
      kept_.erase(oldest);
      buffers_.erase(p);
      kept_bytes_ -= bytes;
      mapped_bytes_ -= bytes;
      drop.emplace_back(p, bytes);
    }
  }
  static void unmap(const std::vector<std::pair<void*, size_t>>& drop) {
    for (const auto& [p, bytes] : drop) munmap(p, bytes);
  }

  std::mutex mu_;
  std::unordered_map<void*, Buffer> buffers_;  // every large buffer mapped, in use or kept
  std::multimap<size_t, void*> kept_;          // the kept ones by size
  size_t kept_bytes_ = 0, mapped_bytes_ = 0, limit_ = 0;
  uint64_t clock_ = 0, reused_ = 0, mapped_ = 0;
};

// Makes BufferCache torch's CPU allocator (from the first call on; tensors allocated before
// keep the allocator they came from) and sets how many bytes of freed buffers it keeps.
void use_buffer_cache(int64_t limit_bytes) {
  TORCH_CHECK(limit_bytes >= 0, "use_buffer_cache: a negative limit");
  static std::once_flag installed;
  BufferCache& cache = BufferCache::get();
  cache.set_limit(static_cast<size_t>(limit_bytes));
  std::call_once(installed, [&] { c10::SetCPUAllocator(&cache, /*priority=*/1); });
}

std::vector<int64_t> buffer_cache_stats() { return BufferCache::get().stats(); }

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("use_buffer_cache(int limit_bytes) -> ()", &radixserve::use_buffer_cache);
  m.def("buffer_cache_stats() -> int[]", &radixserve::buffer_cache_stats);
}
