/* The CUDA emulator's runtime (tests/cudaemu/include/cudaemu.h): the CUDA
 * runtime calls the module and the gpu suite make, on host memory, and the
 * kernels' threads as fibers. Tests only; never installed.
 *
 * What it checks that a GPU would not always report: launch
 * configurations (as the driver does), copies and sets that run past a
 * device allocation or name the wrong kind of memory, kernels that do not
 * meet at a barrier (a deadlock is reported, not waited on), warps whose
 * lanes disagree on an intrinsic's mask, and host code that reads what an
 * asynchronous copy into pinned memory brings, or writes what one out of
 * pinned memory is to read, before waiting for it. */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <map>
#include <set>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDAEMU_ASAN 1
#else
#define CUDAEMU_ASAN 0
#endif

namespace
{

[[noreturn]] void fatal(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cudaemu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

/* Fault injection (cudaemu_fail_at()): the n-th call that can fail (an
 * allocation, a copy, a set, a launch, a synchronisation) fails once; with
 * `sticky`, it and every fallible call after it fail with
 * cudaErrorIllegalAddress, as every call does after a kernel faults. */
std::atomic<long> fallible_calls{0}, fail_at{0};
std::atomic<int> fail_sticky{0}, failed_sticky{0};
std::atomic<int> injected_kind{0}; /* the error the failed call returned */

/* cudaSuccess, or the error to return instead of doing the call */
cudaError_t injected(cudaError_t kind)
{
    if (failed_sticky)
        return cudaErrorIllegalAddress;
    long n = ++fallible_calls;
    if (!fail_at || n != fail_at)
        return cudaSuccess;
    injected_kind = fail_sticky ? cudaErrorIllegalAddress : kind;
    if (!fail_sticky)
        return kind;
    failed_sticky = 1;
    return cudaErrorIllegalAddress;
}

/* ---- memory ------------------------------------------------------------- */

enum mem_kind { MEM_DEVICE, MEM_HOST };
struct allocation {
    size_t size;
    mem_kind kind;
    int device; /* the device selected when it was made (CUDAEMU_DEVICES) */
};
thread_local int current_device = 0;
std::mutex mem_lock;
std::map<uintptr_t, allocation> allocations;

/* The allocation holding [p, p + n), or NULL (with *partial set when p is
 * inside one that ends too soon). */
const allocation *find_allocation(const void *p, size_t n, uintptr_t *base, int *partial)
{
    std::lock_guard<std::mutex> g(mem_lock);
    uintptr_t a = (uintptr_t)p;
    auto it = allocations.upper_bound(a);
    *partial = 0;
    if (it == allocations.begin())
        return NULL;
    --it;
    if (a >= it->first + it->second.size + (it->second.size == 0))
        return NULL;
    if (a + n > it->first + it->second.size) {
        *partial = 1;
        return NULL;
    }
    *base = it->first;
    return &it->second;
}

/* Device and pinned memory: pages of their own with an inaccessible page
 * right after, the block placed as near it as 256-byte alignment allows,
 * so that a kernel that reads or writes past the end faults there. */
struct mapping {
    char *base;
    size_t bytes;
};
std::map<uintptr_t, mapping> mappings;

cudaError_t allocate(void **out, size_t size, mem_kind kind)
{
    if (!out)
        return cudaErrorInvalidValue;
    if (cudaError_t e = injected(cudaErrorMemoryAllocation))
        return e;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), used = (size + 255) & ~(size_t)255;
    size_t span = (used + page - 1) / page * page + page;
    char *base = (char *)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                              0);
    if (base == MAP_FAILED)
        return cudaErrorMemoryAllocation;
    mprotect(base + span - page, page, PROT_NONE);
    char *p = base + span - page - used;
    /* garbage, as fresh device memory is: a kernel that reads what nobody
     * wrote makes wrong bytes rather than lucky zeros */
    memset(p, kind == MEM_DEVICE ? 0xcd : 0xab, used);
    std::lock_guard<std::mutex> g(mem_lock);
    allocations[(uintptr_t)p] = allocation{size, kind, current_device};
    mappings[(uintptr_t)p] = mapping{base, span};
    *out = p;
    return cudaSuccess;
}

cudaError_t release(void *p, mem_kind kind)
{
    if (!p)
        return cudaSuccess;
    std::lock_guard<std::mutex> g(mem_lock);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second.kind != kind)
        return cudaErrorInvalidValue;
    allocations.erase(it);
    auto m = mappings.find((uintptr_t)p);
    munmap(m->second.base, m->second.bytes);
    mappings.erase(m);
    return cudaSuccess;
}

/* 0 when [p, p + n) may be the `device` (1) or host (0) side of a copy. */
int check_side(const void *p, size_t n, int device, const char *what)
{
    uintptr_t base;
    int partial;
    const allocation *a = find_allocation(p, n, &base, &partial);
    if (partial) {
        fprintf(stderr, "cudaemu: %s of %zu bytes at %p runs past its allocation\n", what, n, p);
        return -1;
    }
    if (device && (!a || a->kind != MEM_DEVICE)) {
        fprintf(stderr, "cudaemu: %s at %p is not device memory\n", what, p);
        return -1;
    }
    if (!device && a && a->kind == MEM_DEVICE) {
        fprintf(stderr, "cudaemu: %s at %p is device memory where host memory was named\n", what,
                p);
        return -1;
    }
    return 0;
}

int is_device(const void *p)
{
    uintptr_t base;
    int partial;
    const allocation *a = find_allocation(p, 1, &base, &partial);
    return a && a->kind == MEM_DEVICE;
}

/* ---- errors ------------------------------------------------------------- */

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t note(cudaError_t e)
{
    if (e != cudaSuccess)
        last_error = e;
    return e;
}

/* ---- the device --------------------------------------------------------- */

const int emu_sms = 3; /* an odd number of blocks in cooperative launches */
/* SMs a cooperative launch may fill: fewer than the device reports where a
 * test sets it (cudaemu_limit_coop_sms()), as under MPS. */
std::atomic<int> coop_sms{emu_sms};
/* Blocks of `threads` one "SM" holds at once (cooperative launches). */
int blocks_per_sm(uint64_t threads)
{
    return threads <= 512 ? 2 : 1;
}
const size_t emu_default_shared = 48 * 1024, emu_max_shared = 227 * 1024;

int device_count()
{
    const char *e = getenv("CUDAEMU_DEVICES");
    return e && *e ? atoi(e) : 1;
}

std::mutex attr_lock;
std::map<const void *, size_t> max_dynamic_shared;
std::map<const void *, cudaemu::invoker_fn> invokers;

} // namespace

/* ---- fibers --------------------------------------------------------------- */

namespace cudaemu
{
CUDAEMU_TLS_EXPORT const thread_ctx *cudaemu_tl_ctx;
namespace
{

struct fiber {
    void *sp;
    thread_ctx ctx;
    unsigned lin;
    bool done;
    fiber *next, *prev; /* the ring of threads not yet exited */
};

struct warp_state {
    unsigned alive, arrived, mask, gen;
    warp_view view[2];
};

struct grid_state {
    pthread_barrier_t barrier;
};

struct block_state {
    fiber *fibers;
    unsigned n, alive;
    unsigned bar_arrived, bar_gen;
    bool bar_grid; /* the barrier under way is a grid.sync */
    warp_state *warps;
    void *sched_sp;
    body_fn body;
    void *closure;
    void *dyn;
    grid_state *grid;
    unsigned idle; /* resumptions since a thread last moved on */
    fiber *first;  /* the thread the block starts with */
};

#define CUDAEMU_TLS __thread __attribute__((tls_model("initial-exec")))
CUDAEMU_TLS block_state *tl_block;
CUDAEMU_TLS fiber *tl_fiber;

/* Fiber stacks, per OS thread, reused launch after launch; a guard page
 * under each, so that an overflow faults where it happens. */
const size_t stack_bytes = (CUDAEMU_ASAN ? 256 : 64) * 1024;
struct stack_pool {
    static const size_t count = 1024; /* launch() refuses larger blocks */
    char *base = NULL;
    char *top(size_t i)
    {
        if (i >= count)
            fatal("a block of more than %zu threads", count);
        if (!base) {
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            base = (char *)mmap(NULL, count * stack_bytes, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (base == MAP_FAILED)
                fatal("no memory for %zu fiber stacks", count);
            for (size_t k = 0; k < count; k++)
                mprotect(base + k * stack_bytes, page, PROT_NONE);
        }
        return base + (i + 1) * stack_bytes;
    }
    ~stack_pool()
    {
        if (base)
            munmap(base, count * stack_bytes);
    }
};
thread_local stack_pool stacks;

/* Where in its stack fiber i starts: stacks whose tops lie a multiple of
 * 64 KiB apart all map to the same cache sets, and a block's threads take
 * turns every few instructions, so each switch missed the cache. Starting
 * fiber i (i mod 128) lines lower spreads them over 128 sets. */
size_t stack_color(size_t i)
{
    return (i % 128) * 64;
}

} // namespace
} // namespace cudaemu

extern "C" {
void cudaemu_switch(void **save_sp, void *to_sp);
void cudaemu_fiber_start(void);
__attribute__((used)) void cudaemu_fiber_main(cudaemu::fiber *f);
}

#if defined(__x86_64__)
/* Saves the callee-saved registers on this stack, stores its pointer in
 * *save_sp and resumes the stack at to_sp (System V x86-64). */
__asm__(".text\n"
        ".globl cudaemu_switch\n"
        ".hidden cudaemu_switch\n"
        ".type cudaemu_switch,@function\n"
        "cudaemu_switch:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size cudaemu_switch,.-cudaemu_switch\n"
        ".globl cudaemu_fiber_start\n"
        ".hidden cudaemu_fiber_start\n"
        ".type cudaemu_fiber_start,@function\n"
        "cudaemu_fiber_start:\n"
        "    movq %r12, %rdi\n"
        "    call cudaemu_fiber_main@PLT\n"
        "    ud2\n"
        ".size cudaemu_fiber_start,.-cudaemu_fiber_start\n");
#else
#error "the CUDA emulator switches fibers on x86-64 only"
#endif

namespace cudaemu
{
namespace
{

/* The stack a switch lands on, for AddressSanitizer (which must be told
 * of every stack switch, or it reports the fibers' frames as overflows). */
struct stack_span {
    const void *bottom;
    size_t size;
};
CUDAEMU_TLS const void *sched_bottom;
CUDAEMU_TLS size_t sched_size;

stack_span span_of(const fiber *f)
{
    if (!f)
        return stack_span{sched_bottom, sched_size};
    return stack_span{stacks.top(f->lin) - stack_bytes, stack_bytes};
}

/* Switches to fiber `to` (NULL: back to the scheduler's own stack),
 * leaving the stack pointer to resume this one at *save. A fiber that
 * exits passes dying = true. */
void switch_to(void **save, const fiber *to, void *to_sp, bool dying)
{
#if CUDAEMU_ASAN
    void *fake = NULL;
    stack_span d = span_of(to);
    __sanitizer_start_switch_fiber(dying ? NULL : &fake, d.bottom, d.size);
    cudaemu_switch(save, to_sp);
    __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#else
    (void)to;
    (void)dying;
    cudaemu_switch(save, to_sp);
#endif
}

void enter(fiber *f)
{
    tl_fiber = f;
    cudaemu_tl_ctx = &f->ctx;
}

/* Hands this OS thread to the next live thread of the block; a whole
 * round of threads resumed without any moving on is a deadlock. */
void yield()
{
    block_state *b = tl_block;
    fiber *f = tl_fiber, *to = f->next;
    if (++b->idle > b->alive + 1)
        fatal("block (%u,%u,%u): %u threads wait for each other: %u at a barrier, the rest at "
              "warp intrinsics that do not meet",
              f->ctx.bid.x, f->ctx.bid.y, f->ctx.bid.z, b->alive, b->bar_arrived);
    if (to == f)
        return;
    enter(to);
    switch_to(&f->sp, to, to->sp, false);
}

void release_block(block_state *b)
{
    if (b->bar_grid) {
        int r = pthread_barrier_wait(&b->grid->barrier);
        if (r && r != PTHREAD_BARRIER_SERIAL_THREAD)
            fatal("grid barrier: %s", strerror(r));
        b->bar_grid = false;
    }
    b->bar_arrived = 0;
    b->bar_gen++;
}

void block_barrier(bool grid)
{
    block_state *b = tl_block;
    if (b->bar_arrived && b->bar_grid != grid)
        fatal("threads of block %u meet at __syncthreads and grid.sync at once",
              b->fibers[0].ctx.bid.x);
    b->bar_grid = grid;
    b->idle = 0;
    unsigned g = b->bar_gen;
    if (++b->bar_arrived == b->alive)
        release_block(b);
    else
        while (b->bar_gen == g)
            yield();
}

/* Every lane of the exchange's mask that has not exited has arrived. */
bool warp_met(const warp_state *w)
{
    return (w->arrived & w->alive & w->mask) == (w->alive & w->mask);
}

void release_warp(warp_state *w)
{
    w->arrived = 0;
    w->gen++;
}

} // namespace

void syncthreads()
{
    block_barrier(false);
}

void grid_sync()
{
    if (!tl_block->grid)
        fatal("grid.sync outside a cooperative launch");
    block_barrier(true);
}

void *dynamic_shared()
{
    return tl_block->dyn;
}

const warp_view &warp_exchange(unsigned mask, uint64_t v)
{
    block_state *b = tl_block;
    fiber *f = tl_fiber;
    unsigned l = f->lin & 31;
    warp_state *w = &b->warps[f->lin >> 5];
    if (!(mask >> l & 1u))
        fatal("lane %u of block %u calls a warp intrinsic with mask %#x, which leaves it out", l,
              f->ctx.bid.x, mask);
    unsigned g = w->gen;
    warp_view *view = &w->view[g & 1];
    if (!w->arrived) {
        w->mask = mask;
        view->in = 0;
    } else if (w->mask != mask) {
        fatal("lanes of warp %u (block %u) meet with masks %#x and %#x", f->lin >> 5, f->ctx.bid.x,
              w->mask, mask);
    }
    view->v[l] = v;
    view->in |= 1u << l;
    b->idle = 0;
    w->arrived |= 1u << l;
    if (warp_met(w))
        release_warp(w);
    else
        while (w->gen == g)
            yield();
    return *view;
}

void register_kernel(const void *kernel, invoker_fn invoke)
{
    std::lock_guard<std::mutex> g(attr_lock);
    invokers[kernel] = invoke;
}

namespace
{

void exit_fiber(block_state *b, fiber *f)
{
    f->done = true;
    b->alive--;
    b->idle = 0;
    f->prev->next = f->next;
    f->next->prev = f->prev;
    warp_state *w = &b->warps[f->lin >> 5];
    w->alive &= ~(1u << (f->lin & 31));
    if (w->arrived && warp_met(w))
        release_warp(w);
    if (b->bar_arrived && b->bar_arrived == b->alive)
        release_block(b);
}

/* CUDAEMU_SHUFFLE=SEED (a campaign, not CI): each block's threads run
 * between sync points in a pseudo-random order, and an ordinary launch's
 * blocks too, drawn afresh for every block and launch; 0 or unset: the
 * fixed orders below. */
uint64_t shuffle_seed()
{
    static const uint64_t seed = [] {
        const char *e = getenv("CUDAEMU_SHUFFLE");
        return e ? strtoull(e, NULL, 10) : 0;
    }();
    return seed;
}

uint64_t shuffle_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 0 .. n-1 in an order drawn from `key` (Fisher-Yates). */
std::vector<uint64_t> shuffled(uint64_t n, uint64_t key)
{
    std::vector<uint64_t> order(n);
    for (uint64_t i = 0; i < n; i++)
        order[i] = i;
    for (uint64_t i = n; i > 1; i--) {
        key = shuffle_mix(key);
        std::swap(order[i - 1], order[key % i]);
    }
    return order;
}

std::atomic<uint64_t> shuffle_draws{0};

/* Runs one block's threads to the end on this OS thread. */
void run_block(const cudaemu_cfg &cfg, uint3 bid, body_fn body, void *closure, grid_state *grid,
               std::vector<char> &dyn)
{
    unsigned bx = cfg.block.x, by = cfg.block.y, n = bx * by * cfg.block.z;
    std::vector<fiber> fibers(n);
    std::vector<warp_state> warps((n + 31) / 32);
    block_state b = {};
    b.fibers = fibers.data();
    b.n = b.alive = n;
    b.warps = warps.data();
    b.body = body;
    b.closure = closure;
    b.grid = grid;
    if (!dyn.empty()) {
        memset(dyn.data(), 0xee, dyn.size()); /* shared memory starts as garbage */
        b.dyn = dyn.data();
    }
    for (unsigned i = 0; i < warps.size(); i++) {
        unsigned lanes = n - i * 32 >= 32 ? 32 : n - i * 32;
        warps[i] = warp_state{};
        warps[i].alive = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    }
    for (unsigned i = 0; i < n; i++) {
        fiber *f = &fibers[i];
        f->lin = i;
        f->done = false;
        f->ctx.tid = make_uint3(i % bx, i / bx % by, i / (bx * by));
        f->ctx.bid = bid;
        f->ctx.bdim = cfg.block;
        f->ctx.gdim = cfg.grid;
        f->ctx.lane = i & 31;
        /* the first switch pops r15..rbp (r12: the fiber) and returns to
         * cudaemu_fiber_start with the stack 16-byte aligned for its call */
#if CUDAEMU_ASAN
        /* the stack's last user exited without unwinding: its frames'
         * redzones are still marked */
        ASAN_UNPOISON_MEMORY_REGION(stacks.top(i) - stack_bytes, stack_bytes);
#endif
        void **sp = (void **)(stacks.top(i) - stack_color(i) - 72);
        memset(sp, 0, 72);
        sp[3] = f;
        sp[6] = (void *)cudaemu_fiber_start;
        f->sp = sp;
    }
    /* Thread n/2 goes first and the ring wraps: a block's threads run
     * between sync points in the order n/2 .. n-1, 0 .. n/2-1. A missing
     * __syncthreads then shows whichever way it goes: with thread 0 first,
     * one that thread 0 writes before the others read would pass (they
     * would always read after it), and with thread 0 last, one where they
     * read before it overwrites. */
    std::vector<uint64_t> order;
    if (uint64_t seed = shuffle_seed())
        order = shuffled(n, seed ^ shuffle_mix(++shuffle_draws));
    for (unsigned i = 0; i < n; i++) {
        unsigned at = order.empty() ? (n / 2 + i) % n : (unsigned)order[i];
        unsigned next = order.empty() ? (at + 1) % n : (unsigned)order[(i + 1) % n];
        fibers[at].next = &fibers[next];
        fibers[next].prev = &fibers[at];
    }
    tl_block = &b;
    b.first = &fibers[order.empty() ? n / 2 : order[0]];
    enter(b.first);
    switch_to(&b.sched_sp, b.first, b.first->sp, false); /* back when the last exits */
    tl_block = NULL;
    tl_fiber = NULL;
    cudaemu_tl_ctx = NULL;
}

} // namespace

cudaError_t launch(const void *kernel, const cudaemu_cfg &cfg, int cooperative, body_fn body,
                   void *closure)
{
    const dim3 &g = cfg.grid, &t = cfg.block;
    uint64_t threads = (uint64_t)t.x * t.y * t.z, blocks = (uint64_t)g.x * g.y * g.z;
    size_t shared_cap = emu_default_shared;
    {
        std::lock_guard<std::mutex> lk(attr_lock);
        auto it = max_dynamic_shared.find(kernel);
        if (it != max_dynamic_shared.end())
            shared_cap = it->second;
    }
    if (cudaError_t e = injected(cudaErrorLaunchFailure))
        return note(e);
    if (!threads || threads > 1024 || t.z > 64 || !blocks || g.x > 0x7fffffffu || g.y > 65535 ||
        g.z > 65535)
        return note(cudaErrorInvalidConfiguration);
    if (cfg.shared > shared_cap) {
        fprintf(stderr, "cudaemu: a launch asks %zu bytes of dynamic shared memory, above %zu\n",
                cfg.shared, shared_cap);
        return note(cudaErrorInvalidValue);
    }
    if (!cooperative) {
        std::vector<char> dyn(cfg.shared);
        /* last block first: a kernel that counts on block 0 running before
         * the others (a race on a GPU) computes wrong here */
        std::vector<uint64_t> order;
        if (uint64_t seed = shuffle_seed())
            order = shuffled(blocks, seed ^ shuffle_mix(++shuffle_draws));
        for (uint64_t j = blocks; j-- > 0;) {
            uint64_t k = order.empty() ? j : order[j];
            uint3 bid = make_uint3((unsigned)(k % g.x), (unsigned)(k / g.x % g.y),
                                   (unsigned)(k / ((uint64_t)g.x * g.y)));
            run_block(cfg, bid, body, closure, NULL, dyn);
        }
        return cudaSuccess;
    }
    if (blocks > (uint64_t)coop_sms * (uint64_t)blocks_per_sm(threads))
        return note(cudaErrorCooperativeLaunchTooLarge);
    grid_state grid;
    pthread_barrier_init(&grid.barrier, NULL, (unsigned)blocks);
    std::vector<std::thread> team;
    for (uint64_t k = 0; k < blocks; k++)
        team.emplace_back([&, k] {
            std::vector<char> dyn(cfg.shared);
            uint3 bid = make_uint3((unsigned)(k % g.x), (unsigned)(k / g.x % g.y),
                                   (unsigned)(k / ((uint64_t)g.x * g.y)));
            run_block(cfg, bid, body, closure, &grid, dyn);
        });
    for (std::thread &th : team)
        th.join();
    pthread_barrier_destroy(&grid.barrier);
    return cudaSuccess;
}

} // namespace cudaemu

extern "C" void cudaemu_fiber_main(cudaemu::fiber *f)
{
    cudaemu::block_state *b = cudaemu::tl_block;
#if CUDAEMU_ASAN
    /* the first switch into this fiber: what it came from (the scheduler's
     * stack, the first time on this OS thread) */
    const void *from_bottom;
    size_t from_size;
    __sanitizer_finish_switch_fiber(NULL, &from_bottom, &from_size);
    if (!cudaemu::sched_bottom && f == b->first) {
        cudaemu::sched_bottom = from_bottom;
        cudaemu::sched_size = from_size;
    }
#endif
    b->body(b->closure);
    cudaemu::exit_fiber(b, f);
    if (b->alive) {
        cudaemu::enter(f->next);
        cudaemu::switch_to(&f->sp, f->next, f->next->sp, true);
    } else {
        cudaemu::switch_to(&f->sp, NULL, b->sched_sp, true);
    }
    fatal("a finished CUDA thread was resumed");
}

/* ---- the runtime API ------------------------------------------------------ */

extern "C" {

void cudaemu_fail_at(long n, int sticky)
{
    fallible_calls = 0;
    injected_kind = cudaSuccess;
    fail_sticky = sticky;
    failed_sticky = 0;
    fail_at = n;
}

void cudaemu_limit_coop_sms(int sms)
{
    coop_sms = sms > 0 && sms < emu_sms ? sms : emu_sms;
}

long cudaemu_fallible_calls(void)
{
    return fallible_calls;
}

cudaError_t cudaemu_injected_error(void)
{
    return (cudaError_t)injected_kind.load();
}

cudaError_t cudaGetDeviceCount(int *count)
{
    int n = device_count();
    if (!count)
        return note(cudaErrorInvalidValue);
    *count = n > 0 ? n : 0;
    return n > 0 ? cudaSuccess : note(cudaErrorNoDevice);
}

/* Peer access: from device a to b's memory once enabled with a current
 * (cudaDeviceEnablePeerAccess(b)); every pair of two devices can. */
static std::mutex peers_lock;
static std::set<std::pair<int, int>> peers_enabled;

static bool peer_enabled(int to, int from)
{
    std::lock_guard<std::mutex> g(peers_lock);
    return peers_enabled.count({to, from}) > 0;
}

cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer)
{
    int n = device_count();
    if (!can)
        return note(cudaErrorInvalidValue);
    if (device < 0 || device >= n || peer < 0 || peer >= n)
        return note(cudaErrorInvalidDevice);
    *can = device != peer;
    return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags)
{
    if (flags)
        return note(cudaErrorInvalidValue);
    if (peer < 0 || peer >= device_count() || peer == current_device)
        return note(cudaErrorInvalidDevice);
    std::lock_guard<std::mutex> g(peers_lock);
    if (!peers_enabled.insert({current_device, peer}).second)
        return note(cudaErrorPeerAccessAlreadyEnabled);
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    if (device < 0 || device >= device_count())
        return note(cudaErrorInvalidDevice);
    current_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device)
        return note(cudaErrorInvalidValue);
    *device = current_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device)
{
    if (!prop)
        return note(cudaErrorInvalidValue);
    if (device < 0 || device >= device_count())
        return note(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cudaemu (CUDA emulated on the CPU, tests only)");
    prop->totalGlobalMem = (size_t)8 << 30;
    prop->sharedMemPerBlock = emu_default_shared;
    prop->sharedMemPerBlockOptin = emu_max_shared;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7fffffff;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->multiProcessorCount = emu_sms;
    prop->major = 9;
    prop->cooperativeLaunch = 1;
    prop->unifiedAddressing = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device)
{
    if (!value)
        return note(cudaErrorInvalidValue);
    if (device < 0 || device >= device_count())
        return note(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrCooperativeLaunch: *value = 1; break;
    case cudaDevAttrMultiProcessorCount: *value = emu_sms; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)emu_max_shared; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    default: *value = 0; break;
    }
    return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, const void *func,
                                                          int block_size, size_t dynamic_shared)
{
    (void)func;
    (void)dynamic_shared;
    if (!blocks || block_size <= 0 || block_size > 1024)
        return note(cudaErrorInvalidValue);
    *blocks = blocks_per_sm((uint64_t)block_size);
    return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value)
{
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || (size_t)value > emu_max_shared)
            return note(cudaErrorInvalidValue);
        std::lock_guard<std::mutex> g(attr_lock);
        max_dynamic_shared[func] = (size_t)value;
    }
    return cudaSuccess;
}

cudaError_t cudaLaunchCooperativeKernel(const void *func, dim3 grid, dim3 block, void **args,
                                        size_t shared, cudaStream_t stream)
{
    cudaemu::invoker_fn invoke = NULL;
    {
        std::lock_guard<std::mutex> g(attr_lock);
        auto it = invokers.find(func);
        if (it != invokers.end())
            invoke = it->second;
    }
    if (!invoke)
        return note(cudaErrorInvalidDeviceFunction);
    return invoke(func, cudaemu_cfg(grid, block, shared, stream), args);
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return last_error;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorCooperativeLaunchTooLarge: return "cudaErrorCooperativeLaunchTooLarge";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (CUDAEMU_DEVICES=0)";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "unknown error";
    }
}

cudaError_t cudaMalloc(void **p, size_t size)
{
    return note(allocate(p, size, MEM_DEVICE));
}

static void wait_point(int all, cudaStream_t s); /* below: copies that land late */

cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t stream)
{
    (void)stream;
    return note(allocate(p, size, MEM_DEVICE));
}

cudaError_t cudaFree(void *p)
{
    wait_point(1, NULL); /* it waits for the device */
    return note(release(p, MEM_DEVICE));
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t stream)
{
    (void)stream;
    return note(release(p, MEM_DEVICE));
}

cudaError_t cudaHostAlloc(void **p, size_t size, unsigned flags)
{
    (void)flags;
    return note(allocate(p, size, MEM_HOST));
}

cudaError_t cudaMallocHost(void **p, size_t size)
{
    return note(allocate(p, size, MEM_HOST));
}

cudaError_t cudaFreeHost(void *p)
{
    wait_point(1, NULL); /* it waits for the device */
    return note(release(p, MEM_HOST));
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *attr, const void *p)
{
    if (!attr)
        return note(cudaErrorInvalidValue);
    memset(attr, 0, sizeof *attr);
    uintptr_t base;
    int partial;
    const allocation *a = find_allocation(p, 1, &base, &partial);
    if (!a) {
        attr->type = cudaMemoryTypeUnregistered;
        attr->device = -2;
        return cudaSuccess;
    }
    attr->type = a->kind == MEM_DEVICE ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    attr->device = a->device;
    attr->devicePointer = (void *)p;
    attr->hostPointer = a->kind == MEM_HOST ? (void *)p : NULL;
    return cudaSuccess;
}

/* ---- copies into pinned memory land late --------------------------------
 * On a GPU, cudaMemcpyAsync from device to pinned memory returns before the
 * bytes arrive, and the host may read them only after a wait: on the
 * stream, an event after the copy, or the device. Here such a copy reads
 * its source at once (stream order on the device side), fills its
 * destination with 0xee, and writes the bytes at the next wait, so that
 * host code that reads them without one sees poison and its test fails.
 * Pageable destinations are written at once, as the runtime does. A copy
 * that reads host memory, and every synchronous call, first delivers what
 * is pending (it may read what arrived). */
struct pending {
    cudaStream_t s;
    char *host;              /* a copy's pinned destination, or its pinned source */
    std::vector<char> bytes; /* what lands there, or what the copy read there */
};
static std::mutex late_lock;
static std::vector<pending> late;

/* A copy from pinned memory to the device reads its source, on a GPU, when
 * the stream gets to it: host code must not write that memory (nor hand it
 * on to be written) before a wait. Here the copy reads at once, and keeps a
 * snapshot of what it read; at the next wait, a source that changed since
 * is reported and the process aborts (on a GPU the copy might have read
 * the new bytes). */
static std::vector<pending> watched;

/* Takes out of v, in their order, the entries a wait for stream s reaches:
 * those of s and of the legacy default stream (which the others wait for),
 * or all of them when `all`. Under late_lock. */
static std::vector<pending> take_due(std::vector<pending> &v, int all, cudaStream_t s)
{
    auto due = std::stable_partition(
        v.begin(), v.end(), [&](const pending &p) { return !(all || p.s == s || p.s == NULL); });
    std::vector<pending> out(std::make_move_iterator(due), std::make_move_iterator(v.end()));
    v.erase(due, v.end());
    return out;
}

/* Writes the pending copies a wait for stream s reaches. */
static void deliver(int all, cudaStream_t s)
{
    std::lock_guard<std::mutex> g(late_lock);
    for (const pending &p : take_due(late, all, s))
        memcpy(p.host, p.bytes.data(), p.bytes.size());
}

/* A wait for stream s (every stream when `all`): what it copied into pinned
 * memory lands, and what it read from pinned memory must be unchanged. */
static void wait_point(int all, cudaStream_t s)
{
    deliver(all, s);
    std::lock_guard<std::mutex> g(late_lock);
    for (const pending &p : take_due(watched, all, s))
        if (memcmp(p.host, p.bytes.data(), p.bytes.size()) != 0) {
            fprintf(stderr,
                    "cudaemu: the host wrote %zu bytes of pinned memory at %p that an "
                    "asynchronous copy to the device was still to read (no wait between)\n",
                    p.bytes.size(), (const void *)p.host);
            abort();
        }
}

static int is_pinned(const void *p)
{
    uintptr_t base;
    int partial;
    const allocation *a = find_allocation(p, 1, &base, &partial);
    return a && a->kind == MEM_HOST;
}

static cudaError_t copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);

/* Copies from one device's memory to another's that has peer access to
 * it (cudaemu_peer_copies); without it a GPU's driver stages them through
 * host memory, and they are not counted */
static std::atomic<unsigned long> peer_copies;

/* The device a device allocation holding p was made on */
static int device_of(const void *p)
{
    uintptr_t base;
    int partial;
    const allocation *a = find_allocation(p, 1, &base, &partial);
    return a ? a->device : -1;
}

/* An asynchronous copy on s: from the device into pinned memory, late. */
static cudaError_t copy_async(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                              cudaStream_t s)
{
    int to_host = kind == cudaMemcpyDeviceToHost ||
                  (kind == cudaMemcpyDefault && is_device(src) && !is_device(dst));
    if (n && !to_host && is_pinned(src) && is_device(dst)) {
        cudaError_t e = copy(dst, src, n, kind);
        if (e == cudaSuccess) {
            pending w{s, (char *)src, std::vector<char>((const char *)src, (const char *)src + n)};
            std::lock_guard<std::mutex> g(late_lock);
            watched.push_back(std::move(w));
        }
        return e;
    }
    if (!n || !to_host || !is_pinned(dst) || !is_device(src))
        return copy(dst, src, n, kind);
    if (cudaError_t e = injected(cudaErrorLaunchFailure))
        return note(e);
    if (check_side(dst, n, 0, "a copy's destination") || check_side(src, n, 1, "a copy's source"))
        return note(cudaErrorInvalidValue);
    pending c{s, (char *)dst, std::vector<char>((const char *)src, (const char *)src + n)};
    memset(dst, 0xee, n);
    std::lock_guard<std::mutex> g(late_lock);
    late.push_back(std::move(c));
    return cudaSuccess;
}

static cudaError_t copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    if (n && !is_device(src)) /* it may read what a pending copy brings */
        deliver(1, NULL);
    if (!n)
        return cudaSuccess;
    if (cudaError_t e = injected(cudaErrorLaunchFailure))
        return note(e);
    int dst_dev = is_device(dst), src_dev = is_device(src);
    switch (kind) {
    case cudaMemcpyHostToHost: dst_dev = src_dev = 0; break;
    case cudaMemcpyHostToDevice: dst_dev = 1, src_dev = 0; break;
    case cudaMemcpyDeviceToHost: dst_dev = 0, src_dev = 1; break;
    case cudaMemcpyDeviceToDevice: dst_dev = src_dev = 1; break;
    case cudaMemcpyDefault: break;
    default: return note(cudaErrorInvalidMemcpyDirection);
    }
    if (check_side(dst, n, dst_dev, "a copy's destination") ||
        check_side(src, n, src_dev, "a copy's source"))
        return note(cudaErrorInvalidValue);
    if (dst_dev && src_dev && device_of(dst) != device_of(src) &&
        peer_enabled(device_of(dst), device_of(src)))
        peer_copies.fetch_add(1);
    memmove(dst, src, n);
    return cudaSuccess;
}

extern "C" unsigned long cudaemu_peer_copies(void)
{
    return peer_copies.load();
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    wait_point(1, NULL); /* synchronous: after all the work before it */
    return copy(dst, src, n, kind);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    return copy_async(dst, src, n, kind, stream);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t stream)
{
    if (width > dpitch || width > spitch)
        return note(cudaErrorInvalidPitchValue);
    for (size_t r = 0; r < height; r++) {
        cudaError_t e = copy_async((char *)dst + r * dpitch, (const char *)src + r * spitch, width,
                                   kind, stream);
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int value, size_t n)
{
    if (cudaError_t e = injected(cudaErrorLaunchFailure))
        return note(e);
    if (n && check_side(p, n, 1, "a memset"))
        return note(cudaErrorInvalidValue);
    memset(p, value, n);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream)
{
    (void)stream;
    return cudaMemset(p, value, n);
}

/* Streams and events: every call above runs to its end before it returns,
 * but for the copies into pinned memory, which land at the waits below;
 * otherwise a stream is a name. */
cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    if (!s)
        return note(cudaErrorInvalidValue);
    *s = (cudaStream_t)malloc(16);
    if (!*s)
        return note(cudaErrorMemoryAllocation);
    *(int *)*s = current_device; /* the device it belongs to */
    return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t s, int *device)
{
    if (!device)
        return note(cudaErrorInvalidValue);
    int legacy = s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread;
    *device = legacy ? current_device : *(const int *)s;
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    return cudaStreamCreate(s);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    free(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    wait_point(s == NULL, s); /* the legacy default stream waits for every other */
    return note(injected(cudaErrorLaunchFailure));
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    wait_point(s == NULL, s); /* done: what it copied has arrived */
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    wait_point(1, NULL);
    return note(injected(cudaErrorLaunchFailure));
}

struct emu_event {
    struct timespec at;
};

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    if (!e)
        return note(cudaErrorInvalidValue);
    *e = (cudaEvent_t)calloc(1, sizeof(emu_event));
    return *e ? cudaSuccess : note(cudaErrorMemoryAllocation);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    (void)flags;
    return cudaEventCreate(e);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    free(e);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    (void)s;
    if (!e)
        return note(cudaErrorInvalidResourceHandle);
    clock_gettime(CLOCK_MONOTONIC, &((emu_event *)e)->at);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    if (!e)
        return note(cudaErrorInvalidResourceHandle);
    wait_point(1, NULL); /* the event's stream is not kept: every stream */
    return note(injected(cudaErrorLaunchFailure));
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    if (!e)
        return note(cudaErrorInvalidResourceHandle);
    wait_point(1, NULL);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)s;
    (void)flags;
    return e ? cudaSuccess : note(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    if (!ms || !a || !b)
        return note(cudaErrorInvalidValue);
    const struct timespec &x = ((emu_event *)a)->at, &y = ((emu_event *)b)->at;
    *ms = (float)((y.tv_sec - x.tv_sec) * 1e3 + (y.tv_nsec - x.tv_nsec) / 1e6);
    return cudaSuccess;
}

} // extern "C"
