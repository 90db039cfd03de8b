/* A qemu user-mode plugin that counts the guest instructions a program executes.
 *
 * Built by deploy_recipes/instruction_count.py with the host's C compiler
 * (no qemu headers needed: the few plugin entry points it uses are declared
 * below, as qemu 4.2 to 7.x define them). When qemu exits it writes the
 * total, in decimal, to the file named by the plugin argument "out=PATH".
 *
 * Each translated block carries its instruction count as the argument of a
 * callback that runs every time the block executes; the callback adds it to
 * one total with an atomic add, so the count stays exact when several guest
 * threads run at once.
 *
 * With the argument "blocks=PATH" it also writes, one line a block that ran,
 * "ADDRESS COUNT" (hexadecimal guest address, decimal instructions) there,
 * for benchmarks/profile_arm.py to map to a module's symbols (one guest
 * thread: those counts are plain adds).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct qemu_plugin_tb;

/* The plugin API's own type for a plugin's identity is a 64-bit integer. */
typedef uint64_t plugin_id;
typedef void (*translate_callback)(plugin_id id, struct qemu_plugin_tb *block);
typedef void (*execute_callback)(unsigned int vcpu, void *data);
typedef void (*exit_callback)(plugin_id id, void *data);

size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *block);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *block);
void qemu_plugin_register_vcpu_tb_trans_cb(plugin_id id, translate_callback cb);
/* flags 0: the callback reads no guest registers. */
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *block, execute_callback cb,
                                          int flags, void *data);
void qemu_plugin_register_atexit_cb(plugin_id id, exit_callback cb, void *data);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t executed;
static char out_path[4096];
static char blocks_path[4096];

/* With blocks=PATH: one slot a translation (a block translated twice gets
 * two), far more than a Python run with a model translates. */
struct block { uint64_t address, size, executed; };
#define SLOTS (1 << 22)
static struct block *blocks;
static size_t used;

static void on_block(unsigned int vcpu, void *data) {
    (void)vcpu;
    __atomic_fetch_add(&executed, (uint64_t)(uintptr_t)data, __ATOMIC_RELAXED);
}

static void on_counted_block(unsigned int vcpu, void *data) {
    (void)vcpu;
    struct block *b = data;
    __atomic_fetch_add(&executed, b->size, __ATOMIC_RELAXED);
    b->executed += b->size;
}

static void on_translate(plugin_id id, struct qemu_plugin_tb *block) {
    (void)id;
    uintptr_t n = qemu_plugin_tb_n_insns(block);
    if (blocks && used < SLOTS) {
        struct block *b = &blocks[used++];
        b->address = qemu_plugin_tb_vaddr(block);
        b->size = n;
        qemu_plugin_register_vcpu_tb_exec_cb(block, on_counted_block, 0, b);
        return;
    }
    qemu_plugin_register_vcpu_tb_exec_cb(block, on_block, 0, (void *)n);
}

static void write_blocks(void) {
    FILE *f = fopen(blocks_path, "w");
    if (!f) {
        return;
    }
    for (size_t i = 0; i < used; i++) {
        if (blocks[i].executed) {
            fprintf(f, "%llx %llu\n", (unsigned long long)blocks[i].address,
                    (unsigned long long)blocks[i].executed);
        }
    }
    fclose(f);
}

static void at_exit(plugin_id id, void *data) {
    (void)id;
    (void)data;
    FILE *f = fopen(out_path, "w");
    if (f) {
        fprintf(f, "%llu\n", (unsigned long long)__atomic_load_n(&executed, __ATOMIC_RELAXED));
        fclose(f);
    }
    if (blocks) {
        write_blocks();
    }
}

__attribute__((visibility("default")))
int qemu_plugin_install(plugin_id id, const void *info, int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0 && strlen(argv[i] + 4) < sizeof(out_path)) {
            strcpy(out_path, argv[i] + 4);
        }
        if (strncmp(argv[i], "blocks=", 7) == 0 && strlen(argv[i] + 7) < sizeof(blocks_path)) {
            strcpy(blocks_path, argv[i] + 7);
        }
    }
    if (!out_path[0]) {
        fprintf(stderr, "guest_instructions: give the plugin an argument out=PATH\n");
        return -1;
    }
    if (blocks_path[0] && !(blocks = calloc(SLOTS, sizeof *blocks))) {
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
