/* The buffer pool and the queue of completed buffers (see buffers.h). */
#include "buffers.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "binding.h"

buffer_pool POOL = {.lock = PTHREAD_MUTEX_INITIALIZER};
pool_counts COUNTS;

/* Buffers are mapped pages of their own: fresh ones are zero and cost no memory until written,
 * and a range can be given back to the kernel, to come back zero, without writing it. */
static uint8_t *new_buffer(size_t bytes) {
    void *data = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return data == MAP_FAILED ? NULL : data;
}

static void free_buffer(uint8_t *data, size_t bytes) { munmap(data, bytes); }

/* Zero everything CUPTI may have written, so that the buffer can be handed out again as zeroed
 * (xsp tells CUPTI its buffers come zeroed, and CUPTI then leaves uninitialised whatever it does
 * not write): the pages holding the valid records are cleared, and every page after them, where
 * CUPTI may have begun a record it never completed, is given back to the kernel, which maps it
 * anew, zero, on the next write (a page CUPTI never touched costs nothing here). */
static void zero_buffer(uint8_t *data, size_t valid_size) {
    size_t bytes = POOL.buffer_bytes;
    if (POOL.zeroing == ZERO_WHOLE) {
        memset(data, 0, bytes);
        return;
    }
    long page = sysconf(_SC_PAGESIZE);
    size_t step = page > 0 ? (size_t)page : 4096;
    size_t written = (valid_size + step - 1) / step * step;
    if (written >= bytes) {
        memset(data, 0, bytes);
        return;
    }
    memset(data, 0, written);
    if (madvise(data + written, bytes - written, MADV_DONTNEED) != 0) memset(data + written, 0, bytes - written);
}

int pool_configure(size_t buffer_bytes, size_t max_buffers, int zeroing) {
    pthread_mutex_lock(&POOL.lock);
    POOL.zeroing = zeroing; /* for the buffers given back from now on */
    int status = 0;
    if (POOL.free_list == NULL) {
        POOL.free_list = calloc(max_buffers, sizeof(uint8_t *));
        POOL.queue = calloc(max_buffers, sizeof(completed_buffer));
        POOL.owned = calloc(max_buffers, sizeof(uint8_t *));
        if (POOL.free_list == NULL || POOL.queue == NULL || POOL.owned == NULL) {
            free(POOL.free_list);
            free(POOL.queue);
            free(POOL.owned);
            POOL.free_list = NULL;
            POOL.queue = NULL;
            POOL.owned = NULL;
            status = -1;
        } else {
            POOL.buffer_bytes = buffer_bytes;
            POOL.max_buffers = max_buffers;
        }
    }
    pthread_mutex_unlock(&POOL.lock);
    return status;
}

/* With the lock held. */
static int owned(const uint8_t *buffer) {
    for (size_t i = 0; i < POOL.allocated; i++)
        if (POOL.owned[i] == buffer) return 1;
    return 0;
}

void on_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    uint8_t *data = NULL;
    pthread_mutex_lock(&POOL.lock);
    if (POOL.free_count > 0) {
        data = POOL.free_list[--POOL.free_count];
    } else if (POOL.allocated < POOL.max_buffers) {
        data = new_buffer(POOL.buffer_bytes);
        if (data != NULL) POOL.owned[POOL.allocated++] = data;
    }
    pthread_mutex_unlock(&POOL.lock);
    if (data == NULL) add_count(&COUNTS.buffers_refused, 1);
    *buffer = data;
    *size = data == NULL ? 0 : POOL.buffer_bytes;
    *max_records = 0; /* as many as fit */
}

void count_cupti_drops(void *context, uint32_t stream_id) {
    size_t dropped = 0;
    if (binding_num_dropped(context, stream_id, &dropped) == CUPTI_OK && dropped > 0) {
        add_count(&COUNTS.dropped_by_cupti, dropped);
        add_count(&COUNTS.buffers_with_drops, 1);
        raise_count(&COUNTS.most_dropped_in_a_buffer, dropped);
    }
}

void on_buffer_completed(void *context, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid_size) {
    (void)size;
    count_cupti_drops(context, stream_id);
    if (buffer == NULL) return;
    pthread_mutex_lock(&POOL.lock);
    if (!owned(buffer)) {
        pthread_mutex_unlock(&POOL.lock);
        add_count(&COUNTS.foreign_buffers, 1); /* handed out before xsp registered: not ours to reuse */
        return;
    }
    if (valid_size == 0) {
        POOL.free_list[POOL.free_count++] = buffer; /* nothing written: still zero */
    } else {
        POOL.queue[POOL.queued].data = buffer;
        POOL.queue[POOL.queued].valid_size = valid_size;
        POOL.queued++;
    }
    pthread_mutex_unlock(&POOL.lock);
}

/* The _v2 forms, for xsp's subscriber while it shares CUPTI: the dropped count is the
 * subscriber's (its context and stream are reserved for future use). */
static void on_buffer_requested_v2(uint8_t **buffer, size_t *size, size_t *max_records, void *info) {
    (void)info;
    on_buffer_requested(buffer, size, max_records);
}

static void on_buffer_completed_v2(uint8_t *buffer, size_t size, size_t valid_size, void *info) {
    (void)info;
    on_buffer_completed(NULL, 0, buffer, size, valid_size);
}

cupti_result register_pool_callbacks(void) {
    subscriber_handle subscriber = BINDING.subscriber;
    if (subscriber != NULL)
        return BINDING.register_callbacks_v2(subscriber, on_buffer_requested_v2, on_buffer_completed_v2);
    return BINDING.register_callbacks(on_buffer_requested, on_buffer_completed);
}

size_t pool_take_queue(completed_buffer *out) {
    pthread_mutex_lock(&POOL.lock);
    size_t count = POOL.queued;
    memcpy(out, POOL.queue, count * sizeof(completed_buffer));
    POOL.queued = 0;
    pthread_mutex_unlock(&POOL.lock);
    return count;
}

void pool_give_back(completed_buffer *buffers, size_t count) {
    for (size_t i = 0; i < count; i++) zero_buffer(buffers[i].data, buffers[i].valid_size);
    pthread_mutex_lock(&POOL.lock);
    for (size_t i = 0; i < count; i++) POOL.free_list[POOL.free_count++] = buffers[i].data;
    pthread_mutex_unlock(&POOL.lock);
}

void pool_trim(void) {
    pthread_mutex_lock(&POOL.lock);
    for (size_t i = 0; i < POOL.free_count; i++) {
        uint8_t *buffer = POOL.free_list[i];
        for (size_t j = 0; j < POOL.allocated; j++) {
            if (POOL.owned[j] == buffer) {
                POOL.owned[j] = POOL.owned[--POOL.allocated];
                break;
            }
        }
        free_buffer(buffer, POOL.buffer_bytes);
    }
    POOL.free_count = 0;
    pthread_mutex_unlock(&POOL.lock);
}
