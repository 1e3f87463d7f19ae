/* How xsp.record._activity hands its external-correlation calls to xsp.record._hotpath: a PyCapsule named
 * XSP_CORRELATION_CAPSULE holding a pointer to this struct, so the module-call wrapper pushes
 * and pops CUPTI external correlation ids from C, around each module call. Both calls count
 * their own failures and never raise. */
#ifndef XSP_CORRELATION_H
#define XSP_CORRELATION_H

#include <stdint.h>

#define XSP_CORRELATION_CAPSULE "xsp.record._activity.correlation"

typedef struct {
    void (*push)(uint64_t external_id);
    void (*pop)(void);
} xsp_correlation;

#endif
