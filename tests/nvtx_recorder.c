/* An NVTX tool for the tests: attaches as Nsight Systems does (NVTX_INJECTION64_PATH names this
 * library; NVTX's first call runs InitializeInjectionNvtx2) and records every domain, registered
 * string, push, pop, start and end with its thread and clock, using NVIDIA's own NVTX headers
 * for the callback tables and the event attribute structure (so that xsp's own definitions
 * are checked against them).
 *
 * XSP_NVTX_RECORD names the file the events are written to at exit, one per line, tab-separated:
 *   push <tid> <ns> <domain> <category> <name>     pop <tid> <ns> <domain>
 *   start <tid> <ns> <domain> <id> <name>     end <tid> <ns> <domain> <id>
 *   bad <tid> <ns> <what>   (an event attribute structure NVTX's header would not accept)
 * Without it, events are only counted (the benchmarks' "tool attached" case). */
#define NVTX_NO_IMPL
#include "nvtx3/nvToolsExt.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    char name[64];
} Domain;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *log_text;
static size_t log_length, log_capacity;
static int recording;
static unsigned long long next_id = 1;
static unsigned long long event_count;

static long long now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static void append(const char *format, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void append(const char *format, ...) {
    char line[1024];
    va_list args;
    va_start(args, format);
    int length = vsnprintf(line, sizeof line, format, args);
    va_end(args);
    if (length < 0) return;
    if ((size_t)length >= sizeof line) length = sizeof line - 1;
    pthread_mutex_lock(&lock);
    event_count++;
    if (recording) {
        if (log_length + (size_t)length + 1 > log_capacity) {
            size_t capacity = log_capacity ? 2 * log_capacity : 1 << 20;
            while (capacity < log_length + (size_t)length + 1) capacity *= 2;
            char *grown = realloc(log_text, capacity);
            if (grown != NULL) {
                log_text = grown;
                log_capacity = capacity;
            }
        }
        if (log_length + (size_t)length + 1 <= log_capacity) {
            memcpy(log_text + log_length, line, (size_t)length);
            log_length += (size_t)length;
        }
    }
    pthread_mutex_unlock(&lock);
}

static void count(void) {
    pthread_mutex_lock(&lock);
    event_count++;
    pthread_mutex_unlock(&lock);
}

static long thread_id(void) { return (long)syscall(SYS_gettid); }

static const char *domain_name(nvtxDomainHandle_t domain) {
    return domain == NULL ? "(default)" : ((const Domain *)domain)->name;
}

/* The message of an event, or NULL (and a "bad" line) when the structure is not what NVTX's
 * header defines. */
static const char *message_of(const nvtxEventAttributes_t *attributes) {
    if (attributes == NULL) return NULL;
    if (attributes->version != NVTX_VERSION || attributes->size != NVTX_EVENT_ATTRIB_STRUCT_SIZE) {
        append("bad\t%ld\t%lld\tversion %u size %u\n", thread_id(), now_ns(), attributes->version, attributes->size);
        return NULL;
    }
    switch (attributes->messageType) {
    case NVTX_MESSAGE_TYPE_ASCII: return attributes->message.ascii;
    case NVTX_MESSAGE_TYPE_REGISTERED: return (const char *)attributes->message.registered;
    default:
        append("bad\t%ld\t%lld\tmessage type %d\n", thread_id(), now_ns(), attributes->messageType);
        return NULL;
    }
}

static nvtxDomainHandle_t domain_create(const char *name) {
    Domain *domain = calloc(1, sizeof(Domain));
    if (domain == NULL) return NULL;
    snprintf(domain->name, sizeof domain->name, "%s", name ? name : "");
    if (recording) append("domain\t%ld\t%lld\t%s\n", thread_id(), now_ns(), domain->name);
    return (nvtxDomainHandle_t)domain;
}

/* a registered string's handle is a copy of the text: the events read it back */
static nvtxStringHandle_t register_string(nvtxDomainHandle_t domain, const char *text) {
    (void)domain;
    return (nvtxStringHandle_t)strdup(text ? text : "");
}

static int range_push(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attributes) {
    if (!recording) {
        count();
        return 0;
    }
    const char *message = message_of(attributes);
    if (message != NULL)
        append("push\t%ld\t%lld\t%s\t%u\t%s\n", thread_id(), now_ns(), domain_name(domain), attributes->category,
               message);
    return 0;
}

static int range_pop(nvtxDomainHandle_t domain) {
    if (!recording) {
        count();
        return 0;
    }
    append("pop\t%ld\t%lld\t%s\n", thread_id(), now_ns(), domain_name(domain));
    return 0;
}

static nvtxRangeId_t range_start(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attributes) {
    pthread_mutex_lock(&lock);
    unsigned long long id = next_id++;
    pthread_mutex_unlock(&lock);
    const char *message = message_of(attributes);
    if (message != NULL)
        append("start\t%ld\t%lld\t%s\t%llu\t%s\n", thread_id(), now_ns(), domain_name(domain), id, message);
    return id;
}

static void range_end(nvtxDomainHandle_t domain, nvtxRangeId_t id) {
    append("end\t%ld\t%lld\t%s\t%llu\n", thread_id(), now_ns(), domain_name(domain), (unsigned long long)id);
}

__attribute__((destructor)) static void write_log(void) {
    const char *path = getenv("XSP_NVTX_RECORD");
    if (path == NULL || !*path) return;
    FILE *file = fopen(path, "w");
    if (file == NULL) return;
    if (log_length) fwrite(log_text, 1, log_length, file);
    fprintf(file, "events\t%llu\n", event_count);
    fclose(file);
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const char *path = getenv("XSP_NVTX_RECORD");
    recording = path != NULL && *path;
    const NvtxExportTableCallbacks *callbacks =
        (const NvtxExportTableCallbacks *)get_export_table(NVTX_ETID_CALLBACKS);
    if (callbacks == NULL || callbacks->struct_size < sizeof(NvtxExportTableCallbacks)) return 0;
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || table == NULL) return 0;
    if (size <= NVTX_CBID_CORE2_DomainCreateA) return 0;
    *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
    *table[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
    *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)range_push;
    *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)range_pop;
    *table[NVTX_CBID_CORE2_DomainRangeStartEx] = (NvtxFunctionPointer)range_start;
    *table[NVTX_CBID_CORE2_DomainRangeEnd] = (NvtxFunctionPointer)range_end;
    return 1;
}
