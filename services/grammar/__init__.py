"""The grammar service: structured-output specs compiled with xgrammar, cached, shared.

Reading order: `grammar_spec` (what each kind compiles to; what is refused before compiling;
the cache key), `compiler_process` / `compiler_pool` (compilation in killable child processes
under time and memory limits), `tokenizer_identity` (the served tokenizer as xgrammar sees it),
`grammar_cache` (memory LRU -> Redis -> compile; single flight), `calls` (the bus API),
`service` (wiring). The Redis layout lives in `shared/grammar_store.py`: schedulers read it.
"""
