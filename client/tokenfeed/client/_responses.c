/* tokenfeed.client._responses: where a StreamBatchesResponse's fields lie in its bytes
 * (responses.scan; its reference is responses.scan_py, which documents the result).
 *
 * scan(data) -> (batches, values, batches_per_message, info) or None
 *
 * One pass over the message, nothing copied but the packed integers: each batch is a
 * tuple (epoch, step, offset, shift, rows, cols, dtype, tokens_at, tokens_len,
 * starts_from, starts_to, sources_from, sources_to, ends_at, ends_len), byte ranges
 * into `data` and index ranges into `values` (a bytearray of int64: every batch's
 * starts, then its sources, batch after batch); info is (at, len) of the InfoResponse
 * field or None. None whenever the message is not the plain shape the feeder writes
 * (a field twice where that matters, unpacked repeated integers, a known field of
 * another wire type, groups, a varint or length running past its end, anything
 * malformed): the caller parses those with protobuf, which decides.
 *
 * The field numbers are feeder.proto's; responses.py checks them against the
 * generated descriptors at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };
enum { R_BATCHES = 1, R_PER_MESSAGE = 2, R_INFO = 3 };
enum {
    B_EPOCH = 1, B_STEP, B_OFFSET, B_SHIFT, B_ROWS, B_COLS, B_DTYPE, B_TOKENS, B_STARTS,
    B_SOURCES, B_DOCUMENT_ENDS
};

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* A base-128 varint; 0 when it runs past the end or is longer than 10 bytes (or its
 * tenth byte holds more than the 64th bit: left to protobuf). */
static inline int
varint(Reader *r, uint64_t *out)
{
    uint64_t v = 0;
    for (int i = 0; i < 10 && r->p < r->end; i++) {
        uint8_t b = *r->p++;
        if (i == 9 && b > 1)
            return 0;
        v |= (uint64_t)(b & 0x7F) << (7 * i);
        if (!(b & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

/* A field's key: its number (1 .. 2^29 - 1) and wire type; 0 for anything else. */
static inline int
key(Reader *r, uint32_t *field, int *wire)
{
    uint64_t k;
    if (!varint(r, &k) || k > 0xFFFFFFFFu || (k >> 3) == 0)
        return 0;
    *field = (uint32_t)(k >> 3);
    *wire = (int)(k & 7);
    return 1;
}

/* A length-delimited field's bytes [*at, *at + *len) past its length. */
static inline int
span(Reader *r, Py_ssize_t *at, Py_ssize_t *len, const uint8_t *base)
{
    uint64_t n;
    if (!varint(r, &n) || n > (uint64_t)(r->end - r->p))
        return 0;
    *at = r->p - base;
    *len = (Py_ssize_t)n;
    r->p += n;
    return 1;
}

/* Skips an unknown field of wire type `wire`; 0 for groups and invalid types. */
static inline int
skip(Reader *r, int wire)
{
    uint64_t v;
    Py_ssize_t at, len;
    switch (wire) {
    case VARINT:
        return varint(r, &v);
    case I64:
        if (r->end - r->p < 8)
            return 0;
        r->p += 8;
        return 1;
    case LEN:
        return span(r, &at, &len, r->p);
    case I32:
        if (r->end - r->p < 4)
            return 0;
        r->p += 4;
        return 1;
    default:
        return 0;
    }
}

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Values;

static int
push(Values *vs, int64_t x)
{
    if (vs->n == vs->cap) {
        Py_ssize_t cap = vs->cap ? 2 * vs->cap : 1024;
        int64_t *v = PyMem_Realloc(vs->v, cap * sizeof(int64_t));
        if (!v) {
            PyErr_NoMemory();
            return -1;
        }
        vs->v = v;
        vs->cap = cap;
    }
    vs->v[vs->n++] = x;
    return 0;
}

/* A packed run of varints into `vs`, int32 ones narrowed as protobuf does; 1 done, 0
 * malformed, -1 error (set). */
static int
packed(Reader *r, Values *vs, int narrow)
{
    Py_ssize_t at, len;
    if (!span(r, &at, &len, r->p))
        return 0;
    Reader run = {r->p - len, r->p};
    while (run.p < run.end) {
        uint64_t u;
        if (!varint(&run, &u))
            return 0;
        int64_t x = narrow ? (int64_t)(int32_t)(uint32_t)u : (int64_t)u;
        if (push(vs, x) < 0)
            return -1;
    }
    return 1;
}

typedef struct {
    int64_t ints[7]; /* by field number: epoch .. cols */
    Py_ssize_t dtype_at, dtype_len, tokens_at, tokens_len, ends_at, ends_len;
    Py_ssize_t starts_from, starts_to, sources_from, sources_to;
} Batch;

/* One Batch message; 1 done, 0 not the plain shape, -1 error (set). */
static int
batch(Reader *r, const uint8_t *base, Values *vs, Batch *b)
{
    int starts = 0, sources = 0;
    memset(b, 0, sizeof(*b));
    b->starts_from = b->starts_to = b->sources_from = b->sources_to = vs->n;
    while (r->p < r->end) {
        uint32_t field;
        int wire, got;
        uint64_t u;
        if (!key(r, &field, &wire))
            return 0;
        if (field >= B_EPOCH && field <= B_COLS) {
            if (wire != VARINT || !varint(r, &u))
                return 0;
            b->ints[field] = (int64_t)u;
        } else if (field == B_DTYPE || field == B_TOKENS || field == B_DOCUMENT_ENDS) {
            Py_ssize_t at, len;
            if (wire != LEN || !span(r, &at, &len, base))
                return 0;
            if (field == B_DTYPE)
                b->dtype_at = at, b->dtype_len = len;
            else if (field == B_TOKENS)
                b->tokens_at = at, b->tokens_len = len;
            else
                b->ends_at = at, b->ends_len = len;
        } else if (field == B_STARTS || field == B_SOURCES) {
            int *seen = field == B_STARTS ? &starts : &sources;
            if (wire != LEN || *seen)
                return 0; /* unpacked, or a second run: protobuf's to merge */
            *seen = 1;
            Py_ssize_t from = vs->n;
            if ((got = packed(r, vs, field == B_SOURCES)) <= 0)
                return got;
            if (field == B_STARTS)
                b->starts_from = from, b->starts_to = vs->n;
            else
                b->sources_from = from, b->sources_to = vs->n;
        } else if (!skip(r, wire)) {
            return 0;
        }
    }
    /* Each run must be contiguous with nothing of the other between: it is, as each
     * appears at most once and appends in one go. */
    return 1;
}

/* The last dtype made, to share one str among a message's batches. */
typedef struct {
    PyObject *str;
    const uint8_t *at;
    Py_ssize_t len;
} Dtype;

/* A batch's tuple; NULL with an error set, or NULL and none set when its dtype is not
 * UTF-8 (not the plain shape). */
static PyObject *
batch_tuple(const Batch *b, const uint8_t *base, Dtype *dt)
{
    const uint8_t *at = base + b->dtype_at;
    if (!dt->str || dt->len != b->dtype_len || memcmp(dt->at, at, b->dtype_len) != 0) {
        PyObject *s = PyUnicode_DecodeUTF8((const char *)at, b->dtype_len, NULL);
        if (!s) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                PyErr_Clear();
            return NULL;
        }
        Py_XSETREF(dt->str, s);
        dt->at = at;
        dt->len = b->dtype_len;
    }
    return Py_BuildValue("(LLLLLLOnnnnnnnn)", (long long)b->ints[1], (long long)b->ints[2],
                         (long long)b->ints[3], (long long)b->ints[4], (long long)b->ints[5],
                         (long long)b->ints[6], dt->str, b->tokens_at, b->tokens_len,
                         b->starts_from, b->starts_to, b->sources_from, b->sources_to,
                         b->ends_at, b->ends_len);
}

static PyObject *
scan(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *base = view.buf;
    Reader r = {base, base + view.len};
    Values vs = {NULL, 0, 0};
    PyObject *batches = PyList_New(0), *result = NULL;
    Dtype dtype = {NULL, NULL, 0};
    int64_t per_message = 0;
    Py_ssize_t info_at = -1, info_len = 0;
    int plain = 1;
    if (!batches)
        goto done;
    while (r.p < r.end && plain) {
        uint32_t field;
        int wire;
        uint64_t u;
        Py_ssize_t at, len;
        if (!key(&r, &field, &wire)) {
            plain = 0;
        } else if (field == R_BATCHES) {
            if (wire != LEN || !span(&r, &at, &len, base)) {
                plain = 0;
                break;
            }
            Reader inner = {base + at, base + at + len};
            Batch b;
            int got = batch(&inner, base, &vs, &b);
            if (got < 0)
                goto done;
            if (!got) {
                plain = 0;
                break;
            }
            PyObject *t = batch_tuple(&b, base, &dtype);
            if (!t && PyErr_Occurred())
                goto done;
            if (!t) {
                plain = 0;
                break;
            }
            int bad = PyList_Append(batches, t);
            Py_DECREF(t);
            if (bad < 0)
                goto done;
        } else if (field == R_PER_MESSAGE) {
            if (wire != VARINT || !varint(&r, &u))
                plain = 0;
            else
                per_message = (int64_t)u;
        } else if (field == R_INFO) {
            if (wire != LEN || info_at >= 0 || !span(&r, &at, &len, base))
                plain = 0; /* a second one merges into the first: protobuf's to do */
            else
                info_at = at, info_len = len;
        } else if (!skip(&r, wire)) {
            plain = 0;
        }
    }
    if (!plain) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *values = PyByteArray_FromStringAndSize((const char *)vs.v,
                                                     vs.n * (Py_ssize_t)sizeof(int64_t));
    if (!values)
        goto done;
    if (info_at >= 0)
        result = Py_BuildValue("(ONL(nn))", batches, values, per_message, info_at, info_len);
    else
        result = Py_BuildValue("(ONLO)", batches, values, per_message, Py_None);
done:
    PyMem_Free(vs.v);
    Py_XDECREF(batches);
    Py_XDECREF(dtype.str);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(scan_doc, "scan(data) -> (batches, values, batches_per_message, info) or None: "
                       "where a StreamBatchesResponse's fields lie (responses.scan).");

static PyMethodDef methods[] = {{"scan", scan, METH_O, scan_doc}, {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tokenfeed.client._responses",
    .m_doc = "Where a StreamBatchesResponse's fields lie in its bytes (responses.scan).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__responses(void)
{
    return PyModule_Create(&module);
}
