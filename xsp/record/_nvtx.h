/* How xsp.record._nvtx hands its NVTX ranges to xsp.record._hotpath: a PyCapsule named
 * XSP_NVTX_CAPSULE holding a pointer to this struct, so that the module-call wrapper pushes and
 * pops a range around each module call from C. `message` is an index made by
 * xsp.record._nvtx.message(name). Neither call raises. */
#ifndef XSP_NVTX_H
#define XSP_NVTX_H

#include <stdint.h>

#define XSP_NVTX_CAPSULE "xsp.record._nvtx.ranges"

typedef struct {
    void (*push)(int64_t message);
    void (*pop)(void);
} xsp_nvtx;

#endif
