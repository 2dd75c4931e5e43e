/*
 * _quant.c - Python glue for flashspec._quant: exact matmuls over GGUF blocks.
 *
 * Job: take buffers without copying, check them, pick the backend once, split the
 * work over a small persistent thread pool (GIL released when it pays), and turn
 * every failure into a Python exception that names the argument. Kernels: quant.c
 * (C) and asm/quant_*.asm; their contract is quant.h.
 *
 * Limited API of CPython 3.11 (abi3), like flashspec._residual.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant.h"
#include "quant_step.h"
#include "pybuf.h"

#define FS_QUANT_ABI_VERSION 1
#define ENV_KERNEL "FLASHSPEC_QUANT_KERNEL"
#define ENV_THREADS "FLASHSPEC_QUANT_THREADS"
/* Below this many multiply-adds a call runs on the caller alone, GIL held. */
#define PARALLEL_MIN_MACS (1u << 17)
#define MAX_THREADS 8
/* Weight rows a thread's share is rounded to (keeps every share a whole tile). */
#define SHARE_ROWS 16
/* Pause iterations a worker spins for the next job before it sleeps (~50 us). */
#define SPIN_ITERS 20000

/* ---------------------------------------------------------------- formats */

enum { F_Q4_0, F_Q4_1, F_Q8_0, F_Q4_K, F_Q6_K, F_Q4_KR, F_Q6_KR, F_Q5_0, N_FORMATS };

typedef void (*dequant_fn)(const uint8_t *, size_t, float *);

static const fs_qformat g_formats[N_FORMATS] = {
    {FS_GGML_Q4_0, "Q4_0", 32, 18},  {FS_GGML_Q4_1, "Q4_1", 32, 20},
    {FS_GGML_Q8_0, "Q8_0", 32, 34},  {FS_GGML_Q4_K, "Q4_K", 256, 144},
    {FS_GGML_Q6_K, "Q6_K", 256, 210}, {FS_Q4_KR, "Q4_KR", 32, 24},
    {FS_Q6_KR, "Q6_KR", 32, 40},      {FS_GGML_Q5_0, "Q5_0", 32, 22},
};
static const dequant_fn g_dequant[N_FORMATS] = {
    fs_dequant_q4_0, fs_dequant_q4_1, fs_dequant_q8_0,  fs_dequant_q4_k,
    fs_dequant_q6_k, fs_dequant_q4_kr, fs_dequant_q6_kr, fs_dequant_q5_0};

typedef struct {
    const char *name;
    fs_qmm_fn fn[N_FORMATS];
    int step_isa; /* the compilation of fs_decoder_step that goes with it (quant_step.h) */
    void (*fma_probe)(uint64_t rounds); /* a core's multiply-add peak (quant.h) */
    uint64_t probe_macs;                /* multiply-adds one round of it does */
} backend_t;

static fs_cpu g_cpu;
static backend_t g_backends[3];
static int g_n_backends;
static const backend_t *g_active;

static void register_backends(void) {
    const backend_t scalar = {"scalar",
                              {fs_qmm_q4_0_c, fs_qmm_q4_1_c, fs_qmm_q8_0_c, fs_qmm_q4_k_c,
                               fs_qmm_q6_k_c, fs_qmm_q4_kr_c, fs_qmm_q6_kr_c, fs_qmm_q5_0_c},
                              FS_STEP_BASELINE, fs_fma_probe_c, FS_FMA_PROBE_LANES_C};
    g_n_backends = 0;
    g_backends[g_n_backends++] = scalar;
#ifdef FLASHSPEC_HAVE_QUANT_ASM
    if (fs_cpu_has_avx2(&g_cpu) && g_cpu.fma && g_cpu.f16c) {
        backend_t b = scalar;
        b.name = "avx2";
        b.step_isa = FS_STEP_AVX2;
        b.fma_probe = fs_fma_probe_avx2;
        b.probe_macs = FS_FMA_PROBE_CHAINS_AVX2 * 8;
        b.fn[F_Q4_0] = fs_qmm_q4_0_avx2;
        b.fn[F_Q4_1] = fs_qmm_q4_1_avx2;
        b.fn[F_Q8_0] = fs_qmm_q8_0_avx2;
        b.fn[F_Q4_KR] = fs_qmm_q4_kr_avx2;
        b.fn[F_Q6_KR] = fs_qmm_q6_kr_avx2;
        b.fn[F_Q5_0] = fs_qmm_q5_0_avx2;
        g_backends[g_n_backends++] = b;
    }
    if (fs_cpu_has_avx512(&g_cpu) && g_cpu.fma && g_cpu.f16c) {
        backend_t b = scalar;
        b.name = "avx512";
        b.step_isa = FS_STEP_AVX512;
        b.fma_probe = fs_fma_probe_avx512;
        b.probe_macs = FS_FMA_PROBE_CHAINS_AVX512 * 16;
        b.fn[F_Q4_0] = fs_qmm_q4_0_avx512;
        b.fn[F_Q4_1] = fs_qmm_q4_1_avx512;
        b.fn[F_Q8_0] = fs_qmm_q8_0_avx512;
        b.fn[F_Q4_KR] = fs_qmm_q4_kr_avx512;
        b.fn[F_Q6_KR] = fs_qmm_q6_kr_avx512;
        b.fn[F_Q5_0] = fs_qmm_q5_0_avx512;
        g_backends[g_n_backends++] = b;
    }
#endif
}

static PyObject *available_names(void) {
    PyObject *lst = PyList_New(0);
    for (int i = 0; lst != NULL && i < g_n_backends; i++) {
        PyObject *s = PyUnicode_FromString(g_backends[i].name);
        if (s == NULL || PyList_Append(lst, s) < 0) {
            Py_XDECREF(s);
            Py_CLEAR(lst);
            break;
        }
        Py_DECREF(s);
    }
    return lst;
}

static int select_backend(const char *name, PyObject *exc, const char *origin) {
    for (int i = 0; i < g_n_backends; i++) {
        if (strcmp(g_backends[i].name, name) == 0) {
            g_active = &g_backends[i];
            return 0;
        }
    }
    PyObject *avail = available_names();
    if (avail == NULL) return -1;
    PyErr_Format(exc,
                 "%s: quantized-matmul backend '%s' is not available here (known: 'scalar', "
                 "'avx2', 'avx512'; this build and CPU have %R)",
                 origin, name, avail);
    Py_DECREF(avail);
    return -1;
}

static int format_index(int qtype) {
    for (int i = 0; i < N_FORMATS; i++)
        if (g_formats[i].ggml_type == qtype) return i;
    return -1;
}

/* ------------------------------------------------------------- thread pool */

typedef struct {
    fs_qmm_fn fn;
    const float *x;
    size_t ldx, m, kb, n, row_bytes;
    const uint8_t *w;
    float *y;
    /* Set: the task is not a product but custom(arg, part, parts) on each share. */
    void (*custom)(void *arg, size_t part, size_t parts);
    void *arg;
} task_t;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;   /* workers running (threads - 1) */
    int wanted;    /* threads a call may use, caller included */
    task_t task;
    int parts;     /* shares of the current task */
    atomic_uint generation; /* bumped per task */
    atomic_int pending;     /* worker shares not yet done */
    atomic_int quit;
    /* The generation when worker i was created: it serves the tasks after that one. A worker
     * that read the generation itself once running could start after the first task was
     * posted, take that task as already seen and never answer it. */
    unsigned born[MAX_THREADS];
} g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 1, {0}, 0, 0, 0, 0, {0}};

static atomic_flag g_pool_busy = ATOMIC_FLAG_INIT;

static void run_share(const task_t *t, int part, int parts) {
    if (t->custom != NULL) {
        t->custom(t->arg, (size_t)part, (size_t)parts);
        return;
    }
    size_t per = (t->n + (size_t)parts - 1) / (size_t)parts;
    per = (per + SHARE_ROWS - 1) / SHARE_ROWS * SHARE_ROWS;
    size_t lo = per * (size_t)part, hi = lo + per;
    if (hi > t->n) hi = t->n;
    if (lo >= hi) return;
    for (size_t i0 = 0; i0 < t->m; i0 += FS_Q_MAX_ROWS) {
        size_t rows = t->m - i0 < FS_Q_MAX_ROWS ? t->m - i0 : FS_Q_MAX_ROWS;
        fs_qjob job = {t->x + i0 * t->ldx, t->ldx, t->w + lo * t->row_bytes, t->row_bytes,
                       hi - lo, t->kb, t->y + i0 * t->n + lo, t->n, rows};
        t->fn(&job);
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg; /* share number: 1 .. threads - 1 */
    unsigned seen = g_pool.born[index];
    for (;;) {
        unsigned now;
        int spins = 0;
        while ((now = atomic_load(&g_pool.generation)) == seen && !atomic_load(&g_pool.quit)) {
            if (++spins < SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&g_pool.lock);
            while (atomic_load(&g_pool.generation) == seen && !atomic_load(&g_pool.quit))
                pthread_cond_wait(&g_pool.wake, &g_pool.lock);
            pthread_mutex_unlock(&g_pool.lock);
        }
        if (atomic_load(&g_pool.quit)) return NULL;
        seen = now;
        if (index < g_pool.parts) run_share(&g_pool.task, index, g_pool.parts);
        atomic_fetch_sub(&g_pool.pending, 1);
    }
}

static void pool_after_fork_child(void) {
    /* The workers did not survive the fork: start afresh on the next large call. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    g_pool.lock = fresh;
    g_pool.wake = cond;
    g_pool.started = 0;
    atomic_store(&g_pool.pending, 0);
}

/* Start workers up to wanted - 1 (called with the GIL held). */
static void pool_grow(void) {
    while (g_pool.started < g_pool.wanted - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_pool.born[g_pool.started + 1] = atomic_load(&g_pool.generation);
        int rc = pthread_create(&th, &attr, worker, (void *)(intptr_t)(g_pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer threads: still correct */
        g_pool.started++;
    }
}

static void run_task(const task_t *t, int parts) {
    if (parts <= 1) {
        run_share(t, 0, 1);
        return;
    }
    g_pool.task = *t;
    g_pool.parts = parts;
    atomic_store(&g_pool.pending, g_pool.started);
    pthread_mutex_lock(&g_pool.lock);
    atomic_fetch_add(&g_pool.generation, 1);
    pthread_cond_broadcast(&g_pool.wake);
    pthread_mutex_unlock(&g_pool.lock);
    run_share(t, 0, parts);
    /* Spin briefly, then yield: a worker descheduled by another process must get the core. */
    for (int spins = 0; atomic_load(&g_pool.pending) > 0; spins++) {
        if (spins < SPIN_ITERS)
            cpu_relax();
        else
            sched_yield();
    }
}

static int default_threads(void) {
    cpu_set_t set;
    int n = 1;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    if (n < 1) n = 1;
    return n > MAX_THREADS ? MAX_THREADS : n;
}

/* ----------------------------------------------------------------- buffers */

static int is_float32(const Py_buffer *v) {
    return v->itemsize == 4 && is_float32_format(v->format);
}

/* x, out: NumPy float32 arrays; w: bytes-like blocks; rows: int64 indices. */
static int acquire(PyObject *obj, const char *name, int writable, buf_t *b) {
    return acquire_as(obj, name, writable,
                      "a NumPy array, memoryview, bytes or a CPU tensor's .numpy()", b);
}

static PyObject *g_np_empty;

static PyObject *new_array(Py_ssize_t rows, Py_ssize_t cols, int two_d, const char *dtype) {
    if (g_np_empty == NULL) {
        PyObject *np = PyImport_ImportModule("numpy");
        if (np == NULL) return NULL;
        g_np_empty = PyObject_GetAttrString(np, "empty");
        Py_DECREF(np);
        if (g_np_empty == NULL) return NULL;
    }
    PyObject *shape = two_d ? Py_BuildValue("(nn)", rows, cols) : Py_BuildValue("(n)", cols);
    if (shape == NULL) return NULL;
    PyObject *out = PyObject_CallFunction(g_np_empty, "Os", shape, dtype);
    Py_DECREF(shape);
    return out;
}

static PyObject *new_float_array(Py_ssize_t rows, Py_ssize_t cols, int two_d) {
    return new_array(rows, cols, two_d, "float32");
}

/* w: itemsize 1, exactly `need` bytes. */
static int check_weights(buf_t *w, Py_ssize_t need, const char *what) {
    if (w->view.itemsize != 1) {
        PyErr_Format(PyExc_TypeError,
                     "w must be a buffer of bytes (itemsize 1, e.g. uint8); got itemsize %zd",
                     w->view.itemsize);
        return -1;
    }
    if (w->view.len != need) {
        PyErr_Format(PyExc_ValueError, "w holds %zd bytes, but %s needs exactly %zd",
                     w->view.len, what, need);
        return -1;
    }
    return 0;
}

static int check_geometry(int qtype, Py_ssize_t n, Py_ssize_t k, int *fi) {
    *fi = format_index(qtype);
    if (*fi < 0) {
        PyErr_Format(PyExc_ValueError,
                     "qtype %d is not a supported GGML type; supported: 2 (Q4_0), 3 (Q4_1), "
                     "6 (Q5_0), 8 (Q8_0), 12 (Q4_K), 14 (Q6_K), and flashspec's repacked "
                     "268 (Q4_KR), 270 (Q6_KR)",
                     qtype);
        return -1;
    }
    const fs_qformat *f = &g_formats[*fi];
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "n must be >= 1, got %zd", n);
        return -1;
    }
    if (k < 1 || k % (Py_ssize_t)f->block_elems != 0) {
        PyErr_Format(PyExc_ValueError, "k must be a positive multiple of %zu for %s, got %zd",
                     f->block_elems, f->name, k);
        return -1;
    }
    if (n > PY_SSIZE_T_MAX / (k / (Py_ssize_t)f->block_elems) / (Py_ssize_t)f->block_bytes) {
        PyErr_SetString(PyExc_ValueError, "n * k is too large");
        return -1;
    }
    return 0;
}

static Py_ssize_t weight_bytes(int fi, Py_ssize_t n, Py_ssize_t k) {
    const fs_qformat *f = &g_formats[fi];
    return n * (k / (Py_ssize_t)f->block_elems) * (Py_ssize_t)f->block_bytes;
}

/* ------------------------------------------------------------------ qmatmul */

static PyObject *py_qmatmul(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"x", "w", "qtype", "n", "k", "out", NULL};
    PyObject *xo, *wo, *outo = Py_None;
    int qtype;
    Py_ssize_t n, k;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOinn|O:qmatmul", kw, &xo, &wo, &qtype, &n,
                                     &k, &outo))
        return NULL;
    int fi;
    if (check_geometry(qtype, n, k, &fi) < 0) return NULL;
    buf_t x = {0}, w = {0}, out = {0};
    PyObject *result = NULL, *made = NULL;
    if (acquire(xo, "x", 0, &x) < 0) goto done;
    if (!is_float32(&x.view)) {
        PyErr_Format(PyExc_TypeError, "x must hold float32 (format 'f'); got format '%s'",
                     x.view.format ? x.view.format : "B");
        goto done;
    }
    if ((x.view.ndim != 1 && x.view.ndim != 2) || x.view.shape[x.view.ndim - 1] != k) {
        PyErr_Format(PyExc_ValueError, "x must have shape (m, k) or (k,) with k = %zd", k);
        goto done;
    }
    Py_ssize_t m = x.view.ndim == 2 ? x.view.shape[0] : 1;
    if (m < 1) {
        PyErr_SetString(PyExc_ValueError, "x has no rows (m = 0)");
        goto done;
    }
    if (acquire(wo, "w", 0, &w) < 0) goto done;
    if (check_weights(&w, weight_bytes(fi, n, k), "n x k of this qtype") < 0) goto done;
    if (outo == Py_None) {
        made = new_float_array(m, n, x.view.ndim == 2);
        if (made == NULL) goto done;
        outo = made;
    }
    if (acquire(outo, "out", 1, &out) < 0) goto done;
    if (!is_float32(&out.view) || out.view.ndim != x.view.ndim ||
        (x.view.ndim == 2 && (out.view.shape[0] != m || out.view.shape[1] != n)) ||
        (x.view.ndim == 1 && out.view.shape[0] != n)) {
        PyErr_Format(PyExc_ValueError,
                     "out must be a writable float32 array of shape %s (m = %zd, n = %zd)",
                     x.view.ndim == 2 ? "(m, n)" : "(n,)", m, n);
        goto done;
    }
    if (overlaps(&out.view, &x.view) || overlaps(&out.view, &w.view)) {
        PyErr_SetString(PyExc_ValueError, "out must not overlap x or w");
        goto done;
    }
    const fs_qformat *f = &g_formats[fi];
    task_t t = {g_active->fn[fi],
                (const float *)x.view.buf,
                (size_t)k,
                (size_t)m,
                (size_t)k / f->block_elems,
                (size_t)n,
                (size_t)k / f->block_elems * f->block_bytes,
                (const uint8_t *)w.view.buf,
                (float *)out.view.buf,
                NULL,
                NULL};
    double macs = (double)m * (double)n * (double)k;
    if (macs < PARALLEL_MIN_MACS || g_pool.wanted <= 1) {
        run_share(&t, 0, 1);
    } else if (atomic_flag_test_and_set(&g_pool_busy)) {
        /* Another Python thread holds the pool: this call runs on its own thread. */
        Py_BEGIN_ALLOW_THREADS
        run_share(&t, 0, 1);
        Py_END_ALLOW_THREADS
    } else {
        pool_grow();
        int parts = g_pool.started + 1 < g_pool.wanted ? g_pool.started + 1 : g_pool.wanted;
        Py_BEGIN_ALLOW_THREADS
        run_task(&t, parts);
        Py_END_ALLOW_THREADS
        atomic_flag_clear(&g_pool_busy);
    }
    result = outo;
    Py_INCREF(result);
done:
    release(&x);
    release(&w);
    release(&out);
    Py_XDECREF(made);
    return result;
}

/* ------------------------------------------------------------ decoder step */

#define PLAN_NAME "flashspec._quant.decoder_plan"
/* Per layer: input norm, post-attention norm, then (blocks, qtype) for each product. */
#define PLAN_NORMS 2
#define PLAN_PRODUCTS 7
#define PLAN_FIELDS (PLAN_NORMS + 2 * PLAN_PRODUCTS)

static const char *const g_product_names[PLAN_PRODUCTS] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

typedef struct {
    fs_decoder d;
    fs_dlayer *layer;
    buf_t *views; /* held for the plan's life: the memory its pointers read */
    size_t nviews;
} plan_t;

static void plan_free(plan_t *p) {
    if (p == NULL) return;
    for (size_t i = 0; i < p->nviews; i++) release(&p->views[i]);
    free(p->views);
    free(p->layer);
    free(p);
}

static void plan_destructor(PyObject *capsule) {
    plan_free((plan_t *)PyCapsule_GetPointer(capsule, PLAN_NAME));
}

/* Prefix the pending exception's message with where in `layers` it arose. */
static void error_at(Py_ssize_t layer, const char *field) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_Format(type ? type : PyExc_ValueError, "layers[%zd] %s: %S", layer, field,
                 value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static int plan_norm(PyObject *obj, size_t dim, buf_t *b, const float **out) {
    if (acquire(obj, "the norm weight", 0, b) < 0) return -1;
    if (!is_float32(&b->view) || b->view.len != (Py_ssize_t)(dim * sizeof(float))) {
        PyErr_Format(PyExc_ValueError, "must be %zu float32 values (the hidden size)", dim);
        return -1;
    }
    *out = (const float *)b->view.buf;
    return 0;
}

static int plan_weight(PyObject *blocks, PyObject *qtype_obj, size_t n, size_t k, buf_t *b,
                       fs_qweight *out) {
    long qtype = PyLong_AsLong(qtype_obj);
    if (qtype == -1 && PyErr_Occurred()) return -1;
    int fi;
    if (check_geometry((int)qtype, (Py_ssize_t)n, (Py_ssize_t)k, &fi) < 0) return -1;
    if (acquire(blocks, "w", 0, b) < 0) return -1;
    const fs_qformat *f = &g_formats[fi];
    char what[64];
    snprintf(what, sizeof what, "%zu x %zu of %s", n, k, f->name);
    if (check_weights(b, weight_bytes(fi, (Py_ssize_t)n, (Py_ssize_t)k), what) < 0) return -1;
    out->w = (const uint8_t *)b->view.buf;
    out->format = fi;
    out->n = n;
    out->k = k;
    out->kb = k / f->block_elems;
    out->row_bytes = out->kb * f->block_bytes;
    return 0;
}

static PyObject *py_decoder_plan(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"layers", "dim",  "heads",   "kv_heads",
                         "head_dim", "ffn", "eps", "scaling", NULL};
    PyObject *layers;
    Py_ssize_t dim, heads, kv_heads, head_dim, ffn;
    double eps, scaling;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onnnnndd:decoder_plan", kw, &layers, &dim,
                                     &heads, &kv_heads, &head_dim, &ffn, &eps, &scaling))
        return NULL;
    if (dim < 1 || heads < 1 || kv_heads < 1 || head_dim < 2 || ffn < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "dim, heads, kv_heads and ffn must be >= 1 and head_dim >= 2");
        return NULL;
    }
    if (heads % kv_heads != 0 || head_dim % 2 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "heads (%zd) must be a multiple of kv_heads (%zd) and head_dim (%zd) even",
                     heads, kv_heads, head_dim);
        return NULL;
    }
    if (!(eps >= 0.0) || !(scaling > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "eps must be >= 0 and scaling > 0");
        return NULL;
    }
    Py_ssize_t count = PySequence_Size(layers);
    if (count < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "layers must be a sequence of per-layer tuples");
        return NULL;
    }
    if (count < 1) {
        PyErr_SetString(PyExc_ValueError, "layers is empty");
        return NULL;
    }
    plan_t *p = calloc(1, sizeof *p);
    if (p == NULL) return PyErr_NoMemory();
    p->layer = calloc((size_t)count, sizeof *p->layer);
    p->views = calloc((size_t)count * (PLAN_NORMS + PLAN_PRODUCTS), sizeof *p->views);
    if (p->layer == NULL || p->views == NULL) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    const size_t D = (size_t)dim, H = (size_t)heads * (size_t)head_dim,
                 KV = (size_t)kv_heads * (size_t)head_dim, F = (size_t)ffn;
    /* (outputs, inputs) of q, k, v, o, gate, up, down */
    const size_t shape[PLAN_PRODUCTS][2] = {{H, D}, {KV, D}, {KV, D}, {D, H},
                                            {F, D}, {F, D}, {D, F}};
    for (Py_ssize_t l = 0; l < count; l++) {
        PyObject *item = PySequence_GetItem(layers, l);
        if (item == NULL) goto fail;
        if (!PyTuple_Check(item) || PyTuple_Size(item) != PLAN_FIELDS) {
            Py_DECREF(item);
            PyErr_Format(PyExc_TypeError,
                         "layers[%zd] must be a tuple of %d: (input norm, post norm, then "
                         "blocks and qtype of q, k, v, o, gate, up, down)",
                         l, PLAN_FIELDS);
            goto fail;
        }
        fs_dlayer *L = &p->layer[l];
        buf_t *v = &p->views[p->nviews];
        int bad = 0;
        if (plan_norm(PyTuple_GetItem(item, 0), D, &v[0], &L->in_norm) < 0) {
            error_at(l, "input norm");
            bad = 1;
        } else if (plan_norm(PyTuple_GetItem(item, 1), D, &v[1], &L->post_norm) < 0) {
            error_at(l, "post-attention norm");
            bad = 1;
        }
        fs_qweight *w[PLAN_PRODUCTS] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int j = 0; j < PLAN_PRODUCTS && !bad; j++) {
            if (plan_weight(PyTuple_GetItem(item, PLAN_NORMS + 2 * j),
                            PyTuple_GetItem(item, PLAN_NORMS + 2 * j + 1), shape[j][0],
                            shape[j][1], &v[PLAN_NORMS + j], w[j]) < 0) {
                error_at(l, g_product_names[j]);
                bad = 1;
            }
        }
        p->nviews += PLAN_NORMS + PLAN_PRODUCTS; /* released by plan_free, held or not */
        Py_DECREF(item);
        if (bad) goto fail;
    }
    p->d = (fs_decoder){(size_t)count, D, (size_t)heads, (size_t)kv_heads, (size_t)head_dim,
                        F, (float)eps, (float)scaling, p->layer};
    PyObject *capsule = PyCapsule_New(p, PLAN_NAME, plan_destructor);
    if (capsule == NULL) plan_free(p);
    return capsule;
fail:
    plan_free(p);
    return NULL;
}

typedef struct {
    const backend_t *backend;
    int parts; /* pool shares a large product takes (1: the calling thread alone) */
} step_ctx;

/* Products of one input as one task: each part takes its share of every product's rows. */
typedef struct {
    task_t task[FS_MAX_PRODUCTS];
    size_t count;
} products_t;

static void products_part(void *arg, size_t part, size_t parts) {
    const products_t *p = (const products_t *)arg;
    for (size_t i = 0; i < p->count; i++) run_share(&p->task[i], (int)part, (int)parts);
}

static void step_products(void *ctx, size_t count, const fs_qweight *const *w, const float *x,
                          size_t m, float *const *y) {
    const step_ctx *c = (const step_ctx *)ctx;
    products_t p = {.count = count};
    double macs = 0.0;
    for (size_t i = 0; i < count; i++) {
        p.task[i] = (task_t){c->backend->fn[w[i]->format], x, w[i]->k, m, w[i]->kb, w[i]->n,
                             w[i]->row_bytes, w[i]->w, y[i], NULL, NULL};
        macs += (double)m * (double)w[i]->n * (double)w[i]->k;
    }
    if (c->parts <= 1 || macs < PARALLEL_MIN_MACS) {
        products_part(&p, 0, 1);
        return;
    }
    task_t t = {0};
    t.custom = products_part;
    t.arg = &p;
    run_task(&t, c->parts);
}

static size_t step_parallel(void *ctx, fs_part_fn body, void *arg, double work) {
    const step_ctx *c = (const step_ctx *)ctx;
    task_t t = {0};
    t.custom = body;
    t.arg = arg;
    if (c->parts <= 1 || work < PARALLEL_MIN_MACS) {
        run_share(&t, 0, 1);
        return 1;
    }
    run_task(&t, c->parts);
    return (size_t)c->parts;
}

static PyObject *py_decoder_step(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"plan", "hidden", "cos", "sin", "kv", "past", "mask", NULL};
    PyObject *plano, *ho, *co, *so, *kvo, *masko = Py_None;
    Py_ssize_t past;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOn|O:decoder_step", kw, &plano, &ho,
                                     &co, &so, &kvo, &past, &masko))
        return NULL;
    if (!PyCapsule_IsValid(plano, PLAN_NAME)) {
        PyErr_SetString(PyExc_TypeError, "plan must come from decoder_plan()");
        return NULL;
    }
    const plan_t *p = (const plan_t *)PyCapsule_GetPointer(plano, PLAN_NAME);
    const fs_decoder *d = &p->d;
    buf_t h = {0}, c = {0}, s = {0}, kv = {0}, mk = {0};
    PyObject *result = NULL;
    float *scratch = NULL;
    if (acquire(ho, "hidden", 1, &h) < 0 || acquire(co, "cos", 0, &c) < 0 ||
        acquire(so, "sin", 0, &s) < 0 || acquire(kvo, "kv", 1, &kv) < 0)
        goto done;
    if (masko != Py_None && acquire(masko, "mask", 0, &mk) < 0) goto done;
    const buf_t *all[4] = {&h, &c, &s, &kv};
    const char *names[4] = {"hidden", "cos", "sin", "kv"};
    for (int i = 0; i < 4; i++)
        if (!is_float32(&all[i]->view)) {
            PyErr_Format(PyExc_TypeError, "%s must hold float32", names[i]);
            goto done;
        }
    size_t row = d->dim * sizeof(float);
    if (h.view.len == 0 || (size_t)h.view.len % row != 0) {
        PyErr_Format(PyExc_ValueError, "hidden must hold m >= 1 rows of dim = %zu floats",
                     d->dim);
        goto done;
    }
    size_t rows = (size_t)h.view.len / row;
    Py_ssize_t rope_bytes = (Py_ssize_t)(rows * d->head_dim * sizeof(float));
    if (c.view.len != rope_bytes || s.view.len != rope_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "cos and sin must hold a row of head_dim = %zu floats for each of the "
                     "%zu rows of hidden",
                     d->head_dim, rows);
        goto done;
    }
    /* (layers, 2, kv_heads, capacity, head_dim): a batch of one; with a batch axis after
     * the 2, one plane of rows a layer. */
    const int batched = kv.view.ndim == 6;
    const Py_ssize_t *ks = kv.view.shape;
    if ((kv.view.ndim != 5 && !batched) || ks[0] != (Py_ssize_t)d->layers || ks[1] != 2 ||
        ks[2 + batched] != (Py_ssize_t)d->kv_heads ||
        ks[4 + batched] != (Py_ssize_t)d->head_dim || (batched && ks[2] < 1)) {
        PyErr_Format(PyExc_ValueError,
                     "kv must have shape (layers, 2, kv_heads, capacity, head_dim) = "
                     "(%zu, 2, %zu, capacity, %zu), or (layers, 2, batch, kv_heads, capacity, "
                     "head_dim) for a batch",
                     d->layers, d->kv_heads, d->head_dim);
        goto done;
    }
    size_t batch = batched ? (size_t)ks[2] : 1, cap = (size_t)ks[3 + batched];
    if (rows % batch != 0) {
        PyErr_Format(PyExc_ValueError,
                     "hidden's %zu rows must be the batch of %zu rows' positions, the same "
                     "number each",
                     rows, batch);
        goto done;
    }
    size_t m = rows / batch;
    if (past < 0 || (size_t)past + m > cap) {
        PyErr_Format(PyExc_ValueError,
                     "past must be >= 0 with past + m <= capacity; got past %zd, m %zu, "
                     "capacity %zu",
                     past, m, cap);
        goto done;
    }
    size_t mask_stride = 0;
    int per_query = 0;
    if (mk.held) {
        /* (batch, columns): a row for each batch row; (batch * m, columns): a row for each
         * position (a token tree). With m == 1 the two are the same array. */
        const Py_ssize_t mask_rows = mk.view.ndim == 2 ? mk.view.shape[0] : -1;
        if (mk.view.itemsize != 1 || mk.view.ndim != 2 ||
            (mask_rows != (Py_ssize_t)batch && mask_rows != (Py_ssize_t)rows) ||
            mk.view.shape[1] < past + (Py_ssize_t)m) {
            PyErr_Format(PyExc_ValueError,
                         "mask must be a 2-D array of bytes (uint8 or bool) of shape (batch, "
                         "columns) = (%zu, >= past + m = %zu), or (batch * m, columns) = "
                         "(%zu, >= %zu) for a row per query",
                         batch, (size_t)past + m, rows, (size_t)past + m);
            goto done;
        }
        mask_stride = (size_t)mk.view.shape[1];
        per_query = mask_rows == (Py_ssize_t)rows && m > 1;
    }
    for (int i = 0; i < 4; i++)
        for (int j = i + 1; j < 4; j++)
            if ((i == 0 || j == 3) && overlaps(&all[i]->view, &all[j]->view)) {
                PyErr_Format(PyExc_ValueError, "%s must not overlap %s", names[i], names[j]);
                goto done;
            }
    if (mk.held && (overlaps(&mk.view, &h.view) || overlaps(&mk.view, &kv.view))) {
        PyErr_SetString(PyExc_ValueError, "mask must not overlap hidden or kv");
        goto done;
    }
    step_ctx ctx = {g_active, 1};
    int pooled = g_pool.wanted > 1 && !atomic_flag_test_and_set(&g_pool_busy);
    if (pooled) {
        pool_grow();
        ctx.parts = g_pool.started + 1 < g_pool.wanted ? g_pool.started + 1 : g_pool.wanted;
    }
    scratch = malloc(fs_decoder_scratch(d, rows, (size_t)past + m, (size_t)ctx.parts) *
                     sizeof *scratch);
    if (scratch == NULL) {
        if (pooled) atomic_flag_clear(&g_pool_busy);
        PyErr_NoMemory();
        goto done;
    }
    fs_step_env env = {step_products, step_parallel, &ctx, (size_t)ctx.parts};
    Py_BEGIN_ALLOW_THREADS
    fs_decoder_step(d, (float *)h.view.buf, batch, m, (const float *)c.view.buf,
                    (const float *)s.view.buf, (float *)kv.view.buf, cap, (size_t)past,
                    mk.held ? (const uint8_t *)mk.view.buf : NULL, mask_stride, per_query,
                    scratch, &env, ctx.backend->step_isa);
    Py_END_ALLOW_THREADS
    if (pooled) atomic_flag_clear(&g_pool_busy);
    result = Py_None;
    Py_INCREF(result);
done:
    free(scratch);
    release(&h);
    release(&c);
    release(&s);
    release(&kv);
    release(&mk);
    return result;
}

/* ---------------------------------------------------------------- dequantize */

static PyObject *py_dequantize(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"w", "qtype", "n", "k", "out", NULL};
    PyObject *wo, *outo = Py_None;
    int qtype;
    Py_ssize_t n, k;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oinn|O:dequantize", kw, &wo, &qtype, &n,
                                     &k, &outo))
        return NULL;
    int fi;
    if (check_geometry(qtype, n, k, &fi) < 0) return NULL;
    buf_t w = {0}, out = {0};
    PyObject *result = NULL, *made = NULL;
    if (acquire(wo, "w", 0, &w) < 0) goto done;
    if (check_weights(&w, weight_bytes(fi, n, k), "n x k of this qtype") < 0) goto done;
    if (outo == Py_None) {
        made = new_float_array(n, k, 1);
        if (made == NULL) goto done;
        outo = made;
    }
    if (acquire(outo, "out", 1, &out) < 0) goto done;
    if (!is_float32(&out.view) || out.view.ndim != 2 || out.view.shape[0] != n ||
        out.view.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "out must be a writable float32 array of shape (%zd, %zd)",
                     n, k);
        goto done;
    }
    if (overlaps(&out.view, &w.view)) {
        PyErr_SetString(PyExc_ValueError, "out must not overlap w");
        goto done;
    }
    {
        const fs_qformat *f = &g_formats[fi];
        size_t kb = (size_t)k / f->block_elems, rb = kb * f->block_bytes;
        const uint8_t *src = (const uint8_t *)w.view.buf;
        float *dst = (float *)out.view.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < n; j++) g_dequant[fi](src + (size_t)j * rb, kb, dst + j * k);
        Py_END_ALLOW_THREADS
    }
    result = outo;
    Py_INCREF(result);
done:
    release(&w);
    release(&out);
    Py_XDECREF(made);
    return result;
}

/* The repacked layout of each K format (quant.h), and its repacker; Q5_0's into Q8_0 is
 * kept for callers of repack(), though loads run Q5_0's own blocks. */
static int repacked_index(int fi, void (**repack)(const uint8_t *, size_t, uint8_t *)) {
    if (fi == F_Q4_K) {
        *repack = fs_repack_q4_k;
        return F_Q4_KR;
    }
    if (fi == F_Q6_K) {
        *repack = fs_repack_q6_k;
        return F_Q6_KR;
    }
    if (fi == F_Q5_0) {
        *repack = fs_repack_q5_0;
        return F_Q8_0;
    }
    return -1;
}

static PyObject *py_repack(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"w", "qtype", "n", "k", NULL};
    PyObject *wo;
    int qtype;
    Py_ssize_t n, k;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oinn:repack", kw, &wo, &qtype, &n, &k))
        return NULL;
    int fi;
    if (check_geometry(qtype, n, k, &fi) < 0) return NULL;
    void (*repack)(const uint8_t *, size_t, uint8_t *) = NULL;
    int ri = repacked_index(fi, &repack);
    if (ri < 0) {
        PyErr_Format(PyExc_ValueError,
                     "qtype %d (%s) has no repacked layout; only 6 (Q5_0), 12 (Q4_K) and 14 "
                     "(Q6_K) do",
                     qtype, g_formats[fi].name);
        return NULL;
    }
    if (n > PY_SSIZE_T_MAX / (k / (Py_ssize_t)g_formats[ri].block_elems) /
                (Py_ssize_t)g_formats[ri].block_bytes) {
        PyErr_SetString(PyExc_ValueError, "n * k is too large");
        return NULL;
    }
    buf_t w = {0};
    PyObject *result = NULL, *made = NULL;
    if (acquire(wo, "w", 0, &w) < 0) goto done;
    if (check_weights(&w, weight_bytes(fi, n, k), "n x k of this qtype") < 0) goto done;
    Py_ssize_t out_row = weight_bytes(ri, 1, k);
    made = new_array(n, out_row, 1, "uint8");
    if (made == NULL) goto done;
    {
        Py_buffer view;
        if (PyObject_GetBuffer(made, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        size_t kb = (size_t)k / g_formats[fi].block_elems, rb = kb * g_formats[fi].block_bytes;
        const uint8_t *src = (const uint8_t *)w.view.buf;
        uint8_t *dst = (uint8_t *)view.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < n; j++)
            repack(src + (size_t)j * rb, kb, dst + (size_t)j * (size_t)out_row);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&view);
    }
    result = made;
    made = NULL;
done:
    release(&w);
    Py_XDECREF(made);
    return result;
}

static PyObject *py_dequantize_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kw[] = {"w", "qtype", "k", "rows", "out", NULL};
    PyObject *wo, *ro, *outo = Py_None;
    int qtype;
    Py_ssize_t k;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OinO|O:dequantize_rows", kw, &wo, &qtype,
                                     &k, &ro, &outo))
        return NULL;
    int fi;
    if (check_geometry(qtype, 1, k, &fi) < 0) return NULL;
    buf_t w = {0}, r = {0}, out = {0};
    PyObject *result = NULL, *made = NULL;
    if (acquire(wo, "w", 0, &w) < 0) goto done;
    if (acquire(ro, "rows", 0, &r) < 0) goto done;
    if (r.view.itemsize != 8 || r.view.format == NULL ||
        (strcmp(r.view.format, "q") != 0 && strcmp(r.view.format, "l") != 0 &&
         strcmp(r.view.format, "<q") != 0 && strcmp(r.view.format, "=q") != 0) ||
        r.view.ndim != 1) {
        PyErr_SetString(PyExc_TypeError, "rows must be a 1-D int64 array of row indices");
        goto done;
    }
    Py_ssize_t count = r.view.shape[0];
    Py_ssize_t row_bytes = weight_bytes(fi, 1, k);
    if (w.view.itemsize != 1 || w.view.len % row_bytes != 0) {
        PyErr_Format(PyExc_ValueError,
                     "w must be bytes holding whole rows of %zd bytes (k = %zd); got %zd bytes",
                     row_bytes, k, w.view.len);
        goto done;
    }
    Py_ssize_t n = w.view.len / row_bytes;
    const int64_t *idx = (const int64_t *)r.view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (idx[i] < 0 || idx[i] >= n) {
            PyErr_Format(PyExc_IndexError, "rows[%zd] = %lld is outside 0..%zd", i,
                         (long long)idx[i], n - 1);
            goto done;
        }
    }
    if (outo == Py_None) {
        made = new_float_array(count, k, 1);
        if (made == NULL) goto done;
        outo = made;
    }
    if (acquire(outo, "out", 1, &out) < 0) goto done;
    if (!is_float32(&out.view) || out.view.ndim != 2 || out.view.shape[0] != count ||
        out.view.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "out must be a writable float32 array of shape (%zd, %zd)",
                     count, k);
        goto done;
    }
    if (overlaps(&out.view, &w.view) || overlaps(&out.view, &r.view)) {
        PyErr_SetString(PyExc_ValueError, "out must not overlap w or rows");
        goto done;
    }
    {
        size_t kb = (size_t)k / g_formats[fi].block_elems;
        const uint8_t *src = (const uint8_t *)w.view.buf;
        float *dst = (float *)out.view.buf;
        for (Py_ssize_t i = 0; i < count; i++)
            g_dequant[fi](src + (size_t)idx[i] * (size_t)row_bytes, kb, dst + i * k);
    }
    result = outo;
    Py_INCREF(result);
done:
    release(&w);
    release(&r);
    release(&out);
    Py_XDECREF(made);
    return result;
}

/* ------------------------------------------------------------------- small */

static PyObject *py_formats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < N_FORMATS; i++) {
        PyObject *key = PyLong_FromLong(g_formats[i].ggml_type);
        PyObject *val = Py_BuildValue("(snn)", g_formats[i].name,
                                      (Py_ssize_t)g_formats[i].block_elems,
                                      (Py_ssize_t)g_formats[i].block_bytes);
        if (key == NULL || val == NULL || PyDict_SetItem(d, key, val) < 0) Py_CLEAR(d);
        Py_XDECREF(key);
        Py_XDECREF(val);
    }
    return d;
}

/* ------------------------------------------------------------- the FMA probe */

typedef struct {
    void (*fn)(uint64_t rounds);
    uint64_t rounds;
} probe_job;

static void probe_share(void *arg, size_t part, size_t parts) {
    (void)part;
    (void)parts;
    const probe_job *job = (const probe_job *)arg;
    job->fn(job->rounds);
}

#define PROBE_MAX_ROUNDS (1ULL << 40)

static PyObject *py_fma_probe(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long rounds = PyLong_AsUnsignedLongLong(arg);
    if (rounds == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "fma_probe takes rounds in 1..%llu",
                         PROBE_MAX_ROUNDS);
        }
        return NULL;
    }
    if (rounds < 1 || rounds > PROBE_MAX_ROUNDS) {
        PyErr_Format(PyExc_ValueError, "fma_probe takes rounds in 1..%llu, got %llu",
                     PROBE_MAX_ROUNDS, rounds);
        return NULL;
    }
    probe_job job = {g_active->fma_probe, rounds};
    task_t t = {0};
    t.custom = probe_share;
    t.arg = &job;
    int parts = 1;
    int pooled = g_pool.wanted > 1 && !atomic_flag_test_and_set(&g_pool_busy);
    if (pooled) {
        pool_grow();
        parts = g_pool.started + 1 < g_pool.wanted ? g_pool.started + 1 : g_pool.wanted;
    }
    Py_BEGIN_ALLOW_THREADS
    run_task(&t, parts);
    Py_END_ALLOW_THREADS
    if (pooled) atomic_flag_clear(&g_pool_busy);
    return PyLong_FromUnsignedLongLong((unsigned long long)parts * rounds *
                                       g_active->probe_macs);
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
        PyErr_SetString(PyExc_TypeError, "set_backend takes a backend name (str)");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (name == NULL || select_backend(name, PyExc_ValueError, "set_backend") < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(g_pool.wanted);
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "set_threads takes 1..%d, got %ld", MAX_THREADS, n);
        return NULL;
    }
    /* More workers start on demand; with fewer, the extra ones get no share. */
    g_pool.wanted = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O}", "avx2",
                         fs_cpu_has_avx2(&g_cpu) ? Py_True : Py_False, "fma",
                         g_cpu.fma ? Py_True : Py_False, "f16c", g_cpu.f16c ? Py_True : Py_False,
                         "avx512f", fs_cpu_has_avx512(&g_cpu) ? Py_True : Py_False, "avx512bw",
                         g_cpu.avx512bw ? Py_True : Py_False, "avx512vl",
                         g_cpu.avx512vl ? Py_True : Py_False);
}

static PyObject *py_abi_version(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(FS_QUANT_ABI_VERSION);
}

static PyMethodDef methods[] = {
    {"qmatmul", (PyCFunction)(void (*)(void))py_qmatmul, METH_VARARGS | METH_KEYWORDS,
     "qmatmul(x, w, qtype, n, k, out=None)\n--\n\n"
     "y = x @ W.T for W (n, k) kept as GGUF blocks of GGML type qtype in the bytes w; x is "
     "float32 (m, k) or (k,), out float32 (m, n) or (n,) (a new NumPy array when None). Every "
     "weight takes exactly its dequantized value; sums are float32."},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_VARARGS | METH_KEYWORDS,
     "dequantize(w, qtype, n, k, out=None)\n--\n\nW as float32 (n, k), gguf-py's values."},
    {"repack", (PyCFunction)(void (*)(void))py_repack, METH_VARARGS | METH_KEYWORDS,
     "repack(w, qtype, n, k)\n--\n\n"
     "W (n, k) in Q5_0 (6), Q4_K (12) or Q6_K (14) blocks as a new uint8 (n, row bytes) "
     "array in another layout the SIMD kernels run: Q8_0 (8), or flashspec's Q4_KR (268) / "
     "Q6_KR (270), 32-element blocks with float32 scales; every weight's value bit-identical. "
     "Loads repack Q4_K and Q6_K only: Q5_0 has SIMD kernels over its own blocks."},
    {"dequantize_rows", (PyCFunction)(void (*)(void))py_dequantize_rows,
     METH_VARARGS | METH_KEYWORDS,
     "dequantize_rows(w, qtype, k, rows, out=None)\n--\n\n"
     "Rows `rows` (int64) of W as float32 (len(rows), k): an embedding lookup."},
    {"decoder_plan", (PyCFunction)(void (*)(void))py_decoder_plan, METH_VARARGS | METH_KEYWORDS,
     "decoder_plan(layers, dim, heads, kv_heads, head_dim, ffn, eps, scaling)\n--\n\n"
     "A Llama decoder's quantized layers for decoder_step. layers: one tuple per layer, "
     "(input norm, post-attention norm, then blocks and qtype of q, k, v, o, gate, up and "
     "down); the plan holds their buffers."},
    {"decoder_step", (PyCFunction)(void (*)(void))py_decoder_step, METH_VARARGS | METH_KEYWORDS,
     "decoder_step(plan, hidden, cos, sin, kv, past, mask=None)\n--\n\n"
     "Every layer of the plan for m new positions of each row, in place: hidden (batch * m, "
     "dim) float32 in and out; cos, sin (batch * m, head_dim); kv (layers, 2, kv_heads, "
     "capacity, head_dim) for one row or (layers, 2, batch, kv_heads, capacity, head_dim) "
     "float32, columns past .. past + m - 1 written; mask: None, (batch, >= past + m) bytes "
     "(a row for all of a batch row's positions) or (batch * m, >= past + m) bytes (a row "
     "for each position, row j being batch row j // m's position j % m: a token tree), "
     "nonzero where a key column is visible; position i still sees no column past past + i "
     "(quant_step.h)."},
    {"formats", py_formats, METH_NOARGS,
     "formats()\n--\n\n{GGML type id: (name, block elements, block bytes)}."},
    {"backend", py_backend, METH_NOARGS, "backend()\n--\n\nThe backend in use."},
    {"available_backends", py_available_backends, METH_NOARGS,
     "available_backends()\n--\n\nBackends this build and CPU can run, slowest first."},
    {"set_backend", py_set_backend, METH_O,
     "set_backend(name, /)\n--\n\nSwitch backend (FLASHSPEC_QUANT_KERNEL does it at import)."},
    {"threads", py_threads, METH_NOARGS, "threads()\n--\n\nThreads a large call uses."},
    {"fma_probe", py_fma_probe, METH_O,
     "fma_probe(rounds, /)\n--\n\nRun the backend's float32 multiply-add probe (independent "
     "FMAs on zeros) rounds times on each of threads() cores at once; return the "
     "multiply-adds done. Timed by the caller: the machine's multiply-add peak."},
    {"set_threads", py_set_threads, METH_O,
     "set_threads(n, /)\n--\n\nThreads a large call uses (FLASHSPEC_QUANT_THREADS at import)."},
    {"cpu_features", py_cpu_features, METH_NOARGS, "cpu_features()\n--\n\nCPUID facts."},
    {"abi_version", py_abi_version, METH_NOARGS, "abi_version()\n--\n\nInterface version."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "flashspec._quant",
    "Exact matmuls over GGUF quantized blocks (NASM AVX2/AVX-512 with a portable C fallback, "
    "chosen at import by CPUID).",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__quant(void) {
    fs_cpu_detect(&g_cpu);
    register_backends();
    g_active = &g_backends[g_n_backends - 1];
    const char *forced = getenv(ENV_KERNEL);
    if (forced != NULL && forced[0] != '\0' && strcmp(forced, "auto") != 0) {
        if (select_backend(forced, PyExc_ImportError, ENV_KERNEL) < 0) return NULL;
    }
    g_pool.wanted = default_threads();
    const char *threads = getenv(ENV_THREADS);
    if (threads != NULL && threads[0] != '\0') {
        char *end;
        long n = strtol(threads, &end, 10);
        if (*end != '\0' || n < 1 || n > MAX_THREADS) {
            PyErr_Format(PyExc_ImportError, "%s must be 1..%d, got '%s'", ENV_THREADS,
                         MAX_THREADS, threads);
            return NULL;
        }
        g_pool.wanted = (int)n;
    }
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork_done = 1;
    }
    return PyModule_Create(&module);
}
