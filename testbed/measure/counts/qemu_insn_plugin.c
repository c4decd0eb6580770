/* A QEMU TCG plugin that counts guest instructions: the whole program's, and those executed between
 * each call of the marker functions tb_count_begin() and tb_count_end() (kernels/bench/harness.c
 * calls them around every timed kernel call), so a count is the kernel's, not the harness's.
 *
 *   qemu-aarch64 -d plugin -plugin ./libtb_insn.so,out=instructions.json PROGRAM ARGS...
 *
 * Counting: every translated block adds its instruction count to one counter when it starts
 * executing (an inline add, the cheapest hook QEMU has). A marker's block also calls back into the
 * plugin, which reads the counter: a region's count is the counter at the end marker minus the
 * counter at the begin marker. The guest's instruction stream does not depend on the host's speed
 * or load, so the same program on the same inputs gives the same counts, run after run.
 * Markers are found by symbol name, which QEMU resolves from the ELF symbol table only when its log
 * is on: hence `-d plugin` (the plugin itself writes nothing to the log). Only the block at a
 * marker's entry counts as the marker: a marker that straddles a page is translated as two blocks,
 * both inside its symbol, and the second must not fire again (the entry is the first block of the
 * symbol ever translated: execution enters a function at its entry). With more than one guest
 * thread the shared counter is updated without atomics; the output then says "exact": false.
 *
 * The plugin ABI is QEMU's, version 1 (QEMU 4.2 to 8.1; Debian 12 ships 7.2). The few declarations it
 * needs are written out below, so no QEMU source tree is needed to build it: cc -shared -fPIC. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
typedef struct qemu_info_t qemu_info_t;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS };
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id,
                                           void (*cb)(qemu_plugin_id_t, struct qemu_plugin_tb *));
void qemu_plugin_register_vcpu_init_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, unsigned int));
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, void *), void *userdata);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, void (*cb)(unsigned int, void *),
                                          enum qemu_plugin_cb_flags flags, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_insn_vaddr(const struct qemu_plugin_insn *insn);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const char *qemu_plugin_insn_symbol(const struct qemu_plugin_insn *insn);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

#define MAX_REGIONS 100000

static uint64_t executed;            /* every guest instruction, counted per block */
static uint64_t region_start;
static int in_region;
static uint64_t regions[MAX_REGIONS];
static long n_regions, overflow, unmatched;
static unsigned int vcpus;
static char out_path[4096] = "instructions.json";
static const char *begin_symbol = "tb_count_begin", *end_symbol = "tb_count_end";
static char begin_buf[256], end_buf[256];
static uint64_t begin_entry, end_entry; /* the markers' entry addresses, once seen */

static void at_begin(unsigned int vcpu, void *unused) {
    (void)vcpu, (void)unused;
    if (in_region) unmatched++; /* a begin without its end: the earlier region is dropped */
    in_region = 1;
    region_start = executed;
}

static void at_end(unsigned int vcpu, void *unused) {
    (void)vcpu, (void)unused;
    if (!in_region) { unmatched++; return; }
    in_region = 0;
    if (n_regions < MAX_REGIONS) regions[n_regions++] = executed - region_start;
    else overflow++;
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed, n);
    const struct qemu_plugin_insn *first = n ? qemu_plugin_tb_get_insn(tb, 0) : NULL;
    const char *symbol = first ? qemu_plugin_insn_symbol(first) : NULL;
    if (!symbol) return;
    const uint64_t at = qemu_plugin_insn_vaddr(first);
    if (!strcmp(symbol, begin_symbol)) {
        if (!begin_entry) begin_entry = at;
        if (at == begin_entry) qemu_plugin_register_vcpu_tb_exec_cb(tb, at_begin, QEMU_PLUGIN_CB_NO_REGS, NULL);
    } else if (!strcmp(symbol, end_symbol)) {
        if (!end_entry) end_entry = at;
        if (at == end_entry) qemu_plugin_register_vcpu_tb_exec_cb(tb, at_end, QEMU_PLUGIN_CB_NO_REGS, NULL);
    }
}

static void on_vcpu_init(qemu_plugin_id_t id, unsigned int vcpu) {
    (void)id, (void)vcpu;
    __atomic_fetch_add(&vcpus, 1, __ATOMIC_RELAXED);
}

static void write_counts(qemu_plugin_id_t id, void *unused) {
    (void)id, (void)unused;
    FILE *f = fopen(out_path, "w");
    if (!f) { fprintf(stderr, "tb_insn: cannot write %s\n", out_path); return; }
    fprintf(f, "{\"counter\": \"qemu-tcg-plugin\", \"total\": %llu, \"vcpus\": %u, \"exact\": %s, "
               "\"unmatched_markers\": %ld, \"regions_dropped\": %ld, \"regions\": [",
            (unsigned long long)executed, vcpus, vcpus <= 1 ? "true" : "false", unmatched + in_region, overflow);
    for (long i = 0; i < n_regions; i++) fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)regions[i]);
    fprintf(f, "]}\n");
    fclose(f);
}

__attribute__((visibility("default")))
int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        if (!eq) { fprintf(stderr, "tb_insn: argument %s is not key=value\n", argv[i]); return -1; }
        size_t key = (size_t)(eq - argv[i]);
        const char *value = eq + 1;
        if (key == 3 && !strncmp(argv[i], "out", 3)) snprintf(out_path, sizeof out_path, "%s", value);
        else if (key == 5 && !strncmp(argv[i], "begin", 5)) snprintf(begin_buf, sizeof begin_buf, "%s", value), begin_symbol = begin_buf;
        else if (key == 3 && !strncmp(argv[i], "end", 3)) snprintf(end_buf, sizeof end_buf, "%s", value), end_symbol = end_buf;
        else { fprintf(stderr, "tb_insn: unknown argument %s (accepted: out, begin, end)\n", argv[i]); return -1; }
    }
    qemu_plugin_register_vcpu_init_cb(id, on_vcpu_init);
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, write_counts, NULL);
    return 0;
}
