/* Interned kernel names (see names.h). */
#include "names.h"

#include <stdlib.h>
#include <string.h>

static inline size_t hash_pointer(const char *pointer) {
    uint64_t value = (uint64_t)(uintptr_t)pointer;
    value ^= value >> 33;
    value *= 0xff51afd7ed558ccdULL;
    value ^= value >> 33;
    return (size_t)value;
}

static size_t hash_text(const char *text, size_t *length) {
    uint64_t hash = 0xcbf29ce484222325ULL; /* FNV-1a */
    const char *p = text;
    for (; *p; p++) hash = (hash ^ (uint8_t)*p) * 0x100000001b3ULL;
    *length = (size_t)(p - text);
    return (size_t)hash;
}

static int grow_pointers(name_table *table) {
    size_t capacity = table->pointer_capacity ? table->pointer_capacity * 2 : 256;
    pointer_slot *slots = calloc(capacity, sizeof(pointer_slot));
    if (slots == NULL) return -1;
    for (size_t i = 0; i < table->pointer_capacity; i++) {
        pointer_slot slot = table->by_pointer[i];
        if (slot.pointer == NULL) continue;
        size_t at = hash_pointer(slot.pointer) & (capacity - 1);
        while (slots[at].pointer != NULL) at = (at + 1) & (capacity - 1);
        slots[at] = slot;
    }
    free(table->by_pointer);
    table->by_pointer = slots;
    table->pointer_capacity = capacity;
    return 0;
}

static int grow_contents(name_table *table) {
    size_t capacity = table->content_capacity ? table->content_capacity * 2 : 256;
    uint32_t *slots = calloc(capacity, sizeof(uint32_t));
    if (slots == NULL) return -1;
    for (uint32_t id = 0; id < table->count; id++) {
        size_t length;
        size_t at = hash_text(table->texts[id], &length) & (capacity - 1);
        while (slots[at] != 0) at = (at + 1) & (capacity - 1);
        slots[at] = id + 1;
    }
    free(table->by_content);
    table->by_content = slots;
    table->content_capacity = capacity;
    return 0;
}

/* The id of `text`, added if new; NO_NAME when out of memory. */
static uint32_t intern_text(name_table *table, const char *text) {
    if ((table->count + 1) * 2 > table->content_capacity && grow_contents(table) < 0) return NO_NAME;
    size_t length;
    size_t at = hash_text(text, &length) & (table->content_capacity - 1);
    for (; table->by_content[at] != 0; at = (at + 1) & (table->content_capacity - 1)) {
        uint32_t id = table->by_content[at] - 1;
        if (table->lengths[id] == length && memcmp(table->texts[id], text, length) == 0) return id;
    }
    if (table->count == table->capacity) {
        uint32_t capacity = table->capacity ? table->capacity * 2 : 256;
        char **texts = realloc(table->texts, capacity * sizeof(char *));
        if (texts == NULL) return NO_NAME;
        table->texts = texts;
        size_t *lengths = realloc(table->lengths, capacity * sizeof(size_t));
        if (lengths == NULL) return NO_NAME;
        table->lengths = lengths;
        table->capacity = capacity;
    }
    char *copy = malloc(length + 1);
    if (copy == NULL) return NO_NAME;
    memcpy(copy, text, length + 1);
    uint32_t id = table->count++;
    table->texts[id] = copy;
    table->lengths[id] = length;
    table->by_content[at] = id + 1;
    return id;
}

uint32_t intern_name(name_table *table, const char *pointer) {
    if (pointer == NULL) return intern_text(table, "");
    if (table->pointer_capacity) {
        size_t mask = table->pointer_capacity - 1;
        for (size_t at = hash_pointer(pointer) & mask; table->by_pointer[at].pointer != NULL; at = (at + 1) & mask) {
            if (table->by_pointer[at].pointer != pointer) continue;
            uint32_t id = table->by_pointer[at].id;
            if (strcmp(table->texts[id], pointer) == 0) return id;
            id = intern_text(table, pointer); /* another name at a reused address */
            if (id != NO_NAME) table->by_pointer[at].id = id;
            return id;
        }
    }
    uint32_t id = intern_text(table, pointer);
    if (id == NO_NAME) return NO_NAME;
    if ((table->pointer_used + 1) * 2 > table->pointer_capacity && grow_pointers(table) < 0) return id;
    size_t mask = table->pointer_capacity - 1;
    size_t at = hash_pointer(pointer) & mask;
    while (table->by_pointer[at].pointer != NULL) at = (at + 1) & mask;
    table->by_pointer[at].pointer = pointer;
    table->by_pointer[at].id = id;
    table->pointer_used++;
    return id;
}

void free_names(name_table *table) {
    for (uint32_t id = 0; id < table->count; id++) free(table->texts[id]);
    free(table->texts);
    free(table->lengths);
    free(table->by_pointer);
    free(table->by_content);
    memset(table, 0, sizeof(*table));
}
