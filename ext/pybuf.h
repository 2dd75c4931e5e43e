/*
 * pybuf.h - taking Python buffers without copies, for the extension modules
 * (ext/_residual.c, ext/_quant.c): acquire C-contiguous, say why a buffer was
 * refused (not a buffer, read-only, strided) in the module's own words, release
 * on every path, recognise float32 formats, and tell overlapping buffers apart.
 *
 * Header-only (static functions), limited API of CPython 3.11. Include after
 * Python.h.
 */
#ifndef FLASHSPEC_PYBUF_H
#define FLASHSPEC_PYBUF_H

#include <string.h>

typedef struct {
    Py_buffer view;
    int held;
} buf_t;

static void release(buf_t *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

static int is_float32_format(const char *fmt) {
    if (fmt == NULL) return 0; /* the modules always ask for PyBUF_FORMAT */
    if (strcmp(fmt, "f") == 0 || strcmp(fmt, "@f") == 0 || strcmp(fmt, "=f") == 0)
        return 1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return strcmp(fmt, ">f") == 0 || strcmp(fmt, "!f") == 0;
#else
    return strcmp(fmt, "<f") == 0;
#endif
}

/*
 * Acquire `obj` as a C-contiguous buffer without copying. When the exporter
 * refuses, ask again loosely to tell the user *why* (not a buffer at all,
 * read-only, or strided) instead of passing on the exporter's wording.
 * `kinds` names what the argument may be, for the first of those messages.
 */
static int acquire_as(PyObject *obj, const char *name, int writable, const char *kinds,
                      buf_t *b) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) == 0) {
        b->held = 1;
        return 0;
    }
    PyErr_Clear();
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyObject *tn = PyType_GetName(Py_TYPE(obj));
        PyErr_Format(PyExc_TypeError, "%s must support the buffer protocol (%s); got %S", name,
                     kinds, tn ? tn : Py_None);
        Py_XDECREF(tn);
        return -1;
    }
    if (writable && probe.readonly) {
        PyErr_Format(PyExc_ValueError,
                     "%s is read-only; pass a writable float32 array (or out=None "
                     "to allocate one)", name);
    } else {
        PyErr_Format(PyExc_ValueError,
                     "%s must be C-contiguous (no strides or transposes); pass "
                     "numpy.ascontiguousarray(%s)", name, name);
    }
    PyBuffer_Release(&probe);
    return -1;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = (const char *)a->buf, *b0 = (const char *)b->buf;
    return a0 < b0 + b->len && b0 < a0 + a->len;
}

#endif
