/* The buffer pool and the queue of completed buffers (see buffers.h). */
#include "buffers.h"

#include <stdlib.h>
#include <string.h>

#include "binding.h"

buffer_pool POOL = {.lock = PTHREAD_MUTEX_INITIALIZER};
pool_counts COUNTS;

/* CUPTI may leave bytes of a record it began but could not finish just past the valid size:
 * they are zeroed too when a buffer goes back to the pool. */
#define ZERO_MARGIN 4096

int pool_configure(size_t buffer_bytes, size_t max_buffers) {
    pthread_mutex_lock(&POOL.lock);
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
        data = calloc(1, POOL.buffer_bytes); /* fresh pages: zero, and mapped only when written */
        if (data != NULL) POOL.owned[POOL.allocated++] = data;
    }
    pthread_mutex_unlock(&POOL.lock);
    if (data == NULL) add_count(&COUNTS.buffers_refused, 1);
    *buffer = data;
    *size = data == NULL ? 0 : POOL.buffer_bytes;
    *max_records = 0; /* as many as fit */
}

void on_buffer_completed(void *context, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid_size) {
    (void)size;
    size_t dropped = 0;
    get_num_dropped_fn get_num_dropped = BINDING.get_num_dropped;
    if (get_num_dropped != NULL && get_num_dropped(context, stream_id, &dropped) == CUPTI_OK && dropped > 0)
        add_count(&COUNTS.dropped_by_cupti, dropped);
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

size_t pool_take_queue(completed_buffer *out) {
    pthread_mutex_lock(&POOL.lock);
    size_t count = POOL.queued;
    memcpy(out, POOL.queue, count * sizeof(completed_buffer));
    POOL.queued = 0;
    pthread_mutex_unlock(&POOL.lock);
    return count;
}

void pool_give_back(completed_buffer *buffers, size_t count) {
    for (size_t i = 0; i < count; i++) {
        size_t written = buffers[i].valid_size + ZERO_MARGIN;
        memset(buffers[i].data, 0, written < POOL.buffer_bytes ? written : POOL.buffer_bytes);
    }
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
        free(buffer);
    }
    POOL.free_count = 0;
    pthread_mutex_unlock(&POOL.lock);
}
