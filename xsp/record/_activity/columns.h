/* Reading completed CUPTI buffers into packed columns, one set per record family. Runs
 * without the GIL: nothing here touches a Python object. */
#ifndef XSP_COLUMNS_H
#define XSP_COLUMNS_H

#include "cupti_abi.h"
#include "names.h"

typedef struct {
    char *data;
    uint8_t width;
} column;

typedef struct {
    column columns[MAX_FIELDS];
    size_t rows, capacity;
} family_columns;

typedef struct {
    family_columns families[FAMILIES];
    uint64_t records;       /* records read into columns */
    uint64_t other_kinds;   /* records of kinds xsp does not read (skipped) */
    uint64_t unreadable;    /* records too short for the fields xsp reads (lost) */
    uint64_t cut_short;     /* buffers whose walk CUPTI ended early: an incomplete record (lost) */
    uint64_t size_mismatch; /* records whose size is not the bound release's (read; a diagnostic) */
} drain_columns;

/* Bytes of one stored value of a field of `type`. */
uint8_t field_width(uint8_t type);

/* The struct/buffer-protocol format character of a field of `type`. */
char field_format(uint8_t type);

/* Read every record of one buffer into `out`. Returns 0, -1 when out of memory. */
int read_buffer(drain_columns *out, const release_sizes *release, get_next_record_fn next_record,
                uint8_t *buffer, size_t valid_size, name_table *names);

/* Free what `out` still owns (columns handed over are set to NULL by the taker). */
void free_columns(drain_columns *out);

#endif
