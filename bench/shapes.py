"""The real models whose shapes the GPU benchmarks rebuild with random weights on the device (nothing to
download): the default target and the Llama-3.1-8B shape of DESIGN.md (specwire.synthetic's, less its CPU
test shape)."""

from specwire.config import ModelConfig
from specwire.synthetic import SHAPES as SYNTHETIC_SHAPES

SHAPES: dict[str, ModelConfig] = {name: c for name, c in SYNTHETIC_SHAPES.items() if name != "tiny"}
