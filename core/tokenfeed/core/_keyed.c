/* tokenfeed.core._keyed: the sampling's two loops, in C.
 *
 * - permute: the keyed bijections of [0, n) at many points (keyed.permute; its
 *   reference is keyed.permute_py).
 * - step_rows: one rank's rows of shuffled mixture steps, each slot through its step's
 *   bijection to a source and an item (mixture/steps.py step_rows; its reference is
 *   step_rows_py).
 *
 * keyed.py defines the bijection (its docstring); this evaluates the same Feistel
 * network and cycle walk element by element, so an element costs its stages and
 * nothing else, where numpy makes a pass over the array per operation (about 70 per
 * walk). native.py switches between the two; the tests compare them on random inputs.
 *
 * permute(x, n, sk, bits, inverse, out): x, out: int64 [m]; n, bits: an int or an int64
 * array [m]; sk: uint64 stage keys, [6] (one bijection) or [m, 6] (one per element),
 * any strides. Each x must be below its n (as keyed.permute requires).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define STAGES 6

static inline uint64_t
mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* One pass of the network over [0, 2**bits); `sk` strided by `step` (in uint64s). */
static inline uint64_t
encrypt(uint64_t x, const uint64_t *sk, Py_ssize_t step, unsigned bits)
{
    unsigned wr = bits >> 1, wl = bits - wr;
    uint64_t left = x >> wr, right = x & ((1ULL << wr) - 1);
    for (int r = 0; r < STAGES; r++) {
        uint64_t f = (mix(right ^ sk[r * step]) & ((1ULL << wl) - 1)) ^ left;
        left = right;
        right = f;
        unsigned w = wl;
        wl = wr;
        wr = w;
    }
    return (left << wr) | right;
}

static inline uint64_t
decrypt(uint64_t x, const uint64_t *sk, Py_ssize_t step, unsigned bits)
{
    unsigned wr = bits >> 1, wl = bits - wr;
    uint64_t left = x >> wr, right = x & ((1ULL << wr) - 1);
    for (int r = STAGES - 1; r >= 0; r--) {
        uint64_t f = (mix(left ^ sk[r * step]) & ((1ULL << wr) - 1)) ^ right;
        right = left;
        left = f;
        unsigned w = wl;
        wl = wr;
        wr = w;
    }
    return (left << wr) | right;
}

/* Whether a buffer holds 8-byte ints (signed, or unsigned if `unsigned_`) in `ndim`
 * dimensions. */
static int
is64(const Py_buffer *view, int ndim, int unsigned_)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok = unsigned_ ? (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0)
                       : (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    return ok && view->itemsize == 8 && view->ndim == ndim;
}

/* An int64 array of m elements (C-contiguous) or an int: `*scalar` set for an int. */
static int
int64s(PyObject *obj, Py_buffer *view, int64_t *scalar, Py_ssize_t m, const char *what)
{
    view->obj = NULL;
    if (PyLong_Check(obj)) {
        *scalar = PyLong_AsLongLong(obj);
        return *scalar == -1 && PyErr_Occurred() ? -1 : 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (!is64(view, 1, 0) || view->shape[0] != m) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_TypeError, "permute: %s must be an int or an int64 array like x",
                     what);
        return -1;
    }
    return 0;
}

static PyObject *
permute(PyObject *self, PyObject *args)
{
    PyObject *x_obj, *n_obj, *sk_obj, *bits_obj, *out_obj;
    int inverse;
    if (!PyArg_ParseTuple(args, "OOOOpO:permute", &x_obj, &n_obj, &sk_obj, &bits_obj,
                          &inverse, &out_obj))
        return NULL;
    Py_buffer x = {0}, out = {0}, sk = {0}, n = {0}, bits = {0};
    int64_t n1 = 0, bits1 = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (x.itemsize != 8 || x.ndim != 1) {
        PyErr_SetString(PyExc_TypeError, "permute: x must be a C-contiguous int64 array");
        goto done;
    }
    Py_ssize_t m = x.shape[0];
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) <
        0)
        goto done;
    if (out.itemsize != 8 || out.ndim != 1 || out.shape[0] != m) {
        PyErr_SetString(PyExc_TypeError, "permute: out must be a writable int64 array like x");
        goto done;
    }
    if (int64s(n_obj, &n, &n1, m, "n") < 0 || int64s(bits_obj, &bits, &bits1, m, "bits") < 0)
        goto done;
    if (PyObject_GetBuffer(sk_obj, &sk, PyBUF_FORMAT | PyBUF_STRIDES) < 0)
        goto done;
    /* strides in uint64s: per element (0: one bijection for all) and per stage */
    Py_ssize_t per_x = 0, per_stage;
    if (sk.itemsize == 8 && sk.ndim == 1 && sk.shape[0] == STAGES)
        per_stage = sk.strides[0];
    else if (sk.itemsize == 8 && sk.ndim == 2 && sk.shape[0] == m && sk.shape[1] == STAGES) {
        per_x = sk.strides[0];
        per_stage = sk.strides[1];
    } else {
        PyErr_SetString(PyExc_TypeError, "permute: sk must be uint64 keys of shape (6,) or (m, 6)");
        goto done;
    }
    if (per_x % 8 || per_stage % 8) {
        PyErr_SetString(PyExc_TypeError, "permute: sk must be aligned uint64s");
        goto done;
    }
    per_x /= 8;
    per_stage /= 8;

    const int64_t *xs = x.buf, *ns = n.obj ? n.buf : NULL, *bs = bits.obj ? bits.buf : NULL;
    const uint64_t *keys = sk.buf;
    int64_t *ys = out.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t limit = (uint64_t)(ns ? ns[i] : n1);
        int64_t b = bs ? bs[i] : bits1;
        if (b < 1 || b > 62 || limit < 1 || (uint64_t)xs[i] >= limit || (limit - 1) >> b) {
            bad = 1;
            break;
        }
        const uint64_t *k = keys + i * per_x;
        uint64_t y = (uint64_t)xs[i];
        do /* cycle walking: a point of [0, 2**b) outside [0, n) steps on */
            y = inverse ? decrypt(y, k, per_stage, (unsigned)b) : encrypt(y, k, per_stage, (unsigned)b);
        while (y >= limit);
        ys[i] = (int64_t)y;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "permute: each x must be in [0, n) and bits in [1, 62] cover n");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (x.obj)
        PyBuffer_Release(&x);
    if (out.obj)
        PyBuffer_Release(&out);
    if (sk.obj)
        PyBuffer_Release(&sk);
    if (n.obj)
        PyBuffer_Release(&n);
    if (bits.obj)
        PyBuffer_Release(&bits);
    return result;
}

/* ------------------------------------------------------------- step_rows */

/* A C-contiguous int64 (or uint64, `unsigned_`) array of `ndim` dimensions. */
static int
array64(PyObject *obj, Py_buffer *view, int ndim, int writable, int unsigned_, const char *what)
{
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        view->obj = NULL;
        return -1;
    }
    if (!is64(view, ndim, unsigned_)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_TypeError, "step_rows: %s must be a C-contiguous %s array of %d "
                     "dimension(s)", what, unsigned_ ? "uint64" : "int64", ndim);
        return -1;
    }
    return 0;
}

/* step_rows(sk, gb, rank_slot, start, counts, src, item): one rank's rows of shuffled
 * mixture steps, in one pass (mixture/steps.py step_rows). Step s's slots rank_slot ..
 * rank_slot + B - 1 of [0, gb) go through the step's bijection of [0, gb) (stage keys
 * sk[:, s], sk: uint64 [6, steps]; the same network and cycle walk as `permute`) to v;
 * v's source is the last i with start[s, i] <= v (start: int64 [steps, k], ascending
 * along i, start[s, 0] = 0) and its item counts[s, i] + v - start[s, i]. src, item:
 * int64 [steps, B], written. */
static PyObject *
step_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *sk_obj, *start_obj, *counts_obj, *src_obj, *item_obj;
    long long gb, rank_slot;
    if (!PyArg_ParseTuple(args, "OLLOOOO:step_rows", &sk_obj, &gb, &rank_slot, &start_obj,
                          &counts_obj, &src_obj, &item_obj))
        return NULL;
    Py_buffer sk = {0}, start = {0}, counts = {0}, src = {0}, item = {0};
    PyObject *result = NULL;
    if (array64(sk_obj, &sk, 2, 0, 1, "sk") < 0 || array64(start_obj, &start, 2, 0, 0, "start") < 0 ||
        array64(counts_obj, &counts, 2, 0, 0, "counts") < 0 ||
        array64(src_obj, &src, 2, 1, 0, "src") < 0 || array64(item_obj, &item, 2, 1, 0, "item") < 0)
        goto done;
    Py_ssize_t steps = sk.shape[1], k = start.shape[1], B = src.shape[1];
    if (sk.shape[0] != STAGES || start.shape[0] != steps || counts.shape[0] != steps ||
        counts.shape[1] != k || src.shape[0] != steps || item.shape[0] != steps ||
        item.shape[1] != B || k < 1) {
        PyErr_SetString(PyExc_ValueError, "step_rows: sk [6, steps], start and counts "
                        "[steps, k], src and item [steps, B]");
        goto done;
    }
    if (gb < 1 || gb > (1LL << 62) || rank_slot < 0 || rank_slot + B > gb) {
        PyErr_SetString(PyExc_ValueError, "step_rows: the slots must lie in [0, gb), gb >= 1");
        goto done;
    }
    const uint64_t *keys = sk.buf;
    const int64_t *st = start.buf, *cs = counts.buf;
    int64_t *out_src = src.buf, *out_item = item.buf;
    uint64_t limit = (uint64_t)gb;
    unsigned bits = 1;
    while (bits < 62 && ((uint64_t)1 << bits) < limit)
        bits++;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < steps; s++) {
        const uint64_t *ks = keys + s; /* stage r's key: ks[r * steps] */
        const int64_t *st_s = st + s * k, *cs_s = cs + s * k;
        for (Py_ssize_t b = 0; b < B; b++) {
            uint64_t v = (uint64_t)(rank_slot + b);
            do /* cycle walking, as in permute (gb = 1: the 1-bit domain walks to 0) */
                v = encrypt(v, ks, steps, bits);
            while (v >= limit);
            /* the last i with st_s[i] <= v: st_s[0] = 0 <= v, ascending */
            Py_ssize_t lo = 0, n = k;
            while (n > 1) {
                Py_ssize_t half = n / 2;
                lo = st_s[lo + half] <= (int64_t)v ? lo + half : lo;
                n -= half;
            }
            out_src[s * B + b] = lo;
            out_item[s * B + b] = cs_s[lo] + ((int64_t)v - st_s[lo]);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (sk.obj)
        PyBuffer_Release(&sk);
    if (start.obj)
        PyBuffer_Release(&start);
    if (counts.obj)
        PyBuffer_Release(&counts);
    if (src.obj)
        PyBuffer_Release(&src);
    if (item.obj)
        PyBuffer_Release(&item);
    return result;
}

static PyMethodDef methods[] = {
    {"permute", permute, METH_VARARGS,
     "permute(x, n, sk, bits, inverse, out): keyed.permute into `out`."},
    {"step_rows", step_rows, METH_VARARGS,
     "step_rows(sk, gb, rank_slot, start, counts, src, item): mixture/steps.py step_rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokenfeed.core._keyed",
    "The sampling's loops in C: keyed.permute, mixture step_rows.", -1, methods,
};

PyMODINIT_FUNC
PyInit__keyed(void)
{
    return PyModule_Create(&module);
}
