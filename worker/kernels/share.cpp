// canteen::shared_for and set_step_helpers (share.h): chunks claimed from one atomic counter by
// the calling thread and, while it is awake, one helper thread.
//
// state = (generation << 32) | next chunk. A call publishes a new generation; a thread claims
// chunk c by moving the counter from c to c + 1 within that generation, and a claim past the
// last chunk (or in an old generation) runs nothing. The caller returns once every chunk is
// done, so a chunk's function is alive whenever anyone runs it.

#include "share.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define CANTEEN_PAUSE() _mm_pause()
#else
#define CANTEEN_PAUSE() ((void)0)
#endif

namespace canteen {
namespace {

// Pause loops (about a hundred microseconds) the helper watches for the next call before it
// sleeps: enough to bridge the gaps between one step's linears, not a whole step's spin.
constexpr int kSpins = 4096;
constexpr uint64_t kChunkMask = 0xffffffffu;

struct Slot {
  std::atomic<uint64_t> state{0};
  std::atomic<int64_t> done{0};      // chunks finished in this generation
  std::atomic<uint32_t> posted{0};   // the helper's futex word
  std::atomic<bool> sleeping{false};
  std::atomic<bool> on{false};
  std::atomic<const std::function<void(int64_t, int64_t)>*> fn{nullptr};
  std::atomic<int64_t> n{0}, chunk{1}, chunks{0};
  std::mutex busy;  // one call at a time has the helper; others run alone
  std::once_flag started;
};

Slot& slot() {
  static Slot* s = new Slot;  // never destroyed: the helper thread outlives static teardown
  return *s;
}

// Runs chunks of generation ``gen`` until none is left or the generation moves on.
void work(Slot& s, uint64_t gen) {
  for (;;) {
    uint64_t cur = s.state.load(std::memory_order_acquire);
    if ((cur >> 32) != gen) return;
    if (!s.state.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) continue;
    const auto c = static_cast<int64_t>(cur & kChunkMask);
    if (c >= s.chunks.load(std::memory_order_relaxed)) return;
    const int64_t size = s.chunk.load(std::memory_order_relaxed), begin = c * size;
    (*s.fn.load(std::memory_order_relaxed))(begin, std::min(begin + size, s.n.load(std::memory_order_relaxed)));
    s.done.fetch_add(1, std::memory_order_release);
  }
}

void helper_main(Slot& s) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t cur = s.state.load(std::memory_order_acquire);
    for (int spins = 0; (cur >> 32) == seen; cur = s.state.load(std::memory_order_acquire)) {
      if (++spins < kSpins) {
        CANTEEN_PAUSE();
        continue;
      }
      const uint32_t posted = s.posted.load(std::memory_order_seq_cst);
      s.sleeping.store(true, std::memory_order_seq_cst);
      if ((s.state.load(std::memory_order_seq_cst) >> 32) == seen) {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&s.posted), FUTEX_WAIT_PRIVATE, posted, nullptr, nullptr, 0);
      }
      s.sleeping.store(false, std::memory_order_seq_cst);
      spins = 0;
    }
    seen = cur >> 32;
    work(s, seen);
  }
}

void set_step_helpers(int64_t helpers) {
  TORCH_CHECK(helpers == 0 || helpers == 1, "set_step_helpers: 0 or 1 helper, got ", helpers);
  Slot& s = slot();
  if (helpers) std::call_once(s.started, [&s] { std::thread(helper_main, std::ref(s)).detach(); });
  s.on.store(helpers == 1, std::memory_order_relaxed);
}

}  // namespace

bool has_step_helper() { return slot().on.load(std::memory_order_relaxed); }

void shared_for(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  Slot& s = slot();
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::unique_lock<std::mutex> hold(s.busy, std::try_to_lock);
  if (chunks < 2 || !s.on.load(std::memory_order_relaxed) || !hold.owns_lock()) {
    if (n > 0) fn(0, n);
    return;
  }
  s.fn.store(&fn, std::memory_order_relaxed);
  s.n.store(n, std::memory_order_relaxed);
  s.chunk.store(chunk, std::memory_order_relaxed);
  s.chunks.store(chunks, std::memory_order_relaxed);
  s.done.store(0, std::memory_order_relaxed);
  const uint64_t gen = (s.state.load(std::memory_order_relaxed) >> 32) + 1;
  s.state.store(gen << 32, std::memory_order_seq_cst);  // publishes the fields above
  if (s.sleeping.load(std::memory_order_seq_cst)) {
    s.posted.fetch_add(1, std::memory_order_seq_cst);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&s.posted), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
  work(s, gen);
  while (s.done.load(std::memory_order_acquire) < chunks) CANTEEN_PAUSE();  // the helper's last chunk
}

}  // namespace canteen

TORCH_LIBRARY_FRAGMENT(canteen, m) { m.def("set_step_helpers(int helpers) -> ()", &canteen::set_step_helpers); }
