/* my_engine.h: the engine under test in the README's walk-through ("Engine under test"), as a lab's engine
 * looks from its adapter: load a model, decode rows after what it holds, roll back, hand out its state. The
 * calls mirror llama.cpp's (llama_model_load_from_file + llama_init_from_model, llama_decode,
 * llama_memory_seq_rm, llama_state_seq_get_data). tests/test_readme_walkthrough.py builds the README's
 * adapter against this header and my_engine.c, testbed's own model engine (kernels/tb_model.h) behind it. */
#ifndef MY_ENGINE_H
#define MY_ENGINE_H

#include <stddef.h>

typedef struct my_engine my_engine;

/* The model file and its shape ("key=value" strings, NULL-terminated); room for n_ctx positions in calls of
 * up to n_batch rows. NULL (and a message on stderr) when it cannot be loaded. */
my_engine *my_engine_load(const char *model, const char *const *config, int n_ctx, int n_batch);
int my_engine_vocab(const my_engine *e);
/* tokens[0..n) at positions pos..pos+n-1, right after the positions the engine holds; the logits of row
 * `row` into logits[vocab] (row -1: none). 0 on success. */
int my_engine_decode(my_engine *e, const int *tokens, int n, long pos, int row, float *logits);
/* Forget every position from `pos` on. 0 on success. */
int my_engine_rollback(my_engine *e, long pos);
/* The sequence's state as bytes: how many, written to buf when size holds them. */
size_t my_engine_state(my_engine *e, void *buf, size_t size);

#endif
