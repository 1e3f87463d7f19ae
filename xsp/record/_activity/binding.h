/* The libcupti that cupti-python loaded, bound by xsp's C record path. */
#ifndef XSP_BINDING_H
#define XSP_BINDING_H

#include "cupti_abi.h"

typedef struct {
    void *handle;
    uint32_t version;
    const release_sizes *release;
    register_callbacks_fn register_callbacks;
    get_next_record_fn get_next_record;
    set_attribute_fn set_attribute;
    get_num_dropped_fn get_num_dropped;
    push_external_fn push_external;
    pop_external_fn pop_external;
    /* optional: NULL where the library lacks them */
    get_attribute_fn get_attribute;
    register_timestamp_fn register_timestamp;
    /* the multi-subscriber calls: all bound, or none (where the library lacks one) */
    register_callbacks_v2_fn register_callbacks_v2;
    get_next_record_v2_fn get_next_record_v2;
    set_attribute_v2_fn set_attribute_v2;
    get_num_dropped_v2_fn get_num_dropped_v2;
    push_external_v2_fn push_external_v2;
    pop_external_v2_fn pop_external_v2;
    enable_kind_v2_fn enable_v2, disable_v2;
    enable_api_v2_fn enable_runtime_api_v2, enable_driver_api_v2;
    /* xsp's subscriber, while it shares CUPTI with other subscribers (NULL: the one-subscriber
     * calls are made); set before the callbacks are registered, cleared after the last drain */
    subscriber_handle subscriber;
    char path[1024];
} cupti_binding;

extern cupti_binding BINDING;

/* The library can share CUPTI (13.5's multi-subscriber mode, every _v2 call xsp makes bound). */
int binding_can_share(void);

/* CUPTI's calls, for xsp's subscriber while it shares CUPTI, else the one-subscriber forms. */
cupti_result binding_next_record(uint8_t *buffer, size_t valid_size, void **record);
cupti_result binding_set_attribute(int attribute, size_t *value_size, void *value);
cupti_result binding_num_dropped(void *context, uint32_t stream_id, size_t *dropped);
cupti_result binding_push(uint64_t id);
cupti_result binding_pop(uint64_t *last_id);

/* Bind to the libcupti already loaded in this process: `path` if given, else the loaded object
 * whose file name starts "libcupti.so" (where several are, as when PyTorch's CUDA 12 build and a
 * cupti-python 13 each load their own, the one of CUDA release `major`: 0 names none). Never
 * loads a library (RTLD_NOLOAD): calling a libcupti before cupti-python has checked the driver
 * can crash (13.2) or fail (13.4). Returns 0, or -1 with `why` (one line) filled in; on failure
 * BINDING is left as it was. */
int bind_cupti(const char *path, unsigned major, char *why, size_t why_size);

#endif
