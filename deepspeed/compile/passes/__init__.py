"""Graph passes. The engine-facing modules here (``zero3_compile``, ``prefetch`` ...) exist because DeepSpeed's
engine imports them by name; the pipeline itself lives in ``deepspeed.compile.graph``."""
