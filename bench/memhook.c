/* A malloc counter for measuring peak CPU memory per process: the CPU analogue of
 * torch.cuda.max_memory_allocated, which torch does not offer for CPU tensors.
 *
 * Loaded with LD_PRELOAD into the benchmark's worker processes (bench/measure.py builds it with the system C
 * compiler). Every malloc/calloc/realloc/posix_memalign/aligned_alloc/memalign/valloc/free of the process is
 * passed to glibc's own implementation (__libc_*) and its usable size is added to / subtracted from a counter,
 * on any thread (gloo's worker threads free tensors too, which torch.profiler's memory events miss). torch's CPU
 * allocator is posix_memalign/free, so every CPU tensor is counted; so are C++ buffers (DDP buckets, pipeline
 * receive buffers, DeepSpeed partitions) and malloc'd Python objects (small Python objects live in pymalloc's
 * mmap'd arenas and are not counted).
 *
 * Read from Python with ctypes: memhook_current(), memhook_peak(), memhook_reset_peak().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static long long g_current = 0;
static long long g_peak = 0;

static void account_add(void *p) {
    if (!p) return;
    long long n = (long long)malloc_usable_size(p);
    long long now = __atomic_add_fetch(&g_current, n, __ATOMIC_RELAXED);
    long long peak = __atomic_load_n(&g_peak, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&g_peak, &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void account_sub(void *p) {
    if (!p) return;
    __atomic_sub_fetch(&g_current, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) {
    void *p = __libc_malloc(n);
    account_add(p);
    return p;
}

void *calloc(size_t a, size_t b) {
    void *p = __libc_calloc(a, b);
    account_add(p);
    return p;
}

void *realloc(void *old, size_t n) {
    if (old) account_sub(old);
    void *p = __libc_realloc(old, n);
    if (p) {
        account_add(p);
    } else if (old && n) {
        account_add(old); /* failed: the old block is still ours */
    }
    return p;
}

void free(void *p) {
    account_sub(p);
    __libc_free(p);
}

void *memalign(size_t align, size_t n) {
    void *p = __libc_memalign(align, n);
    account_add(p);
    return p;
}

void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }

int posix_memalign(void **out, size_t align, size_t n) {
    if (align % sizeof(void *) || (align & (align - 1))) return EINVAL;
    void *p = __libc_memalign(align, n);
    if (!p && n) return ENOMEM;
    account_add(p);
    *out = p;
    return 0;
}

void *valloc(size_t n) { return memalign((size_t)sysconf(_SC_PAGESIZE), n); }

void *pvalloc(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return memalign(page, (n + page - 1) / page * page);
}

long long memhook_current(void) { return __atomic_load_n(&g_current, __ATOMIC_RELAXED); }
long long memhook_peak(void) { return __atomic_load_n(&g_peak, __ATOMIC_RELAXED); }
void memhook_reset_peak(void) { __atomic_store_n(&g_peak, __atomic_load_n(&g_current, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
