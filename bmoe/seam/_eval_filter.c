/* The eval and abort callbacks llama.cpp calls on every graph node, answered in C.

   ggml asks the eval callback (ask = true) about every node of a graph, and the CPU backend's
   thread 0 calls the abort callback after every node it computes, while the other threads wait at
   the next barrier. A decode of a large MoE model has thousands of nodes, and a Python callback
   costs a GIL round trip each time. Here both are answered in C: the eval callback hands Python
   (`forward`) only the nodes whose names bmoe.seam.eval_hook.EvalHook stops at (the routing's
   `ffn_moe_weights-L`, the router input `ffn_moe_logits-L` while wanted, the down matmul's inputs
   while wanted) and every node while it captures; the abort callback answers from a flag Python
   sets when it parks an error (or for a dry capture), and asks Python itself at most once per `abort_ns`, so a signal's
   Python handler still runs within that time during a long graph.

   One decision is taken here while Python allows it (`fast`, set after each of Python's stops): a
   routing whose experts are all resident. Its ids are rewritten to their slots from the cache's own
   tables (bmoe.streaming.expert_cache: `table`, `resident`), the layer's tensors narrowed to the highest
   slot read (Streamer.narrow's rule), and the routing logged; Python replays the log (its cache
   bookkeeping, counters and checks) before it decides anything else, so the cache sees the same calls
   in the same order. Nothing changes a table while C reads it: only Python evicts or reads, and Python
   allows this only while no read is in flight. Every other node's answer is Python's.

   The struct is `EvalFilter` in bmoe/seam/eval_filter.py (ctypes), field for field; the name's
   offset in struct ggml_tensor comes from the seam's own mirror, pinned by tests/test_seam.py. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_STEMS 8
#define STEM_LEN 48
#define MAX_LAYER_TENSORS 4

typedef bool (*eval_fn)(void *tensor, bool ask, void *user);

/* One MoE layer as the fast path sees it; the pointers are into Python's own arrays. */
struct fast_layer {
    const int32_t *table;       /* expert -> slot index, -1: holds none (ExpertCache.table[layer]) */
    const uint8_t *resident;    /* expert -> 1 once every slice landed (ExpertCache.resident[layer]) */
    int32_t *seen;              /* slots its tensors show ggml (Streamer.seen[layer]); 0: not bound to the pools */
    int32_t n_expert;
    int32_t handled;            /* 1: its last routing was answered here (its wait nodes need no stop) */
    int32_t n_tensors;
    int32_t pad;
    char *tensors[MAX_LAYER_TENSORS];   /* its expert tensors (struct ggml_tensor *) */
    int64_t strides[MAX_LAYER_TENSORS]; /* their slot strides */
};
typedef bool (*abort_fn)(void *user);

struct eval_filter {
    eval_fn forward;            /* Python's eval callback, for the nodes it decides */
    abort_fn forward_abort;     /* Python's abort callback */
    int64_t abort_ns;           /* ask Python's abort callback at most this often */
    int64_t abort_last;         /* CLOCK_MONOTONIC ns of the last time it was asked */
    int32_t name_offset;        /* offsetof(struct ggml_tensor, name) */
    int32_t every;              /* 1: hand Python every node (the warm-up capture) */
    int32_t stop;               /* 1: an error is parked: stop the graph, ask nothing */
    int32_t halt;               /* 1: stop the graph after the node being computed (a dry capture) */
    int32_t routing;            /* 1: hand Python each ffn_moe_weights-L node */
    int32_t router_input;       /* 1: hand Python each ffn_moe_logits-L node */
    int32_t n_stems;            /* down-matmul input names, without their "-L" */
    char stems[MAX_STEMS][STEM_LEN];
    int32_t fast;               /* 1: answer the routings whose experts are all resident here */
    int32_t n_layers;           /* entries of `layers` (indexed by layer number) */
    struct fast_layer *layers;
    int32_t src_offset;         /* offsetof(struct ggml_tensor, src), ne, nb and data: the seam's mirror's */
    int32_t ne_offset;
    int32_t nb_offset;
    int32_t data_offset;
    int32_t *log;               /* routings answered here: [layer, rows, k, ids (rows*k), slots (rows*k)]... */
    int32_t log_cap;            /* int32s `log` holds */
    int32_t log_len;            /* int32s logged, not yet replayed by Python */
    int64_t stops_in_c;         /* routing stops C said yes to itself, ever (bench/hook_costs.py counts them) */
};

static bool starts(const char *s, const char *prefix, size_t n) { return strncmp(s, prefix, n) == 0; }

/* "STEM-<digits>" and nothing after the digits */
static bool stem_of_layer(const char *name, const char *stem) {
    size_t n = strlen(stem);
    if (strncmp(name, stem, n) != 0 || name[n] != '-' || name[n + 1] == '\0') return false;
    for (const char *p = name + n + 1; *p; p++)
        if (*p < '0' || *p > '9') return false;
    return true;
}

/* the layer number of "STEM-<digits>", or -1 */
static int layer_of(const char *name, const char *stem) {
    if (!stem_of_layer(name, stem)) return -1;
    long v = 0;
    for (const char *p = name + strlen(stem) + 1; *p && v < 1000000; p++) v = v * 10 + (*p - '0');
    return v < 1000000 ? (int)v : -1;
}

#define FIELD(f, t, off, type) (*(type *)((char *)(t) + (f)->off))

/* The routing node `t` of layer L, computed: if every routed expert is resident, its ids become slot
   indices, the layer's tensors show ggml the slots up to the highest read, and the routing is logged;
   true then. False (nothing written): Python decides. */
static bool route_hits(struct eval_filter *f, char *t, int layer) {
    struct fast_layer *fl = &f->layers[layer];
    if (fl->table == NULL || *fl->seen <= 0) return false;
    char *ids = ((char **)(t + f->src_offset))[1]; /* ffn_moe_topk-L, a strided view */
    const int64_t *ne = &FIELD(f, ids, ne_offset, int64_t);
    const size_t *nb = &FIELD(f, ids, nb_offset, size_t);
    char *data = FIELD(f, ids, data_offset, char *);
    int64_t k = ne[0], rows = ne[1], n = k * rows;
    if (n <= 0 || f->log_len + 3 + 2 * n > f->log_cap) return false;
    int32_t *entry = f->log + f->log_len, *logged = entry + 3, *slots = logged + n;
    int32_t high = -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) {
            int32_t e = *(int32_t *)(data + r * nb[1] + j * nb[0]);
            if (e < 0 || e >= fl->n_expert || !fl->resident[e] || fl->table[e] < 0) return false;
            logged[r * k + j] = e;
            slots[r * k + j] = fl->table[e];
            if (fl->table[e] > high) high = fl->table[e];
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) *(int32_t *)(data + r * nb[1] + j * nb[0]) = slots[r * k + j];
    if (*fl->seen != high + 1) {
        for (int i = 0; i < fl->n_tensors; i++) {
            (&FIELD(f, fl->tensors[i], ne_offset, int64_t))[2] = high + 1;
            (&FIELD(f, fl->tensors[i], nb_offset, size_t))[3] = (size_t)fl->strides[i] * (size_t)(high + 1);
        }
        *fl->seen = high + 1;
    }
    entry[0] = layer, entry[1] = (int32_t)rows, entry[2] = (int32_t)k;
    f->log_len += 3 + 2 * (int32_t)n;
    fl->handled = 1;
    return true;
}

static bool in_range(const struct eval_filter *f, int layer) { return layer >= 0 && layer < f->n_layers; }

bool bmoe_eval_filter(void *tensor, bool ask, void *user) {
    struct eval_filter *f = (struct eval_filter *)user;
    if (f->stop) return false;
    if (f->every) return f->forward(tensor, ask, user);
    const char *name = (const char *)tensor + f->name_offset;
    if (!starts(name, "ffn_moe_", 8)) return false;
    if (f->routing) {
        int layer = layer_of(name, "ffn_moe_weights");
        if (layer >= 0) {
            if (f->fast && in_range(f, layer) && f->layers[layer].table != NULL) {
                if (ask) return ++f->stops_in_c, true;
                if (route_hits(f, (char *)tensor, layer)) return true;
            }
            if (in_range(f, layer)) f->layers[layer].handled = 0;
            return f->forward(tensor, ask, user);
        }
    }
    if (f->router_input && stem_of_layer(name, "ffn_moe_logits")) return f->forward(tensor, ask, user);
    for (int i = 0; i < f->n_stems; i++) {
        int layer = layer_of(name, f->stems[i]);
        if (layer >= 0) /* nothing is awaited at a layer whose routing was all hits */
            return in_range(f, layer) && f->layers[layer].handled ? false : f->forward(tensor, ask, user);
    }
    return false;
}

bool bmoe_abort_filter(void *user) {
    struct eval_filter *f = (struct eval_filter *)user;
    if (f->stop || f->halt) return true;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (now - f->abort_last < f->abort_ns) return false;
    f->abort_last = now;
    return f->forward_abort(user);
}

/* sizeof(struct eval_filter) and each field's offsetof by its name (-1: no such field): bmoe.seam.eval_filter's
   ctypes mirror is checked against them, field by field, when the filter is loaded */
size_t bmoe_filter_size(void) { return sizeof(struct eval_filter); }

size_t bmoe_fast_layer_size(void) { return sizeof(struct fast_layer); }

long bmoe_filter_offset(const char *field) {
#define AT(f) if (strcmp(field, #f) == 0) return (long)offsetof(struct eval_filter, f);
    AT(forward) AT(forward_abort) AT(abort_ns) AT(abort_last) AT(name_offset) AT(every) AT(stop) AT(halt)
    AT(routing) AT(router_input) AT(n_stems) AT(stems) AT(fast) AT(n_layers) AT(layers) AT(src_offset)
    AT(ne_offset) AT(nb_offset) AT(data_offset) AT(log) AT(log_cap) AT(log_len) AT(stops_in_c)
#undef AT
    return -1;
}

long bmoe_fast_layer_offset(const char *field) {
#define AT(f) if (strcmp(field, #f) == 0) return (long)offsetof(struct fast_layer, f);
    AT(table) AT(resident) AT(seen) AT(n_expert) AT(handled) AT(n_tensors) AT(pad) AT(tensors) AT(strides)
#undef AT
    return -1;
}

/* An importable module, so that the build and the package find it like any extension; the two
   functions above are what bmoe uses (through ctypes). */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_eval_filter",
                                    "bmoe's eval and abort callbacks in C (see bmoe.seam.eval_filter).", -1, NULL};

PyMODINIT_FUNC PyInit__eval_filter(void) { return PyModule_Create(&module); }
