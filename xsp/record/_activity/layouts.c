/* Where the fields xsp reads lie in each CUPTI record family, and which record sizes each
 * CUPTI release writes (see cupti_abi.h). */
#include "cupti_abi.h"

#define API_SIZE 40
#define EXTERNAL_SIZE 24
#define PEER_SIZE 96

const family_layout FAMILY_LAYOUTS[FAMILIES] = {
    [FAMILY_API] = {"api", 40, 8, {
        {"kind", 0, U32}, {"start", 8, U64}, {"end", 16, U64}, {"correlation_id", 32, U32},
        {"cbid", 4, U32}, {"thread_id", 28, U32}, {"process_id", 24, U32}, {"return_value", 36, U32}}},
    [FAMILY_KERNEL] = {"kernel", 160, 18, {
        {"start", 16, U64}, {"end", 24, U64}, {"correlation_id", 92, U32}, {"name", 104, NAME},
        {"grid_x", 52, I32}, {"grid_y", 56, I32}, {"grid_z", 60, I32},
        {"block_x", 64, I32}, {"block_y", 68, I32}, {"block_z", 72, I32},
        {"registers_per_thread", 6, U16}, {"static_shared_memory", 76, I32}, {"dynamic_shared_memory", 80, I32},
        {"stream_id", 48, U32}, {"device_id", 40, U32}, {"graph_id", 156, U32}, {"graph_node_id", 144, U64},
        {"source_graph_node_id", 240, U64, 1}}}, /* kernel 13 (CUPTI 13.4) on */
    [FAMILY_MEMCPY] = {"memcpy", 76, 10, {
        {"start", 16, U64}, {"end", 24, U64}, {"correlation_id", 44, U32}, {"bytes", 8, U64},
        {"copy_kind", 4, U8}, {"stream_id", 40, U32}, {"device_id", 32, U32},
        {"graph_id", 72, U32}, {"graph_node_id", 64, U64}, {"source_graph_node_id", 104, U64, 1}}}, /* memcpy 7 */
    [FAMILY_MEMSET] = {"memset", 76, 10, {
        {"start", 16, U64}, {"end", 24, U64}, {"correlation_id", 44, U32}, {"bytes", 8, U64},
        {"value", 4, U32}, {"stream_id", 40, U32}, {"device_id", 32, U32},
        {"graph_id", 72, U32}, {"graph_node_id", 64, U64}, {"source_graph_node_id", 96, U64, 1}}}, /* memset 5 */
    [FAMILY_SYNC] = {"sync", 40, 6, {
        {"start", 8, U64}, {"end", 16, U64}, {"correlation_id", 24, U32}, {"type", 4, I32},
        {"stream_id", 32, U32}, {"cuda_event_id", 36, U32}}},
    [FAMILY_EXTERNAL] = {"external", 20, 3, {
        {"external_kind", 4, I32}, {"external_id", 8, U64}, {"correlation_id", 16, U32}}},
    [FAMILY_PEER] = {"memcpy_peer", 64, 9, {
        {"start", 16, U64}, {"end", 24, U64}, {"correlation_id", 60, U32}, {"bytes", 8, U64},
        {"copy_kind", 4, U8}, {"stream_id", 40, U32}, {"device_id", 32, U32},
        {"src_device_id", 44, U32}, {"dst_device_id", 52, U32}}},
};

int family_of_kind(uint32_t kind) {
    switch (kind) {
    case KIND_RUNTIME:
    case KIND_DRIVER: return FAMILY_API;
    case KIND_KERNEL:
    case KIND_CONCURRENT_KERNEL: return FAMILY_KERNEL;
    case KIND_MEMCPY: return FAMILY_MEMCPY;
    case KIND_MEMSET: return FAMILY_MEMSET;
    case KIND_SYNCHRONIZATION: return FAMILY_SYNC;
    case KIND_EXTERNAL_CORRELATION: return FAMILY_EXTERNAL;
    case KIND_MEMCPY2: return FAMILY_PEER;
    default: return -1;
    }
}

/* From each release's cupti_version.h (CUPTI_API_VERSION) and the record versions its
 * cupti_activity.h documents for each kind: 12.6 kernel 9, memcpy 5, memset 4, sync 1;
 * 12.8-12.9 memcpy 6, sync 2; 13.0 kernel 10; 13.1-13.2 kernel 11; 13.3 kernel 12; 13.4-13.5
 * kernel 13, memcpy 7, memset 5. A patch release keeps its minor release's records. */
const release_sizes KNOWN_RELEASES[] = {
    {24, 24, "12.6", 208, 88, 88, 40},
    {26, 26, "12.8", 208, 96, 88, 56},
    {27, 28, "12.9", 208, 96, 88, 56},
    {130000, 130099, "13.0", 216, 96, 88, 56},
    {130100, 130199, "13.1", 224, 96, 88, 56},
    {130200, 130299, "13.2", 224, 96, 88, 56},
    {130300, 130399, "13.3", 232, 96, 88, 56},
    {130400, 130499, "13.4", 248, 112, 104, 56},
    {130500, 130599, "13.5", 248, 112, 104, 56},
};
const size_t KNOWN_RELEASE_COUNT = sizeof(KNOWN_RELEASES) / sizeof(KNOWN_RELEASES[0]);

const release_sizes *release_of_version(uint32_t version) {
    for (size_t i = 0; i < KNOWN_RELEASE_COUNT; i++)
        if (KNOWN_RELEASES[i].first_version <= version && version <= KNOWN_RELEASES[i].last_version)
            return &KNOWN_RELEASES[i];
    return NULL;
}

uint16_t record_size(const release_sizes *release, uint32_t kind) {
    switch (family_of_kind(kind)) {
    case FAMILY_API: return API_SIZE;
    case FAMILY_KERNEL: return release->kernel;
    case FAMILY_MEMCPY: return release->memcpy;
    case FAMILY_MEMSET: return release->memset;
    case FAMILY_SYNC: return release->sync;
    case FAMILY_EXTERNAL: return EXTERNAL_SIZE;
    case FAMILY_PEER: return PEER_SIZE;
    default: return 0;
    }
}
