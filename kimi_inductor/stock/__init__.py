"""The stock Kimi K3 text decoder as vLLM 0.33.0 runs it, in its TP and SP layouts."""

from .config import KimiK3Config
from .model import KimiDecoderLayer, KimiLinearForCausalLM, KimiLinearModel
from .parallel import Parallel
from .state import DecodeStep, LayerCache

__all__ = [
    "DecodeStep", "KimiDecoderLayer", "KimiK3Config", "KimiLinearForCausalLM", "KimiLinearModel",
    "LayerCache", "Parallel",
]
