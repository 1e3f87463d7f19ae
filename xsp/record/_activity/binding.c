/* Binding to the loaded libcupti: dlopen with RTLD_NOLOAD, dlsym, a version check. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dl_iterate_phdr */
#endif
#include "binding.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <link.h>
#endif

cupti_binding BINDING;

#define MAX_LOADED 8

typedef struct {
    char paths[MAX_LOADED][sizeof(BINDING.path)];
    int count; /* may exceed MAX_LOADED: only the first are kept */
} loaded_cuptis;

#ifdef __linux__
static int find_loaded_cupti(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    loaded_cuptis *found = data;
    const char *name = info->dlpi_name;
    if (name == NULL || name[0] == '\0') return 0;
    const char *base = strrchr(name, '/');
    base = base == NULL ? name : base + 1;
    if (strncmp(base, "libcupti.so", 11) != 0) return 0;
    if (found->count < MAX_LOADED) snprintf(found->paths[found->count], sizeof(found->paths[0]), "%s", name);
    found->count++;
    return 0;
}
#endif

/* The CUDA major release of a loaded libcupti (12, 13), or 0 where it cannot be told. */
static unsigned major_of(const char *path) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) return 0;
    get_version_fn get_version = (get_version_fn)dlsym(handle, "cuptiGetVersion");
    uint32_t version = 0;
    const release_sizes *release = get_version != NULL && get_version(&version) == CUPTI_OK
                                       ? release_of_version(version) : NULL;
    dlclose(handle);
    return release == NULL ? 0 : (unsigned)atoi(release->release);
}

static void *symbol(void *handle, const char *name, char *why, size_t why_size) {
    void *address = dlsym(handle, name);
    if (address == NULL) snprintf(why, why_size, "libcupti has no %s", name);
    return address;
}

/* The _v2 calls of the multi-subscriber mode: every one, or none. */
static void bind_sharing_calls(cupti_binding *bound) {
    void *handle = bound->handle;
    bound->register_callbacks_v2 = (register_callbacks_v2_fn)dlsym(handle, "cuptiActivityRegisterCallbacks_v2");
    bound->get_next_record_v2 = (get_next_record_v2_fn)dlsym(handle, "cuptiActivityGetNextRecord_v2");
    bound->set_attribute_v2 = (set_attribute_v2_fn)dlsym(handle, "cuptiActivitySetAttribute_v2");
    bound->get_num_dropped_v2 = (get_num_dropped_v2_fn)dlsym(handle, "cuptiActivityGetNumDroppedRecords_v2");
    bound->push_external_v2 = (push_external_v2_fn)dlsym(handle, "cuptiActivityPushExternalCorrelationId_v2");
    bound->pop_external_v2 = (pop_external_v2_fn)dlsym(handle, "cuptiActivityPopExternalCorrelationId_v2");
    bound->enable_v2 = (enable_kind_v2_fn)dlsym(handle, "cuptiActivityEnable_v2");
    bound->disable_v2 = (enable_kind_v2_fn)dlsym(handle, "cuptiActivityDisable_v2");
    bound->enable_runtime_api_v2 = (enable_api_v2_fn)dlsym(handle, "cuptiActivityEnableRuntimeApi_v2");
    bound->enable_driver_api_v2 = (enable_api_v2_fn)dlsym(handle, "cuptiActivityEnableDriverApi_v2");
    if (bound->register_callbacks_v2 == NULL || bound->get_next_record_v2 == NULL || bound->set_attribute_v2 == NULL
        || bound->get_num_dropped_v2 == NULL || bound->push_external_v2 == NULL || bound->pop_external_v2 == NULL
        || bound->enable_v2 == NULL || bound->disable_v2 == NULL || bound->enable_runtime_api_v2 == NULL
        || bound->enable_driver_api_v2 == NULL) {
        bound->register_callbacks_v2 = NULL;
    }
}

int binding_can_share(void) {
    return BINDING.handle != NULL && BINDING.version >= MULTI_SUBSCRIBER_VERSION && BINDING.register_callbacks_v2 != NULL;
}

cupti_result binding_next_record(uint8_t *buffer, size_t valid_size, void **record) {
    subscriber_handle subscriber = BINDING.subscriber;
    return subscriber != NULL ? BINDING.get_next_record_v2(subscriber, buffer, valid_size, record)
                              : BINDING.get_next_record(buffer, valid_size, record);
}

cupti_result binding_set_attribute(int attribute, size_t *value_size, void *value) {
    subscriber_handle subscriber = BINDING.subscriber;
    return subscriber != NULL ? BINDING.set_attribute_v2(subscriber, attribute, value_size, value)
                              : BINDING.set_attribute(attribute, value_size, value);
}

cupti_result binding_num_dropped(void *context, uint32_t stream_id, size_t *dropped) {
    subscriber_handle subscriber = BINDING.subscriber;
    if (subscriber != NULL) return BINDING.get_num_dropped_v2(subscriber, context, stream_id, dropped);
    get_num_dropped_fn get_num_dropped = BINDING.get_num_dropped;
    return get_num_dropped != NULL ? get_num_dropped(context, stream_id, dropped) : -1;
}

/* Which stack each of the thread's open pushes went to (1: xsp's subscriber's, 0: the process's),
 * so that its pop goes to the same one though CUPTI was shared or let go in between. */
#define TRACKED_PUSHES 256
static __thread uint8_t PUSHED_SHARED[TRACKED_PUSHES];
static __thread int PUSHED_DEPTH;

cupti_result binding_push(uint64_t id) {
    subscriber_handle subscriber = BINDING.subscriber;
    if (PUSHED_DEPTH < TRACKED_PUSHES) PUSHED_SHARED[PUSHED_DEPTH] = subscriber != NULL;
    PUSHED_DEPTH++;
    if (subscriber != NULL) return BINDING.push_external_v2(subscriber, EXTERNAL_KIND_CUSTOM0, id);
    push_external_fn push = BINDING.push_external;
    return push != NULL ? push(EXTERNAL_KIND_CUSTOM0, id) : -1;
}

cupti_result binding_pop(uint64_t *last_id) {
    int shared = 0;
    if (PUSHED_DEPTH > 0 && --PUSHED_DEPTH < TRACKED_PUSHES) shared = PUSHED_SHARED[PUSHED_DEPTH];
    subscriber_handle subscriber = BINDING.subscriber;
    if (shared) /* pushed for xsp's subscriber: if it has gone since, its stack went with it */
        return subscriber != NULL ? BINDING.pop_external_v2(subscriber, EXTERNAL_KIND_CUSTOM0, last_id) : CUPTI_OK;
    pop_external_fn pop = BINDING.pop_external;
    return pop != NULL ? pop(EXTERNAL_KIND_CUSTOM0, last_id) : -1;
}

int bind_cupti(const char *path, unsigned major, char *why, size_t why_size) {
    static loaded_cuptis found;
    found.count = 0;
    if (path == NULL) {
#ifdef __linux__
        dl_iterate_phdr(find_loaded_cupti, &found);
#endif
        if (found.count == 0) {
            snprintf(why, why_size, "no libcupti is loaded in this process");
            return -1;
        }
        if (found.count == 1) {
            path = found.paths[0];
        } else { /* several (PyTorch's and cupti-python's): the one of the release cupti-python drives */
            int matching = 0;
            for (int i = 0; i < found.count && i < MAX_LOADED; i++)
                if (major != 0 && major_of(found.paths[i]) == major) {
                    path = found.paths[i];
                    matching++;
                }
            if (matching != 1) { /* which one cupti-python calls cannot be told: never guess */
                snprintf(why, why_size, "%d libcupti libraries are loaded in this process (%s, %s%s), %d of CUDA %u",
                         found.count, found.paths[0], found.paths[1], found.count > 2 ? " and others" : "", matching,
                         major);
                return -1;
            }
        }
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) {
        const char *error = dlerror();
        snprintf(why, why_size, "%s is not loaded in this process%s%s", path, error ? ": " : "", error ? error : "");
        return -1;
    }
    cupti_binding bound = {.handle = handle};
    get_version_fn get_version = (get_version_fn)symbol(handle, "cuptiGetVersion", why, why_size);
    if (get_version == NULL
        || (bound.register_callbacks = (register_callbacks_fn)symbol(handle, "cuptiActivityRegisterCallbacks", why,
                                                                     why_size)) == NULL
        || (bound.get_next_record = (get_next_record_fn)symbol(handle, "cuptiActivityGetNextRecord", why,
                                                               why_size)) == NULL
        || (bound.set_attribute = (set_attribute_fn)symbol(handle, "cuptiActivitySetAttribute", why, why_size))
               == NULL
        || (bound.get_num_dropped = (get_num_dropped_fn)symbol(handle, "cuptiActivityGetNumDroppedRecords", why,
                                                               why_size)) == NULL
        || (bound.push_external = (push_external_fn)symbol(handle, "cuptiActivityPushExternalCorrelationId", why,
                                                           why_size)) == NULL
        || (bound.pop_external = (pop_external_fn)symbol(handle, "cuptiActivityPopExternalCorrelationId", why,
                                                         why_size)) == NULL) {
        dlclose(handle);
        return -1;
    }
    bound.get_attribute = (get_attribute_fn)dlsym(handle, "cuptiActivityGetAttribute");
    bound.register_timestamp = (register_timestamp_fn)dlsym(handle, "cuptiActivityRegisterTimestampCallback");
    bind_sharing_calls(&bound);
    cupti_result status = get_version(&bound.version);
    if (status != CUPTI_OK) {
        snprintf(why, why_size, "cuptiGetVersion failed (CUPTI error %d)", status);
        dlclose(handle);
        return -1;
    }
    if ((bound.release = release_of_version(bound.version)) == NULL) {
        snprintf(why, why_size, "CUPTI API version %u is not one whose records xsp knows (CUPTI 12.6 to 13.5)",
                 bound.version);
        dlclose(handle);
        return -1;
    }
    if (BINDING.handle == handle) { /* bound already: CUPTI's callbacks may be reading BINDING now */
        BINDING.version = bound.version;
        BINDING.release = bound.release;
        if (BINDING.subscriber == NULL) bind_sharing_calls(&BINDING);
        dlclose(handle); /* a NOLOAD handle: only a reference count */
        return 0;
    }
    snprintf(bound.path, sizeof(bound.path), "%s", path);
    if (BINDING.handle != NULL) dlclose(BINDING.handle);
    BINDING = bound;
    return 0;
}
