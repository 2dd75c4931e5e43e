/*
 * _residual.c - Python glue for flashspec._residual.
 *
 * Job: take buffers without copying, check them, pick the backend once, run the
 * row loop (GIL released when the work pays for it), and turn every failure
 * into a Python exception that names the argument. The kernels themselves live
 * in residual.c (C) and asm/ (NASM); their contract is kernels.h.
 *
 * Written against the limited API of CPython 3.11 (Py_buffer joined it then),
 * so one abi3 wheel per architecture serves every CPython >= 3.11.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "pybuf.h"

/* Bump when the Python-visible behaviour or the kernel contract changes. */
#define FS_ABI_VERSION 1

/* Below this many elements per call the GIL round trip costs more than it saves. */
#define GIL_RELEASE_MIN_ELEMS 32768

/*
 * If the residual mass is this small, 1/sum overflows float32 (FLT_MAX ~ 3.4e38),
 * so the row is normalised in float64 instead of by a float32 reciprocal.
 */
#define TINY_SUM 1e-30

#define ENV_KERNEL "FLASHSPEC_KERNEL"

/* ---------------------------------------------------------------- backends */

static fs_cpu g_cpu;
static fs_backend g_backends[3];
static int g_n_backends;
static const fs_backend *g_active;

static void register_backends(void) {
    g_n_backends = 0;
    g_backends[g_n_backends++] = (fs_backend){"scalar", fs_residual_store_scalar,
                                              fs_residual_sum_scalar, fs_scale_scalar,
                                              fs_scan_scalar};
#ifdef FLASHSPEC_HAVE_ASM
    if (fs_cpu_has_avx2(&g_cpu))
        g_backends[g_n_backends++] = (fs_backend){"avx2", fs_residual_store_avx2,
                                                  fs_residual_sum_avx2, fs_scale_avx2,
                                                  fs_scan_avx2};
    if (fs_cpu_has_avx512(&g_cpu))
        g_backends[g_n_backends++] = (fs_backend){"avx512", fs_residual_store_avx512,
                                                  fs_residual_sum_avx512,
                                                  fs_scale_avx512, fs_scan_avx512};
#endif
}

static int is_known_backend(const char *name) {
    return strcmp(name, "scalar") == 0 || strcmp(name, "avx2") == 0 ||
           strcmp(name, "avx512") == 0;
}

static PyObject *available_names(void) {
    PyObject *lst = PyList_New(0);
    if (lst == NULL) return NULL;
    for (int i = 0; i < g_n_backends; i++) {
        PyObject *s = PyUnicode_FromString(g_backends[i].name);
        if (s == NULL || PyList_Append(lst, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(lst);
            return NULL;
        }
        Py_DECREF(s);
    }
    return lst;
}

/* Select by name; raises `exc` with a message that says what to do instead. */
static int select_backend(const char *name, PyObject *exc, const char *origin) {
    for (int i = 0; i < g_n_backends; i++) {
        if (strcmp(g_backends[i].name, name) == 0) {
            g_active = &g_backends[i];
            return 0;
        }
    }
    PyObject *avail = available_names();
    if (avail == NULL) return -1;
    if (!is_known_backend(name)) {
        PyErr_Format(exc, "%s: unknown kernel backend '%s'; expected one of "
                     "'scalar', 'avx2', 'avx512' (available on this CPU: %R)",
                     origin, name, avail);
    } else {
#ifdef FLASHSPEC_HAVE_ASM
        const char *why = "this CPU (or its OS) does not support it";
#else
        const char *why = "this build has no assembly kernels (FLASHSPEC_NO_ASM or non-x86-64)";
#endif
        PyErr_Format(exc, "%s: kernel backend '%s' is not available: %s; "
                     "available: %R", origin, name, why, avail);
    }
    Py_DECREF(avail);
    return -1;
}

/* ------------------------------------------------------------------ buffers */

/* Each argument may be a NumPy float32 array, a memoryview or an array.array('f'). */
static int acquire(PyObject *obj, const char *name, int writable, buf_t *b) {
    return acquire_as(obj, name, writable,
                      "a NumPy float32 array, memoryview or array.array('f')", b);
}

static int check_float32(const buf_t *b, const char *name) {
    const Py_buffer *v = &b->view;
    if (!is_float32_format(v->format) || v->itemsize != 4) {
        PyErr_Format(PyExc_TypeError,
                     "%s must hold float32 (format 'f', itemsize 4); got format "
                     "'%s' with itemsize %zd; convert with .astype(numpy.float32)",
                     name, v->format ? v->format : "B", v->itemsize);
        return -1;
    }
    if (v->ndim != 1 && v->ndim != 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be 1-D (V,) or 2-D (B, V); got %d dimensions", name,
                     v->ndim);
        return -1;
    }
    return 0;
}

static int same_shape(const Py_buffer *a, const Py_buffer *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

static PyObject *shape_repr(const Py_buffer *v) {
    if (v->ndim == 1) return PyUnicode_FromFormat("(%zd,)", v->shape[0]);
    return PyUnicode_FromFormat("(%zd, %zd)", v->shape[0], v->shape[1]);
}

/* p and q: float32, same shape, V >= 1. Fills rows/cols. */
static int check_pq(buf_t *p, buf_t *q, Py_ssize_t *rows, Py_ssize_t *cols) {
    if (check_float32(p, "p") < 0 || check_float32(q, "q") < 0) return -1;
    if (!same_shape(&p->view, &q->view)) {
        PyObject *sp = shape_repr(&p->view), *sq = shape_repr(&q->view);
        if (sp && sq)
            PyErr_Format(PyExc_ValueError,
                         "p and q must have the same shape; got p %U and q %U", sp, sq);
        Py_XDECREF(sp);
        Py_XDECREF(sq);
        return -1;
    }
    Py_ssize_t v = p->view.shape[p->view.ndim - 1];
    if (v == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "p and q have V = 0 (empty last axis); the vocabulary axis "
                        "needs at least one entry");
        return -1;
    }
    *cols = v;
    *rows = p->view.ndim == 2 ? p->view.shape[0] : 1;
    return 0;
}

/* ---------------------------------------------------------------- row work */

enum { ROW_OK = 0, ROW_NONFINITE_P, ROW_NONFINITE_Q, ROW_NO_MASS };

typedef struct {
    int kind;
    Py_ssize_t row, index;
} row_error;

/* Slow path, taken only when the check sum is not finite: find the culprit. */
static int find_nonfinite(const float *p, const float *q, size_t n, row_error *e) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i])) {
            e->kind = ROW_NONFINITE_P;
            e->index = (Py_ssize_t)i;
            return 1;
        }
    for (size_t i = 0; i < n; i++)
        if (!isfinite(q[i])) {
            e->kind = ROW_NONFINITE_Q;
            e->index = (Py_ssize_t)i;
            return 1;
        }
    return 0; /* finite but huge: the float32 sums overflowed */
}

static double diff_f64(const float *p, const float *q, size_t i) {
    double d = (double)p[i] - (double)q[i];
    return d > 0.0 ? d : 0.0;
}

static double residual_sum_f64(const float *p, const float *q, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += diff_f64(p, q, i);
    return s;
}

static double positive_sum_f64(const float *p, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += p[i] > 0.0f ? (double)p[i] : 0.0;
    return s;
}

/*
 * Zero residual (p <= q everywhere; for two pmfs that means p == q): the limit
 * of the residual as q -> p from below is p renormalised, so that is the row.
 * Negative entries of p are treated as 0 so the result is always a pmf.
 */
static int renormalise_p(const float *p, float *out, size_t n, row_error *e) {
    double s = positive_sum_f64(p, n);
    if (!(s > 0.0)) {
        e->kind = ROW_NO_MASS;
        return -1;
    }
    for (size_t i = 0; i < n; i++) out[i] = p[i] > 0.0f ? (float)((double)p[i] / s) : 0.0f;
    return 0;
}

static int dist_row(const fs_backend *be, const float *p, const float *q, float *out,
                    size_t n, row_error *e) {
    float check;
    double s = be->store(p, q, out, n, &check);
    if (!isfinite(check) || !isfinite(s)) {
        if (find_nonfinite(p, q, n, e)) return -1;
        s = residual_sum_f64(p, q, n);
        if (s > 0.0) { /* finite inputs whose float32 differences overflowed */
            for (size_t i = 0; i < n; i++) out[i] = (float)(diff_f64(p, q, i) / s);
            return 0;
        }
    }
    if (s == 0.0) return renormalise_p(p, out, n, e);
    if (s < TINY_SUM) {
        for (size_t i = 0; i < n; i++) out[i] = (float)((double)out[i] / s);
        return 0;
    }
    be->scale(out, n, (float)(1.0 / s));
    return 0;
}

/* Inverse CDF over w_i >= 0 with total mass `total`, finishing a coarse scan. */
static size_t finish_scan(const float *p, const float *q, size_t n, size_t start,
                          double before, double target) {
    double acc = before;
    for (size_t i = start; i < n; i++) {
        double d = q ? diff_f64(p, q, i) : (p[i] > 0.0f ? (double)p[i] : 0.0);
        if (d > 0.0) {
            acc += d;
            if (acc > target) return i;
        }
    }
    /*
     * Rounding made the scan's total fall short of u * total (u close to 1):
     * the last index with positive mass is the one the exact CDF would give.
     */
    for (size_t i = n; i-- > 0;) {
        double d = q ? diff_f64(p, q, i) : (double)p[i];
        if (d > 0.0) return i;
    }
    return 0; /* unreachable: callers guarantee positive mass */
}

static int sample_row(const fs_backend *be, const float *p, const float *q, size_t n,
                      double u, int64_t *idx, row_error *e) {
    float check;
    double s = be->sum(p, q, n, &check);
    if (!isfinite(check) || !isfinite(s)) {
        if (find_nonfinite(p, q, n, e)) return -1;
        s = residual_sum_f64(p, q, n);
        if (s > 0.0) {
            *idx = (int64_t)finish_scan(p, q, n, 0, 0.0, u * s);
            return 0;
        }
    }
    if (s == 0.0) {
        double sp = positive_sum_f64(p, n);
        if (!(sp > 0.0)) {
            e->kind = ROW_NO_MASS;
            return -1;
        }
        *idx = (int64_t)finish_scan(p, NULL, n, 0, 0.0, u * sp);
        return 0;
    }
    double target = u * s, before = 0.0;
    size_t start = be->scan(p, q, n, target, &before);
    *idx = (int64_t)finish_scan(p, q, n, start, before, target);
    return 0;
}

static void raise_row_error(const row_error *e, Py_ssize_t rows) {
    const char *arg = e->kind == ROW_NONFINITE_P ? "p" : "q";
    switch (e->kind) {
    case ROW_NONFINITE_P:
    case ROW_NONFINITE_Q:
        if (rows > 1)
            PyErr_Format(PyExc_ValueError,
                         "%s contains NaN or infinity at row %zd, index %zd; pass "
                         "finite probabilities", arg, e->row, e->index);
        else
            PyErr_Format(PyExc_ValueError,
                         "%s contains NaN or infinity at index %zd; pass finite "
                         "probabilities", arg, e->index);
        break;
    default:
        PyErr_Format(PyExc_ValueError,
                     "row %zd: p <= q everywhere and p has no positive mass, so "
                     "neither the residual nor p renormalised is a distribution; "
                     "p must be a probability vector", e->row);
    }
}

/* ------------------------------------------------------------ numpy output */

static PyObject *g_np_empty; /* numpy.empty, imported on first use */
static PyObject *g_np_float32, *g_np_int64;

static int np_import(void) {
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL) return -1;
    g_np_empty = PyObject_GetAttrString(np, "empty");
    g_np_float32 = PyObject_GetAttrString(np, "float32");
    g_np_int64 = PyObject_GetAttrString(np, "int64");
    Py_DECREF(np);
    if (g_np_empty == NULL || g_np_float32 == NULL || g_np_int64 == NULL) {
        Py_CLEAR(g_np_empty);
        Py_CLEAR(g_np_float32);
        Py_CLEAR(g_np_int64);
        return -1;
    }
    return 0;
}

/* A new C-contiguous NumPy array of `like`'s shape (its first `ndim` axes). */
static PyObject *np_empty(const Py_buffer *like, int ndim, int is_int64) {
    if (g_np_empty == NULL && np_import() < 0) return NULL;
    PyObject *shape = ndim == 1 ? Py_BuildValue("(n)", like->shape[0])
                                : Py_BuildValue("(nn)", like->shape[0], like->shape[1]);
    if (shape == NULL) return NULL;
    PyObject *arr = PyObject_CallFunctionObjArgs(
        g_np_empty, shape, is_int64 ? g_np_int64 : g_np_float32, NULL);
    Py_DECREF(shape);
    return arr;
}

/* -------------------------------------------------------------- functions */

/* Parse (a, b, /, c=None) from a vectorcall-style argument list. */
static int parse_three(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       const char *fname, const char *third, int third_required,
                       PyObject **a, PyObject **b, PyObject **c) {
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    *c = NULL;
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "%s() takes p and q positionally plus %s; got "
                     "%zd positional arguments", fname, third, nargs);
        return -1;
    }
    *a = args[0];
    *b = args[1];
    if (nargs == 3) *c = args[2];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GetItem(kwnames, i);
        if (k == NULL) return -1;
        if (PyUnicode_CompareWithASCIIString(k, third) != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R "
                         "(p and q are positional; the only keyword is '%s')",
                         fname, k, third);
            return -1;
        }
        if (*c != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got '%s' twice", fname, third);
            return -1;
        }
        *c = args[nargs + i];
    }
    if (third_required && *c == NULL) {
        PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, third);
        return -1;
    }
    return 0;
}

static PyObject *py_residual_dist(PyObject *self, PyObject *const *args,
                                  Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *po, *qo, *oo, *result = NULL;
    buf_t p = {0}, q = {0}, o = {0};
    Py_ssize_t rows, cols;
    row_error err = {ROW_OK, 0, 0};

    if (parse_three(args, nargs, kwnames, "residual_dist", "out", 0, &po, &qo, &oo) < 0)
        return NULL;
    if (acquire(po, "p", 0, &p) < 0 || acquire(qo, "q", 0, &q) < 0) goto done;
    if (check_pq(&p, &q, &rows, &cols) < 0) goto done;

    if (oo == NULL || oo == Py_None) {
        result = np_empty(&p.view, p.view.ndim, 0);
        if (result == NULL) goto done;
        if (acquire(result, "out", 1, &o) < 0) goto fail;
    } else {
        if (acquire(oo, "out", 1, &o) < 0) goto done;
        if (check_float32(&o, "out") < 0) goto done;
        if (!same_shape(&o.view, &p.view)) {
            PyObject *so = shape_repr(&o.view), *sp = shape_repr(&p.view);
            if (so && sp)
                PyErr_Format(PyExc_ValueError,
                             "out must have the shape of p and q, %U; got %U", sp, so);
            Py_XDECREF(so);
            Py_XDECREF(sp);
            goto done;
        }
        if (overlaps(&o.view, &p.view) || overlaps(&o.view, &q.view)) {
            PyErr_SetString(PyExc_ValueError,
                            "out overlaps p or q in memory; pass a separate output "
                            "buffer (or out=None)");
            goto done;
        }
        Py_INCREF(oo);
        result = oo;
    }

    {
        const fs_backend *be = g_active;
        const float *pp = p.view.buf, *qq = q.view.buf;
        float *out = o.view.buf;
        size_t n = (size_t)cols;
        int failed = 0;
        PyThreadState *ts = NULL;
        if (rows * cols >= GIL_RELEASE_MIN_ELEMS) ts = PyEval_SaveThread();
        for (Py_ssize_t r = 0; r < rows; r++) {
            size_t off = (size_t)r * n;
            if (dist_row(be, pp + off, qq + off, out + off, n, &err) < 0) {
                err.row = r;
                failed = 1;
                break;
            }
        }
        if (ts) PyEval_RestoreThread(ts);
        if (failed) {
            raise_row_error(&err, p.view.ndim == 2 ? rows : 1);
            goto fail;
        }
    }
    goto done;

fail:
    Py_CLEAR(result);
done:
    release(&o);
    release(&q);
    release(&p);
    return result;
}

static int read_u(PyObject *uo, const char *what, double *u) {
    double v = PyFloat_AsDouble(uo);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a float in [0, 1); got %R", what, uo);
        return -1;
    }
    if (!(v >= 0.0 && v < 1.0)) {
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 1); got %R", what, uo);
        return -1;
    }
    *u = v;
    return 0;
}

static PyObject *py_residual_sample(PyObject *self, PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    PyObject *po, *qo, *uo, *result = NULL;
    buf_t p = {0}, q = {0}, ub = {0}, ib = {0};
    Py_ssize_t rows, cols;
    row_error err = {ROW_OK, 0, 0};

    if (parse_three(args, nargs, kwnames, "residual_sample", "u", 1, &po, &qo, &uo) < 0)
        return NULL;
    if (acquire(po, "p", 0, &p) < 0 || acquire(qo, "q", 0, &q) < 0) goto done;
    if (check_pq(&p, &q, &rows, &cols) < 0) goto done;

    if (p.view.ndim == 1) {
        double u;
        int64_t idx = 0;
        if (read_u(uo, "u", &u) < 0) goto done;
        if (sample_row(g_active, p.view.buf, q.view.buf, (size_t)cols, u, &idx, &err) < 0) {
            raise_row_error(&err, 1);
            goto done;
        }
        result = PyLong_FromLongLong(idx);
        goto done;
    }

    /* (B, V): u is a (B,) float64 or float32 buffer; the result an int64 array. */
    if (PyFloat_Check(uo) || PyLong_Check(uo)) {
        PyErr_Format(PyExc_TypeError,
                     "u must be an array of shape (%zd,) when p and q are 2-D; got a "
                     "scalar", rows);
        goto done;
    }
    if (acquire(uo, "u", 0, &ub) < 0) goto done;
    {
        const char *f = ub.view.format ? ub.view.format : "B";
        int is_f64 = ub.view.itemsize == 8 && strchr("dD", f[strlen(f) - 1]) != NULL &&
                     strpbrk(f, ">!") == NULL;
        int is_f32 = is_float32_format(f) && ub.view.itemsize == 4;
        if (!is_f64 && !is_f32) {
            PyErr_Format(PyExc_TypeError,
                         "u must hold float64 or float32; got format '%s'", f);
            goto done;
        }
        if (ub.view.ndim != 1 || ub.view.shape[0] != rows) {
            PyErr_Format(PyExc_ValueError,
                         "u must have shape (%zd,) (one uniform per row); got %d-D with "
                         "%zd elements", rows, ub.view.ndim,
                         ub.view.ndim >= 1 ? ub.view.shape[0] : (Py_ssize_t)1);
            goto done;
        }
        for (Py_ssize_t r = 0; r < rows; r++) {
            double u = is_f64 ? ((const double *)ub.view.buf)[r]
                              : (double)((const float *)ub.view.buf)[r];
            if (!(u >= 0.0 && u < 1.0)) {
                PyObject *uv = PyFloat_FromDouble(u);
                if (uv != NULL)
                    PyErr_Format(PyExc_ValueError, "u[%zd] must be in [0, 1); got %R", r, uv);
                Py_XDECREF(uv);
                goto done;
            }
        }
        result = np_empty(&p.view, 1, 1);
        if (result == NULL) goto done;
        if (acquire(result, "result", 1, &ib) < 0) goto fail;

        const fs_backend *be = g_active;
        const float *pp = p.view.buf, *qq = q.view.buf;
        int64_t *idx = ib.view.buf;
        size_t n = (size_t)cols;
        int failed = 0;
        PyThreadState *ts = NULL;
        if (rows * cols >= GIL_RELEASE_MIN_ELEMS) ts = PyEval_SaveThread();
        for (Py_ssize_t r = 0; r < rows; r++) {
            double u = is_f64 ? ((const double *)ub.view.buf)[r]
                              : (double)((const float *)ub.view.buf)[r];
            size_t off = (size_t)r * n;
            if (sample_row(be, pp + off, qq + off, n, u, &idx[r], &err) < 0) {
                err.row = r;
                failed = 1;
                break;
            }
        }
        if (ts) PyEval_RestoreThread(ts);
        if (failed) {
            raise_row_error(&err, rows);
            goto fail;
        }
    }
    goto done;

fail:
    Py_CLEAR(result);
done:
    release(&ib);
    release(&ub);
    release(&q);
    release(&p);
    return result;
}

static PyObject *py_backend(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(g_active->name);
}

static PyObject *py_available_backends(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return available_names();
}

static PyObject *py_set_backend(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_backend() takes a backend name (str); got %R",
                     arg);
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (name == NULL) return NULL;
    if (select_backend(name, PyExc_ValueError, "set_backend()") < 0) return NULL;
    Py_RETURN_NONE;
}

static int put_flag(PyObject *d, const char *key, long value) {
    PyObject *v = PyBool_FromLong(value);
    int rc = v ? PyDict_SetItemString(d, key, v) : -1;
    Py_XDECREF(v);
    return rc;
}

static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    PyObject *leaf = PyLong_FromUnsignedLong(g_cpu.max_leaf);
    if (leaf == NULL || PyDict_SetItemString(d, "max_leaf", leaf) < 0 ||
        put_flag(d, "osxsave", g_cpu.osxsave) < 0 || put_flag(d, "avx", g_cpu.avx) < 0 ||
        put_flag(d, "avx2", g_cpu.avx2) < 0 || put_flag(d, "avx512f", g_cpu.avx512f) < 0 ||
        put_flag(d, "ymm_state", g_cpu.ymm_state) < 0 ||
        put_flag(d, "zmm_state", g_cpu.zmm_state) < 0) {
        Py_XDECREF(leaf);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(leaf);
    return d;
}

static PyObject *py_abi_version(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(FS_ABI_VERSION);
}

PyDoc_STRVAR(residual_dist_doc,
"residual_dist(p, q, /, out=None)\n--\n\n"
"Row-wise residual distribution max(0, p - q) / sum(max(0, p - q)).\n\n"
"p, q: float32 C-contiguous buffers of shape (V,) or (B, V), read without copying.\n"
"out: writable float32 C-contiguous buffer of the same shape, not overlapping p or q;\n"
"written and returned. None allocates a NumPy array.\n"
"Where p <= q everywhere in a row the row is p renormalised (the exact limit).\n"
"Raises ValueError naming the argument on NaN or infinity.");

PyDoc_STRVAR(residual_sample_doc,
"residual_sample(p, q, u)\n--\n\n"
"Sample an index from the normalised residual max(0, p - q) by inverse CDF,\n"
"without writing the distribution: one reduction pass, then a scan that stops\n"
"at the sampled index. (V,) with a float u in [0, 1) returns an int; (B, V) with\n"
"u of shape (B,) (float64 or float32) returns an int64 NumPy array. Where p <= q\n"
"everywhere in a row, samples from p renormalised.");

static PyMethodDef methods[] = {
    {"residual_dist", (PyCFunction)(void (*)(void))py_residual_dist,
     METH_FASTCALL | METH_KEYWORDS, residual_dist_doc},
    {"residual_sample", (PyCFunction)(void (*)(void))py_residual_sample,
     METH_FASTCALL | METH_KEYWORDS, residual_sample_doc},
    {"backend", py_backend, METH_NOARGS,
     "backend()\n--\n\nName of the kernel backend in use: 'scalar', 'avx2' or 'avx512'."},
    {"available_backends", py_available_backends, METH_NOARGS,
     "available_backends()\n--\n\nBackends this build and CPU can run, slowest first."},
    {"set_backend", py_set_backend, METH_O,
     "set_backend(name, /)\n--\n\nSwitch the kernel backend for this process (ValueError "
     "if unavailable).\nThe FLASHSPEC_KERNEL environment variable does the same at import."},
    {"cpu_features", py_cpu_features, METH_NOARGS,
     "cpu_features()\n--\n\nCPUID/XGETBV facts behind the dispatch, as a dict."},
    {"abi_version", py_abi_version, METH_NOARGS,
     "abi_version()\n--\n\nVersion of this module's interface and kernel contract."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "flashspec._residual",
    "Residual distribution kernels for speculative decoding (NASM AVX2/AVX-512 with a "
    "portable C fallback, chosen at import by CPUID).",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__residual(void) {
    fs_cpu_detect(&g_cpu);
    register_backends();
    g_active = &g_backends[g_n_backends - 1]; /* registered slowest first */
    const char *forced = getenv(ENV_KERNEL);
    if (forced != NULL && forced[0] != '\0' && strcmp(forced, "auto") != 0) {
        if (select_backend(forced, PyExc_ImportError, ENV_KERNEL) < 0) return NULL;
    }
    return PyModule_Create(&module);
}
