/* A stand-in libcupti for machines without a GPU: the calls xsp's C record path makes
 * (xsp/_activity), behaving as CUPTI documents them, plus controls for the tests.
 *
 * Built by the tests (tests/native_cupti.py) into their temporary folder. Records are staged as
 * bytes (built from cupti-python's numpy layouts); cuptiActivityFlushAll hands them to the
 * registered callbacks from a thread of its own, as CUPTI's worker thread does, with no Python
 * involved. Record sizes come from a table the test sets, as a real libcupti knows its own. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*requested_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*completed_fn)(void *context, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid);
typedef uint64_t (*timestamp_fn)(void);
typedef void (*requested_v2_fn)(uint8_t **buffer, size_t *size, size_t *max_records, void *info);
typedef void (*completed_v2_fn)(uint8_t *buffer, size_t size, size_t valid, void *info);

#define KINDS 64
#define OK 0
#define INVALID_PARAMETER 1
#define MAX_LIMIT_REACHED 12
#define INVALID_KIND 21
#define QUEUE_EMPTY 18
#define NOT_SUPPORTED 27

static requested_fn requested;
static completed_fn completed;
static uint32_t version = 130401;
static size_t sizes[KINDS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *staged;
static size_t staged_bytes, staged_capacity;
static size_t dropped_pending;
static int zeroed_attribute = -1; /* -1: never set (CUPTI's default, 0) */
static long attribute_sets, timestamp_registrations;
static int check_zero = 1; /* look at every byte of each buffer handed out (off for benchmarks) */
static timestamp_fn timestamp_callback;
static long registrations, flushes, dirty_buffers, refused_requests, pushes;
static __thread uint64_t external_ids[256];
static __thread int depth;

/* CUPTI 13.5's multi-subscriber mode, for the one subscriber the tests made (`shared`, its
 * handle): the one-subscriber calls are refused while it lasts, as the header says of some, so
 * that a call xsp makes in the wrong form shows. */
static void *shared;
static requested_v2_fn requested_v2;
static completed_v2_fn completed_v2;
static int enabled_v2[KINDS];
static int zeroed_v2 = -1, thread_id_type_v2 = -1;
static long silenced_v2, refused_one_subscriber_calls;

static int others_sharing; /* another client still shares CUPTI after xsp's subscriber left */

static int refuse_while_shared(void) {
    if (shared == NULL && !others_sharing) return 0;
    __atomic_add_fetch(&refused_one_subscriber_calls, 1, __ATOMIC_RELAXED);
    return 1;
}

/* CUPTI's calls ------------------------------------------------------------------------------ */
int cuptiGetVersion(uint32_t *out) {
    *out = version;
    return OK;
}

int cuptiActivityRegisterCallbacks(requested_fn on_requested, completed_fn on_completed) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    if (on_requested == NULL || on_completed == NULL) return INVALID_PARAMETER;
    requested = on_requested;
    completed = on_completed;
    requested_v2 = NULL;
    completed_v2 = NULL;
    registrations++;
    return OK;
}

int cuptiActivitySetAttribute(int attribute, size_t *value_size, void *value) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    if (attribute != 5 || *value_size != 1) return INVALID_PARAMETER;
    zeroed_attribute = *(uint8_t *)value;
    attribute_sets++;
    return OK;
}

int cuptiActivityGetAttribute(int attribute, size_t *value_size, void *value) {
    if (attribute != 5 || *value_size < 1) return INVALID_PARAMETER;
    *(uint8_t *)value = (uint8_t)(zeroed_attribute < 0 ? 0 : zeroed_attribute);
    *value_size = 1;
    return OK;
}

/* CUPTI's clock: the client's callback where one is registered, else CLOCK_REALTIME (Linux). */
int cuptiActivityRegisterTimestampCallback(timestamp_fn callback) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    if (callback == NULL && version < 130400) return INVALID_PARAMETER; /* documented up to 13.2 */
    timestamp_callback = callback;
    timestamp_registrations++;
    return OK;
}

static size_t size_at(const uint8_t *record) {
    uint32_t kind;
    memcpy(&kind, record, sizeof(kind));
    return kind < KINDS ? sizes[kind] : 0;
}

static int next_record(uint8_t *buffer, size_t valid, void **record);

int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    return next_record(buffer, valid, record);
}

static int next_record(uint8_t *buffer, size_t valid, void **record) {
    if (buffer == NULL) return INVALID_PARAMETER;
    uint8_t *at = *record == NULL ? buffer : (uint8_t *)*record + size_at(*record);
    if (at >= buffer + valid) return MAX_LIMIT_REACHED;
    size_t size = size_at(at);
    if (size == 0 || at + size > buffer + valid) return INVALID_KIND; /* unknown, or cut short */
    *record = at;
    return OK;
}

int cuptiActivityGetNumDroppedRecords(void *context, uint32_t stream_id, size_t *dropped) {
    (void)context;
    (void)stream_id;
    pthread_mutex_lock(&lock);
    *dropped = dropped_pending;
    dropped_pending = 0;
    pthread_mutex_unlock(&lock);
    return OK;
}

int cuptiActivityPushExternalCorrelationId(int kind, uint64_t id) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    if (kind != 3 || depth == 256) return INVALID_PARAMETER;
    external_ids[depth++] = id;
    __atomic_add_fetch(&pushes, 1, __ATOMIC_RELAXED);
    return OK;
}

int cuptiActivityPopExternalCorrelationId(int kind, uint64_t *last) {
    if (refuse_while_shared()) return NOT_SUPPORTED;
    if (kind != 3) return INVALID_PARAMETER;
    if (depth == 0) return QUEUE_EMPTY;
    *last = external_ids[--depth];
    return OK;
}

/* The _v2 calls: only for the shared subscriber, while it lasts ------------------------------- */
#define CHECK_SUBSCRIBER(subscriber) \
    if ((subscriber) == NULL || (subscriber) != shared) return INVALID_PARAMETER

int cuptiActivityRegisterCallbacks_v2(void *subscriber, requested_v2_fn on_requested, completed_v2_fn on_completed) {
    CHECK_SUBSCRIBER(subscriber);
    if (on_requested == NULL || on_completed == NULL) return INVALID_PARAMETER;
    requested_v2 = on_requested;
    completed_v2 = on_completed;
    registrations++;
    return OK;
}

int cuptiActivityGetNextRecord_v2(void *subscriber, uint8_t *buffer, size_t valid, void **record) {
    CHECK_SUBSCRIBER(subscriber);
    return next_record(buffer, valid, record);
}

int cuptiActivitySetAttribute_v2(void *subscriber, int attribute, size_t *value_size, void *value) {
    CHECK_SUBSCRIBER(subscriber);
    if (attribute == 5 && *value_size == 1) {
        zeroed_v2 = *(uint8_t *)value;
    } else if (attribute == 21 && *value_size == 4) {
        thread_id_type_v2 = *(int32_t *)value;
    } else if (attribute == 22 && *value_size == sizeof(timestamp_fn)) {
        timestamp_callback = *(timestamp_fn *)value;
        timestamp_registrations++;
    } else {
        return INVALID_PARAMETER;
    }
    attribute_sets++;
    return OK;
}

int cuptiActivityGetNumDroppedRecords_v2(void *subscriber, void *context, uint32_t stream_id, size_t *dropped) {
    CHECK_SUBSCRIBER(subscriber);
    return cuptiActivityGetNumDroppedRecords(context, stream_id, dropped);
}

/* each subscriber's own stack of external ids (the one-subscriber calls have the process's) */
static __thread uint64_t shared_ids[256];
static __thread int shared_depth;

int cuptiActivityPushExternalCorrelationId_v2(void *subscriber, int kind, uint64_t id) {
    CHECK_SUBSCRIBER(subscriber);
    if (kind != 3 || shared_depth == 256) return INVALID_PARAMETER;
    shared_ids[shared_depth++] = id;
    __atomic_add_fetch(&pushes, 1, __ATOMIC_RELAXED);
    return OK;
}

int cuptiActivityPopExternalCorrelationId_v2(void *subscriber, int kind, uint64_t *last) {
    CHECK_SUBSCRIBER(subscriber);
    if (kind != 3) return INVALID_PARAMETER;
    if (shared_depth == 0) return QUEUE_EMPTY;
    *last = shared_ids[--shared_depth];
    return OK;
}

static int switch_kind_v2(void *subscriber, uint32_t kind, int on) {
    CHECK_SUBSCRIBER(subscriber);
    if (kind >= KINDS) return INVALID_KIND;
    enabled_v2[kind] = on;
    return OK;
}

int cuptiActivityEnable_v2(void *subscriber, uint32_t kind, void *config) {
    (void)config;
    return switch_kind_v2(subscriber, kind, 1);
}

int cuptiActivityDisable_v2(void *subscriber, uint32_t kind, void *config) {
    (void)config;
    return switch_kind_v2(subscriber, kind, 0);
}

static int switch_api_v2(void *subscriber, uint8_t enable) {
    CHECK_SUBSCRIBER(subscriber);
    silenced_v2 += enable ? -1 : 1;
    return OK;
}

int cuptiActivityEnableRuntimeApi_v2(void *subscriber, uint32_t cbid, uint8_t enable) {
    (void)cbid;
    return switch_api_v2(subscriber, enable);
}

int cuptiActivityEnableDriverApi_v2(void *subscriber, uint32_t cbid, uint8_t enable) {
    (void)cbid;
    return switch_api_v2(subscriber, enable);
}

/* Delivery: buffers filled with whole records, completed from a thread of the library's -------- */
typedef struct {
    const uint8_t *bytes;
    size_t length;
    size_t valid;  /* raw deliveries: the valid size to report (may cut a record) */
    int raw;
    int buffers;   /* raw deliveries: how many times to deliver the bytes */
    long delivered_records;
} delivery;

static int all_zero(const uint8_t *buffer, size_t size) {
    for (size_t i = 0; i < size; i++)
        if (buffer[i]) return 0;
    return 1;
}

static uint8_t *request(size_t *size) {
    uint8_t *buffer = NULL;
    size_t max_records = 0;
    *size = 0;
    if (requested_v2 != NULL)
        requested_v2(&buffer, size, &max_records, NULL);
    else
        requested(&buffer, size, &max_records);
    if (buffer == NULL) {
        pthread_mutex_lock(&lock);
        refused_requests++;
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    if (check_zero && !all_zero(buffer, *size)) {
        pthread_mutex_lock(&lock);
        dirty_buffers++;
        pthread_mutex_unlock(&lock);
    }
    return buffer;
}

static void complete(void *context, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid) {
    if (completed_v2 != NULL)
        completed_v2(buffer, size, valid, NULL);
    else
        completed(context, stream_id, buffer, size, valid);
}

static void deliver_records(delivery *job) {
    size_t at = 0;
    while (at < job->length) {
        size_t size;
        uint8_t *buffer = request(&size);
        if (buffer == NULL) { /* CUPTI drops what it cannot store, and counts it */
            size_t lost = 0;
            for (; at < job->length; at += size_at(job->bytes + at)) lost++;
            pthread_mutex_lock(&lock);
            dropped_pending += lost;
            pthread_mutex_unlock(&lock);
            return;
        }
        size_t used = 0;
        while (at < job->length) {
            size_t record = size_at(job->bytes + at);
            if (record == 0 || used + record > size) break;
            memcpy(buffer + used, job->bytes + at, record);
            used += record;
            at += record;
            job->delivered_records++;
        }
        complete(NULL, 0, buffer, size, used);
        if (used == 0) return; /* a record larger than a buffer: never delivered */
    }
}

static void deliver_raw(delivery *job) {
    for (int i = 0; i < job->buffers; i++) {
        size_t size;
        uint8_t *buffer = request(&size);
        if (buffer == NULL) continue;
        size_t length = job->length < size ? job->length : size;
        memcpy(buffer, job->bytes, length);
        complete(NULL, 7, buffer, size, job->valid < length ? job->valid : length);
    }
}

static void *deliver(void *argument) {
    delivery *job = argument;
    if (job->raw)
        deliver_raw(job);
    else
        deliver_records(job);
    return NULL;
}

int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    if (completed == NULL && completed_v2 == NULL) return OK;
    pthread_mutex_lock(&lock);
    delivery job = {.bytes = staged, .length = staged_bytes};
    staged = NULL;
    staged_bytes = staged_capacity = 0;
    flushes++;
    pthread_mutex_unlock(&lock);
    pthread_t thread;
    if (pthread_create(&thread, NULL, deliver, &job) == 0) pthread_join(thread, NULL);
    free((void *)job.bytes);
    return OK;
}

/* Controls for the tests --------------------------------------------------------------------- */
void fake_set_version(uint32_t value) { version = value; }

void fake_set_record_size(uint32_t kind, size_t size) {
    if (kind < KINDS) sizes[kind] = size;
}

int fake_stage(const uint8_t *bytes, size_t length) {
    pthread_mutex_lock(&lock);
    if (staged_bytes + length > staged_capacity) {
        size_t capacity = (staged_bytes + length) * 2;
        uint8_t *grown = realloc(staged, capacity);
        if (grown == NULL) {
            pthread_mutex_unlock(&lock);
            return -1;
        }
        staged = grown;
        staged_capacity = capacity;
    }
    memcpy(staged + staged_bytes, bytes, length);
    staged_bytes += length;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Deliver `bytes` as one buffer's contents with `valid` valid bytes, `buffers` times on each of
 * `threads` threads at once (none of them Python's). Returns the requests refused. */
long fake_deliver_raw(const uint8_t *bytes, size_t length, size_t valid, int threads, int buffers) {
    if ((completed == NULL && completed_v2 == NULL) || threads < 1 || threads > 64) return -1;
    long refused_before = refused_requests;
    pthread_t ids[64];
    delivery job = {.bytes = bytes, .length = length, .valid = valid, .raw = 1, .buffers = buffers};
    int started = 0;
    for (; started < threads; started++)
        if (pthread_create(&ids[started], NULL, deliver, &job) != 0) break;
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
    return refused_requests - refused_before;
}

/* Complete a buffer xsp never handed out (as one requested before xsp registered would be). */
void fake_complete_foreign(void) {
    static uint8_t foreign[64];
    if (completed != NULL || completed_v2 != NULL) complete(NULL, 0, foreign, sizeof(foreign), 0);
}

void fake_add_dropped(size_t count) {
    pthread_mutex_lock(&lock);
    dropped_pending += count;
    pthread_mutex_unlock(&lock);
}

/* The calling thread's external id on top of CUPTI's stack (0: none), and the stack's depth. */
uint64_t fake_top_external_id(void) {
    if (shared != NULL) return shared_depth ? shared_ids[shared_depth - 1] : 0; /* what its records get */
    return depth ? external_ids[depth - 1] : 0;
}
int fake_depth(void) { return depth + shared_depth; }
int fake_process_depth(void) { return depth; }
int fake_zeroed_attribute(void) { return zeroed_attribute; }
long fake_registrations(void) { return registrations; }
long fake_flushes(void) { return flushes; }
long fake_dirty_buffers(void) { return dirty_buffers; }
long fake_refused_requests(void) { return refused_requests; }
long fake_pushes(void) { return __atomic_load_n(&pushes, __ATOMIC_RELAXED); }
long fake_staged(void) {
    pthread_mutex_lock(&lock);
    long bytes = (long)staged_bytes;
    pthread_mutex_unlock(&lock);
    return bytes;
}
void fake_check_zero(int on) { check_zero = on; }
long fake_attribute_sets(void) { return attribute_sets; }
void fake_reset_attribute(int value) { zeroed_attribute = value; }
long fake_timestamp_registrations(void) { return timestamp_registrations; }
int fake_has_timestamp_callback(void) { return timestamp_callback != NULL; }

/* The shared subscriber (NULL: none; its v2 registration and settings then go with it). */
void fake_set_shared(void *subscriber) {
    shared = subscriber;
    if (subscriber == NULL) { /* its registration and its stack go; the kinds it left enabled show */
        shared_depth = 0; /* (the calling thread's: the tests unsubscribe where they pushed) */
        requested_v2 = NULL;
        completed_v2 = NULL;
        zeroed_v2 = thread_id_type_v2 = -1;
    }
}
void fake_set_others_sharing(int on) { others_sharing = on; }
void fake_reset_v2(void) {
    memset(enabled_v2, 0, sizeof(enabled_v2));
    others_sharing = 0;
    silenced_v2 = 0;
}
int fake_enabled_v2(uint32_t kind) { return kind < KINDS && enabled_v2[kind]; }
int fake_any_enabled_v2(void) {
    for (int kind = 0; kind < KINDS; kind++)
        if (enabled_v2[kind]) return 1;
    return 0;
}
int fake_zeroed_v2(void) { return zeroed_v2; }
int fake_thread_id_type_v2(void) { return thread_id_type_v2; }
long fake_silenced_v2(void) { return silenced_v2; }
long fake_refused_one_subscriber_calls(void) { return refused_one_subscriber_calls; }

/* What CUPTI would stamp a record with now. */
uint64_t fake_timestamp(void) {
    if (timestamp_callback != NULL) return timestamp_callback();
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
