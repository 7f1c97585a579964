"""kimi-inductor: the ``kimi_specialized`` torch.compile backend for Kimi K3 decode."""

__version__ = "0.1.0"


def register() -> None:
    """Register ``kimi_specialized`` with Dynamo when the package is used from a
    source tree (an installed package resolves it through its entry point)."""
    import torch._dynamo

    from .backend import kimi_specialized

    if "kimi_specialized" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(kimi_specialized, "kimi_specialized")


def __getattr__(name: str):
    # ``from kimi_inductor import KimiInductorPass``, lazily (it imports vLLM). vLLM's pass
    # qualnames never reach this (they read ``__dict__``): name ``vllm_glue.kimi_pass``.
    if name == "KimiInductorPass":
        from .vllm_glue import KimiInductorPass

        return KimiInductorPass
    if name == "MatchError":  # strict=True: a layer was not rewritten (a ValueError)
        from .backend import MatchError

        return MatchError
    raise AttributeError(f"module 'kimi_inductor' has no attribute {name!r}")
