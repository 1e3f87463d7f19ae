/* Kernel names, interned: CUPTI owns the strings its kernel records point at, so each one is
 * copied the first time it is seen and the records keep its id. */
#ifndef XSP_NAMES_H
#define XSP_NAMES_H

#include <stddef.h>
#include <stdint.h>

#define NO_NAME UINT32_MAX

typedef struct {
    const char *pointer;
    uint32_t id;
} pointer_slot;

typedef struct {
    pointer_slot *by_pointer; /* CUPTI's pointer -> id: the common case, one probe */
    size_t pointer_capacity, pointer_used;
    uint32_t *by_content; /* hash of the text -> id + 1 (0: empty), when a pointer is new */
    size_t content_capacity;
    char **texts;
    size_t *lengths;
    uint32_t count, capacity;
    uint32_t reported; /* names [0, reported) were handed to Python */
} name_table;

/* The id of the name at `pointer` (NULL: the empty name), copied if new; NO_NAME when out of
 * memory. A pointer seen before is checked against its copy, so a name freed and another put
 * at its address gets its own id. */
uint32_t intern_name(name_table *table, const char *pointer);

void free_names(name_table *table);

#endif
