/* The part of CUPTI's binary interface that xsp's record path uses: result codes, activity
 * kinds, one attribute, the buffer callbacks' types, and the byte offsets of the record fields
 * xsp reads. Written from CUPTI's documented interface; no NVIDIA header is included (they
 * need <cuda.h>, which the wheels lack) or copied.
 *
 * The offsets are the same in every cupti_activity.h from CUPTI 12.6.37 to 13.5.25 (gcc
 * offsetof over all 19 releases, 2026-11-27); tests/unit/test_cuda_records.py checks them
 * against cupti-python's numpy layouts of every record version. */
#ifndef XSP_CUPTI_ABI_H
#define XSP_CUPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int cupti_result;
#define CUPTI_OK 0
#define CUPTI_ERROR_MAX_LIMIT_REACHED 12 /* no more records in the buffer */
#define CUPTI_ERROR_INVALID_KIND 21      /* a record cut short or unknown: stop walking */

/* CUpti_ActivityKind values */
#define KIND_MEMCPY 1
#define KIND_MEMSET 2
#define KIND_KERNEL 3
#define KIND_DRIVER 4
#define KIND_RUNTIME 5
#define KIND_CONCURRENT_KERNEL 10
#define KIND_SYNCHRONIZATION 38
#define KIND_MEMCPY2 22 /* peer-to-peer copies: CUpti_ActivityMemcpyPtoP4, 96 bytes in 12.6-13.5 */
#define KIND_EXTERNAL_CORRELATION 39
#define KIND_LIMIT 64 /* kinds below this are looked up in tables */

#define ATTR_ZEROED_OUT_ACTIVITY_BUFFER 5 /* CUpti_ActivityAttribute; value: uint8_t */
#define ATTR_THREAD_ID_TYPE 21            /* per subscriber (13.5); value: CUpti_ActivityThreadIdType (int) */
#define ATTR_TIMESTAMP_CALLBACK 22        /* per subscriber (13.5); value: a timestamp_fn, NULL unregisters */
#define EXTERNAL_KIND_CUSTOM0 3           /* CUpti_ExternalCorrelationKind */

/* CUPTI 13.5's multi-subscriber mode: cuptiSubscribe_v2 with allowMultipleSubscribers set, then
 * every activity call made for one subscriber through its _v2 form, which takes the handle. */
#define MULTI_SUBSCRIBER_VERSION 130500

typedef void (*buffer_requested_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*buffer_completed_fn)(void *context, uint32_t stream_id, uint8_t *buffer, size_t size,
                                    size_t valid_size);

typedef cupti_result (*get_version_fn)(uint32_t *version);
typedef cupti_result (*register_callbacks_fn)(buffer_requested_fn requested, buffer_completed_fn completed);
typedef cupti_result (*get_next_record_fn)(uint8_t *buffer, size_t valid_size, void **record);
typedef cupti_result (*set_attribute_fn)(int attribute, size_t *value_size, void *value);
typedef cupti_result (*get_attribute_fn)(int attribute, size_t *value_size, void *value);
typedef uint64_t (*timestamp_fn)(void);
typedef cupti_result (*register_timestamp_fn)(timestamp_fn clock);
typedef cupti_result (*get_num_dropped_fn)(void *context, uint32_t stream_id, size_t *dropped);
typedef cupti_result (*push_external_fn)(int kind, uint64_t id);
typedef cupti_result (*pop_external_fn)(int kind, uint64_t *last_id);

/* The _v2 forms (CUPTI 13.5): the same, for one subscriber. The buffer callbacks' _v2 types take
 * an info struct last, which xsp does not read. */
typedef void *subscriber_handle;
typedef void (*buffer_requested_v2_fn)(uint8_t **buffer, size_t *size, size_t *max_records, void *info);
typedef void (*buffer_completed_v2_fn)(uint8_t *buffer, size_t size, size_t valid_size, void *info);
typedef cupti_result (*register_callbacks_v2_fn)(subscriber_handle subscriber, buffer_requested_v2_fn requested,
                                                 buffer_completed_v2_fn completed);
typedef cupti_result (*get_next_record_v2_fn)(subscriber_handle subscriber, uint8_t *buffer, size_t valid_size,
                                              void **record);
typedef cupti_result (*set_attribute_v2_fn)(subscriber_handle subscriber, int attribute, size_t *value_size,
                                            void *value);
typedef cupti_result (*get_num_dropped_v2_fn)(subscriber_handle subscriber, void *context, uint32_t stream_id,
                                              size_t *dropped);
typedef cupti_result (*push_external_v2_fn)(subscriber_handle subscriber, int kind, uint64_t id);
typedef cupti_result (*pop_external_v2_fn)(subscriber_handle subscriber, int kind, uint64_t *last_id);
typedef cupti_result (*enable_kind_v2_fn)(subscriber_handle subscriber, uint32_t kind, void *config);
typedef cupti_result (*enable_api_v2_fn)(subscriber_handle subscriber, uint32_t cbid, uint8_t enable);

/* The record families xsp reads, each a set of kinds sharing one layout. */
enum family { FAMILY_API, FAMILY_KERNEL, FAMILY_MEMCPY, FAMILY_MEMSET, FAMILY_SYNC, FAMILY_EXTERNAL, FAMILY_PEER, FAMILIES };

/* How a field is stored: its width in bytes and struct/buffer-protocol format character. A
 * NAME field is a `const char *` CUPTI owns, stored as the interned name's id (uint32). */
enum field_type { U8, U16, I32, U32, U64, NAME };

typedef struct {
    const char *name; /* as cupti-python names the field, and the column xsp makes of it */
    uint16_t offset;
    uint8_t type;
    uint8_t optional; /* only the newer record versions have it: 0 where a record is too short */
} field_layout;

#define MAX_FIELDS 20

typedef struct {
    const char *name;
    uint16_t extent; /* bytes a record must have for every field below to be read */
    uint8_t field_count;
    field_layout fields[MAX_FIELDS];
} family_layout;

extern const family_layout FAMILY_LAYOUTS[FAMILIES];

/* The family of a kind, or -1 for a kind xsp does not read. */
int family_of_kind(uint32_t kind);

/* What each CUPTI release writes: the size in bytes of its kernel, memcpy, memset and
 * synchronization records (the API, external-correlation and peer-copy records never changed size). */
typedef struct {
    uint32_t first_version, last_version; /* cuptiGetVersion's range */
    const char *release;
    uint16_t kernel, memcpy, memset, sync;
} release_sizes;

/* The release whose records xsp knows for `version`, or NULL. */
const release_sizes *release_of_version(uint32_t version);
extern const release_sizes KNOWN_RELEASES[];
extern const size_t KNOWN_RELEASE_COUNT;

/* The size of one record of `kind` as `release` writes it (0: a kind xsp does not read). */
uint16_t record_size(const release_sizes *release, uint32_t kind);

#endif
