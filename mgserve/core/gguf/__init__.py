"""GGUF files: reading, writing, hyperparameters, tensor layouts, ``mgserve info``."""
