"""ds4py: DeepSeek V4 Flash inference in Python with JIT kernels and PyTorch references."""


def __getattr__(name: str):
    """Lazy `ds4.load` / `ds4.Engine`, so `import ds4.formats.gguf` stays light."""
    if name in ("load", "Engine"):
        from ds4 import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'ds4' has no attribute {name!r}")
