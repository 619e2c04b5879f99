/* The hot loops of kvpool_connector.keys, in C: what a scheduler lookup does per token and
 * per chunk.
 *
 * A 32k-token prompt in 16-token chunks is 32,768 token ids to pack, 2,048 chained hashes
 * and 2,048 key strings to build. In Python the packing cost 0.28 ms (array.fromlist), each
 * hash a Python call, a hash object and a bytes concatenation (about 1 us), each key a
 * concatenation: together more than the lookup goal (scheduler p50 <= 1.5 x the store's own
 * batch_is_exist + 0.2 ms, bench/bench_lookup.py) leaves. Here the loops run in C, the hashes over OpenSSL's SHA-256 (the
 * implementation hashlib.sha256 uses), giving the same bytes, digests and strings: keys.py
 * owns the scheme (root, chunk bytes, which 16 bytes name a chunk, the key grammar); this
 * file only runs its loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if defined(__has_include)
#if !__has_include(<openssl/evp.h>)
#error "kvpool needs OpenSSL's headers to build: apt-get install libssl-dev (scripts/setup.sh does)"
#endif
#endif
#include <openssl/evp.h>
#include <openssl/opensslv.h>

#define DIGEST_BYTES 32
#define NAME_BYTES 16 /* a chunk is named by the first 16 bytes of its chain value */

/* Inputs at least this long are hashed with the GIL released: about 4 ms of work, long
 * enough that the engine's other threads should run meanwhile. Shorter ones keep it, since
 * taking it back can wait a whole switch interval (5 ms) behind a thread that took it. */
#define GIL_FREE_BYTES (1 << 20)

static const EVP_MD *sha256_md;

static PyObject *
token_bytes(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *ids;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "On:token_bytes", &ids, &count)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(ids, "token ids must be a sequence of int");
    if (seq == NULL) {
        return NULL;
    }
    PyObject *out = NULL;
    if (count < 0 || count > PySequence_Fast_GET_SIZE(seq)) {
        PyErr_Format(PyExc_ValueError, "count must be in [0, %zd], got %zd",
                     PySequence_Fast_GET_SIZE(seq), count);
        goto fail;
    }
    out = PyBytes_FromStringAndSize(NULL, 4 * count);
    if (out == NULL) {
        goto fail;
    }
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        /* Like array("I"): any int, or an object with __index__ (a numpy integer). Its
         * __index__ may run any code, even shrink the list: hold the item, then check. */
        if (i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "token ids changed size while being packed");
            goto fail;
        }
        PyObject *given = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        PyObject *item = PyLong_CheckExact(given) ? Py_NewRef(given) : PyNumber_Index(given);
        Py_DECREF(given);
        if (item == NULL) {
            goto fail;
        }
        unsigned long id = PyLong_AsUnsignedLong(item);
        int overflow = id > 0xffffffffUL;
        if (id == (unsigned long)-1 && PyErr_Occurred()) {
            overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
            if (!overflow) {
                Py_DECREF(item);
                goto fail;
            }
            PyErr_Clear();
        }
        if (overflow) {
            /* The message shows the int __index__ gave, never the item's repr (any code, any
             * exception), nor an int too long for a C long long: Python refuses to print one
             * of more than 4,300 digits with ValueError, and the error must stay this one. */
            int wide;
            long long shown = PyLong_AsLongLongAndOverflow(item, &wide);
            if (wide) {
                PyErr_Format(PyExc_OverflowError, "token id at position %zd is outside "
                             "[0, 2**32): %s", i, wide > 0 ? "at least 2**63" : "below -2**63");
            } else {
                PyErr_Format(PyExc_OverflowError, "token id %lld at position %zd is outside "
                             "[0, 2**32)", shown, i);
            }
            Py_DECREF(item);
            goto fail;
        }
        Py_DECREF(item);
        o[4 * i] = (unsigned char)id;
        o[4 * i + 1] = (unsigned char)(id >> 8);
        o[4 * i + 2] = (unsigned char)(id >> 16);
        o[4 * i + 3] = (unsigned char)(id >> 24);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static int
hash_chunks(EVP_MD_CTX *ctx, const unsigned char *data, Py_ssize_t step, Py_ssize_t count,
            const unsigned char *parent, size_t parent_len, unsigned char *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned char *digest = out + i * DIGEST_BYTES;
        if (!EVP_DigestInit_ex(ctx, sha256_md, NULL)
            || !EVP_DigestUpdate(ctx, parent, parent_len)
            || !EVP_DigestUpdate(ctx, data + i * step, (size_t)step)
            || !EVP_DigestFinal_ex(ctx, digest, NULL)) {
            return 0;
        }
        parent = digest;
        parent_len = DIGEST_BYTES;
    }
    return 1;
}

static PyObject *
hex_names(const unsigned char *values, Py_ssize_t count)
{
    static const char hex[] = "0123456789abcdef";
    PyObject *names = PyList_New(count);
    if (names == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyUnicode_New(2 * NAME_BYTES, 127);
        if (name == NULL) {
            Py_DECREF(names);
            return NULL;
        }
        Py_UCS1 *text = PyUnicode_1BYTE_DATA(name);
        const unsigned char *value = values + i * DIGEST_BYTES;
        for (int j = 0; j < NAME_BYTES; j++) {
            text[2 * j] = (Py_UCS1)hex[value[j] >> 4];
            text[2 * j + 1] = (Py_UCS1)hex[value[j] & 0xf];
        }
        PyList_SET_ITEM(names, i, name);
    }
    return names;
}

static PyObject *
sha256_chain(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer data, parent;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*ny*:sha256_chain", &data, &step, &parent)) {
        return NULL;
    }
    PyObject *values = NULL, *names = NULL, *result = NULL;
    EVP_MD_CTX *ctx = NULL;
    if (step <= 0) {
        PyErr_Format(PyExc_ValueError, "step must be > 0, got %zd", step);
        goto done;
    }
    Py_ssize_t count = data.len / step;
    if (count > PY_SSIZE_T_MAX / DIGEST_BYTES) {
        PyErr_NoMemory();
        goto done;
    }
    values = PyBytes_FromStringAndSize(NULL, count * DIGEST_BYTES);
    ctx = EVP_MD_CTX_new();
    if (values == NULL || ctx == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(values);
    int ok;
    if (data.len >= GIL_FREE_BYTES) {
        /* The buffers stay exported (a bytearray cannot be resized) until released below. */
        Py_BEGIN_ALLOW_THREADS
        ok = hash_chunks(ctx, data.buf, step, count, parent.buf, (size_t)parent.len, out);
        Py_END_ALLOW_THREADS
    } else {
        ok = hash_chunks(ctx, data.buf, step, count, parent.buf, (size_t)parent.len, out);
    }
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed");
        goto done;
    }
    names = hex_names(out, count);
    if (names != NULL) {
        result = PyTuple_Pack(2, names, values);
    }
done:
    EVP_MD_CTX_free(ctx);
    Py_XDECREF(names);
    Py_XDECREF(values);
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return result;
}

/* prefix + name + suffix as one new str: a single allocation and copy when all three are
 * ASCII (every pool key is), else through PyUnicode_Concat. */
static PyObject *
join3(PyObject *prefix, PyObject *name, PyObject *suffix)
{
    if (PyUnicode_IS_COMPACT_ASCII(prefix) && PyUnicode_IS_COMPACT_ASCII(name)
        && (suffix == NULL || PyUnicode_IS_COMPACT_ASCII(suffix))) {
        Py_ssize_t lp = PyUnicode_GET_LENGTH(prefix), ln = PyUnicode_GET_LENGTH(name);
        Py_ssize_t ls = suffix == NULL ? 0 : PyUnicode_GET_LENGTH(suffix);
        PyObject *key = PyUnicode_New(lp + ln + ls, 127);
        if (key == NULL) {
            return NULL;
        }
        Py_UCS1 *text = PyUnicode_1BYTE_DATA(key);
        memcpy(text, PyUnicode_1BYTE_DATA(prefix), (size_t)lp);
        memcpy(text + lp, PyUnicode_1BYTE_DATA(name), (size_t)ln);
        if (ls) {
            memcpy(text + lp + ln, PyUnicode_1BYTE_DATA(suffix), (size_t)ls);
        }
        return key;
    }
    PyObject *head = PyUnicode_Concat(prefix, name);
    if (head == NULL || suffix == NULL) {
        return head;
    }
    PyObject *key = PyUnicode_Concat(head, suffix);
    Py_DECREF(head);
    return key;
}

static PyObject *
prefixed_keys(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *prefixes_arg, *names_arg, *suffixes_arg = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O:prefixed_keys", &prefixes_arg, &names_arg,
                          &suffixes_arg)) {
        return NULL;
    }
    /* Tuples or lists are used as they are (no copy); other sequences are copied once. No
     * Python code runs below, so none of them can change while the keys are built. */
    PyObject *prefixes = PySequence_Fast(prefixes_arg, "prefixes must be a sequence of str");
    PyObject *names = prefixes == NULL ? NULL
        : PySequence_Fast(names_arg, "names must be a sequence of str");
    PyObject *suffixes = names == NULL || suffixes_arg == Py_None ? NULL
        : PySequence_Fast(suffixes_arg, "suffixes must be a sequence of str");
    PyObject *keys = NULL;
    if (names == NULL || (suffixes_arg != Py_None && suffixes == NULL)) {
        goto done;
    }
    Py_ssize_t np = PySequence_Fast_GET_SIZE(prefixes), nn = PySequence_Fast_GET_SIZE(names);
    Py_ssize_t ns = suffixes == NULL ? 1 : PySequence_Fast_GET_SIZE(suffixes);
    PyObject **all[3] = {PySequence_Fast_ITEMS(prefixes), PySequence_Fast_ITEMS(names),
                         suffixes == NULL ? NULL : PySequence_Fast_ITEMS(suffixes)};
    Py_ssize_t sizes[3] = {np, nn, suffixes == NULL ? 0 : ns};
    for (int k = 0; k < 3; k++) {
        for (Py_ssize_t i = 0; i < sizes[k]; i++) {
            if (!PyUnicode_Check(all[k][i])) {
                PyErr_Format(PyExc_TypeError, "%s must be str, got %.100s",
                             k == 0 ? "prefixes" : k == 1 ? "names" : "suffixes",
                             Py_TYPE(all[k][i])->tp_name);
                goto done;
            }
        }
    }
    if (np && ns && nn > PY_SSIZE_T_MAX / np / ns) {
        PyErr_NoMemory();
        goto done;
    }
    keys = PyList_New(nn * np * ns);
    if (keys == NULL) {
        goto done;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < nn; i++) {
        for (Py_ssize_t j = 0; j < np; j++) {
            for (Py_ssize_t k = 0; k < ns; k++) {
                PyObject *key = join3(all[0][j], all[1][i], suffixes == NULL ? NULL : all[2][k]);
                if (key == NULL) {
                    Py_CLEAR(keys);
                    goto done;
                }
                PyList_SET_ITEM(keys, at++, key);
            }
        }
    }
done:
    Py_XDECREF(prefixes);
    Py_XDECREF(names);
    Py_XDECREF(suffixes);
    return keys;
}

PyDoc_STRVAR(token_bytes_doc,
"token_bytes(token_ids, count, /) -> bytes\n\n"
"The first count token ids as uint32 little-endian, 4 bytes each. Raises OverflowError for an\n"
"id outside [0, 2**32), TypeError for one that is not an int, ValueError for a count outside\n"
"[0, len(token_ids)].");

PyDoc_STRVAR(prefixed_keys_doc,
"prefixed_keys(prefixes, names, suffixes=None, /) -> list[str]\n\n"
"prefix + name (+ suffix) for every name, then prefix, then suffix: the same list as\n"
"[p + n + s for n in names for p in prefixes for s in suffixes] ([''] for None). Raises\n"
"TypeError for an item that is not a str.");

PyDoc_STRVAR(sha256_chain_doc,
"sha256_chain(data, step, parent, /) -> (names, values)\n\n"
"Chained SHA-256 over the whole step-byte chunks of data (a trailing partial chunk is not\n"
"hashed): chain value i = SHA-256(chain value i-1 + chunk i), chain value -1 = parent.\n"
"names: one str per chunk, the hex of its chain value's first 16 bytes; values: the\n"
"chain values, 32 bytes each, concatenated. Raises ValueError if step <= 0.");

static PyMethodDef methods[] = {
    {"token_bytes", token_bytes, METH_VARARGS, token_bytes_doc},
    {"prefixed_keys", prefixed_keys, METH_VARARGS, prefixed_keys_doc},
    {"sha256_chain", sha256_chain, METH_VARARGS, sha256_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_chunk_hash",
    .m_doc = "The hot loops of kvpool_connector.keys, in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__chunk_hash(void)
{
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    /* Fetched once (kept for the process's life): EVP_sha256() would look the
     * implementation up again on every EVP_DigestInit_ex. */
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
    sha256_md = EVP_sha256();
#endif
    if (sha256_md == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL offers no SHA-256");
        return NULL;
    }
    return PyModule_Create(&module_def);
}
