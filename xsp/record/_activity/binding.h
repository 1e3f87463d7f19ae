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
    char path[1024];
} cupti_binding;

extern cupti_binding BINDING;

/* Bind to the libcupti already loaded in this process: `path` if given, else the loaded object
 * whose file name starts "libcupti.so" (where several are, as when PyTorch's CUDA 12 build and a
 * cupti-python 13 each load their own, the one of CUDA release `major`: 0 names none). Never
 * loads a library (RTLD_NOLOAD): calling a libcupti before cupti-python has checked the driver
 * can crash (13.2) or fail (13.4). Returns 0, or -1 with `why` (one line) filled in; on failure
 * BINDING is left as it was. */
int bind_cupti(const char *path, unsigned major, char *why, size_t why_size);

#endif
