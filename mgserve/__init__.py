"""mgserve: a GGUF inference server for large hybrid MoE models on PCIe multi-GPU machines."""

__version__ = "0.1.0"
