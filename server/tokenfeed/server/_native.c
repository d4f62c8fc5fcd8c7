/* tokenfeed.server._native: the hot path's loops over rows and batches, in C.
 *
 * - splice: a response message is its batches' frames with their rows of tokens
 *   between them, every row a slice of a cached chunk; splice.py describes it as a
 *   program of (key, byte offset, byte count) pieces, and this copies them into one
 *   new bytes object without a Python object per piece. splice_files reads the rows
 *   from the chunk files instead (a positioned read each: rows read in place).
 * - program: a round of batches as that program: where each row lies in the store's
 *   chunks (a row crossing chunks is a piece per chunk), the frames between them.
 * - frames: every batch's protobuf bytes before and after its tokens, for a round of
 *   batches (wire.py), a mixture's `sources` field included. It knows varints and the
 *   order of Batch's fields, not their numbers: wire.py passes the tags, read from the
 *   generated descriptors.
 * - open_files, close_files: many chunk files opened (and stat'ed) or closed with the
 *   GIL released once, not once per system call (descriptors.py).
 *
 * splice.py, wire.py and descriptors.py call each through a public function that falls
 * back to its pure-Python reference beside it (splice_py, program_py, frames_py,
 * open_files_py, close_files_py) when this module is not built or the compiled loops
 * are off (tokenfeed.core.native); the tests compare them, and wire's with protobuf.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* A C-contiguous buffer of int64 rows of 3, or of plain int64 (keys). */
static int
int64_buffer(PyObject *obj, Py_buffer *view, int rows_of_3, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok = view->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    if (ok && rows_of_3)
        ok = view->ndim == 2 && view->shape[1] == 3;
    if (ok && !rows_of_3)
        ok = view->ndim == 1;
    if (!ok) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "splice: %s must be a C-contiguous int64 array%s",
                     what, rows_of_3 ? " of shape (n, 3)" : "");
        return -1;
    }
    return 0;
}

/* Index of `key` in the ascending `keys`, or -1. */
static Py_ssize_t
find(const int64_t *keys, Py_ssize_t n, int64_t key)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && keys[lo] == key ? lo : -1;
}

typedef struct {
    Py_buffer program; /* int64 (n, 3): key, offset, count */
    Py_buffer blob;    /* what key -1 reads */
} Part;

/* Every part's buffers (in `parts`, `*got` of them taken, to release) and the size of
 * the message they make (`*total`); -1 with an exception set on a bad part. */
static int
get_parts(PyObject *parts_seq, Part *parts, Py_ssize_t *got, Py_ssize_t *total)
{
    Py_ssize_t n_parts = PySequence_Fast_GET_SIZE(parts_seq);
    for (; *got < n_parts; ++*got) {
        PyObject *pair = PySequence_Fast_GET_ITEM(parts_seq, *got);
        PyObject *program, *blob;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "OO", &program, &blob)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "splice: a part is a (program, blob) tuple");
            return -1;
        }
        Part *s = &parts[*got];
        if (int64_buffer(program, &s->program, 1, "a program") < 0)
            return -1;
        if (PyObject_GetBuffer(blob, &s->blob, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&s->program);
            return -1;
        }
        const int64_t *p = s->program.buf;
        for (Py_ssize_t i = 0; i < s->program.shape[0]; i++) {
            int64_t count = p[3 * i + 2];
            if (count < 0 || count > PY_SSIZE_T_MAX - *total) {
                ++*got;
                PyErr_Format(PyExc_ValueError, "splice: piece %zd has a bad byte count %lld", i,
                             (long long)count);
                return -1;
            }
            *total += count;
        }
    }
    return 0;
}

/* Where a key's bytes are: in memory at `buf`, or (buf NULL) at `base` of file
 * descriptor `fd`; `size` bytes either way. */
typedef struct {
    const char *buf;
    int fd;
    int64_t base, size;
} Source;

/* What stopped a copy: a piece outside its source, a file cut short, a failed read, or
 * (reading without waiting) bytes not in the page cache. */
typedef struct {
    Py_ssize_t part, piece; /* the piece outside its source; part -1: none */
    int64_t short_key;      /* -1: none */
    int err;                /* an errno; 0: none */
    int would_block;        /* a read without waiting found bytes to wait for */
} Failure;

/* A positioned read; `nowait`: only from the page cache (RWF_NOWAIT), -1 with EAGAIN
 * where the read would wait for the disk. */
static ssize_t
read_at(int fd, char *dst, int64_t count, int64_t at, int nowait)
{
    if (!nowait)
        return pread(fd, dst, (size_t)count, (off_t)at);
#ifdef RWF_NOWAIT
    struct iovec iov = {dst, (size_t)count};
    return preadv2(fd, &iov, 1, (off_t)at, RWF_NOWAIT);
#else
    errno = EAGAIN;
    return -1;
#endif
}

/* Copy every part's pieces into `dst` in order: key -1 reads the part's blob, any other
 * key its source in `src` (`key_of` ascending). Touches no Python object: it runs
 * without the GIL. Stops at the first failure, recorded in `f`. */
static void
copy_pieces(const Part *parts, Py_ssize_t n_parts, const int64_t *key_of, const Source *src,
            Py_ssize_t n_keys, char *dst, int nowait, Failure *f)
{
    for (Py_ssize_t k = 0; k < n_parts; k++) {
        const int64_t *p = parts[k].program.buf;
        const Source blob = {parts[k].blob.buf, -1, 0, parts[k].blob.len};
        for (Py_ssize_t i = 0; i < parts[k].program.shape[0]; i++, p += 3) {
            const Source *s = &blob;
            if (p[0] != -1) {
                Py_ssize_t j = find(key_of, n_keys, p[0]);
                s = j < 0 ? NULL : &src[j];
            }
            if (s == NULL || p[1] < 0 || p[1] > s->size || p[2] > s->size - p[1]) {
                f->part = k, f->piece = i;
                return;
            }
            if (s->buf != NULL) {
                memcpy(dst, s->buf + p[1], (size_t)p[2]);
                dst += p[2];
                continue;
            }
            int64_t left = p[2], at = s->base + p[1];
            while (left > 0) {
                ssize_t got = read_at(s->fd, dst, left, at, nowait);
                if (got < 0 && errno == EINTR)
                    continue;
                /* not cached, a file system that cannot tell, or the end of a file cut
                 * short: a read that may wait says which */
                if (nowait && (got == 0 || (got < 0 && (errno == EAGAIN || errno == EOPNOTSUPP)))) {
                    f->would_block = 1;
                    return;
                }
                if (got < 0) {
                    f->err = errno;
                    return;
                }
                if (got == 0) {
                    f->short_key = p[0];
                    return;
                }
                dst += got, at += got, left -= got;
            }
        }
    }
}

/* The message `parts` make with each key's bytes in `src`: a new bytes object, or NULL
 * with an exception set; `nowait`: None where a read would wait for the disk. */
static PyObject *
spliced(PyObject *parts_seq, const int64_t *key_of, const Source *src, Py_ssize_t n_keys,
        int nowait)
{
    Py_ssize_t n_parts = PySequence_Fast_GET_SIZE(parts_seq);
    Part *parts = PyMem_Calloc(n_parts ? n_parts : 1, sizeof(Part));
    Py_ssize_t got_parts = 0, total = 0;
    PyObject *out = NULL;
    if (parts == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    /* First pass: every part's buffers and the message's size. */
    if (get_parts(parts_seq, parts, &got_parts, &total) < 0)
        goto done;
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto done;
    /* Second pass, without the GIL: find each piece's source, check it, copy it. */
    Failure f = {-1, -1, -1, 0, 0};
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    copy_pieces(parts, n_parts, key_of, src, n_keys, dst, nowait, &f);
    Py_END_ALLOW_THREADS
    if (f.would_block) {
        Py_DECREF(out);
        Py_INCREF(Py_None);
        out = Py_None;
    } else if (f.part >= 0) {
        const int64_t *p = (const int64_t *)parts[f.part].program.buf + 3 * f.piece;
        PyErr_Format(PyExc_ValueError,
                     "splice: piece %zd of part %zd (key %lld, offset %lld, count %lld) is "
                     "not inside its source",
                     f.piece, f.part, (long long)p[0], (long long)p[1], (long long)p[2]);
        Py_CLEAR(out);
    } else if (f.short_key >= 0) {
        PyErr_Format(PyExc_EOFError, "key %lld", (long long)f.short_key);
        Py_CLEAR(out);
    } else if (f.err) {
        errno = f.err;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_CLEAR(out);
    }
done:
    for (Py_ssize_t k = 0; k < got_parts; k++) {
        PyBuffer_Release(&parts[k].program);
        PyBuffer_Release(&parts[k].blob);
    }
    PyMem_Free(parts);
    return out;
}

/* splice(parts, keys, views): piece (key, offset, count) is `count` bytes at `offset` of
 * views[j] (keys[j] == key). */
static PyObject *
splice_views(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *parts_obj, *keys_obj, *views_obj;
    if (!PyArg_ParseTuple(args, "OOO:splice", &parts_obj, &keys_obj, &views_obj))
        return NULL;
    PyObject *parts_seq = PySequence_Fast(parts_obj, "splice: parts must be a sequence");
    if (parts_seq == NULL)
        return NULL;
    PyObject *views = PySequence_Fast(views_obj, "splice: views must be a sequence");
    if (views == NULL) {
        Py_DECREF(parts_seq);
        return NULL;
    }
    Py_ssize_t n_views = PySequence_Fast_GET_SIZE(views);
    Py_buffer *bufs = PyMem_Calloc(n_views ? n_views : 1, sizeof(Py_buffer));
    Source *src = PyMem_Calloc(n_views ? n_views : 1, sizeof(Source));
    Py_buffer keys = {0};
    Py_ssize_t got_views = 0;
    PyObject *out = NULL;
    if (bufs == NULL || src == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (int64_buffer(keys_obj, &keys, 0, "keys") < 0)
        goto done;
    if (keys.shape[0] != n_views) {
        PyErr_Format(PyExc_ValueError, "splice: %zd keys but %zd views", keys.shape[0], n_views);
        goto done;
    }
    for (; got_views < n_views; got_views++) {
        PyObject *v = PySequence_Fast_GET_ITEM(views, got_views);
        if (PyObject_GetBuffer(v, &bufs[got_views], PyBUF_SIMPLE) < 0)
            goto done;
        src[got_views] = (Source){bufs[got_views].buf, -1, 0, bufs[got_views].len};
    }
    out = spliced(parts_seq, keys.buf, src, n_views, 0);
done:
    for (Py_ssize_t j = 0; j < got_views; j++)
        PyBuffer_Release(&bufs[j]);
    if (keys.obj != NULL)
        PyBuffer_Release(&keys);
    PyMem_Free(bufs);
    PyMem_Free(src);
    Py_DECREF(parts_seq);
    Py_DECREF(views);
    return out;
}

/* splice_files(parts, keys, fds, bases, sizes, nowait=False): splice, with each key's
 * bytes read from a file: piece (key, offset, count) is `count` bytes at `bases[j] +
 * offset` of file descriptor `fds[j]` (keys[j] == key), inside [0, sizes[j]). A read
 * that comes back short (the file was cut) raises EOFError("key K"), a failed one
 * OSError. `nowait`: reads from the page cache only, None if one would wait. */
static PyObject *
splice_files(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *parts_obj, *keys_obj, *fds_obj, *bases_obj, *sizes_obj;
    int nowait = 0;
    if (!PyArg_ParseTuple(args, "OOOOO|p:splice_files", &parts_obj, &keys_obj, &fds_obj,
                          &bases_obj, &sizes_obj, &nowait))
        return NULL;
    PyObject *parts_seq = PySequence_Fast(parts_obj, "splice: parts must be a sequence");
    if (parts_seq == NULL)
        return NULL;
    Py_buffer keys = {0}, fds = {0}, bases = {0}, sizes = {0};
    Source *src = NULL;
    PyObject *out = NULL;
    if (int64_buffer(keys_obj, &keys, 0, "keys") < 0 || int64_buffer(fds_obj, &fds, 0, "fds") < 0 ||
        int64_buffer(bases_obj, &bases, 0, "bases") < 0 ||
        int64_buffer(sizes_obj, &sizes, 0, "sizes") < 0)
        goto done;
    Py_ssize_t n_keys = keys.shape[0];
    if (fds.shape[0] != n_keys || bases.shape[0] != n_keys || sizes.shape[0] != n_keys) {
        PyErr_SetString(PyExc_ValueError, "splice_files: one fd, base and size per key");
        goto done;
    }
    src = PyMem_Calloc(n_keys ? n_keys : 1, sizeof(Source));
    if (src == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *fd_of = fds.buf, *base_of = bases.buf, *size_of = sizes.buf;
    for (Py_ssize_t j = 0; j < n_keys; j++)
        src[j] = (Source){NULL, (int)fd_of[j], base_of[j], size_of[j]};
    out = spliced(parts_seq, keys.buf, src, n_keys, nowait);
done:
    if (keys.obj != NULL)
        PyBuffer_Release(&keys);
    if (fds.obj != NULL)
        PyBuffer_Release(&fds);
    if (bases.obj != NULL)
        PyBuffer_Release(&bases);
    if (sizes.obj != NULL)
        PyBuffer_Release(&sizes);
    PyMem_Free(src);
    Py_DECREF(parts_seq);
    return out;
}

/* ----------------------------------------------------------------- program */

/* The last chunk whose start is <= t (chunk_starts ascending, chunk_starts[0] = 0). */
static inline Py_ssize_t
chunk_at(const int64_t *chunk_starts, Py_ssize_t n_chunks, int64_t t)
{
    Py_ssize_t lo = 0, n = n_chunks; /* search chunk_starts[0 .. n_chunks) */
    while (n > 1) {
        Py_ssize_t half = n / 2;
        lo = chunk_starts[lo + half] <= t ? lo + half : lo; /* branch-free step */
        n -= half;
    }
    return lo;
}

/* Append the piece (key, offset, count) to `*prog` (`*here` pieces so far, room for
 * `*room`), doubling it when full; -1 (an exception set, *prog freed) on failure. */
static inline int
add_piece(PyObject **prog, Py_ssize_t *room, Py_ssize_t *here, int64_t key, int64_t offset,
    int64_t count)
{
    if (*here == *room) {
        *room *= 2;
        if (_PyBytes_Resize(prog, (Py_ssize_t)(3 * *room * sizeof(int64_t))) < 0)
            return -1;
    }
    int64_t *p = (int64_t *)PyBytes_AS_STRING(*prog) + 3 * *here;
    p[0] = key, p[1] = offset, p[2] = count;
    ++*here;
    return 0;
}

static PyObject *
program(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *starts_obj, *bounds_obj, *rows_obj, *row_bytes_obj, *frames_obj;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OOOOnO:program", &starts_obj, &bounds_obj, &rows_obj,
                          &row_bytes_obj, &itemsize, &frames_obj))
        return NULL;
    Py_buffer starts = {0}, bounds = {0}, rows = {0}, row_bytes = {0}, frame_sizes = {0};
    PyObject *prog = NULL, *lo = NULL, *result = NULL;
    if (int64_buffer(starts_obj, &starts, 0, "starts") < 0 ||
        int64_buffer(bounds_obj, &bounds, 0, "chunk_starts") < 0 ||
        int64_buffer(rows_obj, &rows, 0, "rows") < 0 ||
        int64_buffer(row_bytes_obj, &row_bytes, 0, "row_bytes") < 0 ||
        int64_buffer(frames_obj, &frame_sizes, 0, "frame sizes") < 0)
        goto done;
    const int64_t *st = starts.buf, *cs = bounds.buf, *nr = rows.buf, *rb = row_bytes.buf;
    const int64_t *fs = frame_sizes.buf;
    Py_ssize_t n_batches = rows.shape[0], n_chunks = bounds.shape[0] - 1;
    if (itemsize <= 0 || n_chunks < 0 || row_bytes.shape[0] != n_batches ||
        frame_sizes.shape[0] != 2 * n_batches) {
        PyErr_SetString(PyExc_ValueError, "program: one rows and row_bytes per batch, two frame "
                                          "sizes, a positive itemsize and chunk_starts");
        goto done;
    }
    for (Py_ssize_t b = 0; b < n_batches; b++)
        if (nr[b] < 0 || rb[b] < 0 || rb[b] % itemsize) {
            PyErr_Format(PyExc_ValueError, "program: batch %zd has bad rows or row_bytes", b);
            goto done;
        }
    /* Room for a head, a tail and two pieces per row (a row crossing one chunk boundary);
     * it doubles when rows cross more. */
    Py_ssize_t room = 2 * n_batches + 2 * starts.shape[0] + 2;
    prog = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(3 * room * sizeof(int64_t)));
    lo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((n_batches + 1) * sizeof(int64_t)));
    if (prog == NULL || lo == NULL)
        goto done;
    /* One pass: head, the rows' pieces (each row checked), tail, batch after batch. */
    int64_t *piece_lo = (int64_t *)PyBytes_AS_STRING(lo), total = cs[n_chunks];
    int64_t at = 0; /* the next frame's offset in the frames blob */
    Py_ssize_t r = 0, here = 0;
    for (Py_ssize_t b = 0; b < n_batches; b++) {
        if (nr[b] > starts.shape[0] - r) {
            PyErr_Format(PyExc_ValueError, "program: batch %zd has bad rows or row_bytes", b);
            goto done;
        }
        piece_lo[b] = here;
        if (add_piece(&prog, &room, &here, -1, at, fs[2 * b]) < 0)
            goto done;
        at += fs[2 * b];
        int64_t cols = rb[b] / itemsize;
        for (int64_t k = 0; k < nr[b]; k++, r++) {
            int64_t s = st[r], end = st[r] + cols;
            if (s < 0 || cols > total - s) {
                PyErr_Format(PyExc_ValueError, "program: row %zd [%lld, %lld) is outside the "
                             "store's %lld tokens", r, (long long)s, (long long)end,
                             (long long)total);
                goto done;
            }
            /* a piece per non-empty chunk the row touches */
            for (Py_ssize_t c = chunk_at(cs, n_chunks, s); c < n_chunks && cs[c] < end; c++) {
                int64_t a = s > cs[c] ? s : cs[c], e = end < cs[c + 1] ? end : cs[c + 1];
                if (a < e && add_piece(&prog, &room, &here, c, (a - cs[c]) * itemsize,
                                 (e - a) * itemsize) < 0)
                    goto done;
            }
        }
        if (add_piece(&prog, &room, &here, -1, at, fs[2 * b + 1]) < 0)
            goto done;
        at += fs[2 * b + 1];
    }
    piece_lo[n_batches] = here;
    if (_PyBytes_Resize(&prog, (Py_ssize_t)(3 * here * sizeof(int64_t))) < 0)
        goto done; /* it freed prog and set it to NULL */
    result = PyTuple_Pack(2, prog, lo);
done:
    if (starts.obj != NULL)
        PyBuffer_Release(&starts);
    if (bounds.obj != NULL)
        PyBuffer_Release(&bounds);
    if (rows.obj != NULL)
        PyBuffer_Release(&rows);
    if (row_bytes.obj != NULL)
        PyBuffer_Release(&row_bytes);
    if (frame_sizes.obj != NULL)
        PyBuffer_Release(&frame_sizes);
    Py_XDECREF(prog);
    Py_XDECREF(lo);
    return result;
}

/* ------------------------------------------------------------------ frames */

static inline Py_ssize_t
varint_size(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline char *
put_varint(char *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

static inline char *
put(char *p, const Py_buffer *b)
{
    memcpy(p, b->buf, (size_t)b->len);
    return p + b->len;
}

/* The bytes of the varints of values[from .. to): a batch's packed `starts` or `sources`. */
static inline Py_ssize_t
packed_size(const int64_t *values, int64_t from, int64_t to)
{
    Py_ssize_t n = 0;
    for (int64_t k = from; k < to; k++)
        n += varint_size((uint64_t)values[k]);
    return n;
}

/* A packed repeated int field of values[from .. to), `packed` bytes of varints (nothing
 * when empty: proto3 leaves out an empty repeated field). */
static inline char *
put_packed(char *p, const Py_buffer *tag, const int64_t *values, int64_t from, int64_t to,
           Py_ssize_t packed)
{
    if (!packed)
        return p;
    p = put(p, tag);
    p = put_varint(p, (uint64_t)packed);
    for (int64_t k = from; k < to; k++)
        p = put_varint(p, (uint64_t)values[k]);
    return p;
}

/* The size of that field. */
static inline Py_ssize_t
field_size(const Py_buffer *tag, Py_ssize_t packed)
{
    return packed ? tag->len + varint_size((uint64_t)packed) + packed : 0;
}

/* A batch's fields before its tokens: epoch, step and offset (proto3 leaves out zeros),
 * then its middle (fields 4-7 and the tokens' tag and length). */
static inline Py_ssize_t
fields_size(const Py_buffer *epoch_field, const Py_buffer *step_tag, uint64_t step,
            const Py_buffer *offset_tag, int64_t offset, PyObject *middle)
{
    Py_ssize_t n = epoch_field->len + PyBytes_GET_SIZE(middle);
    n += step ? step_tag->len + varint_size(step) : 0;
    n += offset ? offset_tag->len + varint_size((uint64_t)offset) : 0;
    return n;
}

static PyObject *
frames(PyObject *module, PyObject *args)
{
    (void)module;
    Py_buffer batch_tag, epoch_field, step_tag, offset_tag, starts_tag, sources_tag;
    Py_buffer offsets = {0}, payloads = {0}, starts = {0}, cut = {0}, sources = {0};
    PyObject *offsets_obj, *middles_obj, *payloads_obj, *starts_obj, *cut_obj, *sources_obj;
    long long step;
    if (!PyArg_ParseTuple(args, "y*y*y*Ly*OOOy*OOy*O:frames", &batch_tag, &epoch_field,
                          &step_tag, &step, &offset_tag, &offsets_obj, &middles_obj,
                          &payloads_obj, &starts_tag, &starts_obj, &cut_obj, &sources_tag,
                          &sources_obj))
        return NULL;
    PyObject *middles = NULL, *blob = NULL, *sizes = NULL, *result = NULL;
    if (int64_buffer(offsets_obj, &offsets, 0, "offsets") < 0 ||
        int64_buffer(payloads_obj, &payloads, 0, "payloads") < 0 ||
        int64_buffer(starts_obj, &starts, 0, "starts") < 0 ||
        int64_buffer(cut_obj, &cut, 0, "cut") < 0 ||
        (sources_obj != Py_None && int64_buffer(sources_obj, &sources, 0, "sources") < 0))
        goto done;
    middles = PySequence_Fast(middles_obj, "frames: middles must be a sequence of bytes");
    if (middles == NULL)
        goto done;
    Py_ssize_t n = offsets.shape[0];
    const int64_t *off = offsets.buf, *pay = payloads.buf, *st = starts.buf, *c = cut.buf;
    const int64_t *src = sources.obj != NULL ? sources.buf : NULL; /* a mixture's */
    if (payloads.shape[0] != n || PySequence_Fast_GET_SIZE(middles) != n ||
        cut.shape[0] != n + 1 || (src != NULL && sources.shape[0] != starts.shape[0])) {
        PyErr_SetString(PyExc_ValueError, "frames: one offset, middle and payload per batch, "
                                          "one more cut (and one source per start)");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = c[i] >= 0 && c[i] <= c[i + 1] && c[i + 1] <= starts.shape[0] && pay[i] >= 0;
        ok = ok && PyBytes_Check(PySequence_Fast_GET_ITEM(middles, i));
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "frames: batch %zd: bad cut, payload or a non-bytes "
                                           "middle", i);
            goto done;
        }
    }
    /* First pass: the sizes of every head and tail. */
    sizes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(2 * n * sizeof(int64_t)));
    if (sizes == NULL)
        goto done;
    int64_t *size = (int64_t *)PyBytes_AS_STRING(sizes);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t tail = field_size(&starts_tag, packed_size(st, c[i], c[i + 1]));
        if (src != NULL)
            tail += field_size(&sources_tag, packed_size(src, c[i], c[i + 1]));
        Py_ssize_t fields = fields_size(&epoch_field, &step_tag, (uint64_t)step + (uint64_t)i,
                                        &offset_tag, off[i], PySequence_Fast_GET_ITEM(middles, i));
        uint64_t length = (uint64_t)fields + (uint64_t)pay[i] + (uint64_t)tail;
        size[2 * i] = batch_tag.len + varint_size(length) + fields;
        size[2 * i + 1] = tail;
        total += size[2 * i] + tail;
    }
    blob = PyBytes_FromStringAndSize(NULL, total);
    if (blob == NULL)
        goto done;
    /* Second pass: the bytes, in Batch's field order (as SerializeToString writes). */
    char *p = PyBytes_AS_STRING(blob);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *middle = PySequence_Fast_GET_ITEM(middles, i);
        Py_ssize_t tail = size[2 * i + 1];
        uint64_t s = (uint64_t)step + (uint64_t)i;
        Py_ssize_t fields = fields_size(&epoch_field, &step_tag, s, &offset_tag, off[i], middle);
        p = put(p, &batch_tag);
        p = put_varint(p, (uint64_t)fields + (uint64_t)pay[i] + (uint64_t)tail);
        p = put(p, &epoch_field);
        if (s) {
            p = put(p, &step_tag);
            p = put_varint(p, s);
        }
        if (off[i]) {
            p = put(p, &offset_tag);
            p = put_varint(p, (uint64_t)off[i]);
        }
        memcpy(p, PyBytes_AS_STRING(middle), (size_t)PyBytes_GET_SIZE(middle));
        p += PyBytes_GET_SIZE(middle);
        /* (the batch's tokens go here) */
        p = put_packed(p, &starts_tag, st, c[i], c[i + 1], packed_size(st, c[i], c[i + 1]));
        if (src != NULL)
            p = put_packed(p, &sources_tag, src, c[i], c[i + 1], packed_size(src, c[i], c[i + 1]));
    }
    result = PyTuple_Pack(2, blob, sizes);
done:
    PyBuffer_Release(&batch_tag);
    PyBuffer_Release(&epoch_field);
    PyBuffer_Release(&step_tag);
    PyBuffer_Release(&offset_tag);
    PyBuffer_Release(&starts_tag);
    PyBuffer_Release(&sources_tag);
    if (sources.obj != NULL)
        PyBuffer_Release(&sources);
    if (offsets.obj != NULL)
        PyBuffer_Release(&offsets);
    if (payloads.obj != NULL)
        PyBuffer_Release(&payloads);
    if (starts.obj != NULL)
        PyBuffer_Release(&starts);
    if (cut.obj != NULL)
        PyBuffer_Release(&cut);
    Py_XDECREF(middles);
    Py_XDECREF(blob);
    Py_XDECREF(sizes);
    return result;
}

/* ------------------------------------------------------------------ descriptors */

/* One file opened for reading and stat'ed: out = (fd, dev, ino, size), or (-errno, 0,
 * 0, 0) with nothing left open. Touches no Python object. */
static void
open_one(const char *path, int advise, long long out[4])
{
    struct stat st;
    int fd;
    do
        fd = open(path, O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    memset(out, 0, 4 * sizeof(long long));
    if (fd < 0) {
        out[0] = -errno;
        return;
    }
    if (fstat(fd, &st) < 0) {
        out[0] = -errno;
        close(fd);
        return;
    }
#ifdef POSIX_FADV_RANDOM
    if (advise)
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM); /* advice: its failure is no error */
#else
    (void)advise;
#endif
    out[0] = fd, out[1] = (long long)st.st_dev, out[2] = (long long)st.st_ino;
    out[3] = (long long)st.st_size;
}

static PyObject *
open_files(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *paths_obj, *seq, *result = NULL;
    int advise;
    if (!PyArg_ParseTuple(args, "Op:open_files", &paths_obj, &advise))
        return NULL;
    seq = PySequence_Fast(paths_obj, "open_files: paths must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0;
    PyObject **encoded = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    long long (*out)[4] = PyMem_Calloc(n ? n : 1, sizeof(*out));
    if (encoded == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, got), &encoded[got]))
            goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        open_one(PyBytes_AS_STRING(encoded[i]), advise, out[i]);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = NULL;
        if (result != NULL)
            row = Py_BuildValue("(LLLL)", out[i][0], out[i][1], out[i][2], out[i][3]);
        if (row == NULL) { /* out of memory: nothing handed over, nothing left open */
            for (Py_ssize_t j = 0; j < n; j++)
                if (out[j][0] >= 0)
                    close((int)out[j][0]);
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, row);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        Py_DECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(out);
    Py_DECREF(seq);
    return result;
}

static PyObject *
close_files(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *fds_obj, *seq;
    if (!PyArg_ParseTuple(args, "O:close_files", &fds_obj))
        return NULL;
    seq = PySequence_Fast(fds_obj, "close_files: fds must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *fds = PyMem_Malloc((n ? n : 1) * sizeof(int)), first = 0;
    if (fds == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < INT_MIN || fd > INT_MAX) {
            if (!PyErr_Occurred()) /* what os.close says */
                PyErr_SetString(PyExc_OverflowError, "fd is out of range");
            PyMem_Free(fds);
            Py_DECREF(seq);
            return NULL;
        }
        fds[i] = (int)fd;
    }
    Py_DECREF(seq);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) /* every one closed; the first failure reported */
        if (close(fds[i]) < 0 && !first && errno != EINTR)
            first = errno;
    Py_END_ALLOW_THREADS
    PyMem_Free(fds);
    if (first) {
        errno = first;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"splice", splice_views, METH_VARARGS,
     "splice(parts, keys, views) -> bytes: see tokenfeed.server.splice."},
    {"splice_files", splice_files, METH_VARARGS,
     "splice_files(parts, keys, fds, bases, sizes, nowait=False) -> bytes | None: see "
     "tokenfeed.server.splice."},
    {"program", program, METH_VARARGS,
     "program(...) -> (int64 (n, 3) as bytes, int64 piece_lo as bytes): see "
     "tokenfeed.server.splice."},
    {"frames", frames, METH_VARARGS,
     "frames(...) -> (bytes, int64 sizes as bytes): see tokenfeed.server.wire."},
    {"open_files", open_files, METH_VARARGS,
     "open_files(paths, advise_random) -> [(fd or -errno, dev, ino, size)]: see "
     "tokenfeed.server.descriptors."},
    {"close_files", close_files, METH_VARARGS,
     "close_files(fds) -> None: see tokenfeed.server.descriptors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokenfeed.server._native",
    "The hot path's loops in C (see tokenfeed.server.splice and tokenfeed.server.wire).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
