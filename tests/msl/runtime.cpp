// Runs one compiled Metal kernel on the CPU: one OS thread per Metal thread,
// one threadgroup at a time, as MLX dispatches it (dispatchThreads: the grid
// is counted in threads, edge threadgroups are partial).
//
// stdin:  "MSL1", grid[3], threadgroup[3], buffer count (uint32 each), then
//         per buffer its size (uint64) and kind (uint32: 0 input, 1 output),
//         then the inputs' bytes in order.
// stdout: the outputs' bytes in order.
// Exit 0, or 3 with one "mlxkv-msl: ..." line on stderr when the kernel
// broke a rule the runtime checks: threads that skip a barrier, threads or
// lanes meeting at different barriers or simd operations, a deadlock, over
// 32 KB of threadgroup memory, over 1024 threads per threadgroup.
//
// Every buffer and threadgroup array is its own exact-size allocation, so
// AddressSanitizer sees out-of-range reads; outputs and threadgroup memory
// start as 0xFF bytes (NaN), so unwritten values show.

#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "msl_abi.h"

namespace {

constexpr unsigned kSimdWidth = 32;
constexpr size_t kThreadgroupMemory = 32768;
constexpr unsigned kMaxThreads = 1024;

[[noreturn]] void fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::fputs("mlxkv-msl: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::fflush(stderr);
  _exit(3);
}

unsigned line_of(unsigned site) { return site >> 10; }

double deadlock_seconds() {
  const char* s = std::getenv("MLXKV_MSL_DEADLOCK_S");
  return s ? std::atof(s) : 30.0;
}

// Wait on `cv` until `done()`; a wait this long means no thread can move.
template <typename Done>
void wait(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, Done done,
          const char* what) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration<double>(deadlock_seconds());
  while (!done()) {
    if (cv.wait_until(lock, deadline) == std::cv_status::timeout && !done())
      fail("deadlock at a %s: some threads never reach it", what);
  }
}

struct Simdgroup {
  std::mutex mu;
  std::condition_variable cv;
  unsigned size = 0;
  unsigned waiting = 0;
  unsigned exited = 0;
  unsigned long generation = 0;
  unsigned site = 0;
  unsigned active = 0;
  unsigned char values[kSimdWidth][16];
  unsigned result_active = 0;
  unsigned char result[kSimdWidth][16];

  void complete() {
    std::memcpy(result, values, sizeof result);
    result_active = active;
    waiting = 0;
    generation++;
    cv.notify_all();
  }
};

struct Group {
  unsigned position[3];
  unsigned size = 0;
  std::mutex mu;
  std::condition_variable cv;
  unsigned waiting = 0;
  unsigned exited = 0;
  unsigned long generation = 0;
  unsigned site = 0;
  std::vector<std::unique_ptr<Simdgroup>> simdgroups;
  std::mutex arrays_mu;
  std::vector<std::pair<void*, size_t>> arrays;
  size_t array_bytes = 0;

  ~Group() {
    for (auto& a : arrays) std::free(a.first);
  }
};

struct ThreadState {
  Group* group;
  unsigned index;
  size_t next_array = 0;
};

thread_local ThreadState* self = nullptr;

void leave_kernel() {
  Group& g = *self->group;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.exited++;
    if (g.waiting > 0 && g.waiting + g.exited == g.size)
      fail("threadgroup (%u,%u,%u): %u threads left the kernel while %u wait at the "
           "barrier on line %u (a barrier skipped by part of the threadgroup)",
           g.position[0], g.position[1], g.position[2], g.exited, g.waiting,
           line_of(g.site));
  }
  Simdgroup& s = *g.simdgroups[self->index / kSimdWidth];
  std::lock_guard<std::mutex> lock(s.mu);
  s.exited++;
  // Lanes that returned are inactive; the others' operation completes.
  if (s.waiting > 0 && s.waiting + s.exited == s.size) s.complete();
}

void run_thread(Group* g, unsigned index, const unsigned local[3], const unsigned dims[3],
                const unsigned grid[3], const unsigned tg[3], const unsigned groups[3],
                void* const* buffers) {
  ThreadState state{g, index};
  self = &state;
  MlxkvBuiltins b{};
  for (int i = 0; i < 3; i++) {
    b.thread_position_in_grid[i] = g->position[i] * tg[i] + local[i];
    b.threads_per_grid[i] = grid[i];
    b.threadgroup_position_in_grid[i] = g->position[i];
    b.threadgroups_per_grid[i] = groups[i];
    b.thread_position_in_threadgroup[i] = local[i];
    b.threads_per_threadgroup[i] = dims[i];
    b.dispatch_threads_per_threadgroup[i] = tg[i];
  }
  b.thread_index_in_threadgroup = index;
  b.thread_index_in_simdgroup = index % kSimdWidth;
  b.simdgroup_index_in_threadgroup = index / kSimdWidth;
  b.simdgroups_per_threadgroup = (g->size + kSimdWidth - 1) / kSimdWidth;
  b.threads_per_simdgroup = kSimdWidth;
  b.quadgroup_index_in_threadgroup = index / 4;
  b.thread_index_in_quadgroup = index % 4;
  mlxkv_msl_entry(buffers, &b);
  leave_kernel();
  self = nullptr;
}

void run_grid(unsigned grid[3], unsigned tg[3], void* const* buffers) {
  unsigned groups[3];
  for (int i = 0; i < 3; i++) {
    if (grid[i] == 0) return;
    tg[i] = tg[i] < grid[i] ? tg[i] : grid[i];  // MLX clamps the group to the grid
    if (tg[i] == 0) fail("threadgroup size 0");
    groups[i] = (grid[i] + tg[i] - 1) / tg[i];
  }
  if (tg[0] * tg[1] * tg[2] > kMaxThreads)
    fail("%u threads per threadgroup, over Metal's %u", tg[0] * tg[1] * tg[2], kMaxThreads);
  for (unsigned z = 0; z < groups[2]; z++) {
    for (unsigned y = 0; y < groups[1]; y++) {
      for (unsigned x = 0; x < groups[0]; x++) {
        Group g;
        g.position[0] = x;
        g.position[1] = y;
        g.position[2] = z;
        unsigned dims[3];
        for (int i = 0; i < 3; i++) {
          unsigned left = grid[i] - g.position[i] * tg[i];
          dims[i] = left < tg[i] ? left : tg[i];
        }
        g.size = dims[0] * dims[1] * dims[2];
        for (unsigned s = 0; s * kSimdWidth < g.size; s++) {
          g.simdgroups.emplace_back(new Simdgroup);
          unsigned left = g.size - s * kSimdWidth;
          g.simdgroups.back()->size = left < kSimdWidth ? left : kSimdWidth;
        }
        std::vector<std::thread> threads;
        threads.reserve(g.size);
        for (unsigned index = 0; index < g.size; index++) {
          unsigned local[3] = {index % dims[0], (index / dims[0]) % dims[1],
                               index / (dims[0] * dims[1])};
          threads.emplace_back([&g, index, local, &dims, grid, tg, &groups, buffers] {
            run_thread(&g, index, local, dims, grid, tg, groups, buffers);
          });
        }
        for (auto& t : threads) t.join();
      }
    }
  }
}

void read_exact(void* dst, size_t n) {
  if (n && std::fread(dst, 1, n, stdin) != n) fail("short input");
}

}  // namespace

extern "C" void mlxkv_msl_barrier(unsigned site) {
  Group& g = *self->group;
  std::unique_lock<std::mutex> lock(g.mu);
  if (g.waiting == 0) {
    g.site = site;
  } else if (g.site != site) {
    fail("threadgroup (%u,%u,%u): threads wait at different barriers (lines %u and %u)",
         g.position[0], g.position[1], g.position[2], line_of(g.site), line_of(site));
  }
  g.waiting++;
  if (g.waiting + g.exited == g.size) {
    if (g.exited)
      fail("threadgroup (%u,%u,%u): %u threads left the kernel without reaching the "
           "barrier on line %u",
           g.position[0], g.position[1], g.position[2], g.exited, line_of(site));
    g.waiting = 0;
    g.generation++;
    g.cv.notify_all();
    return;
  }
  unsigned long generation = g.generation;
  wait(g.cv, lock, [&] { return g.generation != generation; }, "threadgroup barrier");
}

extern "C" void mlxkv_msl_simd_exchange(const void* value, unsigned size, void* lanes,
                                        unsigned* active, unsigned* lane, unsigned site) {
  Group& g = *self->group;
  Simdgroup& s = *g.simdgroups[self->index / kSimdWidth];
  unsigned me = self->index % kSimdWidth;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.waiting == 0) {
    s.site = site;
    s.active = 0;
  } else if (s.site != site) {
    fail("threadgroup (%u,%u,%u) simdgroup %u: lanes reached different simd operations "
         "(lines %u and %u)",
         g.position[0], g.position[1], g.position[2], self->index / kSimdWidth,
         line_of(s.site), line_of(site));
  }
  std::memcpy(s.values[me], value, size);
  s.active |= 1u << me;
  s.waiting++;
  unsigned long generation = s.generation;
  if (s.waiting + s.exited == s.size) {
    s.complete();
  } else {
    wait(s.cv, lock, [&] { return s.generation != generation; }, "simd operation");
  }
  // The next operation cannot complete before this lane joins it, so the
  // result stays put until read.
  std::memcpy(lanes, s.result, sizeof s.result);
  *active = s.result_active;
  *lane = me;
}

extern "C" void* mlxkv_msl_tg_alloc(size_t bytes, size_t align) {
  Group& g = *self->group;
  std::lock_guard<std::mutex> lock(g.arrays_mu);
  size_t k = self->next_array++;
  if (k == g.arrays.size()) {
    g.array_bytes = (g.array_bytes + align - 1) / align * align + bytes;
    if (g.array_bytes > kThreadgroupMemory)
      fail("%zu bytes of threadgroup memory, over Metal's %zu", g.array_bytes,
           kThreadgroupMemory);
    void* p = std::malloc(bytes ? bytes : 1);
    std::memset(p, 0xFF, bytes);
    g.arrays.emplace_back(p, bytes);
  } else if (k > g.arrays.size() || g.arrays[k].second != bytes) {
    fail("threads of one threadgroup declared different threadgroup arrays");
  }
  return g.arrays[k].first;
}

int main() {
  char magic[4];
  unsigned header[7];
  read_exact(magic, 4);
  if (std::memcmp(magic, "MSL1", 4) != 0) fail("bad input header");
  read_exact(header, sizeof header);
  unsigned grid[3] = {header[0], header[1], header[2]};
  unsigned tg[3] = {header[3], header[4], header[5]};
  unsigned count = header[6];
  std::vector<unsigned long long> sizes(count);
  std::vector<unsigned> kinds(count);
  for (unsigned i = 0; i < count; i++) {
    read_exact(&sizes[i], sizeof sizes[i]);
    read_exact(&kinds[i], sizeof kinds[i]);
  }
  std::vector<void*> buffers(count);
  for (unsigned i = 0; i < count; i++) {
    buffers[i] = std::malloc(sizes[i] ? sizes[i] : 1);
    if (kinds[i] == 0) {
      read_exact(buffers[i], sizes[i]);
    } else {
      std::memset(buffers[i], 0xFF, sizes[i]);
    }
  }
  run_grid(grid, tg, buffers.data());
  for (unsigned i = 0; i < count; i++) {
    if (kinds[i] == 1 && std::fwrite(buffers[i], 1, sizes[i], stdout) != sizes[i])
      fail("short output");
  }
  std::fflush(stdout);
  for (void* p : buffers) std::free(p);
  return 0;
}
