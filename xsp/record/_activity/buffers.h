/* The activity buffers xsp hands CUPTI: pooled, pre-zeroed, queued when CUPTI completes them.
 *
 * CUPTI calls the two callbacks on its own threads (or the one flushing), without the GIL:
 * they take a buffer from the pool or put a completed one in the queue, under one mutex, and
 * do nothing else. Records are read later, when a drain takes the queue (Kineto's design). */
#ifndef XSP_BUFFERS_H
#define XSP_BUFFERS_H

#include <pthread.h>

#include "cupti_abi.h"

typedef struct {
    uint8_t *data;
    size_t valid_size;
} completed_buffer;

/* How a buffer read is zeroed before it goes back to the pool. */
enum zeroing { ZERO_WRITTEN, ZERO_WHOLE };

typedef struct {
    pthread_mutex_t lock;
    int zeroing;         /* enum zeroing */
    size_t buffer_bytes;
    size_t max_buffers;
    size_t allocated;    /* buffers that exist: free, with CUPTI, queued or being read */
    uint8_t **owned;     /* every buffer that exists (allocated of max_buffers slots) */
    uint8_t **free_list; /* zeroed buffers ready for CUPTI (max_buffers slots) */
    size_t free_count;
    completed_buffer *queue; /* completed by CUPTI, not read yet (max_buffers slots) */
    size_t queued;
} buffer_pool;

extern buffer_pool POOL;

/* Counts since the last drain, added to from any thread. */
typedef struct {
    uint64_t dropped_by_cupti;  /* cuptiActivityGetNumDroppedRecords, summed per completed buffer */
    uint64_t buffers_with_drops; /* completed buffers whose context and stream had dropped records */
    uint64_t most_dropped_in_a_buffer; /* the largest of those counts */
    uint64_t buffers_refused;   /* requests declined: max_buffers were out (CUPTI drops records then) */
    uint64_t correlation_failed; /* external-id pushes or pops CUPTI refused */
    uint64_t foreign_buffers;   /* completed buffers xsp did not hand out (another client's) */
} pool_counts;

extern pool_counts COUNTS;

/* Size the pool (once: later calls keep the first sizes; the zeroing is set each time). Returns
 * 0, -1 when out of memory. */
int pool_configure(size_t buffer_bytes, size_t max_buffers, int zeroing);

void on_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records);
void on_buffer_completed(void *context, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid_size);

/* Add what CUPTI dropped since it was last asked (of `context` and `stream_id`; NULL and 0: its
 * global queue, every buffer's since CUDA 12) to COUNTS: at each completed buffer, and once at
 * the end, for drops after the last one. */
void count_cupti_drops(void *context, uint32_t stream_id);

/* Register the pool's callbacks with CUPTI: for xsp's subscriber while it shares CUPTI (the _v2
 * call), else the process's one pair. */
cupti_result register_pool_callbacks(void);

/* Move the queued buffers into `out` (room for max_buffers); returns how many. */
size_t pool_take_queue(completed_buffer *out);

/* Give read buffers back, zeroed wherever CUPTI may have written. */
void pool_give_back(completed_buffer *buffers, size_t count);

/* Free the buffers in the free list (none is with CUPTI): memory back between sessions. */
void pool_trim(void);

static inline uint64_t take_count(uint64_t *count) { return __atomic_exchange_n(count, 0, __ATOMIC_ACQ_REL); }
static inline void add_count(uint64_t *count, uint64_t value) { __atomic_add_fetch(count, value, __ATOMIC_RELAXED); }
static inline void raise_count(uint64_t *count, uint64_t value) {
    uint64_t seen = __atomic_load_n(count, __ATOMIC_RELAXED);
    while (value > seen && !__atomic_compare_exchange_n(count, &seen, value, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

#endif
