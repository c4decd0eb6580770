/* The Itanium C++ ABI's per-thread exception state (__cxa_get_globals, ABI section 2.4.2), linked
 * into the Hexagon programs in place of libc++abi's own.
 *
 * Why: zig builds libc++abi position-independent, so its copy reaches this thread-local through
 * __tls_get_addr (the general-dynamic TLS model). ld.lld for Hexagon does not relax that model in a
 * static executable: it calls __tls_get_addr through a PLT slot whose R_HEX_JMP_SLOT relocation is
 * left for a dynamic loader a static program does not have, so the slot stays 0 and the first C++
 * throw (libllama throws and catches while loading any GGUF) jumps to address 0. The local-exec
 * model below addresses the variable from the thread pointer, with no call and no relocation left
 * for run time. The layout is libc++abi's __cxa_eh_globals: the caught-exception stack, the count of
 * exceptions thrown but not yet caught. */

struct eh_globals {
    void *caught_exceptions;
    unsigned int uncaught_exceptions;
};

static _Thread_local struct eh_globals globals __attribute__((tls_model("local-exec")));

void *__cxa_get_globals(void);
void *__cxa_get_globals_fast(void);

void *__cxa_get_globals(void) { return &globals; }
void *__cxa_get_globals_fast(void) { return &globals; }
