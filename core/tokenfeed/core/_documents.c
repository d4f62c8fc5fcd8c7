/* tokenfeed.core._documents: where recorded documents end in a batch, searched in a
 * store's index in place (documents.indexed_ends; its reference is indexed_ends_py).
 *
 * Documents recorded as runs of sentences (a Megatron index, which calls them
 * sequences; documents.Sentences): sentence k starts at token pointers[k] / itemsize
 * (sentence S, one past the last, at `total`); document d is sentences
 * [doc_indices[d], doc_indices[d + 1]), so it ends where sentence doc_indices[d + 1]
 * starts. The two arrays are the index file's, memory-mapped: at an
 * offset that need not be 8-byte aligned (read with memcpy), of 10^8 entries or more,
 * so each row costs four searches over them and touches nothing else.
 *
 * indexed_ends(starts, cols, pointers, doc_indices, itemsize, total, out) -> count:
 * starts: int64 [rows]; pointers: int64 [S]; doc_indices: int64 [D + 1] (any alignment,
 * little-endian); out: int64 [>= rows * cols], written with the batch's flat end
 * indices r * cols + c, strictly ascending; returns how many. ValueError when what the
 * search finds contradicts the layout (an index `verify` would report).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline int64_t
at(const char *base, Py_ssize_t i)
{
    int64_t v;
    memcpy(&v, base + 8 * i, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = (int64_t)__builtin_bswap64((uint64_t)v);
#endif
    return v;
}

/* The first i in [lo, hi) with a[i] >= v, hi if none (a ascending). */
static Py_ssize_t
bisect(const char *a, Py_ssize_t lo, Py_ssize_t hi, int64_t v)
{
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (at(a, mid) < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* bisect(a, lo, hi, v) when the answer is near lo: steps of 1, 2, 4, ... from lo, then
 * a bisection of the last step. */
static Py_ssize_t
gallop(const char *a, Py_ssize_t lo, Py_ssize_t hi, int64_t v)
{
    for (Py_ssize_t step = 1; lo < hi && at(a, lo) < v; step *= 2) {
        Py_ssize_t next = lo + step;
        if (next >= hi || at(a, next) >= v)
            return bisect(a, lo + 1, next < hi ? next : hi, v);
        lo = next + 1;
    }
    return lo;
}

/* bisect(a, lo, hi, v) by interpolation, then a gallop from the guess towards the
 * answer. An index's arrays (running sums of lengths, documents' first sentences) are
 * nearly linear, so the guess lands next to the answer: two or three probes where
 * bisecting 10^8 entries takes 27, each a cache miss and each mapping a page of the
 * file. On skewed arrays the gallop bounds it to about twice bisection's probes.
 * indexed_ends_py bisects: the same answer wherever a is ascending. */
static Py_ssize_t
lower_bound(const char *a, Py_ssize_t lo, Py_ssize_t hi, int64_t v)
{
    if (hi - lo < 16)
        return bisect(a, lo, hi, v);
    int64_t x0 = at(a, lo), x1 = at(a, hi - 1);
    if (x0 >= v)
        return lo;
    if (x1 < v)
        return hi;
    /* x0 < v <= x1: the answer is in (lo, hi - 1] */
    double f = ((double)v - (double)x0) / ((double)x1 - (double)x0);
    Py_ssize_t g = lo + 1 + (Py_ssize_t)(f * (double)(hi - 2 - lo));
    if (g > hi - 1)
        g = hi - 1;
    if (at(a, g) < v)
        return gallop(a, g + 1, hi - 1, v); /* a[hi - 1] >= v */
    /* a[g] >= v: back from g by steps of 1, 2, 4, ... */
    for (Py_ssize_t step = 1;; step *= 2) {
        Py_ssize_t prev = g - step;
        if (prev <= lo)
            return bisect(a, lo + 1, g, v);
        if (at(a, prev) < v)
            return bisect(a, prev + 1, g, v);
        g = prev;
    }
}

/* A C-contiguous buffer of 8-byte integers, any alignment. */
static int
int64s(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        view->obj = NULL;
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || view->ndim != 1 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_TypeError, "indexed_ends: %s must be a 1-d int64 array", what);
        return -1;
    }
    return 0;
}

static PyObject *
indexed_ends(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *starts_obj, *ptr_obj, *doc_obj, *out_obj;
    long long cols, item, total;
    if (!PyArg_ParseTuple(args, "OLOOLLO:indexed_ends", &starts_obj, &cols, &ptr_obj, &doc_obj,
                          &item, &total, &out_obj))
        return NULL;
    Py_buffer st = {0}, ptr = {0}, doc = {0}, out = {0};
    PyObject *result = NULL;
    if (int64s(starts_obj, &st, 0, "starts") < 0 || int64s(ptr_obj, &ptr, 0, "pointers") < 0 ||
        int64s(doc_obj, &doc, 0, "doc_indices") < 0 || int64s(out_obj, &out, 1, "out") < 0)
        goto done;
    Py_ssize_t rows = st.shape[0], S = ptr.shape[0], D = doc.shape[0] - 1;
    if (cols < 1 || item < 1 || item > 8 || total < 0 || D < 0) {
        PyErr_SetString(PyExc_ValueError, "indexed_ends: cols >= 1, itemsize in 1..8, "
                        "total >= 0 and at least one document index");
        goto done;
    }
    if (out.shape[0] < rows * cols) {
        PyErr_SetString(PyExc_ValueError, "indexed_ends: out must hold rows * cols ends");
        goto done;
    }
    const int64_t *starts = st.buf;
    const char *P = ptr.buf, *E = (const char *)doc.buf + 8; /* E: the documents' ends */
    int64_t *o = out.buf;
    Py_ssize_t n = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows && !bad; r++) {
        int64_t s = starts[r];
        /* the sentences starting in [s + 1, s + cols]: the ends row r can hold */
        Py_ssize_t ka = lower_bound(P, 0, S, (s + 1) * item);
        Py_ssize_t kb = gallop(P, ka, S, (s + cols + 1) * item);
        if (kb == S && s + 1 <= total && total <= s + cols)
            kb = S + 1; /* sentence S starts at total */
        Py_ssize_t ja = lower_bound(E, 0, D, ka), jb = gallop(E, ja, D, kb);
        for (Py_ssize_t j = ja; j < jb; j++) {
            int64_t k = at(E, j), p = k < S ? (k >= 0 ? at(P, k) : -1) : total * item;
            int64_t c = p / item - s - 1;
            if (k < 0 || k > S || p < 0 || c < 0 || c >= cols) {
                bad = 1;
                break;
            }
            int64_t f = r * cols + c;
            if (n && f < o[n - 1]) {
                bad = 1;
                break;
            }
            if (!n || f != o[n - 1])
                o[n++] = f;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "sentence pointers or document indices out of order "
                        "or out of range");
        goto done;
    }
    result = PyLong_FromSsize_t(n);
done:
    if (st.obj)
        PyBuffer_Release(&st);
    if (ptr.obj)
        PyBuffer_Release(&ptr);
    if (doc.obj)
        PyBuffer_Release(&doc);
    if (out.obj)
        PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"indexed_ends", indexed_ends, METH_VARARGS,
     "indexed_ends(starts, cols, pointers, doc_indices, itemsize, total, out) -> count: "
     "documents.indexed_ends into `out`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokenfeed.core._documents",
    "Recorded document ends searched in a store's index in place (documents.indexed_ends).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__documents(void)
{
    return PyModule_Create(&module);
}
