/* Native fast path of pddlink.kv.hashing: scheme 1 (XXH3_128_U32LE_V1) over a list or tuple of ints.
 *
 * chain_u32(tokens, block_size, parent) computes, for every full block i of `tokens`,
 *     d_i = XXH3_128(d_{i-1} || tokens[i*B:(i+1)*B] as uint32 little-endian),   d_{-1} = parent,
 * where each digest is xxhash's canonical (big-endian) 16-byte form, and returns the list of
 * int.from_bytes(d_i, "big"). The Python wrapper (hashing.BlockHasher) owns the scheme's definition,
 * the root and the error types; this module only does the loop, against libxxhash's public API.
 *
 * Input contract, so that results and errors match the pure-Python path exactly:
 * - `tokens` must be a list or tuple; every id is checked, including those of a trailing partial block.
 * - An item that is an int (bool and int subclasses included, as array('I') reads them) outside
 *   [0, 2**32) raises OverflowError naming its position.
 * - An item that is not an int (numpy integer, float, str...) makes the function return None: the
 *   caller then takes the pure-Python path, which converts it through __index__ or raises its error.
 *   Because only ints are read, no Python code runs while the list is being read, so it cannot change
 *   under us; the output ints are created only after every block is hashed.
 * The GIL is held throughout; no threads. Pure computation, no I/O.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <xxhash.h>
#if XXH_VERSION_NUMBER < 800
#error "libxxhash >= 0.8.0 is needed: XXH3_128bits output is stable only from 0.8.0"
#endif

#define DIGEST_BYTES 16
#define TOKEN_BYTES 4

/* The slow path of read_token: int subclasses (bool included), ints of several digits, errors. */
static int
read_token_slow(PyObject *item, Py_ssize_t i, uint32_t *out)
{
    if (!PyLong_Check(item)) {
        return 0;
    }
    unsigned long value = PyLong_AsUnsignedLong(item); /* reads the digits; never calls Python code */
    if ((value == (unsigned long)-1 && PyErr_Occurred()) || value > 0xFFFFFFFFUL) {
        PyErr_Clear();
        /* no %R: repr() could run Python code, fail on its own, or print thousands of digits */
        PyErr_Format(PyExc_OverflowError, "token id at index %zd is out of range", i);
        return -1;
    }
    *out = (uint32_t)value;
    return 1;
}

/* Reads item `i` as a uint32. Returns 1 on success, 0 for "not an int" (no exception set),
 * -1 with OverflowError set for an int out of range.
 * Fast path, inline: an exact int that fits in one machine word (every token id in practice);
 * calling PyLong_AsUnsignedLong for each item costs about 3x the rest of the loop. */
static inline int
read_token(PyObject *item, Py_ssize_t i, uint32_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (value >= 0 && value <= (Py_ssize_t)0xFFFFFFFF) {
            *out = (uint32_t)value;
            return 1;
        }
    }
#else /* 3.11: sign and digit count in ob_size, value in ob_digit (cpython/longintrepr.h) */
    if (PyLong_CheckExact(item) && (Py_SIZE(item) == 0 || Py_SIZE(item) == 1)) {
        *out = Py_SIZE(item) ? (uint32_t)((PyLongObject *)item)->ob_digit[0] : 0;
        return 1;
    }
#endif
    return read_token_slow(item, i, out);
}

/* Writes a uint32 as 4 little-endian bytes, whatever the host's byte order (one store on x86/ARM). */
static inline void
put_u32le(unsigned char *p, uint32_t v)
{
#if !PY_LITTLE_ENDIAN
    v = (v >> 24) | ((v >> 8) & 0xFF00u) | ((v << 8) & 0xFF0000u) | (v << 24);
#endif
    memcpy(p, &v, TOKEN_BYTES);
}

/* Hashes every full block into `digests` (n_blocks * 16 bytes) and checks the trailing ids.
 * Returns 1 on success, 0 for "not an int" seen, -1 with an exception set. */
static int
hash_chain(PyObject **items, Py_ssize_t n, Py_ssize_t block_size, const unsigned char *parent,
           unsigned char *digests)
{
    Py_ssize_t n_blocks = n / block_size;
    int status = 1;
    if (n_blocks == 0) { /* no full block: only check the ids (and allocate nothing) */
        for (Py_ssize_t i = 0; i < n && status == 1; i++) {
            uint32_t token;
            status = read_token(items[i], i, &token);
        }
        return status;
    }
    /* block_size <= n here, so the buffer is no larger than the token list's own storage */
    const size_t block_bytes = (size_t)block_size * TOKEN_BYTES;
    unsigned char *buf = PyMem_Malloc(DIGEST_BYTES + block_bytes); /* d_{i-1} || block i */
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, parent, DIGEST_BYTES);
    for (Py_ssize_t b = 0; b < n_blocks && status == 1; b++) {
        unsigned char *p = buf + DIGEST_BYTES;
        for (Py_ssize_t i = b * block_size; i < (b + 1) * block_size; i++, p += TOKEN_BYTES) {
            uint32_t token;
            status = read_token(items[i], i, &token);
            if (status != 1) {
                break;
            }
            put_u32le(p, token);
        }
        if (status == 1) {
            XXH128_canonical_t canon;
            XXH128_canonicalFromHash(&canon, XXH3_128bits(buf, DIGEST_BYTES + block_bytes));
            memcpy(buf, canon.digest, DIGEST_BYTES); /* the next block chains from this digest */
            memcpy(digests + (size_t)b * DIGEST_BYTES, canon.digest, DIGEST_BYTES);
        }
    }
    for (Py_ssize_t i = n_blocks * block_size; i < n && status == 1; i++) {
        uint32_t token; /* a partial block has no identity, but its ids must still be valid */
        status = read_token(items[i], i, &token);
    }
    PyMem_Free(buf);
    return status;
}

/* A 16-byte big-endian digest as a Python int. */
static PyObject *
digest_to_int(const unsigned char *digest)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(
        digest, DIGEST_BYTES, Py_ASNATIVEBYTES_BIG_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray(digest, DIGEST_BYTES, /*little_endian=*/0, /*is_signed=*/0);
#endif
}

static PyObject *
chain_u32(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *tokens;
    Py_ssize_t block_size;
    const char *parent;
    Py_ssize_t parent_len;
    if (!PyArg_ParseTuple(args, "Ony#:chain_u32", &tokens, &block_size, &parent, &parent_len)) {
        return NULL;
    }
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list or a tuple");
        return NULL;
    }
    if (block_size <= 0 || parent_len != DIGEST_BYTES) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive and parent 16 bytes");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    Py_ssize_t n_blocks = n / block_size;
    unsigned char *digests = PyMem_Malloc(n_blocks ? (size_t)n_blocks * DIGEST_BYTES : 1);
    if (digests == NULL) {
        return PyErr_NoMemory();
    }
    int status = hash_chain(PySequence_Fast_ITEMS(tokens), n, block_size, (const unsigned char *)parent,
                            digests);
    PyObject *result = NULL;
    if (status == 0) {
        result = Py_NewRef(Py_None); /* not all ints: the caller takes the pure-Python path */
    }
    else if (status == 1 && (result = PyList_New(n_blocks)) != NULL) {
        for (Py_ssize_t b = 0; b < n_blocks; b++) {
            PyObject *value = digest_to_int(digests + (size_t)b * DIGEST_BYTES);
            if (value == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, b, value);
        }
    }
    PyMem_Free(digests);
    return result;
}

static PyMethodDef methods[] = {
    {"chain_u32", chain_u32, METH_VARARGS,
     "chain_u32(tokens, block_size, parent) -> list[int] | None\n\n"
     "Chained XXH3-128 hashes of every full block of a list/tuple of uint32 token ids (scheme 1),\n"
     "starting from the 16-byte parent digest. None when an item is not an int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native_hash",
    .m_doc = "Native chained block hashing (see _native_hash.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__native_hash(void)
{
    return PyModule_Create(&module_def);
}
