"""kimi-inductor: the ``kimi_specialized`` torch.compile backend for Kimi K3 decode."""

__version__ = "0.1.0"
