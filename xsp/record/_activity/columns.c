/* The record walker and the columns it writes (see columns.h). */
#include "columns.h"

#include <stdlib.h>
#include <string.h>

uint8_t field_width(uint8_t type) {
    switch (type) {
    case U8: return 1;
    case U16: return 2;
    case U64: return 8;
    default: return 4; /* I32, U32, NAME (an id) */
    }
}

char field_format(uint8_t type) {
    switch (type) {
    case U8: return 'B';
    case U16: return 'H';
    case I32: return 'i';
    case U64: return 'Q';
    default: return 'I';
    }
}

static int grow(family_columns *family, const family_layout *layout) {
    size_t capacity = family->capacity ? family->capacity * 2 : 1024;
    for (int i = 0; i < layout->field_count; i++) {
        column *c = &family->columns[i];
        c->width = field_width(layout->fields[i].type);
        char *data = realloc(c->data, capacity * c->width);
        if (data == NULL) return -1;
        c->data = data;
    }
    family->capacity = capacity;
    return 0;
}

static inline int append_record(family_columns *family, const family_layout *layout, const uint8_t *record,
                                size_t size, name_table *names) {
    if (family->rows == family->capacity && grow(family, layout) < 0) return -1;
    size_t row = family->rows;
    for (int i = 0; i < layout->field_count; i++) {
        const field_layout *field = &layout->fields[i];
        char *data = family->columns[i].data;
        const uint8_t *value = record + field->offset;
        if (field->optional && (size_t)field->offset + field_width(field->type) > size) {
            memset(data + row * field_width(field->type), 0, field_width(field->type)); /* an older version */
            continue;
        }
        switch (field->type) {
        case U8: data[row] = (char)*value; break;
        case U16: memcpy(data + row * 2, value, 2); break;
        case I32:
        case U32: memcpy(data + row * 4, value, 4); break;
        case U64: memcpy(data + row * 8, value, 8); break;
        case NAME: {
            const char *pointer;
            memcpy(&pointer, value, sizeof(pointer));
            uint32_t id = intern_name(names, pointer);
            if (id == NO_NAME) return -1;
            memcpy(data + row * 4, &id, 4);
            break;
        }
        }
    }
    family->rows++;
    return 0;
}

/* The next record after `record` (NULL: the first), or NULL at the end of the buffer; *cut set
 * when CUPTI ended the walk early (an incomplete or unknown record). */
static const uint8_t *next_of(get_next_record_fn next_record, uint8_t *buffer, size_t valid_size, void *record,
                              int *cut) {
    void *next = record;
    cupti_result status = next_record(buffer, valid_size, &next);
    if (status == CUPTI_ERROR_MAX_LIMIT_REACHED) return NULL;
    const uint8_t *at = next;
    if (status != CUPTI_OK || at == NULL || at < buffer || at >= buffer + valid_size
        || (record != NULL && at <= (const uint8_t *)record)) {
        *cut = 1;
        return NULL;
    }
    return at;
}

int read_buffer(drain_columns *out, const release_sizes *release, get_next_record_fn next_record,
                uint8_t *buffer, size_t valid_size, name_table *names) {
    const uint8_t *end = buffer + valid_size;
    int cut = 0;
    const uint8_t *at = next_of(next_record, buffer, valid_size, NULL, &cut);
    while (at != NULL) {
        /* the record's true size is where the next one begins: look one ahead */
        const uint8_t *next = next_of(next_record, buffer, valid_size, (void *)at, &cut);
        size_t size = (size_t)((next != NULL ? next : end) - at);
        uint32_t kind;
        memcpy(&kind, at, sizeof(kind));
        int family = family_of_kind(kind);
        if (family < 0) {
            out->other_kinds++;
        } else if (size < FAMILY_LAYOUTS[family].extent) {
            out->unreadable++; /* too short for the fields xsp reads: not a layout xsp knows */
        } else {
            if (size != record_size(release, kind) && (next != NULL || size < record_size(release, kind)))
                out->size_mismatch++;
            if (append_record(&out->families[family], &FAMILY_LAYOUTS[family], at, size, names) < 0) return -1;
            out->records++;
        }
        at = next;
    }
    if (cut) out->cut_short++;
    return 0;
}

void free_columns(drain_columns *out) {
    for (int f = 0; f < FAMILIES; f++)
        for (int i = 0; i < MAX_FIELDS; i++) {
            free(out->families[f].columns[i].data);
            out->families[f].columns[i].data = NULL;
        }
}
