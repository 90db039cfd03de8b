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
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct qemu_plugin_tb;

/* The plugin API's own type for a plugin's identity is a 64-bit integer. */
typedef uint64_t plugin_id;
typedef void (*translate_callback)(plugin_id id, struct qemu_plugin_tb *block);
typedef void (*execute_callback)(unsigned int vcpu, void *data);
typedef void (*exit_callback)(plugin_id id, void *data);

size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *block);
void qemu_plugin_register_vcpu_tb_trans_cb(plugin_id id, translate_callback cb);
/* flags 0: the callback reads no guest registers. */
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *block, execute_callback cb,
                                          int flags, void *data);
void qemu_plugin_register_atexit_cb(plugin_id id, exit_callback cb, void *data);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t executed;
static char out_path[4096];

static void on_block(unsigned int vcpu, void *data) {
    (void)vcpu;
    __atomic_fetch_add(&executed, (uint64_t)(uintptr_t)data, __ATOMIC_RELAXED);
}

static void on_translate(plugin_id id, struct qemu_plugin_tb *block) {
    (void)id;
    uintptr_t n = qemu_plugin_tb_n_insns(block);
    qemu_plugin_register_vcpu_tb_exec_cb(block, on_block, 0, (void *)n);
}

static void on_exit(plugin_id id, void *data) {
    (void)id;
    (void)data;
    FILE *f = fopen(out_path, "w");
    if (f) {
        fprintf(f, "%llu\n", (unsigned long long)__atomic_load_n(&executed, __ATOMIC_RELAXED));
        fclose(f);
    }
}

__attribute__((visibility("default")))
int qemu_plugin_install(plugin_id id, const void *info, int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0 && strlen(argv[i] + 4) < sizeof(out_path)) {
            strcpy(out_path, argv[i] + 4);
        }
    }
    if (!out_path[0]) {
        fprintf(stderr, "guest_instructions: give the plugin an argument out=PATH\n");
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
