"""``mgserve synth``: random-weight GGUF files at real models' shapes."""
