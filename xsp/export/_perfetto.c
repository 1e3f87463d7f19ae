/* Spans as Perfetto TrackEvent slices (protos/perfetto/trace/track_event/track_event.proto), written
 * straight from the span table's columns (xsp/export/perfetto.py): a TYPE_SLICE_BEGIN packet at each
 * span's start and a TYPE_SLICE_END packet at its end, on its track, each a Trace.packet entry.
 *
 * A track's slices must nest: the spans come sorted by track, then start, then end (latest first),
 * and a stack of the open ends per track closes each slice before the next one begins after it. A
 * span that overlaps the open one without fitting in it (an imported trace's) is cut at that one's
 * end, and counted. The bytes go to the output in blocks, so memory does not grow with the spans. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_wire.h"

enum { SLICE_BEGIN = 1, SLICE_END = 2, NEEDS_INCREMENTAL_STATE = 2 };
#define BLOCK_BYTES (8u << 20)

static int flush(Buffer *b, PyObject *out) {
    if (!b->length) return 0;
    PyObject *written = PyObject_CallMethod(out, "write", "y#", b->data, (Py_ssize_t)b->length);
    if (written == NULL) return -1;
    Py_DECREF(written);
    b->length = 0;
    return 0;
}

/* One Trace.packet: TracePacket { timestamp, track_event { type, track_uuid, [name_iid], [category_iids] },
 * trusted_packet_sequence_id, sequence_flags }. At most 80 bytes. */
static void put_event(Buffer *b, uint64_t at_ns, int type, uint64_t track_uuid, uint64_t name_iid,
                      uint64_t category_iid, uint32_t sequence_id) {
    size_t event = 2 + 1 + varint_size(track_uuid);
    if (type == SLICE_BEGIN) event += 1 + varint_size(name_iid) + 1 + varint_size(category_iid);
    size_t packet = 1 + varint_size(at_ns) + 1 + varint_size(event) + event + 1 + varint_size(sequence_id) + 2;
    b->data[b->length++] = 0x0a; /* Trace.packet */
    put_varint(b, packet);
    b->data[b->length++] = 0x40; /* TracePacket.timestamp */
    put_varint(b, at_ns);
    b->data[b->length++] = 0x5a; /* TracePacket.track_event */
    put_varint(b, event);
    b->data[b->length++] = 0x48; /* TrackEvent.type */
    b->data[b->length++] = (char)type;
    b->data[b->length++] = 0x58; /* TrackEvent.track_uuid */
    put_varint(b, track_uuid);
    if (type == SLICE_BEGIN) {
        b->data[b->length++] = 0x50; /* TrackEvent.name_iid */
        put_varint(b, name_iid);
        b->data[b->length++] = 0x18; /* TrackEvent.category_iids */
        put_varint(b, category_iid);
    }
    b->data[b->length++] = 0x50; /* TracePacket.trusted_packet_sequence_id */
    put_varint(b, sequence_id);
    b->data[b->length++] = 0x68; /* TracePacket.sequence_flags */
    b->data[b->length++] = NEEDS_INCREMENTAL_STATE;
}

/* write_slices(out, tracks, starts, ends, name_iids, category_iids, track_uuids, sequence_id) -> int */
static PyObject *write_slices(PyObject *module, PyObject *args) {
    PyObject *out;
    Py_buffer tracks, starts, ends, names, categories, uuids;
    unsigned int sequence_id;
    if (!PyArg_ParseTuple(args, "Oy*y*y*y*y*y*I", &out, &tracks, &starts, &ends, &names, &categories, &uuids,
                          &sequence_id))
        return NULL;
    Py_buffer *views[] = {&tracks, &starts, &ends, &names, &categories, &uuids};
    PyObject *result = NULL;
    Buffer block = {NULL, 0, BLOCK_BYTES + 256};
    int64_t *open_ends = NULL;
    Py_ssize_t count = tracks.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t track_count = uuids.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t item = (Py_ssize_t)sizeof(int64_t);
    if (check(&starts, item, count, "starts") < 0 || check(&ends, item, count, "ends") < 0
        || check(&names, item, count, "names") < 0 || check(&categories, item, count, "categories") < 0)
        goto done;
    block.data = PyMem_Malloc(block.capacity);
    open_ends = PyMem_Malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    if (block.data == NULL || open_ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *track = tracks.buf, *start = starts.buf, *end = ends.buf, *name = names.buf,
                  *category = categories.buf;
    const uint64_t *uuid = uuids.buf;
    Py_ssize_t depth = 0, cut = 0;
    int64_t current = -1;
    for (Py_ssize_t i = 0; i <= count; i++) {
        int next_track = i == count || track[i] != current;
        /* close what ended before this span begins (all of the track's, at a new track) */
        while (depth && (next_track || open_ends[depth - 1] <= start[i])) {
            put_event(&block, (uint64_t)open_ends[depth - 1], SLICE_END, uuid[current], 0, 0, sequence_id);
            depth--;
            if (block.length >= BLOCK_BYTES && flush(&block, out) < 0) goto done;
        }
        if (i == count) break;
        current = track[i];
        if (current < 0 || current >= track_count) {
            PyErr_SetString(PyExc_IndexError, "a track outside the track table");
            goto done;
        }
        int64_t stop = end[i] < start[i] ? start[i] : end[i];
        if (depth && stop > open_ends[depth - 1]) {
            stop = open_ends[depth - 1];
            cut++;
        }
        put_event(&block, (uint64_t)start[i], SLICE_BEGIN, uuid[current], (uint64_t)name[i], (uint64_t)category[i],
                  sequence_id);
        open_ends[depth++] = stop;
        if (block.length >= BLOCK_BYTES && flush(&block, out) < 0) goto done;
    }
    if (flush(&block, out) < 0) goto done;
    result = PyLong_FromSsize_t(cut);
done:
    PyMem_Free(block.data);
    PyMem_Free(open_ends);
    for (size_t v = 0; v < sizeof views / sizeof views[0]; v++) PyBuffer_Release(views[v]);
    return result;
}

static PyMethodDef methods[] = {
    {"write_slices", write_slices, METH_VARARGS,
     "write_slices(out, tracks, starts, ends, name_iids, category_iids, track_uuids, sequence_id) -> int: write "
     "each span (int64 arrays, sorted by track, start, then end latest first) as a slice's begin and end packets "
     "to out.write, in blocks; track_uuids (uint64) by track. Returns how many spans were cut at the end of the "
     "slice they overlap. See xsp/export/perfetto.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_perfetto", "Spans as Perfetto TrackEvent slices, from the span table's columns.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__perfetto(void) { return PyModule_Create(&definition); }
