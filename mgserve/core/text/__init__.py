"""Text: tokenizers (as llama.cpp's), detokenizer, chat templates."""
