// Runs one compiled Metal kernel on the CPU, one threadgroup at a time, as
// MLX dispatches it (dispatchThreads: the grid is counted in threads, edge
// threadgroups are partial). A Metal thread is a fiber on one OS thread: a
// barrier or simd operation is then a switch of a few nanoseconds (x86-64;
// ucontext elsewhere), where with OS threads it was a futex round trip through a
// scheduler that the test suite keeps busy. Under a sanitizer each Metal
// thread is an OS thread, so that ThreadSanitizer sees the races a missing
// barrier allows and AddressSanitizer its usual stacks.
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
//
// Load tracing: a kernel compiled with -fsanitize-coverage=trace-loads calls
// __sanitizer_cov_load* before every load. With MLXKV_MSL_TRACE=FILE and
// MLXKV_MSL_TRACE_BUFFERS=i,j,... each load inside one of those buffers is
// written to FILE as a TraceRecord (efficiency.py groups them into
// simdgroup-wide loads).

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
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

#if defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define MLXKV_MSL_OS_THREADS 1
#endif
#endif

// A fiber's saved registers. On x86-64 a switch is a dozen instructions
// (mlxkv_fiber_switch below); swapcontext also saves the signal mask with a
// system call each time, which was 40% of a launch's time.
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;  // its stack, the registers pushed on it
};

extern "C" void mlxkv_fiber_switch(void** save_sp, void* load_sp);
// Push the callee-saved registers and the SSE and x87 control words, swap
// stacks, pop the other side's. A new fiber's stack is laid out the same
// way by context_make, its return address the fiber's entry.
asm(R"(
  .text
  .globl mlxkv_fiber_switch
  .type mlxkv_fiber_switch, @function
mlxkv_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mlxkv_fiber_switch, .-mlxkv_fiber_switch
)");

void context_make(Context& c, char* stack, size_t bytes, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<uint64_t*>(top - 72);  // entry starts as if called: rsp = 8 mod 16
  std::memset(frame, 0, 72);
  uint32_t mxcsr = 0x1F80, fpcw = 0x037F;  // the defaults: round to nearest, exceptions masked
  std::memcpy(frame, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(frame) + 4, &fpcw, 4);
  frame[7] = reinterpret_cast<uint64_t>(entry);
  c.sp = frame;
}

void context_switch(Context& from, const Context& to) { mlxkv_fiber_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void context_make(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

void context_switch(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// The fibers of the threadgroup that is running, or none (OS threads).
struct Fibers {
  Context scheduler;
  void* current = nullptr;      // the Fiber being resumed
  unsigned long progress = 0;   // a gate opened, a wait ended, a fiber began or ended
  const char* waiting_at = "";  // what the last idle fiber waits at
};
Fibers* fibers = nullptr;

void fiber_yield();

double deadlock_seconds() {
  const char* s = std::getenv("MLXKV_MSL_DEADLOCK_S");
  return s ? std::atof(s) : 30.0;
}

// Where threads wait for the rest of their threadgroup or simdgroup. The
// last to arrive bumps `generation` (release); waiters watch it (acquire)
// without taking the arrivals' mutex: re-taking it would order later
// arrivals' writes before the waiter's reads, and ThreadSanitizer would miss
// a missing barrier. They yield a few times, then sleep on a futex.
struct Gate {
  std::atomic<uint32_t> generation{0};

  void open() {
    generation.fetch_add(1, std::memory_order_release);
    if (fibers != nullptr) {
      fibers->progress++;
      return;
    }
    syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
  }

  // Wait for the opening after `seen`; a wait this long means no thread can move
  // (as fibers: a round of every fiber in which none moved).
  void wait(uint32_t seen, const char* what) const {
    if (fibers != nullptr) {
      while (generation.load(std::memory_order_acquire) == seen) {
        fibers->waiting_at = what;
        fiber_yield();
      }
      fibers->progress++;
      return;
    }
    for (int spin = 0; spin < 8; spin++) {
      if (generation.load(std::memory_order_acquire) != seen) return;
      sched_yield();
    }
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration<double>(deadlock_seconds());
    timespec nap{0, 50 * 1000 * 1000};
    while (generation.load(std::memory_order_acquire) == seen) {
      if (std::chrono::steady_clock::now() > deadline)
        fail("deadlock at a %s: some threads never reach it", what);
      syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, &nap, nullptr, 0);
    }
  }
};

struct Simdgroup {
  std::mutex mu;  // arrivals
  Gate gate;
  unsigned size = 0;
  unsigned waiting = 0;
  unsigned exited = 0;
  unsigned site = 0;
  unsigned active = 0;
  unsigned char values[kSimdWidth][16];
  unsigned result_active = 0;
  unsigned char result[kSimdWidth][16];

  void complete() {
    std::memcpy(result, values, sizeof result);
    result_active = active;
    waiting = 0;
    gate.open();
  }
};

struct Group {
  unsigned position[3];
  uint32_t index = 0;  // linear, x fastest
  unsigned size = 0;
  std::mutex mu;  // arrivals at barriers
  Gate gate;
  unsigned waiting = 0;
  unsigned exited = 0;
  unsigned site = 0;
  std::vector<std::unique_ptr<Simdgroup>> simdgroups;
  std::mutex arrays_mu;
  std::vector<std::pair<void*, size_t>> arrays;
  size_t array_bytes = 0;

  ~Group() {
    for (auto& a : arrays) std::free(a.first);
  }
};

// One traced load: who (threadgroup, thread), when (the thread's count of
// barriers and simd operations so far), where from (the load's return
// address) and what (buffer, byte offset, size).
struct TraceRecord {
  uint32_t group;  // linear threadgroup index
  uint16_t thread;
  uint8_t buffer;
  uint8_t size;
  uint32_t epoch;
  uint32_t site;
  uint64_t offset;
};
static_assert(sizeof(TraceRecord) == 24, "efficiency.py reads 24-byte records");

struct TracedBuffer {
  unsigned index;
  const char* begin;
  const char* end;
};
std::vector<TracedBuffer> traced;
std::mutex trace_mu;
std::vector<TraceRecord> trace;

struct ThreadState {
  Group* group;
  unsigned index;
  size_t next_array = 0;
  uint32_t epoch = 0;
  std::vector<TraceRecord> loads;
};

thread_local ThreadState* self = nullptr;

void trace_load(const void* p, unsigned size, const void* site) {
  if (self == nullptr) return;
  const char* at = static_cast<const char*>(p);
  for (const TracedBuffer& b : traced) {
    if (at >= b.begin && at < b.end) {
      self->loads.push_back({self->group->index, uint16_t(self->index), uint8_t(b.index),
                             uint8_t(size), self->epoch, uint32_t(uintptr_t(site)),
                             uint64_t(at - b.begin)});
      return;
    }
  }
}

void leave_kernel() {
  Group& g = *self->group;
  if (!self->loads.empty()) {
    std::lock_guard<std::mutex> lock(trace_mu);
    trace.insert(trace.end(), self->loads.begin(), self->loads.end());
  }
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

// Threadgroup (x, y, z) of the grid: its position, linear index, size `dims`
// (an edge group is partial) and simdgroups.
void place_group(Group& g, unsigned x, unsigned y, unsigned z, const unsigned grid[3],
                 const unsigned tg[3], const unsigned groups[3], unsigned dims[3]) {
  g.position[0] = x;
  g.position[1] = y;
  g.position[2] = z;
  g.index = (z * groups[1] + y) * groups[0] + x;
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
}

// ---- fibers ----

struct Fiber {
  Context context;
  Group* group;
  unsigned index;
  unsigned local[3];
  bool done = false;
};

// What every fiber of a grid shares: the launch's geometry and buffers.
struct FiberLaunch {
  const unsigned* dims;
  const unsigned* grid;
  const unsigned* tg;
  const unsigned* groups;
  void* const* buffers;
};
const FiberLaunch* fiber_launch = nullptr;

void fiber_yield() {
  ThreadState* me = self;
  Fiber* f = static_cast<Fiber*>(fibers->current);
  context_switch(f->context, fibers->scheduler);
  self = me;
}

void fiber_main() {
  Fiber* f = static_cast<Fiber*>(fibers->current);
  const FiberLaunch& l = *fiber_launch;
  fibers->progress++;
  run_thread(f->group, f->index, f->local, l.dims, l.grid, l.tg, l.groups, l.buffers);
  f->done = true;
  fibers->progress++;
  context_switch(f->context, fibers->scheduler);  // never resumed
  fail("a finished fiber was resumed");
}

// Fiber stacks: the kernels keep their per-thread arrays on them (q, o: a few KB).
constexpr size_t kFiberStack = 256 * 1024;

struct FiberStacks {
  char* base = nullptr;
  size_t count = 0;
  explicit FiberStacks(size_t n) : count(n) {
    void* p = mmap(nullptr, n * kFiberStack, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("cannot map %zu fiber stacks", n);
    base = static_cast<char*>(p);
    // A page below each stack faults on an overflow, where it would write the next fiber's.
    for (size_t i = 0; i < n; i++) mprotect(stack(i), 4096, PROT_NONE);
  }
  ~FiberStacks() { munmap(base, count * kFiberStack); }
  char* stack(size_t i) const { return base + i * kFiberStack; }
};

// Run group `g` to its end: each fiber runs until it waits, round after round.
void run_group_as_fibers(Group& g, const FiberStacks& stacks) {
  const unsigned* dims = fiber_launch->dims;
  Fibers f;
  fibers = &f;
  std::vector<Fiber> list(g.size);
  for (unsigned i = 0; i < g.size; i++) {
    Fiber& fb = list[i];
    fb.group = &g;
    fb.index = i;
    fb.local[0] = i % dims[0];
    fb.local[1] = (i / dims[0]) % dims[1];
    fb.local[2] = i / (dims[0] * dims[1]);
    context_make(fb.context, stacks.stack(i), kFiberStack, fiber_main);
  }
  for (unsigned live = g.size; live > 0;) {
    unsigned long before = f.progress;
    for (Fiber& fb : list) {
      if (fb.done) continue;
      f.current = &fb;
      context_switch(f.scheduler, fb.context);
      if (fb.done) live--;
    }
    if (live > 0 && f.progress == before)
      fail("deadlock at a %s: some threads never reach it", f.waiting_at);
  }
  fibers = nullptr;
}

void run_grid_as_fibers(const unsigned grid[3], const unsigned tg[3], const unsigned groups[3],
                        void* const* buffers) {
  unsigned dims[3];
  FiberLaunch launch{dims, grid, tg, groups, buffers};
  fiber_launch = &launch;
  FiberStacks stacks(tg[0] * tg[1] * tg[2]);
  for (unsigned z = 0; z < groups[2]; z++) {
    for (unsigned y = 0; y < groups[1]; y++) {
      for (unsigned x = 0; x < groups[0]; x++) {
        Group g;
        place_group(g, x, y, z, grid, tg, groups, dims);
        run_group_as_fibers(g, stacks);
      }
    }
  }
  fiber_launch = nullptr;
}

// ---- OS threads (under a sanitizer) ----

// The grid's threadgroups run one at a time on one set of OS threads, as
// many as the largest group has (starting 256 threads per group would cost
// more than most kernels' runs).
struct Dispatch {
  std::mutex mu;
  std::condition_variable cv;
  Group* group = nullptr;  // the threadgroup now running
  unsigned dims[3];        // its size
  unsigned long round = 0;
  unsigned busy = 0;  // workers not done with this round
  bool closed = false;
};

void work(Dispatch& d, unsigned index, const unsigned grid[3], const unsigned tg[3],
          const unsigned groups[3], void* const* buffers) {
  for (unsigned long seen = 0;;) {
    Group* g;
    unsigned dims[3];
    {
      std::unique_lock<std::mutex> lock(d.mu);
      d.cv.wait(lock, [&] { return d.closed || d.round != seen; });
      if (d.closed) return;
      seen = d.round;
      g = d.group;
      std::memcpy(dims, d.dims, sizeof dims);
    }
    if (index < g->size) {
      unsigned local[3] = {index % dims[0], (index / dims[0]) % dims[1],
                           index / (dims[0] * dims[1])};
      run_thread(g, index, local, dims, grid, tg, groups, buffers);
    }
    std::lock_guard<std::mutex> lock(d.mu);
    if (--d.busy == 0) d.cv.notify_all();
  }
}

void run_grid(unsigned grid[3], unsigned tg[3], void* const* buffers) {
  unsigned groups[3];
  for (int i = 0; i < 3; i++) {
    if (grid[i] == 0) return;
    tg[i] = tg[i] < grid[i] ? tg[i] : grid[i];  // MLX clamps the group to the grid
    if (tg[i] == 0) fail("threadgroup size 0");
    groups[i] = (grid[i] + tg[i] - 1) / tg[i];
  }
  const unsigned threads = tg[0] * tg[1] * tg[2];
  if (threads > kMaxThreads) fail("%u threads per threadgroup, over Metal's %u", threads, kMaxThreads);
#ifndef MLXKV_MSL_OS_THREADS
  run_grid_as_fibers(grid, tg, groups, buffers);
  return;
#endif
  Dispatch d;
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned index = 0; index < threads; index++)
    workers.emplace_back([&d, index, grid, tg, &groups, buffers] { work(d, index, grid, tg, groups, buffers); });
  for (unsigned z = 0; z < groups[2]; z++) {
    for (unsigned y = 0; y < groups[1]; y++) {
      for (unsigned x = 0; x < groups[0]; x++) {
        Group g;
        std::unique_lock<std::mutex> lock(d.mu);
        place_group(g, x, y, z, grid, tg, groups, d.dims);
        d.group = &g;
        d.busy = threads;
        d.round++;
        d.cv.notify_all();
        d.cv.wait(lock, [&] { return d.busy == 0; });
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(d.mu);
    d.closed = true;
    d.cv.notify_all();
  }
  for (auto& t : workers) t.join();
}

void read_exact(void* dst, size_t n) {
  if (n && std::fread(dst, 1, n, stdin) != n) fail("short input");
}

}  // namespace

extern "C" void mlxkv_msl_barrier(unsigned site) {
  self->epoch++;
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
    g.gate.open();
    return;
  }
  uint32_t seen = g.gate.generation.load(std::memory_order_relaxed);
  lock.unlock();
  g.gate.wait(seen, "threadgroup barrier");
}

extern "C" void mlxkv_msl_simd_exchange(const void* value, unsigned size, void* lanes,
                                        unsigned* active, unsigned* lane, unsigned site) {
  self->epoch++;
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
  uint32_t seen = s.gate.generation.load(std::memory_order_relaxed);
  if (s.waiting + s.exited == s.size) {
    s.complete();
  } else {
    lock.unlock();
    s.gate.wait(seen, "simd operation");
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

#define MLXKV_TRACE_LOAD(n, type)                                \
  extern "C" void __sanitizer_cov_load##n(type* p) {              \
    trace_load(p, n, __builtin_return_address(0));                \
  }
MLXKV_TRACE_LOAD(1, uint8_t)
MLXKV_TRACE_LOAD(2, uint16_t)
MLXKV_TRACE_LOAD(4, uint32_t)
MLXKV_TRACE_LOAD(8, uint64_t)
MLXKV_TRACE_LOAD(16, __int128)
#undef MLXKV_TRACE_LOAD

namespace {

void trace_buffers(void* const* buffers, const std::vector<unsigned long long>& sizes) {
  const char* list = std::getenv("MLXKV_MSL_TRACE_BUFFERS");
  for (const char* at = list; at && *at;) {
    char* end;
    unsigned long i = std::strtoul(at, &end, 10);
    if (end == at || i >= sizes.size()) fail("bad MLXKV_MSL_TRACE_BUFFERS %s", list);
    const char* begin = static_cast<const char*>(buffers[i]);
    traced.push_back({unsigned(i), begin, begin + sizes[i]});
    at = *end == ',' ? end + 1 : end;
  }
}

void write_trace() {
  const char* path = std::getenv("MLXKV_MSL_TRACE");
  if (path == nullptr) return;
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr || std::fwrite(trace.data(), sizeof(TraceRecord), trace.size(), f) != trace.size() ||
      std::fclose(f) != 0)
    fail("cannot write the load trace to %s", path);
}

}  // namespace

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
  trace_buffers(buffers.data(), sizes);
  run_grid(grid, tg, buffers.data());
  write_trace();
  for (unsigned i = 0; i < count; i++) {
    if (kinds[i] == 1 && std::fwrite(buffers[i], 1, sizes[i], stdout) != sizes[i])
      fail("short output");
  }
  std::fflush(stdout);
  for (void* p : buffers) std::free(p);
  return 0;
}
